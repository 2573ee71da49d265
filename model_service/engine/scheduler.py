"""Decides, each step, which sequences run and how many of their pending tokens.

A step has a token budget. Policies, each one method below:
- `_schedule_running`: running sequences in decode (one pending token) first, then those
  part-way through a chunked prefill; all in priority order.
- `_admit_waiting`: waiting requests, most important first, while budget, sequence slots and
  KV blocks last. A new request first takes the longest cached prefix of its tokens; a
  swapped-out one gets its KV copied back.
- `_pick_victim`: when a running sequence cannot get a KV block, the least important running
  sequence not yet scheduled this step is preempted (highest priority value, then latest
  arrival), never a beam of its own search; the sequence itself when it is the least important.
- `_preempt`: by swap (its KV goes to host memory, while the swap budget lasts) or by
  recompute (its blocks are freed; it prefills again, mostly from the prefix cache).
- Structured output: a waiting request whose grammar is still compiling waits without blocking
  the requests behind it.
- Adapters: a waiting request whose adapter is not resident, or is `draining`, or would be one
  adapter more than `max_loras` distinct adapters in the running batch (vLLM's meaning), waits
  without blocking the requests behind it and is noted in `adapter_demand`; `AdapterControl`
  (engine/adapters.py) loads adapters and decides which to drain, `preempt_adapter` ends a drain
  that has taken too long.
Decode rows and prefill chunks of one step go through the model in one mixed forward pass.
"""

from __future__ import annotations

import bisect
import operator
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from model_service.engine.batch_builder import StepItem
from model_service.engine.cache_manager import CacheManager, SwappedState
from model_service.engine.config import EngineConfig
from model_service.engine.prompt_logprobs import MAX_SCORED_ROWS, pending, prompt_rows, scored_chunk
from model_service.engine.sequence import Sequence, Status, by_rank
from model_service.engine.speculation import Proposal
from model_service.errors import CapacityError


class AdapterSlots(Protocol):
    """The LoRA slot bookkeeping the scheduler needs (implemented by `lora.pool.LoraPool`)."""

    def slot_of(self, name: str) -> int | None: ...

    def adapter_id_for(self, slot: int) -> int: ...

    def acquire(self, slot: int) -> int: ...

    def release(self, resolved: int) -> None: ...


@dataclass
class ScheduledBatch:
    """`work` pairs each sequence with the number of its pending tokens that run this step;
    `scored_rows`: the prompt-logprob rows the step may still take (prompt_logprobs.py)."""

    work: list[tuple[Sequence, int]] = field(default_factory=list)
    scored_rows: int = MAX_SCORED_ROWS


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        cache: CacheManager,
        adapters: AdapterSlots,
        clock: Callable[[], float] = time.monotonic,
        proposals: dict[Sequence, Proposal] | None = None,
    ) -> None:
        """`clock`: the time the scheduler stamps waits with (and `AdapterControl` reads); tests
        pass a simulated one. `proposals`: speculation's, by sequence (engine/speculation.py);
        a decode row verifies its proposals with it when the step has room, and the scheduler
        drops those that cannot run (no room, no checkpoint slots, preemption)."""
        self.cache, self.adapters, self.clock = cache, adapters, clock
        self.proposals: dict[Sequence, Proposal] = {} if proposals is None else proposals
        self.token_budget = config.max_num_batched_tokens
        self.max_num_seqs = config.max_num_seqs
        self.max_loras = config.max_loras
        self.max_waiting = config.max_waiting_requests
        self.preemption_mode = config.preemption_mode
        self.swap_budget = config.swap_space_bytes
        self.swap_used = 0
        self._swapped: dict[Sequence, SwappedState] = {}  # the host copy of each swapped-out one's K/V
        self.waiting: list[Sequence] = []  # sorted by rank
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_computed_tokens = 0  # tokens run through the model (prefix-cache hits excluded)
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.adapter_demand: dict[str, None] = {}  # adapters waiting requests need (ordered set)
        # Adapters admitting no new requests until their running ones are done (name -> when the
        # drain began), so that a starving adapter can take their memory. Set by AdapterControl.
        self.draining: dict[str, float] = {}
        # Adapters whose requests have waited too long, longest first (set by AdapterControl):
        # free places among the step's `max_loras` adapters go to them first, in this order.
        self.starving: list[str] = []
        self._stalled: list[Sequence] = []  # beams that preempted themselves with no way on

    # --- queues ---------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        if len(self.waiting) >= self.max_waiting:
            raise CapacityError(f"the request queue is full ({self.max_waiting} waiting); retry later")
        self._enqueue(seq)

    def requeue(self, seq: Sequence) -> None:
        """Queue `seq` again whatever the queue's length: its request was admitted once."""
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        bisect.insort(self.waiting, seq, key=by_rank)

    def remove(self, seq: Sequence) -> None:
        """Take `seq` out of the queues and free its KV state, wherever it is: it is finished
        (done, aborted, or a beam its search dropped)."""
        seq.status = Status.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free_state(seq)
        self._drop_held(seq)
        self._release_swap(seq)

    def fork(self, parent: Sequence) -> Sequence:
        """A running sibling of `parent` (beam search) sharing its blocks and its adapter slot."""
        assert parent.state is not None
        child = parent.fork()
        child.state = self.cache.fork(parent.state)
        if parent.state.lora_slot >= 0:
            child.state.lora_slot = self.adapters.acquire(parent.state.lora_slot)
        self.running.append(child)
        return child

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def forget_history(self) -> None:
        """Zero the counters and drop the prefix-cache entries no request holds: what the engine's
        warm-up requests left, which no client sent."""
        self.num_preemptions = self.num_computed_tokens = 0
        self.prefix_query_tokens = self.prefix_hit_tokens = 0
        self.cache.forget_unused_prefixes()

    @property
    def num_swapped(self) -> int:
        return len(self._swapped)  # each waits (admitted or removed, it is dropped)

    # --- one step -------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self._schedule_running(self.token_budget, batch)
        self._admit_waiting(budget, batch)
        if self.cache.has_state and (self.proposals or self.cache.keeps_boundaries):  # else none to plan
            batch.work = [(seq, self._plan_checkpoints(seq, n)) for seq, n in batch.work]
        return batch

    def _plan_checkpoints(self, seq: Sequence, n: int) -> int:
        """Reserve the recurrent-state checkpoints that `seq`'s `n` tokens of this step pass: one
        after each verify token but the last (to roll back to), else one at the last block
        boundary (for the prefix cache). Returns the tokens it runs: a verify row that finds no
        slots for its checkpoints drops its proposals and runs as a plain decode row."""
        assert seq.state is not None
        if n > seq.num_pending:  # its proposals to verify
            start = seq.state.num_computed
            if self.cache.plan_checkpoints(seq.state, list(range(start + 1, start + n))):
                return n
            del self.proposals[seq]
            n = seq.num_pending
        self.cache.plan_boundary_checkpoint(seq.state, n)
        return n

    def needs_quiescence(self) -> bool:
        """Whether the next quiescent point needs the step in flight read: a search to start over
        (`take_stalled`), or a scheduling that may preempt."""
        return bool(self._stalled) or self.may_preempt()

    def may_preempt(self) -> bool:
        """Whether the next `schedule` could run out of K/V blocks and preempt a sequence: never
        while the free blocks cover what every running sequence may reserve (its pending tokens'
        blocks and one copy-on-write block)."""
        bs, free = self.cache.block_size, self.cache.num_free_blocks
        if free > 2 * len(self.running) + self.token_budget // bs:  # bounds the sum below
            return False
        need = 0
        for seq in self.running:
            if seq.state is not None:
                blocks = -(-(seq.num_computed + seq.num_pending) // bs) - len(seq.state.block_table)
                need += max(blocks, 0) + 1
        return need > free

    # --- the cache, as steps move it --------------------------------------------------------
    # The engine asks for these; it never moves a sequence's cache state itself.

    def item(self, seq: Sequence, n: int) -> StepItem:
        """What `seq` runs for its `n` tokens of the step: its next pending tokens, or its last
        token and the proposals it verifies (`n` past its one pending token)."""
        state = seq.state
        assert state is not None
        if n > seq.num_pending:
            return StepItem(state, [seq.token_ids[-1], *self.proposals[seq].tokens], n)
        start = state.num_computed
        rows = 0 if seq.output.prompt_logprobs is None else prompt_rows(seq, start, n)
        return StepItem(
            state, seq.token_ids[start : start + n], int(start + n == len(seq.token_ids)), -1, rows
        )

    def commit(self, work: list[tuple[Sequence, int]]) -> None:
        """The step running `work` was launched: its tokens count as in the cache."""
        for seq, n in work:
            assert seq.state is not None
            self.cache.commit(seq.state, n)
            self.num_computed_tokens += n

    def register_prefix(self, seq: Sequence) -> None:
        """Publish `seq`'s newly full blocks to the prefix cache, once the ids of the tokens they
        hold are known (after a verify, or once a token in flight has arrived); nothing for a
        sequence that finished meanwhile."""
        if seq.state is not None:
            self.cache.register_full_blocks(seq.state, seq.token_ids, seq.admission.adapter_id)

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        """Cut `seq`'s last `num_tokens` computed tokens (rejected proposals) out of its cache,
        before the prefix cache sees them; a hybrid model's recurrent state is restored from
        the checkpoint planned for that length."""
        assert seq.state is not None
        self.cache.truncate(seq.state, seq.state.num_computed - num_tokens)

    def _schedule_running(self, budget: int, batch: ScheduledBatch) -> int:
        self.running.sort(key=by_rank)
        # Decode rows first, then prefill chunks; a beam waiting for its siblings' logits (0
        # pending) waits. Pending counts do not change in this loop, except by preemption.
        pending = [(seq, seq.num_pending) for seq in self.running]
        order = [sp for sp in pending if sp[1] == 1] + [sp for sp in pending if sp[1] > 1]
        work, running, cache = batch.work, Status.RUNNING, self.cache  # locals: 256 rows a step
        proposals = self.proposals
        for seq, num_pending in order:
            if budget == 0:
                break
            if seq.status is not running:
                continue  # preempted by a reservation before it
            n, scored = scored_chunk(seq, min(num_pending, budget), batch.scored_rows)
            proposal = proposals.get(seq) if proposals else None
            if num_pending == 1 and proposal is not None:  # verify it too, if the budget allows
                if budget > len(proposal.tokens):
                    n += len(proposal.tokens)
                else:
                    del proposals[seq]
            if n and (cache.has_room(seq.state, n) or self._reserve_or_preempt(seq, n, work)):
                work.append((seq, n))
                budget -= n
                batch.scored_rows -= scored
        return budget

    def _admit_waiting(self, budget: int, batch: ScheduledBatch) -> None:
        i = 0
        in_step: set[int] | None = None  # the running rows' adapter slots, made on first need
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[i]
            if in_step is None and seq.admission.adapter is not None:
                in_step = self.adapters_in_step()
            # (its adapter's demand is noted first, so that a load and a compile overlap)
            ready, slot = self._adapter_slot(seq, in_step)
            constraint = seq.sampling.constraint
            if not ready or (constraint is not None and not constraint.ready):
                i += 1  # its adapter is being promoted or its grammar compiled: it waits, the
                continue  # requests behind it do not
            seq.admission.adapter_id = self.adapters.adapter_id_for(slot) if slot is not None else 0
            if not self._attach_state(seq):
                break
            n, scored = scored_chunk(seq, min(seq.num_pending, budget), batch.scored_rows)
            if not n or not self.cache.reserve(seq.state, seq.num_computed + n):
                self._free_state(seq)  # cached prefix blocks stay cached; swapped KV stays on host
                break
            batch.scored_rows -= scored
            if slot is not None:
                seq.state.lora_slot = self._take_slot(seq, slot)
                in_step.add(seq.state.lora_slot)
            if seq.admission.first_scheduled_at is None:
                seq.admission.first_scheduled_at = self.clock()
            self._release_swap(seq)
            self.waiting.pop(i)
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.work.append((seq, n))
            budget -= n

    def _adapter_slot(self, seq: Sequence, in_step: set[int] | None) -> tuple[bool, int | None]:
        """(ready, resident slot or None for the base model). A missing or draining adapter, or
        one that would exceed `max_loras` in the step (`in_step`: the slots running rows hold),
        is noted as demand, which the engine serves at its next quiescent point, and the
        request's adapter wait starts."""
        admission = seq.admission
        name = admission.adapter
        if name is None:
            return True, None
        if admission.held_slot >= 0:
            return self._held_slot(seq, in_step)
        slot = self.adapters.slot_of(name) if name not in self.draining else None
        if slot is not None and slot not in in_step and not self._may_take_place(name, in_step):
            slot = None
        if slot is None:
            self.adapter_demand[name] = None
            if admission.blocked_since is None:
                admission.blocked_since = self.clock()
            return False, None
        admission.blocked_since = None
        return True, slot

    def _held_slot(self, seq: Sequence, in_step: set[int]) -> tuple[bool, int | None]:
        """`_adapter_slot` of a preempted request that kept its slot: that slot, when it has a place
        in the step. Its name is not looked up again: since it began, a Delete, a new version or a
        rotation (`@active`) may have given the name other weights, or none. A drained slot's
        request lets it go and waits for its adapter as a new request does."""
        slot = seq.admission.held_slot
        if slot in {self.adapters.slot_of(n) for n in self.draining}:
            self._drop_held(seq)
            return self._adapter_slot(seq, in_step)
        if slot in in_step or self._may_take_place(seq.admission.adapter, in_step):
            return True, slot
        return False, None

    def _take_slot(self, seq: Sequence, slot: int) -> int:
        """The reference an admitted `seq` holds on LoRA `slot`: the one it kept while preempted,
        or a new one."""
        if seq.admission.held_slot == slot:
            seq.admission.held_slot = -1
            return slot
        return self.adapters.acquire(slot)

    def _drop_held(self, seq: Sequence) -> None:
        """Release the slot `seq` kept while preempted: it ended, or a drain frees that slot (it
        waits for its adapter by name, as a new request does)."""
        self.adapters.release(seq.admission.held_slot)
        seq.admission.held_slot = -1

    def _may_take_place(self, name: str, in_step: set[int]) -> bool:
        """Whether adapter `name`, not in the step, may join it: a free place among `max_loras`
        that no starving adapter before it in line needs."""
        free = self.max_loras - len(in_step)
        if not self.starving:
            return free > 0
        line = [n for n in self.starving if self.adapters.slot_of(n) not in in_step]
        return (line.index(name) if name in line else len(line)) < free

    def adapters_in_step(self) -> set[int]:
        """The adapter slots of the running rows: at most `max_loras` distinct ones."""
        return {s.state.lora_slot for s in self.running if s.state is not None and s.state.lora_slot >= 0}

    def blocked_adapters(self) -> dict[str, float]:
        """Adapters that waiting requests wait for, each with the start of its longest wait, the
        longest first. Made from the queue itself, so a request the last step did not look at
        (the budget ran out before it) still counts, and an aborted one no longer does."""
        since: dict[str, float] = {}
        for seq in self.waiting:
            t, name = seq.admission.blocked_since, seq.admission.adapter
            if t is not None and name is not None:
                since[name] = min(t, since.get(name, t))
        return dict(sorted(since.items(), key=operator.itemgetter(1)))

    def work_left(self) -> dict[int, int]:
        """Per LoRA slot, the tokens its running sequences still have to run at most (prompt not
        yet computed plus output not yet produced): how long draining that slot may take."""
        left: dict[int, int] = {}
        for seq in self.running:
            if seq.state is not None and seq.state.lora_slot >= 0:
                n = len(seq.token_ids) - seq.num_computed + seq.params.max_tokens - seq.num_output_tokens
                left[seq.state.lora_slot] = left.get(seq.state.lora_slot, 0) + n
        return left

    def preempt_adapter(self, slot: int) -> int:
        """Preempt every running sequence that holds LoRA `slot`, so its refcount drops to zero
        now; they wait again (recomputed mostly from the prefix cache, or swapped). Only at a
        quiescent point: no token of theirs may be in flight. Returns how many were preempted."""
        holders = [s for s in self.running if s.state is not None and s.state.lora_slot == slot]
        for seq in holders:
            self._preempt(seq)
        for seq in self.waiting:
            if seq.admission.held_slot == slot:
                self._drop_held(seq)
        return len(holders)

    def _attach_state(self, seq: Sequence) -> bool:
        """Give a waiting sequence its KV state: restored from host, or with its cached prefix."""
        swapped = self._swapped.get(seq)
        if swapped is not None:
            seq.state = self.cache.swap_in(swapped)
            return seq.state is not None
        if not self.cache.can_allocate():
            return False
        seq.state = self.cache.allocate()
        cached = self._take_cached_prefix(seq)
        self.prefix_query_tokens += len(seq.token_ids)
        self.prefix_hit_tokens += cached
        return True

    def _take_cached_prefix(self, seq: Sequence) -> int:
        """Attach `seq`'s longest cached prefix; none for a prompt still to be scored (prompt
        logprobs): a cached position is never computed, so it would have no logits row."""
        assert seq.state is not None
        if pending(seq):
            return 0
        return self.cache.take_cached_prefix(seq.state, seq.token_ids, seq.admission.adapter_id)

    # --- preemption -----------------------------------------------------------------------

    def _reserve_or_preempt(self, seq: Sequence, n: int, work: list[tuple[Sequence, int]]) -> bool:
        """Make room for `seq`'s next `n` tokens, preempting what `work` has not scheduled yet."""
        assert seq.state is not None
        while not (
            self.cache.make_writable(seq.state) and self.cache.reserve(seq.state, seq.num_computed + n)
        ):
            victim = self._pick_victim({id(s) for s, _ in work}, seq)
            self._preempt(victim)
            if victim is seq:
                self._note_stall(seq)
                return False
        return True

    def _note_stall(self, seq: Sequence) -> None:
        """`seq` preempted itself for lack of K/V blocks. If it is a beam whose only running company
        is beams waiting for their siblings, nothing running will ever free a block: it would be
        admitted again and preempt itself again, every step, forever (beams preempted one by one
        and recomputed apart no longer share blocks: a 3-beam search beside one short request on
        24 blocks of 2 hung so). The engine starts its search over (`take_stalled`)."""
        if seq.group is not None and all(s.group is not None and s.num_pending == 0 for s in self.running):
            self._stalled.append(seq)

    def take_stalled(self) -> list[Sequence]:
        """The beams `_note_stall` found since the last call (for `BeamSearch.unstall`)."""
        stalled, self._stalled = self._stalled, []
        return stalled

    def _pick_victim(self, scheduled: set[int], seq: Sequence) -> Sequence:
        """The least important running sequence not yet `scheduled`, for `seq` that needs blocks;
        never a beam of `seq`'s own search: the two would preempt each other in turn, each
        recomputed apart from its siblings, and neither would ever be done (`_note_stall`)."""
        group = seq.group
        others = (s for s in self.running if id(s) not in scheduled and (s is seq or s.group is not group))
        return max(others, key=by_rank)

    def _preempt(self, seq: Sequence) -> None:
        assert seq.state is not None
        self.running.remove(seq)
        size = self.cache.swap_bytes(seq.state)
        self.proposals.pop(seq, None)
        swap = self.preemption_mode == "swap" and seq.group is None  # forked beams share blocks: recompute
        # It keeps its adapter's slot (and reference): it resumes on the weights it began with.
        seq.admission.held_slot, seq.state.lora_slot = seq.state.lora_slot, -1
        if swap and self.swap_used + size <= self.swap_budget:
            saved = self._swapped[seq] = self.cache.swap_out(seq.state)
            self.swap_used += saved.nbytes  # what `_release_swap` gives back
            seq.state = None
        else:
            self._free_state(seq)
        self._enqueue(seq)
        self.num_preemptions += 1

    def _free_state(self, seq: Sequence) -> None:
        if seq.state is not None:
            self.cache.free(seq.state)  # raises on a double free, before any refcount moves
            self.adapters.release(seq.state.lora_slot)
            seq.state = None

    def _release_swap(self, seq: Sequence) -> None:
        """Drop the host copy of a swapped sequence (it is back on the device, or gone)."""
        swapped = self._swapped.pop(seq, None)
        if swapped is not None:
            self.swap_used -= swapped.nbytes
