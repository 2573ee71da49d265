"""A pod's Generate stream as the gateway relays it: serialized bytes in, the same bytes out.

Decoding each message only to encode it again cost the gateway CPU per token; the messages are
kept as they came instead, and parsed only when a pod fails mid-stream and the request must
resume on another pod from what the caller already has (`GenerateRequest.resume`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import grpc
from opentelemetry import propagate, trace

from spindle.traced_streams import note_cancelled
from spindle.v1 import generation_pb2 as pb

GENERATE = "/spindle.v1.Generation/Generate"


class Relayed:
    """One request and every message relayed to its caller so far, across pods."""

    def __init__(self, request: pb.GenerateRequest) -> None:
        self.request = request
        self.messages: list[bytes] = []
        self.prompt_tokens = 0  # the prompt's length where known (a pod refused it as too long)

    def add(self, raw: bytes) -> None:
        self.messages.append(raw)

    def next_request(self) -> pb.GenerateRequest | None:
        """What to send the next pod: the request, resumed after what was relayed (on top of the
        caller's own `resume`, if any); None when the final message went out already."""
        if not self.messages:
            return self.request
        tokens: list[int] = []
        chars = 0
        for raw in self.messages:
            msg = pb.GenerateResponse.FromString(raw)
            if msg.HasField("final"):
                return None
            tokens += msg.chunk.token_ids
            chars += len(msg.chunk.text)
        resumed = pb.GenerateRequest()
        resumed.CopyFrom(self.request)
        resumed.resume.output_token_ids.extend(tokens)
        resumed.resume.text_chars += chars
        return resumed

    def final(self) -> pb.Final | None:
        last = pb.GenerateResponse.FromString(self.messages[-1]) if self.messages else None
        return last.final if last is not None and last.HasField("final") else None


@contextlib.contextmanager
def client_span(
    tracer: trace.Tracer, address: str, caller: grpc.aio.ServicerContext
) -> Iterator[tuple[trace.Span, list[tuple[str, str]]]]:
    """The span of one Generate call to a pod, and the metadata that carries its context there;
    what the client interceptor would record, without its per-message wrapper. Not tracing here
    (no span context), the caller's own context (its call's metadata) goes on to the pod. A call
    the gateway cancels because its caller did (or the caller's deadline passed) says so."""
    span = tracer.start_span(
        GENERATE,
        kind=trace.SpanKind.CLIENT,
        attributes={"rpc.system": "grpc", "rpc.service": "spindle.v1.Generation", "rpc.method": "Generate",
                    "net.peer.name": address},
    )  # fmt: skip
    if span.get_span_context().is_valid:
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        metadata = list(carrier.items())
    else:
        fields = propagate.get_global_textmap().fields
        metadata = [(k, v) for k, v in caller.invocation_metadata() or () if k in fields]
    try:
        yield span, metadata
        span.set_attribute("rpc.grpc.status_code", grpc.StatusCode.OK.value[0])
    except grpc.aio.AioRpcError as e:
        span.set_attribute("rpc.grpc.status_code", e.code().value[0])
        span.set_status(trace.Status(trace.StatusCode.ERROR, f"{e.code().name}: {e.details()}"))
        raise
    except (asyncio.CancelledError, GeneratorExit):
        note_cancelled(span, caller)
        raise
    finally:
        span.end()


def add_generation_service(servicer: Any, server: grpc.aio.Server) -> None:
    """Serve Generation with `servicer`, whose Generate yields serialized GenerateResponses."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate,
            request_deserializer=pb.GenerateRequest.FromString,
            response_serializer=None,  # bytes, sent as they are
        ),
        "Abort": grpc.unary_unary_rpc_method_handler(
            servicer.Abort,
            request_deserializer=pb.AbortRequest.FromString,
            response_serializer=pb.AbortResponse.SerializeToString,
        ),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            servicer.ListModels,
            request_deserializer=pb.ListModelsRequest.FromString,
            response_serializer=pb.ListModelsResponse.SerializeToString,
        ),
    }
    service = "spindle.v1.Generation"
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)
