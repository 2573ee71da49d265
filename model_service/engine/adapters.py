"""The engine's adapter duties: control operations, and admission of requests whose adapter is
not resident.

Both run at the start of a step, a quiescent point (no forward pass in flight), so slot
contents change only between passes. Control operations come from other threads through a
queue; each answers its caller's future.

Loads. An adapter only on disk is read (parsed, validated, packed in page-locked memory) by a
worker thread (`LoraPool.host_ready`) while steps run, and loaded at the first quiescent
point after: the engine thread only copies it to the device.

Admission. A waiting request whose adapter is not resident, or is draining, or would make
more than `max_loras` distinct adapters in the running batch, waits without blocking the
requests behind it; its wait starts when the scheduler first finds it so
(`Admission.blocked_since`, engine/sequence.py). At each quiescent point the adapters waited for are loaded,
longest wait first, until the pool answers that its memory is taken (`SlotsBusyError`): a
younger adapter never takes memory an older one waits for. An adapter whose oldest request has
waited `adapter_starvation_s` is *starving* (until its requests are admitted), and starving
adapters take precedence, oldest first: each one the pool cannot place, or the step has no
place for, gets a drain in progress. A drain picks a resident
adapter held by running requests, neither pinned nor `@active`, the one with the least work
left, and stops admitting its new requests (`Scheduler.draining`) so that its refcount reaches
zero; the starving adapter is then loaded into the freed memory. A drain that has run
`adapter_drain_s` preempts the drained adapter's running sequences (they requeue; their K/V
mostly comes back from the prefix cache), so it ends at that quiescent point. Whether an
adapter fits is the pool's answer, not a count of slots: while a starving adapter still does
not fit, the memory already drained stays reserved and one more adapter is drained. A drained
adapter's own waiting requests age like any others: once it is evicted they wait for a
non-resident adapter, from the moment they first waited, and starve in their turn.

Bound. Let T = `adapter_starvation_s`, D = `adapter_drain_s`, δ the longest step (adapter
loads included), and m the places a drain may free (the resident adapters, or `max_loras`
when fewer, less the pinned and `@active` ones; at least 1). If nothing but its adapter holds
a request back (K/V blocks, the token budget and `max_num_seqs` suffice) and each adapter fits
the memory of one drained adapter,
a request is first scheduled within

    T + 2δ + ceil((k + 1) / m) × (D + 2δ)

of its arrival, where k counts the other adapters that requests were already waiting for when
its own wait began and still are when its wait reaches T. Its wait starts within δ of
arrival; within T + δ after that its adapter is starving and at most (k+1)-th in line; every
drain ends within D + δ of its start and serves the head of the line, and a slot can be
drained again one step after it is loaded, so each of the m slots serves one starving adapter
per D + 2δ. With the defaults (1 s and 1 s) and k < m that is 2 s + 4δ. Where one drained
adapter does not make room for another (capacity in bytes), k + 1 becomes the number of drains
the adapters ahead and its own need.

Busy memory never fails a request. Only a load that fails for another reason (a bad file,
unreachable storage) can: it is tried again after `RETRY_S` seconds, then twice as long each
time, and a request that has waited
`adapter_wait_timeout_s` while its adapter fails to load ends with that error.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass

from model_service.engine.config import EngineConfig
from model_service.engine.scheduler import Scheduler
from model_service.engine.sequence import Sequence
from model_service.errors import NotFoundError, PreconditionError
from model_service.lora.adapter import AdapterError
from model_service.lora.control import ControlOp, ControlResult, execute
from model_service.lora.pool import (
    ACTIVE,
    AdapterNotFoundError,
    AdapterTooLargeError,
    LoraPool,
    SlotsBusyError,
)

log = logging.getLogger(__name__)

# At most one warning about drains in this many seconds: a pod short of adapter memory drains
# at most quiescent points, and the counter (`spindle:lora_adapter_drains`) says how often.
DRAIN_WARNING_S = 60.0

# Load failures no retry can mend: the adapter was deleted, or is larger than the adapter memory
# (its requests waited `adapter_wait_timeout_s` for nothing, then failed naming the flag anyway).
NEVER_LOADS = (AdapterNotFoundError, AdapterTooLargeError)

RETRY_S = 1.0  # the first wait before loading again an adapter that failed for a reason other than memory


@dataclass
class _LoadFailure:
    error: str  # why the latest attempt failed
    retry_at: float
    backoff: float  # the wait before `retry_at`; the next one is twice as long
    gone: bool = False  # deleted, or too large for the adapter memory: no retry can load it


class AdapterControl:
    def __init__(self, pool: LoraPool, scheduler: Scheduler, config: EngineConfig) -> None:
        """Times come from `scheduler.clock`, the clock the scheduler stamps waits with."""
        self.pool, self.scheduler, self.clock = pool, scheduler, scheduler.clock
        self.wait_timeout_s = config.adapter_wait_timeout_s
        self.starvation_s = config.adapter_starvation_s
        self.drain_s = config.adapter_drain_s
        self.max_loras = config.max_loras
        self.num_drains = 0  # drains begun for starving adapters
        self._warned_at: float | None = None  # when `_begin_drains` last logged
        self._failures: dict[str, _LoadFailure] = {}
        self._control: queue.Queue[tuple[ControlOp, Future[ControlResult]]] = queue.Queue()

    def submit(self, op: ControlOp) -> Future[ControlResult]:
        """Queue an operation (thread-safe); it runs at the start of the next step."""
        future: Future[ControlResult] = Future()
        self._control.put((op, future))
        return future

    def check_request(self, adapter: str | None) -> None:
        """Refuse, at admission, a request for an adapter it would wait for forever: none is
        active (for `@active`), the server has no slots, or no adapter has that name."""
        if adapter == ACTIVE and self.pool.slot_of(ACTIVE) is None:
            raise PreconditionError(
                f"no adapter is active, so {ACTIVE!r} names none: ModelControl.SetActive sets one "
                "(or name the adapter itself)"
            )
        if adapter is not None and self.max_loras == 0:
            raise PreconditionError(
                f"adapter {adapter!r} asked for, but this server has no LoRA slots (--max-loras 0)"
            )
        if adapter is not None and not self.pool.known(adapter):
            names = sorted(a.name for a in self.pool.report())
            raise NotFoundError(f"unknown adapter {adapter!r}; this server has {names or 'no adapters'}")

    def needs_quiescence(self) -> bool:
        """Whether `at_quiescent_point` must not run while a step is in flight: control
        operations (they answer callers about state that step may still change) or drains (they
        may preempt its sequences). Loading a waiting request's adapter needs none: it writes
        arena memory and a table row that no adapter of a running row uses (only idle adapters
        are evicted, and compaction moves bytes and table rows together), by copies queued on
        the device after the step in flight, so the async pipeline keeps going."""
        return not self._control.empty() or bool(self.scheduler.draining)

    def at_quiescent_point(self) -> list[tuple[Sequence, str]]:
        """Run queued operations, then admission (see the module docstring). Returns the waiting
        requests that must fail, each with why; the caller finishes them."""
        while not self._control.empty():
            op, future = self._control.get_nowait()
            try:
                future.set_result(execute(op, self.pool))
            except Exception as e:  # a failed operation fails its caller, not the engine
                future.set_exception(e)
        if not (self.scheduler.adapter_demand or self.scheduler.draining or self.scheduler.starving):
            return []
        return self._admit()

    # --- admission ------------------------------------------------------------------------

    def _admit(self) -> list[tuple[Sequence, str]]:
        """Load what waiting requests need, plan the drains, end the overdue ones (and load into
        what they free); returns the requests whose adapter failed to load for too long."""
        self.scheduler.adapter_demand = {}
        now = self.clock()
        blocked = self.scheduler.blocked_adapters()
        self._failures = {n: f for n, f in self._failures.items() if n in blocked}
        # Starving adapters load first: the step's places are kept for them, so an idle resident
        # adapter waited for longer but held by this loop would keep the memory they need while
        # its own requests could not be admitted either (a hang the engine fuzz found).
        first = [n for n in self.scheduler.starving if n in blocked]
        unloaded = self._load_in_order(first + [n for n in blocked if n not in first], now)
        starving = self._update_starving(blocked, unloaded, now)
        self._plan_drains(starving, unloaded, now)
        if self._end_overdue_drains(now):
            unloaded = self._load_in_order(unloaded, now)
            self._plan_drains(starving, unloaded, now)
        return self._doomed(now)

    def _update_starving(self, blocked: dict[str, float], unloaded: list[str], now: float) -> list[str]:
        """The starving adapters, longest wait first (also `Scheduler.starving`). An adapter
        starts starving once its oldest request has waited `adapter_starvation_s` for memory or
        for a place among the step's `max_loras` adapters, and starves until its requests are
        admitted: the scheduler gives free places in the step to starving adapters in this
        order, or requests queued before its own (a drained adapter's) would take the place
        its drain freed."""
        room = set(unloaded) | self._without_place(blocked)
        was = set(self.scheduler.starving)
        self.scheduler.starving = [
            n
            for n, since in blocked.items()
            if n not in self.scheduler.draining
            and n not in self._failures
            and (n in was or (n in room and now - since >= self.starvation_s))
        ]
        return self.scheduler.starving

    def _without_place(self, names: Iterable[str]) -> set[str]:
        """Those of `names` (in line order) that are resident but will get no place in the step
        at the next schedule: the free places among `max_loras` go to the first in line."""
        in_step = self.scheduler.adapters_in_step()
        line = [n for n in names if (slot := self.pool.slot_of(n)) is not None and slot not in in_step]
        return set(line[max(0, self.scheduler.max_loras - len(in_step)) :])

    def _load_in_order(self, names: list[str], now: float) -> list[str]:
        """Load `names` in order until the pool is full. Returns those still waiting for memory, in
        order (not the draining, not those whose load fails otherwise). Every adapter loaded or
        found resident holds a reference until the end, so that a later load cannot evict it
        before the scheduler admits its requests."""
        held: list[int] = []
        try:
            for i, name in enumerate(names):
                if name in self.scheduler.draining or not self._may_try(name, now):
                    continue
                try:
                    if not self.pool.host_ready(name):
                        continue  # read from disk in a worker meanwhile: loaded once it is in
                    slot, _ = self.pool.load(name)
                except SlotsBusyError:
                    return [n for n in names[i:] if self._waits_for_memory(n)]
                except AdapterError as e:
                    self._note_failure(name, str(e), now, isinstance(e, NEVER_LOADS))
                    continue
                self._failures.pop(name, None)
                held.append(self.pool.acquire(slot))
            return []
        finally:
            for slot in held:
                self.pool.release(slot)

    def _note_failure(self, name: str, error: str, now: float, gone: bool) -> None:
        last = self._failures.get(name)
        backoff = RETRY_S if last is None else 2 * last.backoff
        self._failures[name] = _LoadFailure(error, now + backoff, backoff, gone)

    def _may_try(self, name: str, now: float) -> bool:
        failure = self._failures.get(name)
        return failure is None or now >= failure.retry_at

    def _waits_for_memory(self, name: str) -> bool:
        return (
            name not in self.scheduler.draining
            and name not in self._failures
            and self.pool.slot_of(name) is None
        )

    def _plan_drains(self, starving: list[str], unloaded: list[str], now: float) -> None:
        """Give each starving adapter that still needs room (not resident: `unloaded`, or without
        a place in the step), oldest first, a drain in progress: the earliest-begun one no
        adapter before it claimed, else a new one. A drain no such adapter claims ends (its
        adapter admits requests again), except that a drained adapter no request holds any
        more stays drained while a starving adapter waits for memory: its memory is reserved
        for it, and it may take several drains to fit one adapter. (A place in the step needs
        no such reservation: the scheduler keeps places for starving adapters.)"""
        draining = self.scheduler.draining
        candidates = self.pool.displaceable()
        for name in [n for n in draining if n not in candidates]:
            del draining[name]  # evicted, pinned or made @active since
        waiting_memory = [n for n in starving if n in unloaded]
        without_place = self._without_place(starving)
        unplaced = waiting_memory + [n for n in starving if n in without_place]
        if not unplaced:
            draining.clear()
            return
        in_progress = [n for n in draining if candidates[n][1] > 0]  # in the order they began
        ended = in_progress[len(unplaced) :]
        if not waiting_memory:
            ended += [n for n in draining if candidates[n][1] == 0]
        for name in ended:
            del draining[name]
        if len(unplaced) > len(in_progress):
            self._begin_drains(len(unplaced) - len(in_progress), candidates, now)

    def _begin_drains(self, n: int, candidates: dict[str, tuple[int, int]], now: float) -> None:
        """Drain up to `n` more adapters: among those held by running requests, the least work left
        first (the drain that ends soonest, and wastes least if it must preempt)."""
        work = self.scheduler.work_left()
        held = sorted(
            (work.get(slot, 0), slot, name)
            for name, (slot, refcount) in candidates.items()
            if refcount > 0 and name not in self.scheduler.draining
        )
        drained = [name for _, _, name in held[:n]]
        for name in drained:
            self.scheduler.draining[name] = now
            self.num_drains += 1
        if drained and (self._warned_at is None or now - self._warned_at >= DRAIN_WARNING_S):
            self._warned_at = now
            log.warning(
                "adapters starve for a place: draining %s (%d drains so far); the device holds "
                "%.0f of %.0f MB of adapters and a step at most %d distinct ones. If this repeats, "
                "raise --lora-memory-bytes or --max-loras, or route fewer distinct adapters here",
                ", ".join(map(repr, drained)), self.num_drains,
                self.pool.memory_used_bytes / 1e6, self.pool.memory_capacity_bytes / 1e6, self.max_loras,
            )  # fmt: skip

    def _end_overdue_drains(self, now: float) -> bool:
        """Preempt the running sequences of every drain that has run `adapter_drain_s`, so that no
        drain outlasts it by more than a step. Whether any sequence was preempted."""
        candidates = self.pool.displaceable()
        preempted = 0
        for name, began in self.scheduler.draining.items():
            if now - began >= self.drain_s:
                preempted += self.scheduler.preempt_adapter(candidates[name][0])
        return preempted > 0

    def _doomed(self, now: float) -> list[tuple[Sequence, str]]:
        """Waiting requests that have waited `adapter_wait_timeout_s` for an adapter whose latest
        load failed for a reason other than memory, and at once those whose adapter no retry can
        load (deleted while they waited, or larger than the adapter memory: they waited out the
        timeout for nothing)."""
        if not self._failures:
            return []
        doomed = []
        for seq in self.scheduler.waiting:
            name, since = seq.admission.adapter, seq.admission.blocked_since
            failure = self._failures.get(name) if name is not None else None
            if (
                failure is not None
                and since is not None
                and (failure.gone or now - since >= self.wait_timeout_s)
            ):
                doomed.append((seq, f"adapter {name!r} could not be loaded: {failure.error}"))
        return doomed
