"""`spindle serve`: one model pod. The engine behind a grpc.aio server.

Start-up order: listen at once (health NOT_SERVING, so Kubernetes and the gateway hold traffic),
load the model on a worker thread, warm it with one tiny request, then report SERVING.
SIGTERM (or SIGINT) drains: NOT_SERVING, refuse new requests, let in-flight ones finish within
--drain-timeout, abort the rest (their streams end UNAVAILABLE), stop, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path
from typing import Any

import grpc

from model_service.control_service import ModelControlService
from model_service.pod import ModelPod
from model_service.services import GenerationService, PodStatusService
from spindle import envflags, serving, telemetry
from spindle.v1 import generation_pb2_grpc, model_control_pb2_grpc, pod_status_pb2_grpc

log = logging.getLogger("spindle.serve")

SERVICES = ("spindle.v1.Generation", "spindle.v1.PodStatus", "spindle.v1.ModelControl")


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from model_service.cli import add_engine_args

    parser.description = (
        "Run a model pod: the engine behind gRPC (Generation, PodStatus, ModelControl, grpc.health.v1, "
        "reflection) and Prometheus /metrics."
    )
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="0.0.0.0", help="address to listen on [0.0.0.0]")
    g.add_argument("--port", type=int, default=50052, help="gRPC port (0 = any free port) [50052]")
    g.add_argument("--metrics-port", type=int, default=9090, help="Prometheus /metrics port; 0 = off [9090]")
    g.add_argument(
        "--served-model-name",
        default=None,
        help="the model's name in ListModels and GenerateRequest.model [the alias, or the checkpoint's name]",
    )
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds in-flight requests get to finish before they are aborted [30]",
    )
    g.add_argument(
        "--adapter-cache-dir",
        default=None,
        help="where adapters fetched from peer pods are written [a new temporary directory]",
    )
    g.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR [INFO]")
    add_engine_args(parser)
    envflags.apply_env(parser)
    return parser


def served_name(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return args.served_model_name
    from model_service.models.loader import ALIASES

    if args.model in ALIASES:
        return args.model
    path = Path(args.model)
    return path.stem if path.suffix == ".gguf" else path.name


def run(args: argparse.Namespace) -> int:
    serving.setup_logging(args.log_level)
    return asyncio.run(serve(args))


async def start(
    pod: ModelPod, host: str, port: int, provider: Any = None, adapter_cache_dir: str | None = None
) -> tuple[grpc.aio.Server, int]:
    """Register the pod's services on a new server and start listening (NOT_SERVING until loaded).
    Also used in-process by tests and the benchmark."""
    server = serving.make_server(telemetry.server_interceptors(provider))
    tracer = telemetry.get_tracer(__name__, provider)
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationService(pod, tracer), server)
    pod_status_pb2_grpc.add_PodStatusServicer_to_server(PodStatusService(pod), server)
    control = ModelControlService(pod, adapter_cache_dir)
    model_control_pb2_grpc.add_ModelControlServicer_to_server(control, server)
    pod.health = serving.Health(server, SERVICES)
    serving.enable_reflection(server, SERVICES)
    bound = serving.bind(server, host, port)
    await server.start()
    return server, bound


async def serve(args: argparse.Namespace) -> int:
    from model_service.cli import engine_config
    from model_service.timed_engine import TimedEngine

    provider = telemetry.tracer_provider_from_env("spindle-model")
    pod = ModelPod(served_name(args), args.drain_timeout)
    server, port = await start(pod, args.host, args.port, provider, args.adapter_cache_dir)
    serving.on_shutdown_signal(pod.request_exit)
    if args.metrics_port:
        metrics_port = pod.metrics.serve(args.host, args.metrics_port)
        log.info("metrics on http://%s:%d/metrics", args.host, metrics_port)
    log.info(
        "listening on %s:%d; loading %s (NOT_SERVING until loaded and warmed)", args.host, port, args.model
    )
    config = engine_config(args)
    loading = asyncio.create_task(pod.load(lambda: TimedEngine(config)))
    loading.add_done_callback(lambda t: _load_done(t, pod))
    await pod.exit_requested.wait()
    if loading.done() and not loading.cancelled() and loading.exception() is None:
        await pod.drain()
    await server.stop(grace=1.0)
    pod.close()
    if provider is not None:
        provider.shutdown()
    return pod.exit_code


def _load_done(task: asyncio.Task, pod: ModelPod) -> None:
    if task.cancelled():
        return
    e = task.exception()
    if e is not None:
        log.error("could not load the model: %s", e, exc_info=e)
        pod.request_exit("model load failed", code=1)
    else:
        log.info("SERVING")
