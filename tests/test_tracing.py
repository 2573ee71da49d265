"""One trace per request across gateway -> model pod, with the GenAI attributes.

In-process (grpc.aio servers in this test's event loop) so an in-memory exporter sees both sides;
the W3C context still crosses a real loopback gRPC connection between them.
"""

from __future__ import annotations

import asyncio

import grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from spindle.v1 import generation_pb2_grpc
from tests.service_helpers import gateway_in_process, pod_in_process, token_request

GENERATE = "/spindle.v1.Generation/Generate"


async def _run(tiny_llama, exporter: InMemorySpanExporter, gateway_traced: bool = True, metadata=()) -> None:
    """One request through a gateway (traced with the pod's provider, or with none) to a traced pod."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    async with pod_in_process(tiny_llama, "tiny", provider) as pod:
        flags = ["--pods", f"127.0.0.1:{pod.port}", "--allow-unauthenticated"]
        async with (
            gateway_in_process(flags, provider if gateway_traced else None) as gw,
            grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as ch,
        ):
            req = token_request([5, 6, 7, 8], 6, temperature=0.0)
            req.model = "tiny"
            call = generation_pb2_grpc.GenerationStub(ch).Generate(req, timeout=20, metadata=metadata)
            async for _ in call:
                pass
            await asyncio.sleep(0.3)  # a few more health polls, which must not be traced


def test_one_trace_spans_gateway_and_pod_with_genai_attributes(tiny_llama):
    exporter = InMemorySpanExporter()
    asyncio.run(_run(tiny_llama, exporter))
    spans = exporter.get_finished_spans()
    assert not [s.name for s in spans if "Health" in s.name or "GetLoad" in s.name]
    gw = next(
        s
        for s in spans
        if s.name == GENERATE and s.kind == SpanKind.SERVER and "spindle.caller" in s.attributes
    )
    client = next(s for s in spans if s.name == GENERATE and s.kind == SpanKind.CLIENT)
    pod = next(s for s in spans if s.name == GENERATE and s.kind == SpanKind.SERVER and s is not gw)
    assert gw.context.trace_id == client.context.trace_id == pod.context.trace_id
    assert client.parent.span_id == gw.context.span_id and pod.parent.span_id == client.context.span_id
    for s in (gw, pod):
        assert s.attributes["gen_ai.request.model"] == "tiny"
        assert s.attributes["gen_ai.usage.input_tokens"] == 4
        assert s.attributes["gen_ai.usage.output_tokens"] == 6
        assert s.attributes["gen_ai.response.finish_reasons"] == ("length",)  # gateway: was the enum name
    assert pod.attributes["gen_ai.request.max_tokens"] == 6
    phases = {s.name: s for s in spans if s.parent is not None and s.parent.span_id == pod.context.span_id}
    assert {"spindle.prefill", "spindle.decode"} <= set(phases)
    assert phases["spindle.decode"].start_time >= phases["spindle.prefill"].end_time - 1000
    assert not any("gen_ai.input.messages" in s.attributes for s in spans)  # prompts are off by default


def test_a_resumed_streams_pod_span_counts_the_replayed_tokens_as_input(tiny_llama):
    """A stream resumed on a second pod (after a failover, or by a client's own `resume`) replays
    the tokens already sent: the pod prefills them. Its span counted them as output, so a trace's
    pod spans added up to more tokens than were generated (the first pod's counted twice), and
    disagreed with the pod's own metrics. The caller's usage is the whole request's still."""

    async def go(exporter: InMemorySpanExporter) -> object:
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        async with (
            pod_in_process(tiny_llama, "tiny", provider) as pod,
            grpc.aio.insecure_channel(f"127.0.0.1:{pod.port}") as ch,
        ):
            req = token_request([5, 6, 7, 8], 6, temperature=0.0)
            req.resume.output_token_ids.extend([9, 10])  # two of the six came from another pod
            messages = [m async for m in generation_pb2_grpc.GenerationStub(ch).Generate(req, timeout=20)]
            return messages[-1].final.usage

    exporter = InMemorySpanExporter()
    usage = asyncio.run(go(exporter))
    assert (usage.prompt_tokens, usage.completion_tokens) == (4, 6)
    pod = next(s for s in exporter.get_finished_spans() if s.name == GENERATE)
    assert pod.attributes["gen_ai.usage.input_tokens"] == 4 + 2
    assert pod.attributes["gen_ai.usage.output_tokens"] == 6 - 2


def test_a_gateway_that_exports_nothing_passes_the_callers_context_to_the_pod(tiny_llama, monkeypatch):
    """No exporter: the gateway makes no spans (no provider), and the pod's span is the child of
    the caller's own span instead of one nobody can see."""
    from spindle import telemetry

    for var in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    assert telemetry.tracer_provider_from_env("spindle-gateway") is None
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    assert telemetry.tracer_provider_from_env("spindle-gateway") is not None
    exporter = InMemorySpanExporter()
    trace_id, parent = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    asyncio.run(_run(tiny_llama, exporter, False, (("traceparent", f"00-{trace_id}-{parent}-01"),)))
    pod = next(s for s in exporter.get_finished_spans() if s.name == GENERATE and s.kind == SpanKind.SERVER)
    assert f"{pod.context.trace_id:032x}" == trace_id and f"{pod.parent.span_id:016x}" == parent


def test_otlp_over_http_protobuf_reaches_an_http_receiver(monkeypatch):
    """`OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf` (the OpenTelemetry Operator's usual setting)
    posts the spans as protobuf to the receiver's /v1/traces; gRPC sent to that port lost them.
    A protocol without a Python exporter exports nothing rather than the wrong thing."""
    import http.server
    import threading

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from spindle import telemetry

    received: list[tuple[str, str, bytes]] = []

    class Receiver(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((self.path, self.headers["Content-Type"], body))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        provider = telemetry.tracer_provider_from_env("spindle-test")
        assert provider is not None
        with provider.get_tracer("t").start_as_current_span("probe"):
            pass
        provider.force_flush()
        provider.shutdown()
    finally:
        server.shutdown()
    path, content_type, body = received[0]
    assert (path, content_type) == ("/v1/traces", "application/x-protobuf")
    spans = ExportTraceServiceRequest.FromString(body).resource_spans[0].scope_spans[0].spans
    assert [s.name for s in spans] == ["probe"]
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    assert telemetry.tracer_provider_from_env("spindle-test") is None


def test_a_variable_set_to_the_empty_string_is_unset(monkeypatch):
    """The OTel spec reads `VAR=""` as unset (what a chart or an operator writes for a value it was
    not given). Beside an endpoint, OTEL_TRACES_EXPORTER="" exported nothing, silently, and
    OTEL_EXPORTER_OTLP_PROTOCOL="" refused every span; each now means its default (otlp, grpc)."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    from spindle import telemetry

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
    for var in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_SDK_DISABLED"):
        monkeypatch.setenv(var, "")
    provider = telemetry.tracer_provider_from_env("spindle-test")
    assert provider is not None
    try:
        [processor] = provider._active_span_processor._span_processors
        assert isinstance(processor.span_exporter, OTLPSpanExporter)
    finally:
        provider.shutdown()
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", " None ")  # the spec's values, in any case
    assert telemetry.tracer_provider_from_env("spindle-test") is None


def test_shutdown_with_the_collector_down_is_bounded():
    """A pod's exit used to wait for the exporter's retries (7-30 s with the collector down),
    past a short termination grace period; now it gives up after its bound and says so."""
    import threading
    import time

    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExportResult

    from spindle import telemetry

    release = threading.Event()

    class Unreachable(InMemorySpanExporter):
        def export(self, spans):  # a collector that never answers, until the test ends
            release.wait(30)
            return SpanExportResult.FAILURE

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Unreachable()))
    for _ in range(50):
        provider.get_tracer(__name__).start_span("s").end()
    start = time.monotonic()
    telemetry.shutdown(provider, seconds=0.5)
    assert time.monotonic() - start < 2.0
    release.set()
    telemetry.shutdown(None)  # tracing off: nothing to do
