"""Storing and indexing a new version of an adapter, safely when several replicas share Redis and S3.

Under the name's registration lease (adapter_service/leases.py), one replica at a time:

1. sweeps files of versions that never got their commit mark (a writer that timed out or died);
2. reads the versions in storage: if the latest has these weights, that version is the answer
   (indexed if a registration that timed out stored it but never indexed it): registering the
   same name and sha256 again never makes a second version, so a caller may retry blindly;
3. gets the next version number from the registry's `assign_version` script (one past both the
   index and storage, and only for the lease's holder), so versions are unique and dense;
4. writes the version to storage, its commit mark last;
5. indexes it with the registry's `commit` script, which refuses if the lease was lost.

It runs as a task of its own, shielded from the RPC: when the RPC's bound runs out the caller is
answered at once, and the task gives up at its next step (the commit mark is not written once
it was abandoned) but keeps the lease until its storage call has returned, so no other replica
writes the same version meanwhile. A replica that dies mid-way leaves at most files without a
commit mark (swept by the next registration) and a lease that expires.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from adapter_service.controller import Controller
from adapter_service.leases import Leases
from adapter_service.store import Version


class LeaseLost(Exception):
    """The registration lease of a name expired or vanished (a registry restart) mid-way."""


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
    async with leases.hold(f"register:{name}", f"another registration of {name!r}", abandoned):
        await c.store.sweep(name)
        stored = await c.store.versions(name)
        latest = stored[-1] if stored else None
        if latest is not None and latest.sha256 == sha:
            await _index(c, leases, latest)
            return Registered(latest, new=False)
        number = await c.registry.assign_version(name, leases.owner, latest.version if latest else 0)
        if number is None:
            raise LeaseLost(f"the registration lease of {name!r} was lost before a version was assigned")
        v = describe(number, latest)
        await c.store.put(v, config, weights, abandoned)
        await _index(c, leases, v)
        return Registered(v, new=True)


async def _index(c: Controller, leases: Leases, v: Version) -> None:
    if not await c.registry.commit(v, leases.owner):
        raise LeaseLost(
            f"the registration lease of {v.name!r} was lost (the registry restarted or did not answer) "
            f"after version {v.version} was stored"
        )
