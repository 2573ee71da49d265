"""Leases held by one replica of the adapter service, so several replicas sharing one Redis decide
each thing once.

- `register:NAME`: held while a version of NAME is assigned, stored and indexed (and while NAME is
  deleted or pinned). Registrations of one name on two replicas run one after the other, so the
  version each gets is unique and dense; different names never wait for each other.
- `place:NAME`: held while NAME is placed on demand. Place reaches whichever replica the
  gateway's connection lands on; the second replica asked waits for the first's placement and
  answers with the pod it chose, so an adapter is never loaded twice for one need.
- `leader`: one replica runs the policy loop (spreading hot adapters, cooling idle ones,
  rotating pods a registration left on an old version). That loop acts on the whole fleet from
  one view; two replicas running it would each spread and cool the same adapters.

A lease expires `ttl` seconds after its last renewal, so a replica that dies holding one blocks
nobody for longer than that; while held it is renewed every `ttl / 3` seconds. Each hold records
its own token as the lease's owner, not the replica's name: a holder whose lease lapsed under it
(a restarted registry, renewals that failed past the ttl) while another attempt on the same
replica took the name can then neither renew, release nor commit under that attempt's lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import threading
import uuid
from collections.abc import AsyncIterator

from adapter_service.deadlines import waiting_for
from adapter_service.registry import Registry, cancel_and_wait

log = logging.getLogger("spindle.adapters")


class GaveUp(Exception):
    """The caller stopped waiting for a lease (its RPC answered already)."""


class Leases:
    def __init__(self, registry: Registry, ttl: float = 10.0, owner: str = "") -> None:
        self.registry, self.ttl = registry, ttl
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._holds = itertools.count()

    @contextlib.asynccontextmanager
    async def hold(self, key: str, what: str, give_up: threading.Event | None = None) -> AsyncIterator[str]:
        """Wait until `key` is free, hold it (renewed) for the block, release it after; yields the
        hold's token, the owner to name in the registry's calls made under it. `what` names the
        wait for a bound that runs out meanwhile ("another registration of 'x'")."""
        token, delay = f"{self.owner}#{next(self._holds)}", 0.02
        with waiting_for(what):
            while True:  # give up before taking it, too: a caller gone holds it for nobody
                if give_up is not None and give_up.is_set():
                    raise GaveUp(key)
                if await self.registry.acquire(key, token, self.ttl):
                    break
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.25)
        renewing = asyncio.create_task(self._renew(key, token))
        try:
            yield token
        finally:
            await cancel_and_wait(renewing)
            try:
                await self.registry.release(key, token)
            except Exception as e:  # unreachable registry: the lease expires on its own
                log.warning("releasing lease %s failed (it expires in %g s): %s", key, self.ttl, e)

    async def _renew(self, key: str, token: str) -> None:
        while True:
            await asyncio.sleep(self.ttl / 3)
            try:
                if not await self.registry.renew(key, token, self.ttl):
                    log.warning("lease %s was lost (expired, or the registry restarted)", key)
                    return
            except Exception as e:  # keep trying: the registry may come back before it expires
                log.warning("renewing lease %s failed: %s", key, e)

    async def lead(self, ttl: float) -> bool:
        """Whether this replica leads the policy loop now: takes the lead if nobody holds it, keeps
        it by renewing (call at least every `ttl / 2` seconds)."""
        return await self.registry.renew("leader", self.owner, ttl) or await self.registry.acquire(
            "leader", self.owner, ttl
        )
