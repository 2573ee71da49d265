"""The service token: what a caller of a control RPC (ModelControl, the adapter service) must show.

The services of one cluster share a secret token from a file (`--control-token-file`, a mounted
Secret); the control servers refuse calls without it, and every service sends it on its own
control calls. The file is re-read when it changes. It may hold several tokens, one a line: the
first is sent, any is accepted, so a rotation need not reach every pod at once (a Secret update
reaches each pod's files up to a minute or two apart): add the new token on a second line, then
make it the first, then drop the old one, each step once the last has reached every pod.
Health and reflection stay open (probes).
Without a token file the control RPCs are open to whoever reaches the port: fine on a laptop,
and the services say so at start-up unless mutual TLS guards the port instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import grpc

log = logging.getLogger(__name__)

HEADER = "x-spindle-service-token"


class ServiceToken:
    def __init__(self, path: str) -> None:
        self.path = path
        self._stamp: tuple = ()
        self._values: tuple[bytes, ...] = ()
        self.value()
        if not self._values:
            raise ValueError(f"control token file {path!r} is empty")

    def value(self) -> bytes:
        """The token to send: the file's first; re-read if the file changed (a file that vanished
        mid-rotation keeps the old tokens)."""
        return self._read()[0]

    def _read(self) -> tuple[bytes, ...]:
        """Every token of the file, one a line, blank lines skipped. A two-line file used to be
        one token with a newline in it, which no caller could send as metadata."""
        try:
            st = os.stat(self.path)
            stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
            if stamp != self._stamp:
                with open(self.path, "rb") as f:
                    values = tuple(line.strip() for line in f.read().splitlines() if line.strip())
                if values:
                    self._values, self._stamp = values, stamp
        except OSError as e:
            if not self._values:
                raise ValueError(f"cannot read control token file {self.path!r}: {e}") from e
            log.warning("control token file unreadable, keeping the previous token: %s", e)
        return self._values or (b"",)

    def matches(self, offered: str | bytes | None) -> bool:
        """Whether `offered` is one of the file's tokens; each is compared, with no early exit."""
        offered_bytes = offered.encode() if isinstance(offered, str) else offered or b""
        found = False
        for value in self._read():
            found |= hmac.compare_digest(offered_bytes, value)
        return found


def _offered(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | bytes | None:
    return next((v for k, v in metadata or () if k == HEADER), None)


class RequireToken(grpc.aio.ServerInterceptor):
    """Refuse the RPCs of the `protected` services unless they carry the service token."""

    def __init__(self, token: ServiceToken, protected: Iterable[str], port_name: str) -> None:
        self.token, self.protected, self.port_name = token, tuple(protected), port_name

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if details.method.lstrip("/").split("/", 1)[0] not in self.protected:
            return handler
        offered = _offered(details.invocation_metadata)
        if offered is None:
            return _refusal(
                handler,
                f"{details.method} is a control RPC of the {self.port_name}: send the cluster's service "
                f"token as `{HEADER}` metadata (the file given by --control-token-file)",
            )
        if not self.token.matches(offered):
            return _refusal(
                handler, f"{details.method}: the service token is wrong (not this cluster's, or rotated)"
            )
        return handler


# How long a refused call's request stream is read (and dropped) before the refusal.
DRAIN_S = 1.0


def _refusal(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler | None:
    """A handler of the real one's call shape that ends the call UNAUTHENTICATED, after reading a
    request stream to its end (`DRAIN_S` at most, the messages dropped): a stream-stream call
    ended while its client still wrote came back INTERNAL ("Internal error from Core"), not
    UNAUTHENTICATED, about once in a hundred calls on a loaded host."""
    if handler is None:  # no such method: UNIMPLEMENTED, as without the token
        return None

    async def drained(request: Any) -> None:
        if handler.request_streaming:
            with contextlib.suppress(Exception):  # too slow, or bytes that do not parse: refused all the same
                await asyncio.wait_for(_read_all(request), DRAIN_S)

    async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
        await drained(request)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await drained(request)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # an async generator, as a streaming handler must be

    shapes = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    shape = (handler.request_streaming, handler.response_streaming)
    return shapes[shape](
        deny_stream if handler.response_streaming else deny,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


async def _read_all(requests: AsyncIterator[Any]) -> None:
    async for _ in requests:
        pass


class _SendToken:
    def __init__(self, token: ServiceToken) -> None:
        self.token = token

    async def _intercept(self, continuation: Any, details: grpc.aio.ClientCallDetails, request: Any) -> Any:
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        metadata.add(HEADER, self.token.value().decode())  # read at each call: rotation applies
        return await continuation(details._replace(metadata=metadata), request)


_SHAPES = {
    grpc.aio.UnaryUnaryClientInterceptor: "intercept_unary_unary",
    grpc.aio.UnaryStreamClientInterceptor: "intercept_unary_stream",
    grpc.aio.StreamUnaryClientInterceptor: "intercept_stream_unary",
    grpc.aio.StreamStreamClientInterceptor: "intercept_stream_stream",
}


def send_token(token: ServiceToken) -> list[Any]:
    """Client interceptors adding the token to every call of a channel. One per call shape, each
    the same method under that shape's name: an aio channel files an interceptor under the first
    shape it implements."""
    return [
        type(f"SendToken{shape.__name__}", (_SendToken, shape), {method: _SendToken._intercept})(token)
        for shape, method in _SHAPES.items()
    ]
