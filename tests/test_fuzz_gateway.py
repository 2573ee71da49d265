"""Property-based fuzzing of the gateway itself, through real gRPC: every RPC it serves
(Generation, the adapter admin API it forwards, health, reflection) with hostile requests
(tests/fuzz_strategies.py) AND hostile inputs of its own: API-key metadata (none, empty, huge,
wrong, several, a -bin twin, a valid key for an adapter it may not use), deadlines from past to
1e9 s, request ids, trace and routing-looking headers, resume fields, cancellation mid-stream,
aborts of live streams, and raw HTTP/2 headers a gRPC client will not send (tests/raw_http2.py).

Two gateways (one tracing every span, one passing the caller's trace headers on) run in a thread
of this process, so their counters can be read, in front of a real pod process and the real
adapter service (tests/fuzz_harness.py). Checked: every call ends with a status the caller can
act on and a message, and the right one where the key decides it (no valid key: UNAUTHENTICATED;
a key without the adapter or the admin scope: PERMISSION_DENIED); afterwards every counter the
gateways keep is zero (streams per pod, requests in flight, streams per key), the pod holds no KV
block, and a request through each gateway gets exactly the tokens the pod gives directly.
SPINDLE_FUZZ_EXAMPLES sets the examples per RPC (default 25; docs/reliability.md reports 1,000).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2 as rpb
from grpc_reflection.v1alpha import reflection_pb2_grpc
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.trace import TracerProvider

from gateway.server import GatewayService
from spindle import serving
from spindle.serving import SERVICE_UNKNOWN
from spindle.v1 import adapters_pb2 as apb
from spindle.v1 import adapters_pb2_grpc
from spindle.v1 import generation_pb2 as pb
from tests import fuzz_harness as fh
from tests import fuzz_strategies as fs
from tests import raw_http2
from tests.service_helpers import collect, gateway_in_process, stub, token_request, wait_idle

Code = grpc.StatusCode
pytestmark = [
    pytest.mark.usefixtures("fuzz_report"),
    # the gateways' router (ties) and span ids draw from `random` on their thread while Hypothesis,
    # on this one, watches that module for strategies that use it
    pytest.mark.filterwarnings(
        "ignore:Do not use the `random` module:hypothesis.errors.HypothesisDeprecationWarning"
    ),
]

KEY_LINES = """admin      key-admin  *     admin
plain      key-plain  -
only-kept  key-kept   kept
pair       key-pair   *     concurrency=2
rated      key-rated  *     rate=50 burst=5
"""
KEYS = {"key-admin": "admin", "key-plain": "plain", "key-kept": "only-kept", "key-pair": "pair",
        "key-rated": "rated"}  # fmt: skip
MAY_USE: dict[str, frozenset[str] | None] = {  # None: any adapter
    "admin": None, "plain": frozenset(), "only-kept": frozenset({"kept"}), "pair": None, "rated": None,
}  # fmt: skip
ADMIN = (("authorization", "Bearer key-admin"),)
PROMPT = [5, 6, 7, 8, 9]
WHICH = st.sampled_from(["plain", "traced"])


class LoopThread:
    """An event loop on a thread of its own: the gateways serve there while this test's blocking
    gRPC clients call them, and their counters are read there."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.stack = contextlib.AsyncExitStack()

    def run(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def enter(self, manager):
        return self.run(self.stack.enter_async_context(manager))

    def __enter__(self) -> LoopThread:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.run(self.stack.aclose())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


@dataclass
class Gateways:
    loop: LoopThread
    servers: dict[str, GatewayService]
    channels: dict[str, grpc.Channel]

    async def _open(self) -> dict[str, object]:
        """What is still open, by gateway and counter (only the non-zero ones)."""
        opened: dict[str, object] = {}
        for which, gw in self.servers.items():
            counts = {
                "streams per pod": {a: p.in_flight for a, p in gw.pool.pods.items() if p.in_flight},
                "requests in flight": sorted(gw.inflight),
                "streams per key": {n: c for n in MAY_USE if (c := gw.limits.open_streams(n))},
            }
            opened.update({f"{which}: {k}": v for k, v in counts.items() if v})
        return opened

    def assert_settled(self, timeout: float = 15.0) -> None:
        """Every counter the gateways keep is back to zero (a cancel reaches them a moment later)."""
        deadline = time.monotonic() + timeout
        while opened := self.loop.run(self._open()):
            assert time.monotonic() < deadline, f"gateway counters not back to zero: {opened}"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def gateways(tiny_pod, adapter_service, lora_dirs, tmp_path_factory):
    fh.registered(adapter_service, "kept", lora_dirs["b"])  # placed on the pod by the first request for it
    keys = tmp_path_factory.mktemp("gateway_keys") / "keys"
    keys.write_text(KEY_LINES)
    flags = ["--pods", tiny_pod.address, "--api-keys-file", str(keys), "--adapter-service",
             adapter_service.address, "--placement-timeout", "30"]  # fmt: skip
    with LoopThread() as loop:
        servers = {
            "plain": loop.enter(gateway_in_process(flags)),  # no span: trace headers go on to the pod
            "traced": loop.enter(gateway_in_process(flags, TracerProvider())),  # every span recorded
        }
        channels = {w: grpc.insecure_channel(f"127.0.0.1:{gw.port}") for w, gw in servers.items()}
        yield Gateways(loop, servers, channels)
        for ch in channels.values():
            ch.close()


def _also(timeout: float | None) -> frozenset:
    """Besides bad input: the key's verdicts, and a deadline the caller set too short."""
    codes = {Code.UNAUTHENTICATED, Code.PERMISSION_DENIED}
    return frozenset(codes | ({Code.DEADLINE_EXCEEDED} if timeout is not None and timeout < 10 else set()))


def _silent(auth: fs.Auth) -> frozenset:
    """Metadata over gRPC's limit is refused by its transport, at times without a message."""
    return frozenset({Code.RESOURCE_EXHAUSTED}) if auth.size > fs.METADATA_LIMIT else frozenset()


def _check_key(outcome: str, auth: fs.Auth, denied: bool) -> None:
    """The verdict the key decides: none valid -> UNAUTHENTICATED; `denied` (the caller may not
    use the adapter, or the admin API) -> PERMISSION_DENIED; else neither."""
    if outcome == "DEADLINE_EXCEEDED" or (outcome == "RESOURCE_EXHAUSTED" and auth.size > fs.METADATA_LIMIT):
        return  # over before the gateway decided, or metadata the transport refuses
    if auth.caller is None:
        assert outcome == "UNAUTHENTICATED", (outcome, auth)
    elif denied:
        over_rate = auth.caller == "rated" and outcome == "RESOURCE_EXHAUSTED"
        assert outcome == "PERMISSION_DENIED" or over_rate, (outcome, auth)
    else:
        assert outcome not in ("UNAUTHENTICATED", "PERMISSION_DENIED"), (outcome, auth)


def test_generate_fuzz(gateways, tiny_pod):
    @fh.FUZZ
    @given(
        which=WHICH,
        auth=fs.api_key_metadata(KEYS),
        timeout=fs.deadlines,
        cancel_after=st.sampled_from([None, None, 1, 3]),
        req=fs.generate_requests(vocab=320, adapters=("a", "kept")),
    )
    def fuzz(which, auth, timeout, cancel_after, req) -> None:
        g = stub(gateways.channels[which])
        also = _also(timeout)
        outcome = fh.drive_generate(
            g, "gateway Generate", req, cancel_after, also, _silent(auth), timeout=timeout,
            metadata=auth.metadata,
        )  # fmt: skip
        adapter = req.adapter if req.HasField("adapter") else None
        allowed = MAY_USE.get(auth.caller or "")
        prompt = req.WhichOneof("prompt") is not None
        denied = prompt and adapter is not None and allowed is not None and adapter not in allowed
        urgent = prompt and req.HasField("priority") and req.priority < 0  # no key here may ask for it
        _check_key(outcome, auth, denied or urgent)

    fuzz()
    gateways.assert_settled()
    wait_idle(tiny_pod, timeout=60)


def test_abort_and_list_models_fuzz(gateways):
    @fh.FUZZ
    @given(which=WHICH, auth=fs.api_key_metadata(KEYS), timeout=fs.deadlines, rid=fs.names)
    def fuzz(which, auth, timeout, rid) -> None:
        g = stub(gateways.channels[which])
        try:
            g.Abort(pb.AbortRequest(request_id=rid), metadata=auth.metadata, timeout=timeout)
            outcome = fh.note("gateway Abort", "OK")
        except grpc.RpcError as e:
            outcome = fh.refused_properly("gateway Abort", e, _also(timeout), _silent(auth))
        _check_key(outcome, auth, denied=False)
        assert outcome != "OK", "nothing of this caller's is in flight to abort"
        try:
            models = g.ListModels(pb.ListModelsRequest(), metadata=auth.metadata, timeout=timeout).models
            outcome = fh.note("gateway ListModels", "OK")
        except grpc.RpcError as e:
            outcome, models = fh.refused_properly("gateway ListModels", e, _also(timeout), _silent(auth)), []
        _check_key(outcome, auth, denied=False)
        allowed = MAY_USE.get(auth.caller or "")
        shown = {m.id for m in models if m.kind == pb.MODEL_KIND_ADAPTER}
        assert allowed is None or shown <= allowed, (auth.caller, shown)  # only adapters it may use

    fuzz()
    gateways.assert_settled()


_serial = itertools.count()


@settings(fh.FUZZ, max_examples=max(5, fh.EXAMPLES // 5))
@given(
    which=WHICH,
    rid=st.from_regex(r"[!-~]{1,40}", fullmatch=True),
    owner=st.sampled_from(["key-admin", "key-pair", "key-kept"]),
    other=st.sampled_from([*sorted(KEYS), "key-nobody"]),
    action=st.sampled_from(["abort", "abort by another key", "same id again", "cancel"]),
)
def test_aborts_and_duplicate_ids_of_live_streams(gateways, which, rid, owner, other, action):
    """A stream in flight: its owner aborts it (it ends ABORT), another key cannot (NOT_FOUND,
    as if it did not exist), its id cannot be reused while it runs (ALREADY_EXISTS), a cancel
    frees it; the counters come back to zero either way."""
    rid = f"{rid[:200]}-{next(_serial)}"
    g = stub(gateways.channels[which])
    req = token_request([7, 7, 7], 400, temperature=0.0)
    req.request_id = rid
    stream = g.Generate(req, metadata=(("x-api-key", owner),), timeout=60)
    assert next(stream).HasField("chunk")
    md = (("x-api-key", other),)
    expect = "UNAUTHENTICATED" if other not in KEYS else None
    try:
        if action == "abort":
            g.Abort(pb.AbortRequest(request_id=rid), metadata=(("x-api-key", owner),), timeout=10)
            assert list(stream)[-1].final.finish_reason == pb.FINISH_REASON_ABORT
            fh.note("gateway Abort (live)", "OK")
        elif action == "abort by another key" and other != owner:
            with pytest.raises(grpc.RpcError) as e:
                g.Abort(pb.AbortRequest(request_id=rid), metadata=md, timeout=10)
            assert e.value.code().name == (expect or "NOT_FOUND"), e.value.details()
            fh.note("gateway Abort (live, another key)", e.value.code().name)
        elif action == "same id again":
            with pytest.raises(grpc.RpcError) as e:
                list(g.Generate(req, metadata=md, timeout=10))
            assert e.value.code().name in ({expect} if expect else {"ALREADY_EXISTS", "RESOURCE_EXHAUSTED"})
            fh.note("gateway Generate (id in flight)", e.value.code().name)
    finally:
        stream.cancel()
    gateways.assert_settled()


ADMIN_METHODS = ["Delete", "Get", "Import", "List", "Pin"]


@pytest.mark.parametrize("method", ADMIN_METHODS)
def test_admin_api_fuzz(method, gateways, adapter_service, s3):
    """spindle.v1.Adapters through the gateway: only admin keys reach the service; `kept` survives."""
    before = s3.keys("kept/")
    rpc = f"gateway Adapters.{method}"

    @fh.FUZZ
    @given(
        which=WHICH,
        auth=fs.api_key_metadata(KEYS),
        timeout=fs.deadlines,
        req=fs.adapter_requests[method].filter(lambda r: getattr(r, "name", "") != "kept"),
    )
    def fuzz(which, auth, timeout, req) -> None:
        call = getattr(adapters_pb2_grpc.AdaptersStub(gateways.channels[which]), method)
        try:
            call(req, metadata=auth.metadata, timeout=timeout)
            outcome = fh.note(rpc, "OK")
        except grpc.RpcError as e:
            outcome = fh.refused_properly(rpc, e, _also(timeout) | {Code.DATA_LOSS}, _silent(auth))
        _check_key(outcome, auth, denied=auth.caller not in (None, "admin"))

    fuzz()
    admin = adapters_pb2_grpc.AdaptersStub(gateways.channels["plain"])
    assert admin.Get(apb.GetAdapterRequest(name="kept"), metadata=ADMIN, timeout=10).name == "kept"
    assert s3.keys("kept/") == before


def test_admin_register_fuzz(gateways, s3):
    before = s3.keys()

    @fh.FUZZ
    @given(which=WHICH, auth=fs.api_key_metadata(KEYS), timeout=fs.deadlines, chunks=fs.register_streams())
    def fuzz(which, auth, timeout, chunks) -> None:
        admin = adapters_pb2_grpc.AdaptersStub(gateways.channels[which])
        try:
            admin.Register(iter(chunks), metadata=auth.metadata, timeout=timeout)
            raise AssertionError("a fuzzed upload was registered")
        except grpc.RpcError as e:
            outcome = fh.refused_properly("gateway Adapters.Register", e, _also(timeout), _silent(auth))
        _check_key(outcome, auth, denied=auth.caller not in (None, "admin"))

    fuzz()
    assert s3.keys() == before  # nothing refused was stored


_HEALTHY = ("", "spindle.v1.Generation", "spindle.v1.Adapters")

_reflection_requests = st.one_of(
    st.just(rpb.ServerReflectionRequest()),
    st.just(rpb.ServerReflectionRequest(list_services="")),
    st.one_of(fs.names, st.sampled_from(["spindle.v1.Generation", "spindle/v1/generation.proto"])).flatmap(
        lambda n: st.sampled_from(
            [
                rpb.ServerReflectionRequest(file_by_filename=n),
                rpb.ServerReflectionRequest(file_containing_symbol=n),
                rpb.ServerReflectionRequest(all_extension_numbers_of_type=n),
            ]
        )
    ),
    st.builds(
        lambda t, n: rpb.ServerReflectionRequest(
            file_containing_extension=rpb.ExtensionRequest(containing_type=t, extension_number=n)
        ),
        fs.names,
        fs.int32,
    ),
)


def test_health_and_reflection_fuzz(gateways):
    """Open to anyone (a probe has no key): any service name, any metadata."""

    @fh.FUZZ
    @given(
        which=WHICH,
        auth=fs.api_key_metadata(KEYS),
        service=st.one_of(st.sampled_from(_HEALTHY), fs.names),
        reflect=st.lists(_reflection_requests, min_size=1, max_size=3),
    )
    def fuzz(which, auth, service, reflect) -> None:
        ch = gateways.channels[which]
        health = health_pb2_grpc.HealthStub(ch)
        request = health_pb2.HealthCheckRequest(service=service)
        try:
            status = health.Check(request, metadata=auth.metadata, timeout=10).status
            assert service in _HEALTHY and status == health_pb2.HealthCheckResponse.SERVING
            fh.note("gateway Health.Check", "OK")
        except grpc.RpcError as e:
            fh.refused_properly("gateway Health.Check", e, silent=_silent(auth))
            assert e.code() == Code.NOT_FOUND or auth.size > fs.METADATA_LIMIT, e
        watch = health.Watch(request, metadata=auth.metadata, timeout=10)
        try:
            first = next(watch).status
            known = service in _HEALTHY
            assert first == (health_pb2.HealthCheckResponse.SERVING if known else SERVICE_UNKNOWN)
            fh.note("gateway Health.Watch", "OK")
        except grpc.RpcError as e:
            fh.refused_properly("gateway Health.Watch", e, silent=_silent(auth))
            assert auth.size > fs.METADATA_LIMIT, e  # only metadata gRPC refuses
        finally:
            watch.cancel()
        _reflect(ch, reflect, auth)

    fuzz()


def _reflect(ch: grpc.Channel, requests: list[rpb.ServerReflectionRequest], auth: fs.Auth) -> None:
    """Each request gets its answer or an error_response in the stream, which ends OK."""
    reflection = reflection_pb2_grpc.ServerReflectionStub(ch)
    try:
        replies = list(reflection.ServerReflectionInfo(iter(requests), metadata=auth.metadata, timeout=10))
    except grpc.RpcError as e:
        fh.refused_properly("gateway ServerReflectionInfo", e, silent=_silent(auth))
        assert auth.size > fs.METADATA_LIMIT, e
        return
    assert len(replies) == len(requests)
    for reply in replies:
        if reply.HasField("error_response"):
            assert reply.error_response.error_code and reply.error_response.error_message
    fh.note("gateway ServerReflectionInfo", "OK")


_RAW_METHODS = [
    ("/spindle.v1.Generation/Generate", "unary_stream"),
    ("/spindle.v1.Generation/Abort", "unary_unary"),
    ("/spindle.v1.Generation/ListModels", "unary_unary"),
    ("/spindle.v1.Adapters/Register", "stream_unary"),
    ("/spindle.v1.Adapters/Get", "unary_unary"),
    ("/grpc.health.v1.Health/Check", "unary_unary"),
]


@pytest.mark.parametrize(("path", "kind"), _RAW_METHODS)
def test_malformed_protobuf_bytes_through_the_gateway(path, kind, gateways):
    fh.fuzz_raw_bytes(gateways.channels["traced"], path, kind, metadata=ADMIN)


_raw_key = st.one_of(
    st.tuples(st.just(b"authorization"), st.binary(max_size=40).map(lambda b: b"Bearer " + b)),
    st.tuples(st.sampled_from([b"x-api-key", b"X-Api-Key", b"x-api-key\0"]), st.binary(max_size=40)),
    st.sampled_from(
        [
            (b"authorization", "Bearer kéy-admin".encode()),
            (b"authorization", b"Bearer key-admin\r\nx-api-key: key-admin"),
            (b"authorization", b"Bearer key-admin\x00"),
            (b"authorization", b"Bearer \xff\xfe"),
            (b"Authorization", b"Bearer key-admin"),
        ]
    ),
)
_raw_other = st.tuples(
    st.sampled_from([b"grpc-timeout", b"x-request-id", b"traceparent", b"baggage", b"grpc-encoding"]),
    st.one_of(
        st.binary(max_size=12),
        st.sampled_from([b"", b"abc", b"1", b"-1S", b"0n", b"1n", b"99999999S", b"100000000H", b"1.5S"]),
    ),
)


# what gRPC's C core answers (INTERNAL) to an upper-case header name, a malformed grpc-timeout or
# grpc-encoding: before the gateway's code runs, and no gRPC client sends them
_TRANSPORT_REFUSALS = ("Illegal header", "Error parsing 'grpc-")


def test_raw_http2_headers(gateways):
    """Header bytes no gRPC client sends (non-ASCII, invalid UTF-8, CR / LF / NUL, upper-case
    names, malformed grpc-timeout): a status that is not UNKNOWN / INTERNAL, with a message, or
    the transport's refusal (a stream reset, or _TRANSPORT_REFUSALS); no valid key never succeeds."""
    message = token_request(PROMPT, 2, temperature=0.0).SerializeToString()

    @fh.FUZZ
    @given(which=WHICH, headers=st.lists(st.one_of(_raw_key, _raw_other), max_size=4))
    def fuzz(which, headers) -> None:
        address = f"127.0.0.1:{gateways.servers[which].port}"
        got = raw_http2.call(address, "/spindle.v1.Generation/Generate", headers, message)
        if got.status is None:
            fh.note("gateway raw HTTP/2 headers", got.reset.split(" ")[0])
            return
        code = next(c for c in Code if c.value[0] == got.status)
        if code == Code.INTERNAL and got.message.startswith(_TRANSPORT_REFUSALS):
            # gRPC's HTTP/2 layer refuses the request before any handler runs
            fh.note("gateway raw HTTP/2 headers", "INTERNAL (gRPC's transport, no handler ran)")
            return
        fh.note("gateway raw HTTP/2 headers", code.name)
        assert code not in (Code.UNKNOWN, Code.INTERNAL), (headers, got)
        assert code == Code.OK or got.message, (headers, got)
        assert code != Code.OK, f"served without a valid key: {headers}"

    fuzz()
    gateways.assert_settled()


def test_after_the_fuzz_the_gateways_serve_exactly_and_hold_nothing(gateways, tiny_pod):
    """Run last: everything up, every counter zero, and each gateway's tokens the pod's own."""
    gateways.assert_settled()
    assert tiny_pod.proc.poll() is None, tiny_pod.output()
    for which, ch in gateways.channels.items():
        for adapter in ("", "kept"):
            req = token_request(PROMPT, 8, temperature=0.0)
            if adapter:
                req.adapter = adapter
            through, msgs = collect(stub(ch).Generate(req, metadata=ADMIN, timeout=60))
            with tiny_pod.channel() as direct:
                expected, _ = collect(stub(direct).Generate(req, timeout=60))
            assert through == expected and len(expected) == 8, (which, adapter)
            assert msgs[-1].final.finish_reason == pb.FINISH_REASON_LENGTH
    wait_idle(tiny_pod, timeout=30)
    gateways.assert_settled()


def test_fuzz_findings_regressions(gateways):
    """What this fuzz found, one named case each (docs/reliability.md)."""
    ch = gateways.channels["plain"]
    for md in ((("x-api-key-bin", b"\xff\xfe"),), (("authorization-bin", b"key-admin"),)):  # was UNKNOWN
        with pytest.raises(grpc.RpcError) as e:
            stub(ch).ListModels(pb.ListModelsRequest(), metadata=md, timeout=10)
        assert e.value.code() == Code.UNAUTHENTICATED and "API key" in e.value.details()
    got = raw_http2.call(  # invalid UTF-8 in the key header itself: was UNKNOWN (UnicodeDecodeError)
        f"127.0.0.1:{gateways.servers['plain'].port}", "/spindle.v1.Generation/ListModels",
        [(b"authorization", b"Bearer \xff\xfe")], b"",
    )  # fmt: skip
    assert got.status == Code.UNAUTHENTICATED.value[0] and got.message, got
    admin = adapters_pb2_grpc.AdaptersStub(ch)
    headless = [apb.RegisterChunk(data=b"<\x03\xf5#"), apb.RegisterChunk(data=b"")]
    for _ in range(30):  # the service refuses at once: ~1 in 10 was INTERNAL "Internal error from Core"
        with pytest.raises(grpc.RpcError) as e:
            admin.Register(iter(headless), metadata=ADMIN, timeout=10)
        assert e.value.code() == Code.INVALID_ARGUMENT and e.value.details(), e.value
    for giant in ("r" * 10_000, "r" * 1_000_000):  # echoed whole in the message, the trailers went
        for call, code in (  # past gRPC's 8 KiB limit: the caller got RESOURCE_EXHAUSTED, not the code
            (lambda g=giant: stub(ch).Abort(pb.AbortRequest(request_id=g), metadata=ADMIN, timeout=10),
             Code.NOT_FOUND),
            (lambda g=giant: admin.Get(apb.GetAdapterRequest(name=g), metadata=ADMIN, timeout=10),
             Code.INVALID_ARGUMENT),
        ):  # fmt: skip
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == code and "more characters" in e.value.details(), e.value
    kept = token_request(PROMPT, 2)
    kept.adapter = "kept"
    for _ in range(10):  # the caller's deadline passing was UNAVAILABLE ("no model pod answered",
        # "placing adapter ... taking too long; retry"): now DEADLINE_EXCEEDED. A local ListModels
        # can come back before the client's own 1 us timer fires (once in CI, 2026-12-01 p): an
        # answer is allowed there, any refusal but DEADLINE_EXCEEDED is not.
        try:
            stub(ch).ListModels(pb.ListModelsRequest(), metadata=ADMIN, timeout=1e-6)
        except grpc.RpcError as e:
            assert e.code() == Code.DEADLINE_EXCEEDED, e
        with pytest.raises(grpc.RpcError) as e:
            list(stub(ch).Generate(kept, metadata=ADMIN, timeout=1e-6))
        assert e.value.code() == Code.DEADLINE_EXCEEDED, e.value
    health = health_pb2_grpc.HealthStub(ch)
    watch = health.Watch(health_pb2.HealthCheckRequest(service="spindle.v1.Generation"), timeout=10)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING  # was UNKNOWN on every server
    watch.cancel()
    with pytest.raises(grpc.RpcError) as e:  # was NOT_FOUND without a message
        health.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=10)
    assert e.value.code() == Code.NOT_FOUND and "spindle.v1.Generation" in e.value.details()
    server, health, port = gateways.loop.run(_health_server())  # unknown names leave no watcher
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as own:
            for n in range(20):
                watch = health_pb2_grpc.HealthStub(own).Watch(
                    health_pb2.HealthCheckRequest(service=f"new-{n}"), timeout=10
                )
                assert next(watch).status == SERVICE_UNKNOWN
                watch.cancel()
        assert set(health.servicer._server_watchers) <= {""}  # grpc's kept every name: memory grew
    finally:
        gateways.loop.run(server.stop(0))


async def _health_server() -> tuple[grpc.aio.Server, serving.Health, int]:
    """A server with only grpc.health.v1 (serving.Health), SERVING, on a free port."""
    server = serving.make_server()
    health = serving.Health(server, ["x"])
    await health.set(True)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, health, port
