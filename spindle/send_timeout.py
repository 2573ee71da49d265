"""A response stream whose reader takes nothing for `--send-timeout` seconds is ended (Envoy's
`stream_flush_timeout`).

A client that keeps its connection alive (it answers keepalive pings) but never reads, with no
deadline, was never ended: once its gRPC flow-control window was full, the handler waited at its
send for as long as the client lived, holding its output, its in-flight entry, its caller's
concurrency slot and a place in the pod's `requests_in_flight` (what the gateway routes by),
after the engine had finished the request, or running it on. Here each send of a response stream
may wait on the reader at most `seconds`; the timer is per send, so a reader that keeps taking,
however slowly, is never cut (gRPC counts what it takes in window updates, about every 32 KB).

When one times out, the handler's stream is closed at once, so its cleanup runs as for a caller
that cancelled (the engine request aborted, every per-request entry released), and the call ends
DEADLINE_EXCEEDED saying why. grpc-python cannot reset one stream from the server: the status
waits behind the output gRPC already holds for the client (a flow-control window of it), and
reaches the client when it reads again; that stream, and nothing of the handler's, stays until
then or until the client goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

log = logging.getLogger(__name__)

Stream = Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]
_CUT: contextvars.ContextVar[bool] = contextvars.ContextVar("spindle_send_timed_out", default=False)


def cut() -> bool:
    """Whether the call being cleaned up is one this module ended: its handler's stream is closed
    as for a caller that left, but the caller is told DEADLINE_EXCEEDED, so spans and metrics must
    say that too, not CANCELLED (traced_streams.cancelled_code). Each call runs in its own task,
    with its own copy of this."""
    return _CUT.get()


async def within(send: Awaitable[None], seconds: float) -> None:
    """`send` awaited at most `seconds` (0: as long as it takes), else `asyncio.TimeoutError`.
    A send a streamed token: `asyncio.timeout` (3.11+) arms a timer, where `wait_for` wraps each
    send in a task of its own (~10 us against ~4)."""
    if not seconds:
        await send
    elif hasattr(asyncio, "timeout"):
        async with asyncio.timeout(seconds):
            await send
    else:
        await asyncio.wait_for(send, seconds)


async def _sent_in_time(
    responses: AsyncIterator[Any], context: grpc.aio.ServicerContext, seconds: float
) -> bool:
    """Write every response, each within `seconds`; False when one was not taken in time."""
    async for response in responses:
        try:
            await within(context.write(response), seconds)
        except asyncio.TimeoutError:  # on 3.10 not the builtin TimeoutError
            return False
    return True


def bounded(stream: Stream, seconds: float) -> Callable[[Any, grpc.aio.ServicerContext], Awaitable[None]]:
    """`stream` (an async-generator handler) as a handler that writes its responses itself, ending
    the call DEADLINE_EXCEEDED when a reader takes nothing for `seconds`."""

    async def writes(request: Any, context: grpc.aio.ServicerContext) -> None:
        async with contextlib.aclosing(stream(request, context)) as responses:
            if await _sent_in_time(responses, context, seconds):
                return
            _CUT.set(True)  # before the close below runs the handler's cleanup
        # closed: its cleanup ran; the status goes out behind what the client has not read
        log.info("ended a stream whose client read nothing for %g s (--send-timeout)", seconds)
        await context.abort(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"the client read nothing of this stream for {seconds:g} s (the server's --send-timeout); "
            "its request was cancelled",
        )

    return writes


class SendTimeout(grpc.aio.ServerInterceptor):
    """Bound each send of every async-generator response stream by `seconds` (0: unbounded)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or not self.seconds or not inspect.isasyncgenfunction(handler.unary_stream):
            return handler
        return grpc.unary_stream_rpc_method_handler(
            bounded(handler.unary_stream, self.seconds),
            handler.request_deserializer,
            handler.response_serializer,
        )
