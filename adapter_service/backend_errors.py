"""Redis or S3 unreachable ends an RPC UNAVAILABLE with the backend named, not UNKNOWN; one that
does not answer ends it DEADLINE_EXCEEDED within the RPC's bound, naming what it waited on.

The registry (Redis) and the store (S3) are other processes; while one restarts, every RPC that
reaches it would otherwise end UNKNOWN "Unexpected ConnectionError", which a caller cannot tell
from a bug. UNAVAILABLE says: nothing was changed, retry. A frozen backend (no refusal, no
answer) used to hold an admin RPC for minutes; each now runs within `--rpc-timeout`
(adapter_service/deadlines.py), read from the servicer's controller (`self.c.bounds`). Class
decorators, so a new RPC of a decorated servicer is covered without remembering to. Register
bounds itself (`bounded_after_upload`): its upload may take long and is bounded by the client.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from adapter_service.deadlines import BoundExceeded, within

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
    how = "did not answer in time" if "timeout" in type(e).__name__.lower() else "is unreachable"
    return f"the adapter {which} {how} ({type(e).__name__}: {e}); nothing was changed, retry"


def _late(e: BoundExceeded) -> str:
    return (
        f"{e} (--rpc-timeout): the operation was given up; retry (registering the same weights "
        "again is safe: it never makes a second version)"
    )


def bounded_after_upload(method: Callable[..., Any]) -> Callable[..., Any]:
    """Mark an RPC that applies the bound itself (with `deadlines.within`), after its upload."""
    method.bounds_itself = True  # type: ignore[attr-defined]
    return method


def _wrap(method: Callable[..., Any], bounded: bool) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                async for item in method(self, request, context):
                    yield item
            except (*REDIS_DOWN, *S3_DOWN) as e:
                await context.abort(grpc.StatusCode.UNAVAILABLE, _message(e))

        return stream

    bounded = bounded and not getattr(method, "bounds_itself", False)

    @functools.wraps(method)
    async def unary(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            if bounded:
                return await within(self.c.bounds.rpc, method(self, request, context))
            return await method(self, request, context)
        except (*REDIS_DOWN, *S3_DOWN) as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, _message(e))
        except BoundExceeded as e:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, _late(e))

    return unary


def _wrap_rpcs(cls: T, bounded: bool) -> T:
    for name, method in list(vars(cls).items()):
        if name[:1].isupper() and (inspect.iscoroutinefunction(method) or inspect.isasyncgenfunction(method)):
            setattr(cls, name, _wrap(method, bounded))
    return cls


def unavailable_when_backends_are_down(cls: T) -> T:
    """Wrap every RPC method (an upper-case name defined on `cls`) of a servicer class: Placement
    and the weight stream, which the gateway's --placement-timeout and the pods' deadlines bound
    (a placement may take a while: weights copied, a slot loaded)."""
    return _wrap_rpcs(cls, bounded=False)


def admin_rpcs_bounded(cls: T) -> T:
    """The same, and each RPC within `--rpc-timeout` (DEADLINE_EXCEEDED naming what it waited on
    after): the admin API, which a person waits on."""
    return _wrap_rpcs(cls, bounded=True)
