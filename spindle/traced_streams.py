"""OpenTelemetry's grpc.aio server interceptor, with response streams (Generate, weight streaming)
traced so that a call ending by cancellation ends its span at once, saying so.

Upstream keeps the span's context attached across each `yield` of the stream. A call cancelled
(its caller gone, its deadline passed) while grpc was sending a message leaves that generator
suspended there; the garbage collector closes it later, in another context: "Failed to detach
context" logged at ERROR twice with tracebacks, and the span ended then, as OK
(`rpc.grpc.status_code` 0). Here the context is attached only while the handler runs (each step
of its stream), and a cancelled call's span says CANCELLED or DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any
from urllib.parse import unquote

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.instrumentation.grpc._aio_server import (
    OpenTelemetryAioServerInterceptor,
    _OpenTelemetryAioServicerContext,
)

from spindle import send_timeout

RPC_GRPC_STATUS_CODE = "rpc.grpc.status_code"  # the attribute OpenTelemetry's gRPC interceptors set
# A server's deadline starts when it reads the call's headers, after the caller's clock began: the
# caller's own timer fires first and its cancel can land while the server still has this much left
# (a loaded CI machine: a few ms). Such a call ended by its deadline, as its caller was told.
DEADLINE_SLACK_S = 0.1
_END = object()


class TracedStreams(OpenTelemetryAioServerInterceptor):
    """Upstream's interceptor (unary calls as it traces them), response streams as above."""

    def _intercept_aio_server_stream(
        self, behavior: Callable[..., AsyncIterator[Any]], handler_call_details: grpc.HandlerCallDetails
    ) -> Callable[..., AsyncIterator[Any]]:
        async def traced(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            pairs = [(m.key, m.value) for m in context.invocation_metadata() or ()]
            metadata = dict(pairs)
            caller = callers_context(pairs)  # its trace, and its baggage (passed on to pods)
            span = self._tracer.start_span(
                handler_call_details.method,
                caller,
                trace.SpanKind.SERVER,
                attributes=_attributes(handler_call_details.method, metadata, context.peer()),
            )
            current = trace.set_span_in_context(span, caller)
            context = _OpenTelemetryAioServicerContext(context, span)  # records an abort's status
            responses = behavior(request, context)
            try:
                while (response := await _within(current, anext(responses, _END))) is not _END:
                    yield response
            except (asyncio.CancelledError, GeneratorExit):
                note_cancelled(span, context)
                raise
            except grpc.aio.AbortError:
                raise  # its status is on the span already (the wrapped context's abort)
            except Exception as e:  # a bug in the handler: grpc answers UNKNOWN
                span.record_exception(e)
                span.set_attribute(RPC_GRPC_STATUS_CODE, grpc.StatusCode.UNKNOWN.value[0])
                span.set_status(trace.Status(trace.StatusCode.ERROR, f"UNKNOWN: {type(e).__name__}"))
                raise
            finally:
                try:
                    await _within(current, responses.aclose())  # the handler's cleanup sees its span
                finally:
                    span.end()

        return traced


def callers_context(fields: Iterable[tuple[str, str]]) -> otel_context.Context:
    """The trace context and baggage of a caller's headers or gRPC metadata, a field sent several
    times read as one, its values joined by commas (RFC 9110 5.3), as W3C Trace Context and
    Baggage ask: every `tracestate` entry kept (a dict kept the last, aiohttp's headers the
    first), and a `traceparent` sent twice invalid, so the call starts a trace of its own."""
    joined: dict[str, str] = {}
    for key, value in fields:
        key = key.lower()
        joined[key] = f"{joined[key]},{value}" if key in joined else value
    return propagate.extract(joined)


async def _within(current: otel_context.Context, step: Any) -> Any:
    """Await `step` with `current` attached, detached again before the caller goes on."""
    token = otel_context.attach(current)
    try:
        return await step
    finally:
        otel_context.detach(token)


def _attributes(method: str, metadata: dict[str, Any], peer: str) -> dict[str, Any]:
    """The attributes upstream's server spans carry."""
    service, name = method.lstrip("/").split("/", 1)
    attributes: dict[str, Any] = {"rpc.system": "grpc", RPC_GRPC_STATUS_CODE: grpc.StatusCode.OK.value[0],
                                  "rpc.method": name, "rpc.service": service}  # fmt: skip
    if "user-agent" in metadata:
        attributes["rpc.user_agent"] = metadata["user-agent"]
    if peer.startswith(("ipv4:", "ipv6:")):  # "ipv6:[::1]:57284", "ipv4:10.2.1.1:57284,127.0.0.1:57284"
        ip, port = peer.split(",")[0].split(":", 1)[1].rsplit(":", 1)
        attributes.update({"net.peer.ip": unquote(ip), "net.peer.port": port})
    return attributes


def note_cancelled(span: trace.Span, context: Any) -> None:
    """Record on a call's span that it ended because its caller cancelled it or its deadline
    passed. DEADLINE_EXCEEDED is an error on a server span (the RPC conventions); CANCELLED is the
    caller's choice, not one. `context`: the call's servicer context."""
    if not span.is_recording():
        return
    code = cancelled_code(context)
    span.set_attribute(RPC_GRPC_STATUS_CODE, code.value[0])
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        span.set_status(trace.Status(trace.StatusCode.ERROR, "DEADLINE_EXCEEDED: the deadline passed"))


def cancelled_code(context: Any) -> grpc.StatusCode:
    """The status of a call grpc.aio ended by cancelling its handler: DEADLINE_EXCEEDED when its
    deadline has passed, or all but DEADLINE_SLACK_S of it (the caller sees that code), else
    CANCELLED (the caller left). A cancelled handler cannot tell the two apart by its exception;
    spans and metrics both ask here. A stream ended for --send-timeout is DEADLINE_EXCEEDED too:
    its caller is told so."""
    if send_timeout.cut():
        return grpc.StatusCode.DEADLINE_EXCEEDED
    remaining = context.time_remaining()
    late = remaining is not None and remaining <= DEADLINE_SLACK_S
    return grpc.StatusCode.DEADLINE_EXCEEDED if late else grpc.StatusCode.CANCELLED
