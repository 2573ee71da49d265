"""Per-API-key limits: a request rate (token bucket) and a number of concurrent streams.

Both are counted per key NAME in this gateway process (N gateway replicas admit up to N times
the figures; set them per replica). A refusal is RESOURCE_EXHAUSTED with a retry hint: the time
until the bucket has a token again, or, for streams, a short fixed pause (when one ends is not
known in advance).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway.auth import Caller

STREAM_RETRY_S = 0.5  # the hint when every stream slot is taken
POD_RETRY_S = 1.0  # the hint when every pod tried was at capacity (their queues were full)


@dataclass
class TokenBucket:
    rate: float  # tokens a second
    burst: float  # the most it holds
    tokens: float
    last: float  # when `tokens` was counted

    def take(self, now: float) -> float:
        """Spend one token; 0 when there was one, else seconds until there is."""
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.rate


class Limits:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._buckets: dict[str, TokenBucket] = {}
        self._streams: dict[str, int] = {}
        self._holders: dict[object, str] = {}

    def take(self, caller: Caller) -> float:
        """Spend one request of the caller's rate; 0 when admitted, else seconds until a token."""
        if caller.rate <= 0:
            return 0.0
        now, burst = self.clock(), caller.burst or max(1, math.ceil(caller.rate))
        b = self._buckets.get(caller.name)
        if b is None or (b.rate, b.burst) != (caller.rate, burst):  # new key, or its limits were edited
            b = self._buckets[caller.name] = TokenBucket(caller.rate, burst, burst, now)
        return b.take(now)

    def acquire(self, caller: Caller, holder: object) -> bool:
        """Take one of the caller's stream slots for `holder` (released by `release(holder)`)."""
        if caller.concurrency <= 0:
            return True
        if self._streams.get(caller.name, 0) >= caller.concurrency:
            return False
        self._streams[caller.name] = self._streams.get(caller.name, 0) + 1
        self._holders[holder] = caller.name
        return True

    def release(self, holder: object) -> None:
        name = self._holders.pop(holder, None)
        if name is not None:
            self._streams[name] -= 1

    def open_streams(self, name: str) -> int:
        return self._streams.get(name, 0)
