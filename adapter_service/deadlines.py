"""Bounds on every call the service makes to storage (S3) and the registry (Redis), and on every RPC.

Without them a storage endpoint that stops answering (a partition, a frozen process: no refusal,
no reply) held `spindle adapters register` for minutes: boto3 waits 60 s a read and retries,
redis-py waits forever. Each call now has a connect and read timeout and a bounded number of
attempts, and every RPC of the service a server-side bound (`--rpc-timeout`); an RPC that hits
it ends DEADLINE_EXCEEDED naming what it was waiting on, which `awaiting` records: the store and
the registry mark each of their calls with their `label` (`track`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import functools
import inspect
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from spindle import flagtypes, redis_client

T = TypeVar("T", bound=type)


@dataclass(frozen=True)
class Bounds:
    """Timeouts (seconds) and attempts of every backend call, and the bound of an RPC."""

    s3_connect: float = 3.0
    s3_read: float = 10.0
    s3_attempts: int = 3
    redis: float = redis_client.TIMEOUT_S  # connect and read timeout of one Redis command
    redis_attempts: int = redis_client.ATTEMPTS
    rpc: float = 30.0

    def s3_call_seconds(self) -> float:
        """The longest one S3 call can take: every attempt connects and waits its read timeout,
        with botocore's standard backoff (at most 20 s; a second or two here) between them."""
        return self.s3_attempts * (self.s3_connect + self.s3_read) + 2.0 * (self.s3_attempts - 1)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Bounds:
        return cls(
            s3_connect=args.s3_connect_timeout,
            s3_read=args.s3_read_timeout,
            s3_attempts=args.s3_max_attempts,
            redis=args.redis_timeout,
            redis_attempts=args.redis_max_attempts,
            rpc=args.rpc_timeout,
        )


def add_args(parser: argparse.ArgumentParser) -> None:
    d = Bounds()
    g = parser.add_argument_group("deadlines (docs/reliability.md, the adapter manager)")
    g.add_argument(
        "--s3-connect-timeout",
        type=flagtypes.seconds,
        default=d.s3_connect,
        help=f"seconds [{d.s3_connect:g}]",
    )
    g.add_argument(
        "--s3-read-timeout",
        type=flagtypes.seconds,
        default=d.s3_read,
        help=f"seconds an S3 answer may take [{d.s3_read:g}]",
    )
    g.add_argument(
        "--s3-max-attempts",
        type=flagtypes.at_least(1),
        default=d.s3_attempts,
        help=f"attempts of one S3 call [{d.s3_attempts}]",
    )
    g.add_argument(
        "--redis-timeout",
        type=flagtypes.seconds,
        default=d.redis,
        help=f"connect and read timeout of Redis [{d.redis:g}]",
    )
    g.add_argument(
        "--redis-max-attempts",
        type=flagtypes.at_least(1),
        default=d.redis_attempts,
        help=f"attempts of one Redis command [{d.redis_attempts}]",
    )
    g.add_argument(
        "--rpc-timeout",
        type=flagtypes.seconds,
        default=d.rpc,
        help=f"server-side bound of every RPC (a Register's, once its upload is received) [{d.rpc:g}]",
    )


# What the current RPC is waiting on, innermost last; None outside a bounded RPC.
_awaiting: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("awaiting", default=None)


def _drop(stack: list[str], what: str) -> None:
    del stack[len(stack) - 1 - stack[::-1].index(what)]


@contextlib.contextmanager
def waiting_for(what: str) -> Iterator[None]:
    """Name `what` as pending for the bounded RPC around this code. Left named if cancelled there:
    the bound that cancelled it reads it."""
    stack = _awaiting.get()
    if stack is None:
        yield
        return
    stack.append(what)
    try:
        yield
    except asyncio.CancelledError:
        raise
    except BaseException:
        _drop(stack, what)
        raise
    _drop(stack, what)


def _tracked(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    async def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        with waiting_for(self.label):
            return await method(self, *args, **kwargs)

    return call


def track(cls: T) -> T:
    """Mark every public coroutine method of a backend class (which has a `label`) as a wait on it."""
    for name, method in list(vars(cls).items()):
        if not name.startswith("_") and inspect.iscoroutinefunction(method):
            setattr(cls, name, _tracked(method))
    return cls


class BoundExceeded(Exception):
    """An RPC ran past its bound; `waiting_on` is what it was waiting for then."""

    def __init__(self, seconds: float, waiting_on: str | None) -> None:
        self.seconds = seconds
        self.waiting_on = waiting_on or "this service (no storage or registry call was pending)"
        super().__init__(f"{self.waiting_on} did not answer within {seconds:g} s")


async def within(seconds: float, coro: Awaitable[Any]) -> Any:
    """`coro`'s result, or BoundExceeded naming the backend call pending when `seconds` ran out.
    (`asyncio.wait_for` rather than `asyncio.timeout`: the service runs on Python 3.10 too.)"""
    stack: list[str] = []
    token = _awaiting.set(stack)
    try:
        task = asyncio.ensure_future(coro)  # runs in a copy of this context: it sees `stack`
    finally:
        _awaiting.reset(token)
    try:
        return await asyncio.wait_for(task, seconds)
    except asyncio.TimeoutError:
        if not task.cancelled():  # the call's own TimeoutError (a socket's), not the bound
            raise
        raise BoundExceeded(seconds, stack[-1] if stack else None) from None
