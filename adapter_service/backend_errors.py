"""Redis or S3 unreachable ends an RPC UNAVAILABLE with the backend named, not UNKNOWN.

The registry (Redis) and the store (S3) are other processes; while one restarts, every RPC that
reaches it would otherwise end UNKNOWN "Unexpected ConnectionError", which a caller cannot tell
from a bug. UNAVAILABLE says: nothing was changed, retry. A class decorator, so a new RPC of a
decorated servicer is covered without remembering to.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

T = TypeVar("T", bound=type)


def _redis_down() -> tuple[type[Exception], ...]:
    try:  # the clients are optional (the `adapter` extra): embedded mode runs without them
        import redis.exceptions
    except ImportError:
        return ()
    return (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


def _s3_down() -> tuple[type[Exception], ...]:
    try:
        import botocore.exceptions
    except ImportError:
        return ()
    return (botocore.exceptions.ConnectionError, botocore.exceptions.HTTPClientError)


REDIS_DOWN, S3_DOWN = _redis_down(), _s3_down()


def _message(e: Exception) -> str:
    which = "registry (Redis)" if isinstance(e, REDIS_DOWN) else "storage (S3)"
    return f"the adapter {which} is unreachable ({type(e).__name__}: {e}); nothing was changed, retry"


def _wrap(method: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                async for item in method(self, request, context):
                    yield item
            except (*REDIS_DOWN, *S3_DOWN) as e:
                await context.abort(grpc.StatusCode.UNAVAILABLE, _message(e))

        return stream

    @functools.wraps(method)
    async def unary(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await method(self, request, context)
        except (*REDIS_DOWN, *S3_DOWN) as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, _message(e))

    return unary


def unavailable_when_backends_are_down(cls: T) -> T:
    """Wrap every RPC method (an upper-case name defined on `cls`) of a servicer class."""
    for name, method in list(vars(cls).items()):
        if name[:1].isupper() and (inspect.iscoroutinefunction(method) or inspect.isasyncgenfunction(method)):
            setattr(cls, name, _wrap(method))
    return cls
