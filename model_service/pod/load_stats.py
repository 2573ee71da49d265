"""The engine's stats for load reports, answered within the gateway's health-check deadline.

The engine thread answers a stats call only between steps, and one step can run for seconds: a
long prompt's chunk on a CPU, or on a slow device. A load report that waited for it missed the
gateway's deadline (1 s), and two misses in a row ejected a pod that was only busy (a 5,920-token
prompt on SmolLM2, two CPU cores: 48 s of prefill, the pod ejected within seconds, new requests
refused meanwhile). So a report waits briefly for fresh stats, else answers with those of the
last step boundary; one stats call is in flight at a time. A call pending past `stall_s` means the
engine thread is stuck, not busy: the report then fails UNAVAILABLE and the gateway ejects the pod,
as it did before for any slow report.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from model_service.errors import UnavailableError

T = TypeVar("T")

# How long a report waits for the engine thread before answering with the last stats: well
# inside the gateway's 1 s check deadline, and longer than a step at serving speed on a GPU.
FRESH_WAIT_S = 0.25


class LoadStats(Generic[T]):
    """`recent()`: fresh stats when the engine thread reaches a step boundary within
    `FRESH_WAIT_S`, else the last ones gathered (the first report waits for its own)."""

    def __init__(self, gather: Callable[[], Awaitable[T]], stall_s: float) -> None:
        self.gather, self.stall_s = gather, stall_s
        self._pending: asyncio.Future[T] | None = None
        self._since = 0.0  # when the pending call was made
        self._last: T | None = None

    async def recent(self) -> T:
        if self._pending is None:
            self._pending, self._since = asyncio.ensure_future(self.gather()), time.monotonic()
            self._pending.add_done_callback(self._done)
        wait = FRESH_WAIT_S if self._last is not None else None
        try:
            return await asyncio.wait_for(asyncio.shield(self._pending), wait)
        except asyncio.TimeoutError:  # not the builtin before Python 3.11
            stalled = time.monotonic() - self._since
            if stalled > self.stall_s:
                raise UnavailableError(
                    f"the engine has not finished a step in {stalled:.0f} s (--engine-stall-timeout "
                    f"{self.stall_s:g}): stuck, not busy"
                ) from None
            assert self._last is not None
            return self._last

    def _done(self, future: asyncio.Future[T]) -> None:
        self._pending = None
        if not future.cancelled() and future.exception() is None:
            self._last = future.result()
