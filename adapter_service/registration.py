"""Storing and indexing a new version of an adapter, safely when several replicas share Redis and S3.

Under the name's registration lease (adapter_service/leases.py), one replica at a time:

1. rolls back what earlier registrations of the name left in storage without being
   acknowledged: files without a commit mark, and versions above the one indexed (stored, then
   the registration timed out, lost its lease or died before indexing; its caller was told it
   failed). A version is registered once it is indexed, and only then acknowledged;
2. reads the latest version in storage: if it has these weights, that version is the answer:
   registering the same name and sha256 again never makes a second version, so a caller may
   retry blindly (ALREADY_EXISTS, naming the version);
3. gets the next version number from the registry's `assign_version` script (one past both the
   index and storage, and only for the lease's holder), so versions are unique and dense;
4. writes the version to storage, its commit mark last;
5. indexes it with the registry's `commit` script, which refuses if the lease was lost.

It runs as a task of its own, shielded from the RPC: when the RPC's bound runs out the caller is
answered at once, and the task stops before its next write to storage (if the commit mark was
written already, it indexes the version, which the caller's retry then finds), keeping the
lease until its storage call has returned, so no other replica writes the same version
meanwhile. A replica that dies mid-way leaves at most an unindexed version
(rolled back by the next registration of the name) and a lease that expires.

The index is rebuilt from storage when Redis lost it; a version a timed-out registration stored
may then be indexed (a retry of it answers ALREADY_EXISTS with that version). Rolling back reads
the index and checks the lease again just before deleting, so a Redis restart in between cannot
make it delete an acknowledged version (it sees "not built", rebuilds, reads again).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from adapter_service.controller import Controller
from adapter_service.leases import GaveUp, Leases
from adapter_service.store import Version

log = logging.getLogger("spindle.adapters")


class LeaseLost(Exception):
    """The registration lease of a name expired or vanished (a registry restart) mid-way: the
    registration is not acknowledged (a retry finds what it stored, if it was indexed)."""


@dataclass
class Registered:
    version: Version
    new: bool  # False: the latest stored version of the name has these weights already


async def register(
    c: Controller,
    leases: Leases,
    name: str,
    sha: str,
    config: bytes,
    weights: Path,
    describe: Callable[[int, Version | None], Version],
) -> Registered:
    """Register `weights` (sha256 `sha`) under `name`; `describe(number, latest stored)` makes the
    new Version's record."""
    abandoned = threading.Event()
    task = asyncio.create_task(_register(c, leases, name, sha, config, weights, describe, abandoned))
    task.add_done_callback(lambda t: t.cancelled() or t.exception())  # once abandoned, nobody reads it
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        abandoned.set()
        raise


async def _register(
    c: Controller,
    leases: Leases,
    name: str,
    sha: str,
    config: bytes,
    weights: Path,
    describe: Callable[[int, Version | None], Version],
    abandoned: threading.Event,
) -> Registered:
    async with leases.hold(f"register:{name}", f"another registration of {name!r}", abandoned) as owner:
        await _roll_back(c, owner, leases.ttl, name)
        latest = next(iter(await c.store.versions(name, latest=True)), None)
        if latest is not None and latest.sha256 == sha:
            await _index(c, owner, latest)
            return Registered(latest, new=False)
        if abandoned.is_set():
            raise GaveUp(name)
        number = await c.registry.assign_version(name, owner, latest.version if latest else 0)
        if number is None:
            raise LeaseLost(f"the registration lease of {name!r} was lost before a version was assigned")
        v = describe(number, latest)
        await c.store.put(v, config, weights, abandoned)
        await _index(c, owner, v)
        return Registered(v, new=True)


async def _roll_back(c: Controller, owner: str, ttl: float, name: str) -> None:
    indexed = await c.registry.indexed_version(name)
    if indexed is None:  # a new or restarted Redis: the index comes from storage first
        await c.ensure_built()
        indexed = await c.registry.indexed_version(name)
    if indexed is None or not await c.registry.renew(f"register:{name}", owner, ttl):
        raise LeaseLost(f"the registry changed under the registration of {name!r} (restarted?)")
    if n := await c.store.roll_back(name, above=indexed):
        log.warning("rolled back %d files of %s above version %d (never acknowledged)", n, name, indexed)


async def _index(c: Controller, owner: str, v: Version) -> None:
    if not await c.registry.commit(v, owner):
        raise LeaseLost(
            f"the registration lease of {v.name!r} was lost (the registry restarted or did not answer) "
            f"before version {v.version} was indexed"
        )
