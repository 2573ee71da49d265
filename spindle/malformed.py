"""Requests whose bytes are not the method's message end INVALID_ARGUMENT, not UNKNOWN.

grpc-python parses a request with the handler's deserializer before any handler code runs, and a
`DecodeError` there (wrong wire types, truncated fields, invalid UTF-8 in a string) ends the call
UNKNOWN "Unexpected DecodeError", which reads as a server bug. This interceptor swaps each
deserializer for one that hands a `Malformed` marker to a thin wrapper around the handler, which
refuses the call with a message that names the message type. A streaming handler that writes
with `context.write` instead of yielding (grpc's health Watch) keeps that style: wrapped as an
async generator it ended UNKNOWN ("'async for' requires an object with __aiter__ method").
A wrapped stream closes the handler's when it is closed (a cancelled call), so the handler's
cleanup runs then, in the call's task and context, not later when the garbage collector finds it.

The wrapper also ends a handler's unexpected exception (a bug) INTERNAL "internal error (id ...)",
the id in the log line with the traceback: grpc-python answered UNKNOWN "Unexpected <class>: <the
exception's text>", which may carry file paths, tensor shapes or a prompt's words.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from spindle.grpc_status import internal_error

log = logging.getLogger("spindle.server")


@dataclass(frozen=True)
class Malformed:
    error: str


def _tolerant(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def parse(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except DecodeError as e:
            return Malformed(str(e))

    return parse


async def _refuse(context: grpc.aio.ServicerContext, bad: Malformed) -> None:
    await context.abort(
        grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a valid protobuf message: {bad.error}"
    )


async def _checked(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, Malformed):
            await _refuse(context, request)
        yield request


@contextlib.asynccontextmanager
async def _guarded(context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
    """An exception other than the handler's own abort ends the call INTERNAL with an error id."""
    try:
        yield
    except grpc.aio.AbortError:
        raise
    except Exception as e:
        await context.abort(grpc.StatusCode.INTERNAL, internal_error(e, log, "a handler failed"))


def _wrap(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """The same handler, its deserializer tolerant and its behavior refusing malformed input."""
    deserialize = _tolerant(handler.request_deserializer)
    serialize = handler.response_serializer
    if handler.unary_unary is not None:
        inner_uu = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, Malformed):
                await _refuse(context, request)
            async with _guarded(context):
                return await inner_uu(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, deserialize, serialize)
    if handler.unary_stream is not None and not inspect.isasyncgenfunction(handler.unary_stream):
        inner_uw = handler.unary_stream  # streams with context.write (grpc's health Watch)

        async def unary_writes(request: Any, context: grpc.aio.ServicerContext) -> None:
            if isinstance(request, Malformed):
                await _refuse(context, request)
            async with _guarded(context):
                await inner_uw(request, context)

        return grpc.unary_stream_rpc_method_handler(unary_writes, deserialize, serialize)
    if handler.unary_stream is not None:
        inner_us = handler.unary_stream

        async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if isinstance(request, Malformed):
                await _refuse(context, request)
            async with _guarded(context), contextlib.aclosing(inner_us(request, context)) as responses:
                async for response in responses:
                    yield response

        return grpc.unary_stream_rpc_method_handler(unary_stream, deserialize, serialize)
    if handler.stream_unary is not None:
        inner_su = handler.stream_unary

        async def stream_unary(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
            async with _guarded(context):
                return await inner_su(_checked(requests, context), context)

        return grpc.stream_unary_rpc_method_handler(stream_unary, deserialize, serialize)
    inner_ss = handler.stream_stream

    async def stream_stream(
        requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        async with (
            _guarded(context),
            contextlib.aclosing(inner_ss(_checked(requests, context), context)) as responses,
        ):
            async for response in responses:
                yield response

    return grpc.stream_stream_rpc_method_handler(stream_stream, deserialize, serialize)


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        return None if handler is None else _wrap(handler)
