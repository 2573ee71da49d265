"""One run of an async refresh for any number of callers who each need a fresh one.

After a placement the gateway must see the pods' new load reports, and the adapter service its
pods' new slots, before routing or placing: each caller needs a refresh that *started after it
asked*. Under load hundreds of placements finish close together; one refresh each was a storm
(every pod polled, every index read, hundreds of times a second). Here a caller waits for the
refresh running now to end, then either finds that another started after it asked (and has
finished: its result is fresh enough) or runs the next one itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


class Coalesced:
    def __init__(self, refresh: Callable[[], Awaitable[object]]) -> None:
        self.refresh = refresh
        self._lock = asyncio.Lock()
        self._started = 0

    async def __call__(self) -> None:
        """Return once a refresh that started after this call has ended. Only the caller that
        ran it sees its exception; the others return (they asked for fresh state, not a retry)."""
        asked = self._started
        async with self._lock:  # FIFO: whoever waited longest goes first
            if self._started > asked:
                return
            self._started += 1
            await self.refresh()
