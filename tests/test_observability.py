"""What a platform team's Prometheus and OpenTelemetry see of requests that do not end well: a
caller that cancels, a deadline that passes mid-stream, a scrape during a long step.

On the fake engine (bench/fake_engine.py: one token a step, each step sleeps), so a stream is
still running when its caller gives up, however fast the machine.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from bench.fake_engine import FakeFastEngine
from model_service.engine.sampling_params import SamplingParams
from model_service.pod import server as pod_server
from model_service.pod.state import ModelPod
from spindle.traced_streams import DEADLINE_SLACK_S, cancelled_code
from spindle.v1 import generation_pb2 as pb
from spindle.v1 import generation_pb2_grpc
from tests.service_helpers import gateway_in_process

GENERATE = "/spindle.v1.Generation/Generate"
STEP_S = 0.005


@asynccontextmanager
async def _fake_pod(
    provider: TracerProvider | None = None, host: str = "127.0.0.1"
) -> AsyncIterator[tuple[ModelPod, int]]:
    pod = ModelPod("fake", drain_timeout=1.0)
    servers = await pod_server.start(pod, host, 0, 0, provider)
    try:
        await pod.load(lambda: FakeFastEngine(STEP_S))
        yield pod, servers.port
    finally:
        await servers.stop(0)
        pod.close()


def _request(prompt_len: int, max_tokens: int) -> pb.GenerateRequest:
    ids = pb.TokenIds(ids=list(range(1, prompt_len + 1)))
    return pb.GenerateRequest(token_ids=ids, max_tokens=max_tokens)


async def _three_endings(channel: grpc.aio.Channel) -> int:
    """One request to its end (3 prompt tokens, 5 generated), one cancelled after 3 messages (4
    prompt tokens), one past its deadline mid-stream (5 prompt tokens); the tokens received."""
    stub = generation_pb2_grpc.GenerationStub(channel)
    received = sum([len(m.chunk.token_ids) async for m in stub.Generate(_request(3, 5), timeout=30)])
    call = stub.Generate(_request(4, 100_000), timeout=30)
    async for m in call:
        received += len(m.chunk.token_ids)
        if received >= 5 + 3:
            call.cancel()
            break
    late = stub.Generate(_request(5, 100_000), timeout=0.3)
    try:
        async for m in late:
            received += len(m.chunk.token_ids)
    except grpc.aio.AioRpcError as e:
        assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    return received


def test_cancelled_and_timed_out_streams_are_counted_in_the_pods_metrics():
    """Only a request that reached its final message was counted: a stream its caller cancelled,
    or whose deadline passed, added nothing to `vllm:generation_tokens_total` (the work was done),
    `vllm:request_success_total{finished_reason="abort"}` or the latency histograms, so
    throughput and request-rate dashboards undercounted a pod whose callers time out."""

    async def go() -> tuple[int, dict[str, list]]:
        async with _fake_pod() as (pod, port), grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            received = await _three_endings(ch)
            for _ in range(200):  # the aborted streams' handlers finish as their cancellation lands
                if not pod.inflight:
                    break
                await asyncio.sleep(0.01)
            text = (await asyncio.to_thread(generate_latest, pod.metrics.registry)).decode()
        return received, _strictly_parsed(text)

    received, metrics = asyncio.run(go())
    assert _value(metrics, "vllm:prompt_tokens_total") == 3 + 4 + 5
    assert _value(metrics, "vllm:generation_tokens_total") >= received
    reasons = {s.labels["finished_reason"]: s.value for s in metrics["vllm:request_success_total"]}
    assert reasons == {"length": 1, "abort": 2}
    assert _value(metrics, "vllm:e2e_request_latency_seconds_count") == 3
    assert _value(metrics, "vllm:time_to_first_token_seconds_count") == 3
    assert _value(metrics, "vllm:num_requests_running") == 0


def _value(metrics: dict[str, list], name: str) -> float:
    [sample] = metrics[name]
    return sample.value


def _strictly_parsed(text: str) -> dict[str, list]:
    """The samples by name, once the text passes the exposition format's rules a scraper relies
    on: HELP and TYPE once per family, counters' samples end `_total`, histogram buckets are
    cumulative up to `+Inf` which equals `_count`, no series twice."""
    families = list(text_string_to_metric_families(text))
    for kind in ("HELP", "TYPE"):
        named = re.findall(rf"^# {kind} (\S+)", text, re.M)
        assert len(named) == len(set(named)) == len(families), kind
    series: set[tuple] = set()
    samples: dict[str, list] = {}
    for f in families:
        for s in f.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in series, key
            series.add(key)
            samples.setdefault(s.name, []).append(s)
            if f.type == "counter":
                assert s.name.endswith(("_total", "_created")), s.name
        if f.type == "histogram":
            _check_histogram(f)
    return samples


def _check_histogram(family) -> None:
    by_labels: dict[tuple, dict[str, list]] = {}
    for s in family.samples:
        labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
        by_labels.setdefault(labels, {}).setdefault(s.name.rsplit("_", 1)[-1], []).append(s)
    for parts in by_labels.values():
        buckets = [(float(s.labels["le"]), s.value) for s in parts["bucket"]]
        assert buckets == sorted(buckets) and buckets[-1][0] == float("inf"), family.name
        [count] = parts["count"]
        assert buckets[-1][1] == count.value and "sum" in parts, family.name


async def _traced_endings(exporter: InMemorySpanExporter) -> None:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    async with _fake_pod(provider) as (_, port):
        flags = ["--pods", f"127.0.0.1:{port}", "--allow-unauthenticated"]
        async with (
            gateway_in_process(flags, provider) as gw,
            grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as ch,
        ):
            await _three_endings(ch)
            await asyncio.sleep(0.3)  # the pod's handlers see the cancellations


def test_a_cancelled_or_timed_out_call_is_not_traced_as_ok(caplog):
    """grpc.aio ends a cancelled call, or one past its deadline, by cancelling its handler, which
    OpenTelemetry's server interceptor does not see (it catches Exception), and when that landed
    while a message was being sent the interceptor's generator was closed later by the garbage
    collector ("Failed to detach context" logged at ERROR): every such span said
    `rpc.grpc.status_code` 0 (OK), so a trace-based error rate missed every timeout. Now the
    spans say CANCELLED (1) or DEADLINE_EXCEEDED (4, an error by the RPC conventions), and
    the pod's what it generated before."""
    exporter = InMemorySpanExporter()
    asyncio.run(_traced_endings(exporter))
    assert not [r for r in caplog.records if r.name.startswith("opentelemetry")]
    calls = [s for s in exporter.get_finished_spans() if s.name == GENERATE]
    by_trace: dict[int, dict[str, list]] = {}
    for s in sorted(calls, key=lambda s: s.start_time):
        by_trace.setdefault(s.context.trace_id, {}).setdefault(s.kind.name, []).append(s)
    [done, cancelled, late] = [(t["SERVER"][0], t["CLIENT"][0], t["SERVER"][1]) for t in by_trace.values()]
    for gateway_span, _, pod_span in (done, cancelled, late):
        assert "spindle.caller" in gateway_span.attributes and "spindle.caller" not in pod_span.attributes
    codes = [[s.attributes["rpc.grpc.status_code"] for s in spans] for spans in (done, cancelled, late)]
    # The pod's deadline is the gateway's: whichever of the gateway's cancel and its own lands first.
    assert codes[:2] == [[0, 0, 0], [1, 1, 1]] and codes[2][:2] == [4, 4] and codes[2][2] in (1, 4)
    for span in (*done, *cancelled):
        assert span.status.status_code == StatusCode.UNSET  # a cancel is the caller's choice, not a fault
    assert late[0].status.status_code == late[1].status.status_code == StatusCode.ERROR
    for _, _, pod_span in (cancelled, late):
        assert pod_span.attributes["gen_ai.response.finish_reasons"] == ("abort",)
        assert pod_span.attributes["gen_ai.usage.output_tokens"] > 0


class _Remaining:
    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds

    def time_remaining(self) -> float | None:
        return self.seconds


def test_a_cancel_that_lands_just_before_the_servers_deadline_is_read_as_the_deadline():
    """The caller's timer starts before the server reads the headers, so its cancel at its own
    deadline can reach a loaded server a few ms before the server's: CI once read such a call
    as CANCELLED though its caller had been told DEADLINE_EXCEEDED."""
    assert cancelled_code(_Remaining(DEADLINE_SLACK_S / 2)) == grpc.StatusCode.DEADLINE_EXCEEDED
    assert cancelled_code(_Remaining(-1.0)) == grpc.StatusCode.DEADLINE_EXCEEDED
    assert cancelled_code(_Remaining(DEADLINE_SLACK_S * 5)) == grpc.StatusCode.CANCELLED
    assert cancelled_code(_Remaining(None)) == grpc.StatusCode.CANCELLED  # no deadline


def test_a_scrape_during_a_long_step_answers_from_the_last_step_boundary():
    """The metrics collector asked the engine thread for its stats and waited for it: a scrape
    during a long step (a long prompt's prefill on a slow device: 48 s on 2 CPU cores) waited the
    whole step, past Prometheus's 10 s scrape timeout (the pod then reads as down), and a
    stuck engine held every scrape's thread for good. Now a scrape answers as the load reports
    do: fresh stats within a quarter second, else those of the last step boundary."""

    async def go() -> tuple[float, dict[str, list]]:
        async with _fake_pod() as (pod, _):
            await pod.load_stats.recent()  # what the gateway's first load poll does
            engine = pod.engine
            assert isinstance(engine, FakeFastEngine)
            engine.step_s = 1.5
            assert pod.async_engine is not None
            one = SamplingParams(max_tokens=1)
            long = pod.async_engine.generate("long", prompt_token_ids=[1], params=one)
            step = asyncio.ensure_future(anext(long))  # a step of 1.5 s begins
            await asyncio.sleep(0.1)
            started = time.monotonic()
            text = (await asyncio.to_thread(generate_latest, pod.metrics.registry)).decode()
            took = time.monotonic() - started
            await step
            await long.aclose()
            return took, _strictly_parsed(text)

    took, metrics = asyncio.run(go())
    assert took < 1.0  # FRESH_WAIT_S (0.25 s), not the step
    assert _value(metrics, "vllm:num_requests_running") == 0  # the stats of the step boundary before


def test_closing_a_wrapped_stream_closes_the_handlers_at_once():
    """The malformed-request wrapper around every streaming handler iterated the handler's stream
    without closing it: a call cancelled while grpc sent a message closed only the wrapper, and
    the handler's cleanup (its span's attributes, the pod's metrics, the gateway's stream slot)
    ran later, whenever the garbage collector found it, after its span had ended."""
    from spindle.malformed import _wrap

    cleaned: list[str] = []

    async def handler(request: int, context: object) -> AsyncIterator[int]:
        try:
            yield request
            yield request + 1
        finally:
            cleaned.append("handler")

    async def go() -> None:
        wrapped = _wrap(grpc.unary_stream_rpc_method_handler(handler)).unary_stream
        stream = wrapped(7, None)
        assert await anext(stream) == 7
        await stream.aclose()
        assert cleaned == ["handler"]

    asyncio.run(go())


class _Answers:
    """A Generation servicer behind the HTTP front: `max_tokens` 1 is refused (INVALID_ARGUMENT),
    2 fails after its first chunk (UNAVAILABLE), anything else answers."""

    async def Generate(self, request: pb.GenerateRequest, context: Any) -> AsyncIterator[pb.GenerateResponse]:
        if request.max_tokens == 1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "one token is not enough")
        yield pb.GenerateResponse(chunk=pb.Chunk(text="Hel", token_ids=[1]))
        if request.max_tokens == 2:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the pod went away")
        usage = pb.Usage(prompt_tokens=1, completion_tokens=1)
        yield pb.GenerateResponse(final=pb.Final(finish_reason=pb.FINISH_REASON_LENGTH, usage=usage))


def test_http_spans_say_their_status_and_are_errors_only_for_the_servers_faults():
    """The HTTP front's span began after the body was parsed (a malformed request had none) and
    carried no HTTP attributes, and a refusal set it ERROR: every 400, 401 and 429 counted as a
    server error in a trace backend's error rate. Now: a span per request but /health, with
    `http.request.method`, `http.route` and `http.response.status_code`; ERROR only for a 5xx,
    or for a stream that failed after its 200 (its error event)."""
    import aiohttp
    from opentelemetry.trace import get_tracer

    from spindle.openai_api.server import OpenAIServer

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = get_tracer(__name__, tracer_provider=provider)

    async def go() -> list[int]:
        server = OpenAIServer(_Answers(), lambda: ("m",), lambda: True, tracer)
        port = await server.start("127.0.0.1", 0)
        url = f"http://127.0.0.1:{port}"
        statuses = []
        try:
            async with aiohttp.ClientSession() as http:
                for body in ({"max_tokens": 5}, {"max_tokens": 1}, {"max_tokens": 2, "stream": True}):
                    async with http.post(
                        f"{url}/v1/completions", json={"model": "m", "prompt": "x", **body}
                    ) as r:
                        statuses.append(r.status)
                        await r.read()
                for path in ("/v1/completions", "/v1/models/m", "/health"):
                    async with http.request("POST" if "compl" in path else "GET", url + path, data=b"{") as r:
                        statuses.append(r.status)
        finally:
            await server.stop()
        return statuses

    assert asyncio.run(go()) == [200, 400, 200, 400, 500, 200]
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == ["POST /v1/completions"] * 4 + ["GET /v1/models/{model}"]
    codes = [s.attributes.get("http.response.status_code") for s in spans]
    assert codes == [200, 400, 200, 400, 500]
    errors = [s.status.status_code == StatusCode.ERROR for s in spans]
    assert errors == [False, False, True, False, True]
    assert {s.attributes["http.request.method"] for s in spans} == {"POST", "GET"}
    assert spans[0].attributes["http.route"] == "/v1/completions"


class _PassedOn:
    """A Generation servicer behind the HTTP front that records the context it would pass on to a
    pod (what the gateway's relay injects into the pod call's metadata)."""

    def __init__(self) -> None:
        self.carriers: list[dict[str, str]] = []

    async def Generate(self, request: pb.GenerateRequest, context: Any) -> AsyncIterator[pb.GenerateResponse]:
        from opentelemetry import propagate

        self.carriers.append({})
        propagate.inject(self.carriers[-1])
        usage = pb.Usage(prompt_tokens=1, completion_tokens=1)
        yield pb.GenerateResponse(final=pb.Final(finish_reason=pb.FINISH_REASON_LENGTH, usage=usage))


async def _passed_on(tracer: Any, headers: Any) -> dict[str, str]:
    """One completion through the HTTP front with `headers`: the context it would pass on."""
    import aiohttp

    from spindle.openai_api.server import OpenAIServer

    servicer = _PassedOn()
    server = OpenAIServer(servicer, lambda: ("m",), lambda: True, tracer)
    port = await server.start("127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as http:
            body = {"model": "m", "prompt": "x", "max_tokens": 1}
            url = f"http://127.0.0.1:{port}/v1/completions"
            async with http.post(url, json=body, headers=headers) as r:
                assert r.status == 200, await r.text()
    finally:
        await server.stop()
    [carrier] = servicer.carriers
    return carrier


def test_the_http_front_passes_the_callers_baggage_on_with_its_trace():
    """The HTTP front made only the caller's span current, not its context: a `baggage` header
    (a tenant, a test run's id) reached the pods from gRPC callers but never from HTTP ones,
    whether the gateway traced or not. Now both the trace and the baggage go on."""
    from opentelemetry.trace import NoOpTracerProvider, get_tracer

    trace_id = "0af7651916cd43dd8448eb211c80319c"
    headers = {"traceparent": f"00-{trace_id}-b7ad6b7169203331-01", "baggage": "tenant=acme"}
    for provider in (TracerProvider(), NoOpTracerProvider()):  # a gateway that traces, one that does not
        carrier = asyncio.run(_passed_on(get_tracer(__name__, tracer_provider=provider), headers))
        assert carrier.get("baggage") == "tenant=acme", (provider, carrier)
        assert carrier["traceparent"].split("-")[1] == trace_id


def test_a_field_sent_twice_is_read_as_w3c_trace_context_says():
    """`tracestate` in two header fields (a proxy adding its vendor's entry) is one list, as W3C
    Trace Context asks (RFC 9110's combining): the HTTP front kept only the first field's entries
    and a gRPC server only the last's. A `traceparent` sent twice is invalid: a trace of its own
    (it went on as whichever the dict kept; the W3C test suite's `test_traceparent_duplicated`)."""
    from multidict import CIMultiDict
    from opentelemetry.trace import get_tracer

    from spindle.traced_streams import TracedStreams

    trace_id, other_id = "0af7651916cd43dd8448eb211c80319c", "1" * 32
    parent, other = f"00-{trace_id}-b7ad6b7169203331-01", f"00-{other_id}-2222222222222222-01"
    provider = TracerProvider()
    tracer = get_tracer(__name__, tracer_provider=provider)
    fields = [("traceparent", parent), ("tracestate", "a=1"), ("tracestate", "b=2,c=3")]
    carrier = asyncio.run(_passed_on(tracer, CIMultiDict(fields)))
    assert carrier["tracestate"] == "a=1,b=2,c=3" and carrier["traceparent"].split("-")[1] == trace_id
    carrier = asyncio.run(_passed_on(tracer, CIMultiDict([("traceparent", parent), ("traceparent", other)])))
    assert carrier["traceparent"].split("-")[1] not in (trace_id, other_id)

    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    interceptor = TracedStreams(provider.get_tracer("t"))
    details = collections.namedtuple("Details", "method invocation_metadata")("/s.S/M", ())

    async def stream(request: int, context: Any) -> AsyncIterator[int]:
        yield request

    async def run() -> None:
        fields = (("traceparent", parent), ("tracestate", "a=1"), ("tracestate", "b=2"))
        async for _ in interceptor._intercept_aio_server_stream(stream, details)(1, _Call(fields)):
            pass

    asyncio.run(run())
    [span] = exporter.get_finished_spans()
    assert dict(span.context.trace_state) == {"a": "1", "b": "2"}


class _Call:
    """The part of a grpc.aio servicer context the tracing interceptor reads."""

    def __init__(self, fields: tuple[tuple[str, str], ...] = ()) -> None:
        parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        self.fields = fields or (("traceparent", parent), ("baggage", "tenant=acme"))

    def invocation_metadata(self) -> tuple:
        entry = collections.namedtuple("Metadatum", "key value")
        return tuple(entry(k, v) for k, v in self.fields)

    def peer(self) -> str:
        return "ipv4:10.0.0.1:5000"

    def time_remaining(self) -> None:
        return None

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: tuple = ()) -> None:
        raise grpc.aio.AbortError()


def test_a_traced_stream_says_how_it_ended():
    """Refused by the caller's fault (UNSET), by the server's (ERROR), or a bug in the handler
    (UNKNOWN, ERROR: upstream's stream interceptor left such a span OK); each in the caller's
    trace, each ended; the handler sees the caller's baggage (which the gateway passes on)."""
    from opentelemetry import baggage

    from spindle.traced_streams import TracedStreams

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    interceptor = TracedStreams(provider.get_tracer("t"))
    details = collections.namedtuple("Details", "method invocation_metadata")("/s.S/M", ())
    seen: list[object] = []

    def handler(ending: Any) -> Any:
        async def stream(request: int, context: Any) -> AsyncIterator[int]:
            seen.append(baggage.get_baggage("tenant"))
            yield request
            if isinstance(ending, grpc.StatusCode):
                await context.abort(ending, "refused")
            raise ending

        return interceptor._intercept_aio_server_stream(stream, details)

    async def run(ending: Any) -> None:
        with contextlib.suppress(Exception):
            async for _ in handler(ending)(1, _Call()):
                pass

    endings = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INTERNAL, KeyError("bug"))
    for ending in endings:
        asyncio.run(run(ending))
    spans = exporter.get_finished_spans()
    assert [s.attributes["rpc.grpc.status_code"] for s in spans] == [5, 13, 2]
    assert [s.status.status_code for s in spans] == [StatusCode.UNSET, StatusCode.ERROR, StatusCode.ERROR]
    assert {f"{s.context.trace_id:032x}" for s in spans} == {"0af7651916cd43dd8448eb211c80319c"}
    assert spans[0].attributes["net.peer.ip"] == "10.0.0.1"
    assert seen == ["acme"] * 3


def test_an_adapter_name_the_lora_metric_would_split_is_refused():
    """`vllm:lora_requests_info` lists adapters comma-joined, as vLLM does and as the Gateway API
    Inference Extension reads them: a pod adapter named `x,y` read as adapters `x` and `y`."""
    from model_service.pod.control import ModelControlService
    from spindle.openai_api.context import HttpCallContext, Refused

    service = ModelControlService(ModelPod("m", drain_timeout=1.0))

    async def refused(name: str) -> bool:
        try:
            await service._name(name, HttpCallContext({}))
        except Refused as e:
            return e.code == grpc.StatusCode.INVALID_ARGUMENT
        return False

    names = ("x,y", "a\nb", "sql-lora.v2", "ü")
    assert [asyncio.run(refused(n)) for n in names] == [True, True, False, False]


def test_a_lora_flag_names_an_adapter_as_the_control_api_would():
    """`--lora NAME=DIR` took any name the control API refuses: `x,y` was listed as adapters `x`
    and `y` in `vllm:lora_requests_info`, and `@active` shadowed the pod's own name."""
    from spindle.errors import SpindleError
    from spindle.peft import lora_specs

    assert lora_specs(["sql-lora.v2=/a", "ü=/b"]) == {"sql-lora.v2": "/a", "ü": "/b"}
    for spec in ("x,y=/a", "@active=/a", "a\tb=/a"):
        try:
            lora_specs([spec])
        except SpindleError as e:
            assert "adapter name" in str(e)
        else:
            raise AssertionError(f"--lora {spec} was taken")


def test_a_resumed_streams_replayed_tokens_count_as_prefill_not_generation():
    """A stream the gateway resumes on another pod (its first pod failed mid-stream) carries the
    tokens already sent (`resume`); the pod replays them into its output, and counted them in
    `vllm:generation_tokens_total` as if it had generated them: the fleet's generation
    throughput counted every resumed token twice (the first pod counted it too), and the
    prompt counter missed the replayed tokens this pod did prefill. Now: generated here is
    generated, and the replayed tokens are prefill (vLLM's "prefill tokens processed")."""

    async def go() -> dict[str, list]:
        async with _fake_pod() as (pod, port), grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            req = _request(3, 7)
            req.resume.output_token_ids.extend([100, 101, 102])  # what the fake engine made first
            req.resume.text_chars = 3
            stub = generation_pb2_grpc.GenerationStub(ch)
            messages = [m async for m in stub.Generate(req, timeout=30)]
            assert sum(len(m.chunk.token_ids) for m in messages) == 4  # only what follows the resumed
            assert messages[-1].final.usage.completion_tokens == 7  # the caller's usage: the whole output
            text = (await asyncio.to_thread(generate_latest, pod.metrics.registry)).decode()
        return _strictly_parsed(text)

    metrics = asyncio.run(go())
    assert _value(metrics, "vllm:generation_tokens_total") == 4
    assert _value(metrics, "vllm:prompt_tokens_total") == 3 + 3


def test_long_latencies_land_in_a_finite_bucket():
    """The pod's time-to-first-token buckets stopped at 20 s and its request buckets (e2e, queue,
    prefill, decode) at 120 s, the gateway's at 60 s and 600 s: a 5-minute queue on a loaded pod
    or a 30-minute reasoning answer fell in `+Inf`, where `histogram_quantile` answers the last
    finite bound, so a p99 dashboard read 20 s for 300 s. vLLM's own buckets (which dashboards and
    alerts written for these names expect) reach 2560 s for TTFT and 7680 s for a request."""
    from gateway.metrics import GatewayMetrics
    from model_service.pod.metrics import PodMetrics

    class NoPods:
        def __init__(self) -> None:
            self.pods: dict = {}
            self.ejections: dict = {}

    pod, gateway = PodMetrics("m", lambda: None), GatewayMetrics(NoPods())  # type: ignore[arg-type]
    waits = {pod.ttft: 300.0, pod.e2e: 1800.0, pod.queue: 300.0, pod.decode: 1800.0,
             gateway.ttft.labels("m"): 300.0, gateway.latency.labels("m"): 1800.0}  # fmt: skip
    for hist, wait in waits.items():
        hist.observe(wait)
    samples = {**_strictly_parsed(generate_latest(pod.registry).decode()),
               **_strictly_parsed(generate_latest(gateway.registry).decode())}  # fmt: skip
    names = [f"vllm:{n}_seconds" for n in ("time_to_first_token", "e2e_request_latency", "request_queue_time",
                                           "request_decode_time")]  # fmt: skip
    names += ["spindle_gateway_time_to_first_token_seconds", "spindle_gateway_request_duration_seconds"]
    expected = dict(zip(names, waits.values(), strict=True))
    for name, wait in expected.items():
        bounds = [float(s.labels["le"]) for s in samples[f"{name}_bucket"] if s.value == 0]
        first = min(float(s.labels["le"]) for s in samples[f"{name}_bucket"] if s.value == 1)
        assert first != float("inf") and max(bounds) < wait <= first <= 4 * wait, (name, first)


def test_a_prometheus_scrape_keeps_the_vllm_metric_names():
    """Prometheus 2 (and 3 with legacy name validation) asks for OpenMetrics without UTF-8 names;
    prometheus_client then wrote each sample's name with `:` turned to `_`
    (`vllm_num_requests_waiting`) under HELP and TYPE lines that kept `vllm:`
    (prometheus/client_python#1177): every `vllm:*` series was stored under another name, so
    dashboards, KEDA's Prometheus trigger and alerts on vLLM's names found nothing. /metrics
    now answers in the Prometheus text format, which every scraper accepts, names unchanged."""
    import urllib.request

    from model_service.pod.metrics import PodMetrics

    prometheus_2 = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
                    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")  # fmt: skip
    metrics = PodMetrics("m", lambda: None)
    metrics.ttft.observe(0.5)
    port = metrics.serve("127.0.0.1", 0)
    try:
        scrape = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Accept": prometheus_2})
        with urllib.request.urlopen(scrape, timeout=5) as r:
            text = r.read().decode()
    finally:
        metrics.stop()
    samples = _strictly_parsed(text)
    assert _value(samples, "vllm:time_to_first_token_seconds_count") == 1
    assert not [line for line in text.splitlines() if line.startswith("vllm_")]


def test_metrics_on_the_wildcard_host_are_scraped_over_ipv6_and_ipv4():
    """/metrics on the default --host 0.0.0.0 listened on IPv4 alone: on an IPv6 single-stack
    cluster Prometheus (and KEDA's Prometheus trigger) could not scrape any service, whose gRPC
    ports, bound to the same 0.0.0.0, answered over IPv6. The wildcard is now both families."""
    import socket
    import urllib.request

    from model_service.pod.metrics import PodMetrics

    if not socket.has_dualstack_ipv6():
        import pytest

        pytest.skip("no dual-stack IPv6 here")
    metrics = PodMetrics("m", lambda: None)
    port = metrics.serve("0.0.0.0", 0)
    try:
        for url in (f"http://[::1]:{port}/metrics", f"http://127.0.0.1:{port}/metrics"):
            with urllib.request.urlopen(url, timeout=5) as r:
                assert b"vllm:" in r.read(), url
    finally:
        metrics.stop()


def test_a_gateway_and_its_pod_on_ipv6_loopback_serve_and_log_bracketed_addresses(caplog):
    """`--host ::1` in-process: a pod, a gateway dialling it as `--pods [::1]:PORT`, a stream over
    gRPC and one over HTTP through the gateway, /metrics scraped, and the start-up lines naming
    each address as a client or a URL takes it ("[::1]:PORT", "http://[::1]:PORT/metrics"): they
    said "::1:PORT" and "http://::1:PORT/metrics", which no gRPC client or URL parser reads."""
    import logging
    import socket
    import urllib.request

    import aiohttp
    import pytest

    from tests.service_helpers import free_port

    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    caplog.set_level(logging.INFO)
    metrics_port = free_port()

    async def go() -> tuple[int, int, bytes]:
        async with _fake_pod(host="::1") as (_, port):
            flags = ["--host", "::1", "--pods", f"[::1]:{port}", "--allow-unauthenticated",
                     "--metrics-port", str(metrics_port), "--http-port", str(free_port())]  # fmt: skip
            async with (
                gateway_in_process(flags) as gw,
                grpc.aio.insecure_channel(f"[::1]:{gw.port}") as ch,
                aiohttp.ClientSession() as http,
            ):
                grpc_tokens = await _three_endings(ch)
                body = {"model": "fake", "prompt": "x", "max_tokens": 3}
                async with http.post(f"http://[::1]:{gw.http_port}/v1/completions", json=body) as r:
                    status = r.status
                url = f"http://[::1]:{metrics_port}/metrics"
                scrape = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())
                return grpc_tokens, status, scrape

    tokens, status, scrape = asyncio.run(go())
    assert tokens > 0 and status == 200 and b"spindle_gateway" in scrape
    said = caplog.text
    assert "gateway listening on [::1]:" in said and "OpenAI-compatible HTTP API on [::1]:" in said
    assert f"metrics on http://[::1]:{metrics_port}/metrics" in said
