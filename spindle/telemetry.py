"""OpenTelemetry for the gRPC services: one trace per request, gateway -> model pod.

Configured only by the standard variables, so a cluster's OTel setup applies unchanged:
`OTEL_SDK_DISABLED`, `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER(_ARG)`,
`OTEL_TRACES_EXPORTER` (`otlp`, `console`, `none`; default `otlp` when an
`OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT` is set, else `none`), and the exporter's own
`OTEL_EXPORTER_OTLP_*` settings. With no exporter no span is made (nobody could see it, and
the gateway's interceptor and spans cost it ~0.15 ms a request); the gateway then passes the
caller's own trace context on to the pods, so a pod that does export still joins the caller's trace.

W3C trace context travels in gRPC metadata through opentelemetry-instrumentation-grpc's
interceptors. Health checks, reflection and the gateway's load polls are not traced: at one
poll per pod per second they would drown the requests. Prompt and completion text are recorded
only when `OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true` (the GenAI convention's switch).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from opentelemetry import trace
from opentelemetry.instrumentation.grpc import aio_client_interceptors
from opentelemetry.instrumentation.grpc import filters as grpc_filters
from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

from spindle.traced_streams import TracedStreams

log = logging.getLogger(__name__)

# GenAI semantic-convention attribute names (https://opentelemetry.io/docs/specs/semconv/gen-ai/).
OPERATION = "gen_ai.operation.name"
PROVIDER = "gen_ai.provider.name"
REQUEST_MODEL = "gen_ai.request.model"
RESPONSE_ID = "gen_ai.response.id"
MAX_TOKENS = "gen_ai.request.max_tokens"
TEMPERATURE = "gen_ai.request.temperature"
TOP_P = "gen_ai.request.top_p"
TOP_K = "gen_ai.request.top_k"
SEED = "gen_ai.request.seed"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
FINISH_REASONS = "gen_ai.response.finish_reasons"
INPUT_MESSAGES = "gen_ai.input.messages"
OUTPUT_MESSAGES = "gen_ai.output.messages"
TIME_TO_FIRST_TOKEN = "gen_ai.server.time_to_first_token"
# Ours: the GenAI conventions have no LoRA adapter attribute yet.
ADAPTER = "spindle.adapter"

_UNTRACED = grpc_filters.negate(
    grpc_filters.any_of(
        grpc_filters.health_check(),
        grpc_filters.service_prefix("grpc.reflection."),
        grpc_filters.service_name("spindle.v1.PodStatus"),
    )
)


def capture_content() -> bool:
    return os.environ.get("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "").lower() == "true"


def tracer_provider_from_env(default_service_name: str) -> TracerProvider | None:
    """A TracerProvider with the exporters the environment asks for; None when the SDK is disabled
    or nothing would be exported."""
    if _setting("OTEL_SDK_DISABLED") == "true":
        return None
    exporters = _exporters_from_env()
    if not exporters:
        return None
    resource = Resource.create({"service.name": default_service_name}).merge(OTELResourceDetector().detect())
    provider = TracerProvider(resource=resource)  # the sampler comes from OTEL_TRACES_SAMPLER
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


FLUSH_SECONDS = 3.0  # what a pod's exit spends on its last spans; Kubernetes' default grace is 30 s


def shutdown(provider: TracerProvider | None, seconds: float = FLUSH_SECONDS) -> None:
    """Flush and close `provider`, waiting at most `seconds`. The SDK's own shutdown waits for
    the exporter's retries: with the collector down a pod's exit took 7 s (a few spans queued)
    to 30 s (thousands), past a short termination grace period, so it was killed mid-drain.
    Spans not out by then are dropped, loudly; the flush goes on in a daemon thread the exit ends."""
    if provider is None:
        return
    done = threading.Thread(target=provider.shutdown, name="otel-shutdown", daemon=True)
    done.start()
    done.join(seconds)
    if done.is_alive():
        log.warning("spans not exported within %.1f s of shutdown (collector unreachable?): dropped", seconds)


def _setting(*names: str, default: str = "") -> str:
    """The first of the variables `names` that is set, lower-cased; `default` if none is. Set to
    the empty string is unset, as the OTel spec says (a chart or an operator writes `VAR=""` for
    a value it was not given): OTEL_TRACES_EXPORTER="" beside an endpoint exported nothing, and
    OTEL_EXPORTER_OTLP_PROTOCOL="" refused every span."""
    return next((v for v in (os.environ.get(n, "").strip().lower() for n in names) if v), default)


def _exporters_from_env() -> list[Any]:
    endpoint_set = bool(_setting("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
    names = _setting("OTEL_TRACES_EXPORTER", default="otlp" if endpoint_set else "none")
    exporters: list[Any] = []
    for name in (n.strip() for n in names.split(",") if n.strip()):
        if name == "otlp":
            exporters.extend(_otlp_exporter())
        elif name == "console":
            exporters.append(ConsoleSpanExporter())
        elif name != "none":
            log.warning("OTEL_TRACES_EXPORTER=%r is not supported (otlp, console, none); ignored", name)
    return exporters


def _otlp_exporter() -> list[Any]:
    """The OTLP exporter of the protocol the environment names: gRPC (the SDK's default) or
    HTTP with protobuf bodies (`http/protobuf`, what the OpenTelemetry Operator and most
    collectors' HTTP receivers on 4318 are given). Each reads its own endpoint variables. A
    protocol the Python SDK has no exporter for (`http/json`) exports nothing, loudly: sending
    gRPC to an HTTP receiver's port would lose every span just as silently."""
    protocol = _setting("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL", default="grpc")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        log.error("OTLP protocol %r is not supported (grpc, http/protobuf): no spans are exported", protocol)
        return []
    return [OTLPSpanExporter()]


def server_interceptors(provider: TracerProvider | None) -> list[Any]:
    """Continue the caller's trace (W3C `traceparent` metadata) in a server span per RPC; a
    response stream's ends with its call, cancelled or not (traced_streams.py)."""
    if provider is None:
        return []
    tracer = trace.get_tracer("opentelemetry.instrumentation.grpc", tracer_provider=provider)
    return [TracedStreams(tracer, filter_=_UNTRACED)]


def client_interceptors(provider: TracerProvider | None) -> list[Any]:
    """A client span per outgoing RPC, its context injected into the call's metadata."""
    return [] if provider is None else aio_client_interceptors(tracer_provider=provider, filter_=_UNTRACED)


def get_tracer(name: str, provider: TracerProvider | None) -> trace.Tracer:
    return trace.get_tracer(name, tracer_provider=provider or trace.NoOpTracerProvider())
