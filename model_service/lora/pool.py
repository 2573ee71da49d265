"""The tiers an adapter lives in, and the device slots that requests hold.

- disk: adapters registered by name and directory (parsed and validated at registration);
- host: parsed adapters in CPU memory, LRU, at most `max_cpu_loras`;
- device: resident adapters, each in a slot (a row of the LoRA layers' tables; there are
  `RESIDENT_SLOTS` rows, more than any arena holds adapters of a useful size) and an extent of
  the adapter arena as large as its own weights (lora/arena.py): how many are resident is set
  by their bytes, so many small adapters share the memory a few padded slots took. A request's
  forward rows use one slot. (How many distinct adapters one step may run is the scheduler's
  `--max-loras`, vLLM's meaning.)

Making an adapter resident takes a free slot (else the least recently used idle one) and room
in the arena: idle adapters are evicted, least recently used first, until its extent fits
(compacting the arena when the free elements suffice but no gap does). The pool itself is
bookkeeping only (names, tiers, refcounts, extents), which is why one pool can serve several
executors (one per tensor-parallel rank) through the `SlotWriter` they implement: a rank's shard
of an adapter is smaller than the adapter, so it fits the extent the pool gave the whole.

Reading a disk-only adapter (read and hash the file, validate, convert into its host form)
happens in worker threads when admission asks for it (`host_ready`), so steps go on meanwhile;
the engine thread only adds the result to the host tier and copies it to the device. Such a read
takes the sha256 that registration computed (`Identity`) when the file's chunked digest is the
registered one, rather than hashing the file a second time. Explicit control operations
(register, LoadAdapter) still read on the engine thread: their caller waits for the answer anyway.

Refcounts follow the seed contract: `acquire(slot)` resolves -1 to the active adapter and
returns the RESOLVED index, and `release(resolved)` releases exactly that index, so a rotation
between a request's start and end cannot make it release a slot it never held. A slot with a
reference or a pin is never evicted or overwritten. Every method here runs on the engine
thread at a quiescent point (between steps), so no forward pass sees a slot change.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Protocol

from model_service.lora.adapter import AdapterError, HostForm, LoraAdapter, load_peft_adapter
from model_service.lora.arena import ArenaSpace
from model_service.lora.files import MAX_ADAPTER_BYTES
from model_service.models.config import ModelConfig

ACTIVE = "@active"  # the adapter name that follows rotation (the seed's slot -1)
READ_WORKERS = 2  # threads reading adapters from disk for admission


class AdapterNotFoundError(AdapterError, LookupError):
    """The adapter is not known here, or not in the tier the operation needs (NOT_FOUND)."""


class AdapterBusyError(AdapterError):
    """The slot or adapter is in use or pinned; retry once it is released (FAILED_PRECONDITION)."""


class AdapterTooLargeError(AdapterError):
    """The adapter needs more memory than the whole arena: no eviction or retry can place it."""


class SlotsBusyError(AdapterBusyError):
    """The slots or the adapter memory needed are held by adapters in use or pinned: promotion
    must wait for sequences to finish."""


class SlotWriter(Protocol):
    """Where resident adapters live: the arena and tables of the model's LoRA layers."""

    def load_slot(self, slot: int, adapter: LoraAdapter, offset: int) -> None: ...

    def clear_slot(self, slot: int) -> None: ...

    def move_slot(self, slot: int, offset: int) -> None: ...


class Identity(NamedTuple):
    """A registered adapter's latest version, as reported while it is on disk only."""

    adapter_id: int
    rank: int
    sha256: str
    chunked: bytes  # its weights' chunked digest: a read that finds it again has this sha256
    targets: frozenset[str]  # the PEFT modules it has weights on (the graphs a warm-up captures)


@dataclass
class Slot:
    adapter: LoraAdapter | None = None  # the host copy whose weights the slot's buffers hold
    refcount: int = 0
    pinned: bool = False
    stale: bool = False  # its name was re-registered with new content, or forgotten: no new requests


@dataclass
class AdapterInfo:
    name: str
    adapter_id: int
    tier: str  # "gpu" | "cpu" | "disk"
    slot: int | None
    refcount: int
    pinned: bool
    rank: int = 0
    sha256: str = ""
    active: bool = False  # the adapter `@active` requests get


class LoraPool:
    def __init__(
        self,
        base: ModelConfig,
        num_slots: int,
        max_cpu_loras: int,
        max_lora_rank: int,
        writer: SlotWriter,
        arena: tuple[int, int],
        max_adapter_bytes: int = MAX_ADAPTER_BYTES,
        host_form: HostForm | None = None,
        readers: Executor | None = None,
    ) -> None:
        """`arena`: (elements, bytes per element) of the writer's adapter arena. `host_form`: what
        an adapter becomes in the host tier (the arena's dtype, page-locked for a GPU); without
        it, adapters read from disk are float32 and those made in memory stay as they are.
        `readers`: where disk reads for admission run (`READ_WORKERS` threads by default)."""
        self.base, self.max_lora_rank, self.max_adapter_bytes = base, max_lora_rank, max_adapter_bytes
        self.writer, self.host_form = writer, host_form
        self.max_cpu_loras = max_cpu_loras
        self.space, self.element_size = ArenaSpace(arena[0]), arena[1]
        self.slots = [Slot() for _ in range(num_slots)]
        self._free = set(range(num_slots))
        self._in_use_order: OrderedDict[int, None] = OrderedDict()  # occupied slots, least recent first
        self._resident: dict[str, int] = {}  # name -> slot of its current version
        self.host: OrderedDict[str, LoraAdapter] = OrderedDict()
        self.disk: dict[str, Path] = {}
        self.identity: dict[str, Identity] = {}  # name -> its latest version
        self.active = -1  # slot of the active adapter, -1 = none
        self._reads: dict[str, Future[LoraAdapter]] = {}  # disk reads in worker threads
        self._readers = readers or ThreadPoolExecutor(READ_WORKERS, thread_name_prefix="lora-read")
        # Counters the pod exports: device loads, the engine thread's time in them, evictions.
        self.num_loads = self.num_evictions = 0
        self.load_seconds = 0.0

    # --- lookup ---------------------------------------------------------------------------

    def known(self, name: str) -> bool:
        return name == ACTIVE or name in self.disk or name in self.host or self.slot_of(name) is not None

    def slot_of(self, name: str) -> int | None:
        if name == ACTIVE:
            return self.active if self.active >= 0 else None
        return self._resident.get(name)

    @property
    def memory_capacity_bytes(self) -> int:
        return self.space.capacity * self.element_size

    @property
    def memory_used_bytes(self) -> int:
        return self.space.used * self.element_size

    def adapter_id_for(self, slot: int) -> int:
        """Prefix-cache identity of the weights `slot` selects (-1 = active); 0 for the base model."""
        slot = self.active if slot == -1 else slot
        adapter = self.slots[slot].adapter if slot >= 0 else None
        return adapter.adapter_id if adapter is not None else 0

    # --- refcounts ------------------------------------------------------------------------

    def acquire(self, slot: int) -> int:
        resolved = self.active if slot == -1 else slot
        if resolved < 0:
            return -1
        s = self.slots[resolved]
        if s.adapter is None:
            raise RuntimeError(f"acquire of empty LoRA slot {resolved}")
        s.refcount += 1
        self._in_use_order.move_to_end(resolved)
        return resolved

    def release(self, resolved: int) -> None:
        if resolved < 0:
            return
        s = self.slots[resolved]
        if s.refcount <= 0:
            raise RuntimeError(f"LoRA slot {resolved} released more times than acquired")
        s.refcount -= 1
        if s.refcount == 0 and s.stale:
            self._clear(resolved)

    def _retire(self, slot: int) -> None:
        """The slot's adapter is no longer what its name means (re-registered, or forgotten): it
        serves only the requests that hold it and is cleared when the last ends. It keeps no pin:
        a pin is for the name's current weights (the adapter service pins them where it loads
        them), and a pinned stale slot was never cleared, holding its memory and hiding the new
        version from the pod's report for good."""
        s = self.slots[slot]
        s.stale, s.pinned = True, False
        if self._resident.get(s.adapter.name) == slot:
            del self._resident[s.adapter.name]
        if s.refcount == 0:
            self._clear(slot)

    # --- control operations (quiescent points only) ---------------------------------------

    def register(self, name: str, path: Path) -> LoraAdapter:
        """Add (or replace) a disk-tier adapter; parsed now so a bad one fails here, not mid-request."""
        adapter = self._read(name, Path(path), self.identity.get(name))  # the same bytes again: no hash
        self._reads.pop(name, None)  # a read of the old files: its result is dropped
        self.disk[name] = Path(path)
        targets = frozenset(module for _, module in adapter.modules)
        self.identity[name] = Identity(
            adapter.adapter_id, adapter.max_rank, adapter.sha256, adapter.chunked, targets
        )
        adapter = self._keep(adapter)
        current = self.slot_of(name)
        if current is not None and self.slots[current].adapter.adapter_id != adapter.adapter_id:
            self._retire(current)  # a resident older version keeps serving only its requests
        return adapter

    def load(self, name: str, slot: int | None = None) -> tuple[int, list[str]]:
        """Make `name` resident (into `slot`, or a free or the LRU idle slot). Returns (slot, the
        adapters evicted to make room)."""
        start = time.perf_counter()
        placed, evicted = self._load(name, slot)
        self.load_seconds += time.perf_counter() - start
        return placed, evicted

    def host_ready(self, name: str) -> bool:
        """Whether `name` can be made resident without reading its files: it is resident, in the
        host tier, or a worker has read it since (it joins the host tier now). Otherwise a
        worker starts reading it, if it is registered, and the answer is False. A worker's
        failure (a bad or vanished file) is raised here, as `load` would raise it."""
        if self.slot_of(name) is not None or name in self.host or name not in self.disk:
            return True  # (an unknown name: `load` says so)
        read = self._reads.get(name)
        if read is None:
            known = self.identity[name]
            read = self._reads[name] = self._readers.submit(self._read, name, self.disk[name], known)
        if not read.done():
            return False
        del self._reads[name]
        adapter = read.result()
        if adapter.adapter_id != self.identity[name].adapter_id:
            return self.host_ready(name)  # re-registered while it was read: read the new files
        self._keep(adapter)
        return True

    def pending_reads(self) -> list[Future[LoraAdapter]]:
        """The workers' reads not yet taken in (an idle engine waits on them rather than spinning)."""
        return list(self._reads.values())

    def _load(self, name: str, slot: int | None) -> tuple[int, list[str]]:
        current = self.slot_of(name)
        if current is not None and (slot is None or slot == current):
            self._in_use_order.move_to_end(current)
            return current, []
        adapter = self._host_copy(name)
        size = adapter.numel
        if size > self.space.capacity:
            raise AdapterTooLargeError(
                f"adapter {name!r} needs {self._mb(size)} of adapter memory; the arena holds "
                f"{self._mb(self.space.capacity)} (raise --lora-memory-bytes)"
            )
        target = self._victim() if slot is None else slot
        if target is None:
            raise SlotsBusyError(
                f"cannot load adapter {name!r}: all {len(self.slots)} LoRA slots are in use or pinned"
            )
        if not 0 <= target < len(self.slots):
            raise AdapterError(f"slot {target} does not exist (there are {len(self.slots)})")
        victim = self.slots[target]
        if victim.refcount > 0 or victim.pinned:
            raise AdapterBusyError(
                f"slot {target} holds adapter {victim.adapter.name!r}, which is in use or pinned"
            )
        if current is not None:  # moving to another slot: the old one must be idle too
            busy = self._busy(current)
            if busy:
                raise AdapterBusyError(f"adapter {name!r} {busy}; not moved to slot {target}")
            self._clear(current)
        evicted = [victim.adapter.name] if victim.adapter is not None else []
        self._clear(target)
        offset = self._room(name, target, size, evicted)
        self.writer.load_slot(target, adapter, offset)
        self.num_loads += 1
        self.num_evictions += len(evicted)
        self.slots[target] = Slot(adapter)
        self._free.discard(target)
        self._in_use_order[target] = None
        self._resident[name] = target
        return target, evicted

    def _room(self, name: str, slot: int, size: int, evicted: list[str]) -> int:
        """An arena offset for `slot`'s `size` elements: idle adapters are evicted, least
        recently used first, until a gap holds it (compacting when the free elements would)."""
        while True:
            offset = self.space.place(slot, size)
            if offset is not None:
                return offset
            if self.space.compacting_frees(size):
                for moved, to in self.space.compaction():
                    self.writer.move_slot(moved, to)
                continue
            victim = self._lru_idle()
            if victim is None:
                raise SlotsBusyError(
                    f"cannot load adapter {name!r}: it needs {self._mb(size)} of adapter memory, "
                    f"{self._mb(self.space.free)} is free and the rest is held by adapters in use or pinned"
                )
            evicted.append(self.slots[victim].adapter.name)
            self._clear(victim)

    def evict(self, name: str) -> int:
        slot = self.slot_of(name)
        if slot is None:
            raise AdapterNotFoundError(f"adapter {name!r} is not resident")
        busy = self._busy(slot)
        if busy:
            raise AdapterBusyError(f"adapter {name!r} {busy}; not evicted")
        self._clear(slot)
        return slot

    def pin(self, name: str, pinned: bool) -> int:
        slot = self.slot_of(name)
        if slot is None:
            raise AdapterNotFoundError(f"adapter {name!r} is not resident; load it before pinning")
        self.slots[slot].pinned = pinned
        return slot

    def set_active(self, name: str | None) -> int:
        """Rotate: the adapter that requests for `@active` get from now on (running ones keep theirs)."""
        if name is None:
            self.active = -1
            return -1
        slot = self.slot_of(name)
        if slot is None:
            raise AdapterNotFoundError(f"adapter {name!r} is not resident; load it before making it active")
        self.active = slot
        return slot

    def report(self) -> list[AdapterInfo]:
        """Every adapter at its highest tier, as a new request for it would get it. A stale slot (an
        older version finishing its requests) is not listed: under the name it hid the current
        version, so the gateway routed to a pod that had forgotten the name and the adapter
        service saw the old weights there."""
        out, seen = [], set()
        for i in sorted(self._in_use_order):
            s = self.slots[i]
            a = s.adapter
            if a is not None and not s.stale:
                seen.add(a.name)
                out.append(
                    AdapterInfo(
                        a.name,
                        a.adapter_id,
                        "gpu",
                        i,
                        s.refcount,
                        s.pinned,
                        a.max_rank,
                        a.sha256,
                        i == self.active,
                    )
                )
        for name, a in self.host.items():
            if name not in seen:
                seen.add(name)
                out.append(AdapterInfo(name, a.adapter_id, "cpu", None, 0, False, a.max_rank, a.sha256))
        for name in self.disk:
            if name not in seen:
                known = self.identity[name]
                out.append(
                    AdapterInfo(name, known.adapter_id, "disk", None, 0, False, known.rank, known.sha256)
                )
        return out

    def target_sets(self) -> list[frozenset[str]]:
        """The distinct sets of PEFT modules the registered adapters target, the most common first."""
        counts = Counter(known.targets for known in self.identity.values())
        return [targets for targets, _ in counts.most_common()]

    def drop_host_copy(self, name: str) -> None:
        self.host.pop(name, None)

    def forget(self, name: str) -> int | None:
        """Forget `name` in every tier (the adapter was deleted): new requests for it get
        NOT_FOUND, while a slot that running requests hold keeps serving them and is cleared when
        they end (refusing, as before, left a deleted adapter served here for good). Refused while
        pinned. Returns the slot it was resident in, if any."""
        slot = self.slot_of(name)
        if slot is not None:
            if self.slots[slot].pinned:
                raise AdapterBusyError(f"adapter {name!r} is pinned; unpin it before forgetting it")
            self._retire(slot)
        self.host.pop(name, None)
        self.disk.pop(name, None)
        self.identity.pop(name, None)
        self._reads.pop(name, None)
        return slot

    # --- admission (engine/adapters.py drains adapters through this) ------------------------

    def displaceable(self) -> dict[str, tuple[int, int]]:
        """Resident adapters that may be drained to make room for a starving one, as name ->
        (slot, refcount): neither pinned nor `@active` (a stale slot takes no new requests and
        frees itself)."""
        return {
            s.adapter.name: (i, s.refcount)
            for i, s in ((i, self.slots[i]) for i in self._in_use_order)
            if not s.pinned and not s.stale and i != self.active
        }

    def first_free_slot(self) -> int | None:
        """The lowest slot holding no adapter (a new one may go there without an eviction)."""
        return min(self._free) if self._free else None

    # --- internals ------------------------------------------------------------------------

    def _host_copy(self, name: str) -> LoraAdapter:
        if name in self.host:
            self.host.move_to_end(name)
            return self.host[name]
        if name not in self.disk:
            raise AdapterNotFoundError(f"unknown adapter {name!r}; register it first")
        return self._keep(self._read(name, self.disk[name], self.identity[name]))

    def _read(self, name: str, path: Path, known: Identity | None) -> LoraAdapter:
        """An adapter's files read, validated and in their host form (in a worker thread for
        admission). `known`: the registered version, whose sha256 a read of the same bytes has."""
        return load_peft_adapter(
            name,
            path,
            self.base,
            self.max_lora_rank,
            self.max_adapter_bytes,
            self.host_form,
            (known.chunked, known.sha256) if known is not None else None,
        )

    def _remember(self, adapter: LoraAdapter) -> LoraAdapter:
        return self._keep(self.host_form(adapter) if self.host_form is not None else adapter)

    def _keep(self, adapter: LoraAdapter) -> LoraAdapter:
        """Add an adapter in its host form to the host tier (least recently used ones leave)."""
        self.host[adapter.name] = adapter
        self.host.move_to_end(adapter.name)
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)
        return adapter

    def _victim(self) -> int | None:
        """A slot to load into: a free one, else the least recently used idle one."""
        free = self.first_free_slot()
        return free if free is not None else self._lru_idle()

    def _lru_idle(self) -> int | None:
        """The least recently used resident slot that may be evicted (no reference, no pin, not
        the active adapter), or None. Busy slots were used recently, so the scan stops early."""
        return next(
            (
                i
                for i in self._in_use_order
                if self.slots[i].refcount == 0 and not self.slots[i].pinned and i != self.active
            ),
            None,
        )

    def _mb(self, elements: int) -> str:
        return f"{elements * self.element_size / 2**20:.1f} MB"

    def _busy(self, slot: int) -> str:
        """Why `slot` must not change now ('' when it may)."""
        s = self.slots[slot]
        if s.refcount > 0:
            return f"is in use by {s.refcount} running sequence(s)"
        return "is pinned" if s.pinned else ""

    def _clear(self, slot: int) -> None:
        adapter = self.slots[slot].adapter
        if adapter is None:
            return
        if self._resident.get(adapter.name) == slot:
            del self._resident[adapter.name]
        self.writer.clear_slot(slot)
        self.space.release(slot)
        self.slots[slot] = Slot()
        self._free.add(slot)
        self._in_use_order.pop(slot, None)
        if self.active == slot:
            self.active = -1
