"""The adapter tiers of a fake pod (bench/fake_engine.py's FakeLoraEngine): disk, host, device.

What a fleet simulation needs of a pod's adapters, without weights: the device has a fixed
adapter memory in bytes (the byte-sized pool, issue 30); making an adapter resident takes
time in proportion to its bytes (from host memory: a copy; from disk: a parse into host memory
first); room is made by evicting the least recently used adapters that no request holds and
nobody pinned. An adapter's bytes come from its rank (`bytes_per_rank`: all seven projections
of every layer, as the real adapters of docs/adapter_service.md are), so different adapters load
in different times. Bookkeeping only, on the engine thread; the clock is passed in.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from model_service.lora.pool import AdapterBusyError, AdapterInfo, AdapterNotFoundError

BYTES_PER_RANK = 1_225_000  # SmolLM2-135M, float32, q/k/v/o/gate/up/down of 30 layers: 9.8 MB at rank 8


@dataclass
class Known:
    """An adapter on this pod's disk: what a load needs to know."""

    adapter_id: int
    rank: int
    sha256: str
    nbytes: int


@dataclass
class Resident:
    """An adapter's device copy; `ready_at` > now while its load is still under way."""

    slot: int
    ready_at: float
    refcount: int = 0
    pinned: bool = False


@dataclass
class Speeds:
    """Bytes per second of the two loads (a disk load is a parse into host memory, then a copy)."""

    host_to_device: float = 2e9
    disk_to_host: float = 5e8


class AdapterTiers:
    def __init__(
        self, capacity_bytes: int, max_host: int, max_slots: int, speeds: Speeds | None = None
    ) -> None:
        self.capacity_bytes, self.max_host, self.max_slots = capacity_bytes, max_host, max_slots
        self.speeds = speeds or Speeds()
        self.disk: dict[str, Known] = {}
        self.host: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self.device: OrderedDict[str, Resident] = OrderedDict()  # least recently used first
        self.loads = self.evictions = 0
        self.load_seconds = 0.0

    # --- what the pod reports ------------------------------------------------------------------

    @property
    def memory_used_bytes(self) -> int:
        return sum(self.disk[name].nbytes for name in self.device)

    @property
    def memory_capacity_bytes(self) -> int:
        return self.capacity_bytes

    def known(self, name: str) -> bool:
        return name in self.disk

    def ready(self, name: str, now: float) -> bool:
        entry = self.device.get(name)
        return entry is not None and entry.ready_at <= now

    def report(self) -> list[AdapterInfo]:
        """Every adapter at its highest tier, as LoraPool.report lists them."""
        out = []
        for name, k in self.disk.items():
            entry = self.device.get(name)
            if entry is not None:
                slot, refcount, pinned = entry.slot, entry.refcount, entry.pinned
                out.append(AdapterInfo(name, k.adapter_id, "gpu", slot, refcount, pinned, k.rank, k.sha256))
            else:
                tier = "cpu" if name in self.host else "disk"
                out.append(AdapterInfo(name, k.adapter_id, tier, None, 0, False, k.rank, k.sha256))
        return out

    # --- requests --------------------------------------------------------------------------------

    def hold(self, name: str, now: float) -> bool:
        """Take a reference on the device copy for a request, starting its load when there is
        room; False when there is none yet (every other copy is in use): try again later."""
        entry = self.device.get(name) or self.load(name, now)
        if entry is None:
            return False
        entry.refcount += 1
        self.device.move_to_end(name)
        return True

    def release(self, name: str) -> None:
        entry = self.device.get(name)
        if entry is not None and entry.refcount > 0:
            entry.refcount -= 1

    # --- control operations ------------------------------------------------------------------------

    def register(self, name: str, known: Known) -> None:
        """On disk, and parsed into host memory (as LoraPool.register does)."""
        if name in self.device and self.disk[name].sha256 != known.sha256:
            raise AdapterBusyError(f"adapter {name!r} has other weights resident; evict it first")
        self.disk[name] = known
        self._to_host(name)

    def load(self, name: str, now: float) -> Resident | None:
        """The device copy of `name`, loading it (ready after a time in proportion to its bytes);
        None when no room can be made. NOT_FOUND when the pod does not know it."""
        if name in self.device:
            return self.device[name]
        if name not in self.disk:
            raise AdapterNotFoundError(f"unknown adapter {name!r}; register it first")
        known = self.disk[name]
        slot = self._make_room(known.nbytes, now)
        if slot is None:
            return None
        seconds = known.nbytes / self.speeds.host_to_device
        if name not in self.host:
            seconds += known.nbytes / self.speeds.disk_to_host
        self._to_host(name)
        self.device[name] = entry = Resident(slot, now + seconds)
        self.loads += 1
        self.load_seconds += seconds
        return entry

    def evict(self, name: str) -> None:
        entry = self.device.get(name)
        if entry is None:
            return
        if entry.refcount > 0 or entry.pinned:
            raise AdapterBusyError(f"adapter {name!r} is in use or pinned; not evicted")
        del self.device[name]
        self.evictions += 1

    def drop_host_copy(self, name: str) -> None:
        self.host.pop(name, None)

    def forget(self, name: str) -> None:
        if name in self.device:
            raise AdapterBusyError(f"adapter {name!r} is resident; evict it before forgetting it")
        self.disk.pop(name, None)
        self.host.pop(name, None)

    def pin(self, name: str, pinned: bool) -> int:
        entry = self.device.get(name)
        if entry is None:
            raise AdapterNotFoundError(f"adapter {name!r} is not resident; load it before pinning")
        entry.pinned = pinned
        return entry.slot

    # --- internals ---------------------------------------------------------------------------------

    def _to_host(self, name: str) -> None:
        self.host[name] = None
        self.host.move_to_end(name)
        while len(self.host) > self.max_host:
            self.host.popitem(last=False)

    def _make_room(self, nbytes: int, now: float) -> int | None:
        """A free slot with `nbytes` free beside it, evicting idle copies (loaded, unreferenced,
        not pinned) least recently used first; None, evicting nothing, when even every idle one
        would not make the room."""
        idle = [n for n, e in self.device.items() if e.refcount == 0 and not e.pinned and e.ready_at <= now]
        free_bytes = self.capacity_bytes - self.memory_used_bytes
        free_slots = self.max_slots - len(self.device)
        victims = []
        for name in idle:
            if free_bytes >= nbytes and free_slots > 0:
                break
            victims.append(name)
            free_bytes += self.disk[name].nbytes
            free_slots += 1
        if free_bytes < nbytes or free_slots <= 0:
            return None
        for name in victims:
            self.evict(name)
        used = {e.slot for e in self.device.values()}
        return next(i for i in range(self.max_slots) if i not in used)
