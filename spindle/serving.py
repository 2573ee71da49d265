"""What the gRPC servers (model pod, gateway) share: construction, health, reflection, signals."""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import importlib.util
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from spindle import flagtypes
from spindle.errors import ListenError, listen_hint
from spindle.malformed import MalformedRequestInterceptor
from spindle.send_timeout import SendTimeout
from spindle.tls import PLAINTEXT, TlsConfig, server_credentials

log = logging.getLogger(__name__)
T = TypeVar("T")

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name

# The shortest spacing of a client's keepalive pings that the servers accept. gRPC's server
# default is 5 minutes unless it sent data in between, and no pings at all on a connection without
# a call; past two pings too soon it answers GOAWAY ENHANCE_YOUR_CALM "too_many_pings", which
# closes the connection and every stream on it. A client with a 10-30 s keepalive (grpc-go's and
# grpc-java's floor is 10 s; Envoy's `connection_keepalive`; load balancers keeping idle
# connections alive) lost any stream silent for ~30 s: a long prefill, a request queued behind
# others. Faster pings still count as abuse (a ping flood).
KEEPALIVE_MIN_PING_S = 5.0
# The servers' own keepalive: a ping after this long without a frame from the client, and the
# connection closed (its calls cancelled) when no answer comes within the timeout. gRPC's server
# default waits 2 hours: a caller hung or cut off without a FIN (a stopped process, a lost node, a
# partition) held its streams, and their requests ran on in the engine holding KV blocks, for as
# long as its kernel kept the socket (a hung process's: forever).
KEEPALIVE_TIME_S = 30.0
KEEPALIVE_TIMEOUT_S = 20.0  # grpc-go's default


def _options() -> list[tuple[str, int]]:
    return [
        # gRPC sets SO_REUSEPORT by default, which lets a second server silently share a port that is
        # in use (and the kernel split connections between them). A port conflict must be an error.
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", 64 << 20),
        ("grpc.max_send_message_length", 64 << 20),
        ("grpc.http2.min_ping_interval_without_data_ms", int(KEEPALIVE_MIN_PING_S * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.keepalive_time_ms", int(KEEPALIVE_TIME_S * 1000)),
        ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
        ("grpc.http2.ping_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),  # what newer grpc cores wait
    ]


def add_send_timeout_arg(parser: Any, default: float, behind: str) -> None:
    """`--send-timeout` (SPINDLE_SEND_TIMEOUT): how long one send of a response stream, gRPC or
    server-sent events, may wait on a client that takes nothing, `behind` saying why this default."""
    parser.add_argument(
        "--send-timeout",
        type=flagtypes.seconds_or_none,
        default=default,
        help="seconds a stream's send may wait on a client that reads nothing (its gRPC flow-control "
        "window or socket full) before the stream is ended (gRPC: DEADLINE_EXCEEDED; HTTP: the "
        "connection closed) and its request cancelled; a client that keeps reading, however "
        f"slowly, is never cut; 0 = wait forever ({behind}) [{default:g}]",
    )


def served_model_name(model: str) -> str:
    """The name a pod serves `--model` under unless `--served-model-name` says otherwise: an alias
    as it is, a checkpoint directory's name, a .gguf file's stem. Torch-free, so `spindle up` names
    the model in the commands it prints as the pod will (it printed the path, which 404s)."""
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name


def make_server(interceptors: Iterable[Any] = (), send_timeout: float = 0.0) -> grpc.aio.Server:
    """A server whose requests that do not parse end INVALID_ARGUMENT (spindle/malformed.py); that
    interceptor runs last, next to the handlers, so the others see the wrapped handler. Clients'
    keepalive pings are accepted every KEEPALIVE_MIN_PING_S, with or without a call; a client that
    stops answering pings is cut off (KEEPALIVE_TIME_S, KEEPALIVE_TIMEOUT_S). A response stream
    whose client reads nothing for `send_timeout` seconds is ended (0: never; send_timeout.py); that
    interceptor runs first, so it writes what the others yield."""
    bound = [SendTimeout(send_timeout)] if send_timeout else []
    return grpc.aio.server(
        interceptors=[*bound, *interceptors, MalformedRequestInterceptor()], options=_options()
    )


def host_port(host: str, port: int | str) -> str:
    """HOST:PORT as gRPC targets and URLs want it: an IPv6 host in brackets ([::1]:50051)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# --host values meaning every address. gRPC takes 0.0.0.0 and [::] alike as every address of both
# families (one dual-stack socket, IPv4 alone where the host has no IPv6); the plain-socket servers
# (HTTP API, /metrics) take them the same way through listen_address.
WILDCARD_HOSTS = ("", "0.0.0.0", "::")


def listen_address(host: str, port: int) -> tuple[socket.AddressFamily, str]:
    """The family and address a plain socket binds for `--host host`. The wildcard is "::" on a
    dual-stack socket (see listening_socket), as gRPC binds it: 0.0.0.0 taken literally was IPv4
    alone, and on an IPv6 single-stack cluster the HTTP API, its httpGet readiness probe and
    /metrics were refused while the gRPC ports of the same --host answered."""
    if host in WILDCARD_HOSTS:
        return (socket.AF_INET6, "::") if socket.has_dualstack_ipv6() else (socket.AF_INET, "0.0.0.0")
    return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0], host


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on host:port (SO_REUSEADDR), the wildcard one socket for both
    families (IPV6_V6ONLY off, whatever net.ipv6.bindv6only says): the same port on each. Built by
    hand, not by `socket.create_server`, whose errors append the address to the OS's reason."""
    family, address = listen_address(host, port)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and host in WILDCARD_HOSTS:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((address, port))
        sock.listen()
    except OSError:
        sock.close()
        raise
    return sock


def bind(server: grpc.aio.Server, host: str, port: int, tls: TlsConfig = PLAINTEXT) -> int:
    """Listen on host:port (port 0 = any free one), with TLS when `tls` has a certificate; returns
    the port, or raises with a clear message."""
    address = host_port(host, port)
    try:
        if tls.serves_tls:
            bound = server.add_secure_port(address, server_credentials(tls))
        else:
            bound = server.add_insecure_port(address)
    except RuntimeError as e:  # grpc's message only says to set GRPC_VERBOSITY
        raise ListenError(f"cannot listen on {address}: {why_not_listen(host, port)}") from e
    if bound == 0:
        raise ListenError(f"cannot listen on {address}: {why_not_listen(host, port)}")
    return bound


def why_not_listen(host: str, port: int) -> str:
    """The OS's reason host:port cannot be listened on: gRPC's failure names none, and "is the
    port in use?" misled where the host was another machine's address or a name that does not
    resolve."""
    refusal = bind_refusal(host, port)
    if refusal is None:
        return "refused by gRPC (is the port in use?)"  # free now: taken meanwhile, or gRPC's own
    return listen_hint(refusal)


def bind_refusal(host: str, port: int) -> OSError | None:
    """Why a socket bound as the servers bind (`listening_socket`: SO_REUSEADDR, the wildcard on
    both families) cannot take host:port, or None when it can: in use, another machine's address,
    a name that does not resolve."""
    try:
        with listening_socket(host, port):
            return None
    except OSError as e:
        return e


def serve_metrics(host: str, port: int, registry: Any = None) -> Any:
    """Prometheus /metrics over HTTP on host:port, in a thread (`registry`: the default one when
    None); returns the HTTP server. A port in use is a ListenError, as gRPC's ports are."""
    import socket
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from prometheus_client import REGISTRY, make_wsgi_app
    from prometheus_client.exposition import ThreadingWSGIServer

    class Server(ThreadingWSGIServer):
        def server_bind(self) -> None:
            if self.address_family == socket.AF_INET6 and host in WILDCARD_HOSTS:  # both families
                self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            super().server_bind()

    class Quiet(WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # a scrape every few seconds
            pass

    try:  # IPv4 or IPv6, as `host` is; the wildcard both
        Server.address_family, address = listen_address(host, port)
        server = make_server(address, port, _text_format(make_wsgi_app(registry or REGISTRY)), Server, Quiet)
    except OSError as e:
        raise ListenError(f"cannot serve /metrics on {host_port(host, port)}: {e.strerror}") from e
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server


def _text_format(app: Callable[..., Any]) -> Callable[..., Any]:
    """`app` answering in the Prometheus text format (0.0.4), whatever the scraper prefers. Asked
    for OpenMetrics without UTF-8 names (Prometheus 2, or 3 with legacy name validation),
    prometheus_client turns each sample name's `:` into `_` but not its HELP and TYPE lines'
    (prometheus/client_python#1177): every `vllm:*` series was stored as `vllm_*`, where vLLM's
    dashboards, alerts and KEDA queries never look. Every Prometheus accepts the text format."""

    def text_format(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        return app({k: v for k, v in environ.items() if k != "HTTP_ACCEPT"}, start_response)

    return text_format


@contextlib.asynccontextmanager
async def stopped_on_failure(*stops: Callable[[], Awaitable[Any]]) -> AsyncIterator[None]:
    """Run each of `stops` if the block raises. A start-up step failing after servers started (a
    later port in use) left them running past `asyncio.run`'s end, where gRPC's clean-up of a
    running server printed "Event loop is closed" tracebacks under the one-line error."""
    try:
        yield
    except BaseException:
        for stop in stops:
            with contextlib.suppress(Exception):
                await stop()
        raise


class _HealthServicer(health_aio.HealthServicer):
    """grpc's health servicer, with List, and for names it does not know: Check's NOT_FOUND says which it does
    (it had no message), and Watch answers SERVICE_UNKNOWN without keeping a watcher entry for
    the name (grpc's are never removed: watching ever-new names grew memory on an open port).
    A server's services are fixed when it starts, so an unknown name stays unknown."""

    async def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> Any:
        if request.service not in self._server_status:
            known = ", ".join(repr(n) for n in sorted(self._server_status))
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"no service {request.service[:200]!r} here; known: {known}"
            )
        return await super().Check(request, context)

    async def List(
        self, request: health_pb2.HealthListRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthListResponse:
        """Every service this server knows and its status (the protocol's List, which the reflected
        service offers; grpcio's servicer answered it UNIMPLEMENTED)."""
        statuses = {name: health_pb2.HealthCheckResponse(status=s) for name, s in self._server_status.items()}
        return health_pb2.HealthListResponse(statuses=statuses)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:
        if request.service in self._server_status:
            return await super().Watch(request, context)
        await context.write(health_pb2.HealthCheckResponse(status=SERVICE_UNKNOWN))
        await asyncio.Event().wait()  # until the caller goes away


class Health:
    """grpc.health.v1 for the whole server ("") and each named service, starting NOT_SERVING.
    One status, answered on every server given (a process may listen on several ports: `also_on`),
    each knowing only the services it serves."""

    def __init__(self, server: grpc.aio.Server, services: Iterable[str]) -> None:
        self._servicers: list[_HealthServicer] = []
        self.servicer = self.also_on(server, services)
        self.serving = False
        self._plaintext: grpc.aio.Server | None = None

    def also_on(self, server: grpc.aio.Server, services: Iterable[str]) -> _HealthServicer:
        """Answer on `server` too, for `services` (and ""): a pod's control port serves only
        ModelControl, and said SERVING for Generation, which it answers UNIMPLEMENTED."""
        servicer = _HealthServicer()
        # Every name known from the start, NOT_SERVING (grpc's servicer starts with "" SERVING: nothing
        # may route here before we say so). A named service was unknown until the first `set`: a
        # Watch begun while the pod loaded (grpc's client-side health checking) got SERVICE_UNKNOWN
        # and never heard SERVING.
        servicer._server_status.update(dict.fromkeys(["", *services], NOT_SERVING))
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        self._servicers.append(servicer)
        return servicer

    async def serve_plaintext(self, host: str, port: int) -> None:
        """Also answer on `port` (0 = not), alone and without TLS, for every service of the process:
        Kubernetes' gRPC probes speak no TLS, and a health status is no secret."""
        if not port:
            return
        server = make_server()
        names = {name for servicer in self._servicers for name in servicer._server_status}
        self.also_on(server, names)
        await self.set(self.serving)
        bind(server, host, port)
        await server.start()
        self._plaintext = server

    async def stop(self) -> None:
        if self._plaintext is not None:
            await self._plaintext.stop(0)

    async def set(self, serving: bool) -> None:
        self.serving = serving
        for servicer in self._servicers:
            for name in list(servicer._server_status):
                await servicer.set(name, SERVING if serving else NOT_SERVING)


def enable_reflection(server: grpc.aio.Server, services: Iterable[str]) -> None:
    """Server reflection, so `grpcurl -plaintext HOST:PORT list` and `describe` work without protos:
    `grpc.reflection.v1` and its older `v1alpha`. grpcio-reflection serves only v1alpha
    (grpc/grpc#38576), which grpc-java deprecated; clients that ask for v1 alone (grpc_cli, newer
    tools) found no reflection. The two are the same messages under two package names, so one
    servicer answers both."""
    v1 = _v1_reflection_service()
    servicer = reflection.aio.ReflectionServicer([*services, HEALTH_SERVICE, reflection.SERVICE_NAME, v1])
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    method = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(v1, {"ServerReflectionInfo": method}),)
    )


def _v1_reflection_service() -> str:
    """The name of `grpc.reflection.v1.ServerReflection`, its file added to the default descriptor
    pool (v1alpha's, renamed) unless there already, so reflection describes itself under v1 too."""
    alpha, name = reflection_pb2.DESCRIPTOR, "grpc/reflection/v1/reflection.proto"
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(name)
    except KeyError:
        proto = descriptor_pb2.FileDescriptorProto.FromString(alpha.serialized_pb)
        proto.name, proto.package = name, "grpc.reflection.v1"
        old, new = f".{alpha.package}.", ".grpc.reflection.v1."
        for field in (f for m in proto.message_type for f in m.field if f.HasField("type_name")):
            field.type_name = field.type_name.replace(old, new)
        for m in proto.service[0].method:
            m.input_type, m.output_type = m.input_type.replace(old, new), m.output_type.replace(old, new)
        pool.Add(proto)
    return "grpc.reflection.v1.ServerReflection"


def on_shutdown_signal(callback: Callable[[str], None]) -> None:
    """Call `callback(signal name)` on the running loop for SIGTERM (Kubernetes) and SIGINT (Ctrl-C)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, callback, sig.name)


def exit_if_stuck(seconds: float, what: str) -> None:
    """Bound a shutdown that has begun: if the process is still here `seconds` from now, write
    where every thread and asyncio task waits, then exit with status 1. Kubernetes would SIGKILL
    it at the end of its grace period and say nothing of why; an adapter service once sat 30 s
    after SIGTERM in the tests, its loop idle on some await that threads' stacks could not name."""
    loop = asyncio.get_running_loop()

    def give_up() -> None:
        log.error("%s still running %g s after it began to stop: exiting; its stacks follow", what, seconds)
        faulthandler.dump_traceback(all_threads=True)
        for task in asyncio.all_tasks(loop):
            print(f"{task!r} awaits:", *_awaits(task.get_coro()), sep="\n  ", file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)

    timer = threading.Timer(seconds, give_up)
    timer.daemon = True  # a shutdown that ends in time is not held up by it
    timer.start()


async def in_daemon_thread(call: Callable[[], T], name: str) -> T:
    """`call()` on a daemon thread of its own, as `asyncio.to_thread` runs it but for what may
    outlast the service's wish to stop: the default executor's threads are joined when the loop
    ends (with no bound on Python 3.11), so a model pod told to stop while it built a large model
    could exit only once the whole load was done. This thread is left behind at exit instead."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(outcome: Callable[[Any], None], value: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody awaits it now
            loop.call_soon_threadsafe(lambda: done.done() or outcome(value))

    def run() -> None:
        try:
            value = call()
        except BaseException as e:  # handed to the awaiting task, as to_thread would
            settle(done.set_exception, e)
        else:
            settle(done.set_result, value)

    threading.Thread(target=run, name=name, daemon=True).start()
    return await done


def _awaits(coro: Any) -> list[str]:
    """Where a suspended coroutine waits, outermost first, down its chain of awaits (a task's own
    stack names only its outermost frame)."""
    where = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            where.append(repr(coro)[:200])  # a future, or a finished frame
            break
        where.append(f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return where


def setup_logging(level: str) -> None:
    """A service process's diagnostics: log lines on stderr at `level`, and every thread's Python
    stack on stderr at SIGUSR1 (`kill -USR1 PID`), so a process that hangs (a shutdown that does not
    end, a backend call that does not return) can say where before anyone kills it."""
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def run_event_loop(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)`, on uvloop when it is installed (`pip install 'spindle[gateway]'`):
    grpc.aio's per-message callbacks cost the gateway ~6% less CPU there (docs/performance.md)."""
    if importlib.util.find_spec("uvloop") is None:
        return asyncio.run(main)
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)
