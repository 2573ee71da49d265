"""Decides, each step, which sequences run and how many of their pending tokens.

A step has a token budget. Running sequences in decode (one pending token) go first, in
priority order; then running sequences part-way through a chunked prefill; then waiting
requests are admitted while budget, sequence slots and KV blocks last. A prompt longer
than the budget is split into chunks across steps. Decode rows and prefill chunks of the
same step go through the model in one mixed forward pass.

When a running sequence cannot get a KV block, the scheduler preempts the least important
running sequence not yet scheduled this step (highest priority value, then latest arrival):
its blocks are freed and it returns to the waiting queue to be recomputed.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from model_service.engine.config import EngineConfig
from model_service.engine.model_runner import ModelRunner
from model_service.engine.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    """`work` pairs each sequence with the number of its pending tokens that run this step."""

    work: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(self, model: ModelRunner, config: EngineConfig) -> None:
        self.model = model
        self.token_budget = config.max_num_batched_tokens
        self.max_num_seqs = config.max_num_seqs
        self.waiting: list[Sequence] = []  # sorted by Sequence.sort_key
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        bisect.insort(self.waiting, seq, key=Sequence.sort_key)

    def remove(self, seq: Sequence) -> None:
        """Take `seq` out of the queues and free its KV state (finish or abort)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free_state(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.token_budget
        self.running.sort(key=Sequence.sort_key)
        scheduled: set[int] = set()
        # Decodes first, then continuing prefills: both already hold KV blocks.
        for decoding in (True, False):
            for seq in list(self.running):
                if budget == 0:
                    break
                if seq.status is not Status.RUNNING or (seq.num_pending == 1) != decoding:
                    continue
                n = min(seq.num_pending, budget)
                if not self._reserve_or_preempt(seq, n, scheduled, batch):
                    continue
                batch.work.append((seq, n))
                scheduled.add(id(seq))
                budget -= n
        # Then admit waiting requests, most important first, while they fit.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            seq.state = seq.state or self.model.alloc_sequence()
            n = min(seq.num_pending, budget)
            if not self.model.reserve(seq.state, seq.num_computed + n):
                self._free_state(seq)
                break
            self.waiting.pop(0)
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.work.append((seq, n))
            scheduled.add(id(seq))
            budget -= n
        return batch

    def _reserve_or_preempt(self, seq: Sequence, n: int, scheduled: set[int], batch: ScheduledBatch) -> bool:
        assert seq.state is not None
        while not self.model.reserve(seq.state, seq.num_computed + n):
            victims = [s for s in self.running if id(s) not in scheduled]
            victim = max(victims, key=Sequence.sort_key)
            self._preempt(victim, batch)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        self._free_state(seq)
        self.add(seq)
        self.num_preemptions += 1
        batch.preempted.append(seq)

    def _free_state(self, seq: Sequence) -> None:
        if seq.state is not None:
            self.model.free_sequence(seq.state)
            seq.state = None
