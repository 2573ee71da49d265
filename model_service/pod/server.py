"""`spindle serve`: one model pod. The engine behind two grpc.aio servers.

- the serving port (`--port`, 50052): Generation, PodStatus, grpc.health.v1 and reflection, for
  the gateway;
- the control port (`--control-port`, 50053): ModelControl, grpc.health.v1 and reflection, for
  the adapter service and peer pods (PromoteFromPeer fetches from a peer's control port).
  Two servers rather than one with a filter, so each port simply has no handler for the other's
  services (UNIMPLEMENTED) and a Kubernetes NetworkPolicy can admit each audience to its port.

Start-up order: listen at once (health NOT_SERVING, so Kubernetes and the gateway hold traffic),
load the model and capture its CUDA graphs on a worker thread (`Engine.warm_up`), warm it with
one tiny request, then report SERVING.
SIGTERM (or SIGINT) drains: NOT_SERVING, refuse new requests, let in-flight ones finish within
--drain-timeout, abort the rest (their streams end UNAVAILABLE), stop, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from opentelemetry.sdk.trace import TracerProvider

from model_service.engine.config import EngineConfig, add_engine_args, engine_config
from model_service.pod.control import ModelControlService
from model_service.pod.generation import GenerationService, PodStatusService
from model_service.pod.state import ModelPod
from spindle import flagtypes, serving, telemetry
from spindle.errors import SpindleError
from spindle.openai_api.responses_store import Store, store_of
from spindle.openai_api.server import OpenAIServer, add_http_args
from spindle.security import PLAINTEXT, Security, add_security_args, security_from_args
from spindle.v1 import generation_pb2_grpc, model_control_pb2_grpc, pod_status_pb2_grpc

if TYPE_CHECKING:
    from model_service.engine.engine import Engine

log = logging.getLogger("spindle.serve")

SERVICES = ("spindle.v1.Generation", "spindle.v1.PodStatus")
CONTROL_SERVICES = ("spindle.v1.ModelControl",)


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.description = (
        "Run a model pod: the engine behind gRPC (Generation, PodStatus, grpc.health.v1, reflection on "
        "--port; ModelControl on --control-port) and Prometheus /metrics."
    )
    g = parser.add_argument_group("server")
    g.add_argument(
        "--host",
        default="0.0.0.0",
        help="address to listen on; 0.0.0.0 or :: = every address, IPv4 and IPv6 [0.0.0.0]",
    )
    g.add_argument(
        "--port",
        type=flagtypes.port,
        default=50052,
        help="gRPC port for Generation (0 = any free port) [50052]",
    )
    g.add_argument(
        "--control-port",
        type=flagtypes.port,
        default=50053,
        help="gRPC port for ModelControl: the adapter service and peer pods (0 = any free port) [50053]",
    )
    add_http_args(g)
    g.add_argument(
        "--metrics-port", type=flagtypes.port, default=9090, help="Prometheus /metrics port; 0 = off [9090]"
    )
    g.add_argument(
        "--served-model-name",
        default=None,
        help="the model's name in ListModels and GenerateRequest.model [the alias, or the checkpoint's name]",
    )
    g.add_argument(
        "--drain-timeout",
        type=flagtypes.seconds_or_none,
        default=30.0,
        help="on SIGTERM, seconds in-flight requests get to finish before they are aborted [30]",
    )
    serving.add_send_timeout_arg(g, 300.0, "longer than the gateway's 60, which is the pod's reader")
    g.add_argument(
        "--engine-stall-timeout",
        type=flagtypes.seconds,
        default=120.0,
        help="seconds one engine step may run before load reports (GetLoad) answer UNAVAILABLE and the "
        "gateway ejects the pod as stuck; until then they answer with the last step's stats [120]",
    )
    g.add_argument(
        "--adapter-cache-dir",
        default=None,
        help="where adapters fetched from peer pods are written [a new temporary directory]",
    )
    g.add_argument(
        "--stream-interval",
        type=flagtypes.at_least(1),
        default=1,
        help="send a stream's tokens N at a time (the first token and the rest at the end at once): "
        "fewer messages for the pod, gateway and client, a burstier stream (vLLM's --stream-interval) [1]",
    )
    g.add_argument(
        "--log-level", type=flagtypes.log_level, default="INFO", help="DEBUG, INFO, WARNING, ERROR [INFO]"
    )
    add_security_args(parser)
    add_engine_args(parser)
    return parser


def served_name(args: argparse.Namespace) -> str:
    return args.served_model_name or serving.served_model_name(args.model)


def run(args: argparse.Namespace) -> int:
    serving.setup_logging(args.log_level)
    return asyncio.run(serve(args))


@dataclass
class PodServers:
    """The pod's listening servers and the ports they got."""

    serving: grpc.aio.Server
    control: grpc.aio.Server
    port: int
    control_port: int
    http: OpenAIServer | None = None  # the OpenAI-compatible API on --http-port (0 = none)
    http_port: int = 0

    async def stop(self, grace: float | None) -> None:
        if self.http is not None:
            await self.http.stop()
        await asyncio.gather(self.serving.stop(grace), self.control.stop(grace))


def warmed_engine(config: EngineConfig) -> Engine:
    """The engine with every decode graph captured (and so its kernels compiled): the pod pays
    that before it reports SERVING, not as stalls of its first requests."""
    from model_service.engine.engine import Engine  # torch's import takes seconds: after the bind

    engine = Engine(config)
    engine.warm_up()
    return engine


async def start(
    pod: ModelPod,
    host: str,
    port: int,
    control_port: int,
    provider: TracerProvider | None = None,
    adapter_cache_dir: str | None = None,
    security: Security = PLAINTEXT,
    http_port: int = 0,
    tool_parser: str = "none",
    reasoning_parser: str = "none",
    reasoning_key: bytes | None = None,
    send_timeout: float = 0.0,
    responses_store: Store | None = None,
) -> PodServers:
    """Register the pod's services on its two servers and start listening (NOT_SERVING until
    loaded), and on `http_port` the OpenAI-compatible API over the same Generation servicer
    (0 = none), reading tool calls with `tool_parser` and reasoning with `reasoning_parser` (its blobs signed
    with `reasoning_key`); a stream whose client reads nothing for `send_timeout` seconds is
    ended (0: never); `responses_store` keeps the Responses API's responses (None: none is).
    Also used in-process by tests and the benchmark. The control port's
    ModelControl needs the service token when `security` has one."""
    interceptors = telemetry.server_interceptors(provider)
    guard = security.guard(CONTROL_SERVICES, "model pod's control port")
    server = serving.make_server(interceptors, send_timeout)
    control = serving.make_server([*guard, *interceptors])
    tracer = telemetry.get_tracer(__name__, provider)
    generation = GenerationService(pod, tracer)
    generation_pb2_grpc.add_GenerationServicer_to_server(generation, server)
    pod_status_pb2_grpc.add_PodStatusServicer_to_server(PodStatusService(pod), server)
    model_control_pb2_grpc.add_ModelControlServicer_to_server(
        ModelControlService(pod, adapter_cache_dir, security), control
    )
    pod.health = serving.Health(server, SERVICES)
    pod.health.also_on(control, CONTROL_SERVICES)
    serving.enable_reflection(server, SERVICES)
    serving.enable_reflection(control, CONTROL_SERVICES)
    servers = PodServers(
        server,
        control,
        serving.bind(server, host, port, security.tls),
        serving.bind(control, host, control_port, security.tls),
    )
    pod.control_port = servers.control_port
    await server.start()
    await control.start()
    if http_port:
        async with serving.stopped_on_failure(lambda: servers.stop(None)):
            servers.http = OpenAIServer(
                generation,
                lambda: (pod.model_name,),
                lambda: pod.health.serving,
                tracer,
                tool_parser,
                reasoning_parser,
                reasoning_key,
                send_timeout=send_timeout,
                store=responses_store,
            )
            servers.http_port = await servers.http.start(host, http_port, security.tls)
    return servers


async def serve(args: argparse.Namespace) -> int:
    config = engine_config(args)  # a bad setting fails here, before any port is taken
    provider = telemetry.tracer_provider_from_env("spindle-model")
    pod = ModelPod(
        served_name(args),
        args.drain_timeout,
        stream_interval=args.stream_interval,
        stall_timeout=args.engine_stall_timeout,
    )
    security = security_from_args(args)
    servers = await start(
        pod,
        args.host,
        args.port,
        args.control_port,
        provider,
        args.adapter_cache_dir,
        security,
        args.http_port,
        args.tool_call_parser,
        args.reasoning_parser,
        args.reasoning_key_file,
        args.send_timeout,
        store_of(args),
    )
    async with serving.stopped_on_failure(lambda: servers.stop(None), pod.health.stop):
        await pod.health.serve_plaintext(args.host, args.health_port)
        if args.metrics_port:
            metrics_port = pod.metrics.serve(args.host, args.metrics_port)
            log.info("metrics on http://%s/metrics", serving.host_port(args.host, metrics_port))
    serving.on_shutdown_signal(pod.request_exit)
    log.info(
        "listening on %s (control %d, HTTP %s); loading %s (NOT_SERVING until loaded and warmed)",
        serving.host_port(args.host, servers.port),
        servers.control_port,
        servers.http_port or "off",
        args.model,
    )
    loading = asyncio.create_task(pod.load(lambda: warmed_engine(config)))
    loading.add_done_callback(lambda t: _load_done(t, pod))
    await pod.exit_requested.wait()
    # Within Kubernetes' grace (drain + 15 s in the chart): a stuck exit says where it waits.
    serving.exit_if_stuck(args.drain_timeout + 10.0, "the model pod")
    if loading.done() and not loading.cancelled() and loading.exception() is None:
        await pod.drain()
    await servers.stop(grace=1.0)
    await pod.health.stop()
    pod.close()
    telemetry.shutdown(provider)
    return pod.exit_code


def _load_done(task: asyncio.Task, pod: ModelPod) -> None:
    if task.cancelled():
        return
    e = task.exception()
    if e is not None:
        # A SpindleError (a path that does not exist, a checkpoint we refuse) says all there is
        # to say; its traceback only buried that line. Anything else is a bug: keep the trace.
        log.error("could not load the model: %s", e, exc_info=None if isinstance(e, SpindleError) else e)
        pod.request_exit("model load failed", code=1)
    else:
        log.info("SERVING")
