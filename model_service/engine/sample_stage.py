"""The sample stage on the host's schedule: a step's logits rows turned into tokens at once.

Beam rows report their logits to the beam search (which advances a group once every beam of it
has), plain rows sample in one batch (a structured-output row's bitmask applied first), and
verify rows keep the proposals the target accepts (the rest leave the cache through the
scheduler). The tokens go to the request table; the rows that go on get their next proposals.
With async scheduling a step samples on the device instead (engine/overlap.py).
"""

from __future__ import annotations

import torch

from model_service.engine.batch_builder import StepItem
from model_service.engine.beams import BeamSearch
from model_service.engine.grammar import GrammarCompiler, GrammarError
from model_service.engine.request_table import RequestTable
from model_service.engine.sampler import SampleRow, sample, select_rows
from model_service.engine.scheduler import Scheduler
from model_service.engine.sequence import Sequence
from model_service.engine.speculation import Speculation

Rows = list[tuple[Sequence, int]]
Runs = list[tuple[Sequence, slice]]


def logits_rows(work: list[tuple[Sequence, int]], items: list[StepItem]) -> tuple[Rows, Runs, Runs]:
    """The step's logits rows, split for `SampleStage.run`: (sequence, its row) for each plain
    row that produces a token, (sequence, its k + 1 rows) for each verify row; a prefill chunk
    that does not end its prompt has none. Then (sequence, its rows) for each prefill chunk's
    prompt rows (engine/prompt_logprobs.py)."""
    rows: Rows = []
    verify: Runs = []
    prompt: Runs = []
    first = 0
    for (seq, _), item in zip(work, items, strict=True):
        if item.prompt_rows:
            prompt.append((seq, slice(first, first + item.prompt_rows)))
            first += item.prompt_rows
        if item.num_logits > 1:
            verify.append((seq, slice(first, first + item.num_logits)))
        elif item.num_logits:
            rows.append((seq, first))
        first += item.num_logits
    return rows, verify, prompt


def greedy_argmax(verify: list[tuple[Sequence, slice]], logits: torch.Tensor) -> list[int]:
    """Every logits row's argmax, read in one transfer for the step when a verify run is greedy
    (a read per run waits on the device once a run: ~2 ms a step at batch 64); else none."""
    if not any(seq.params.greedy for seq, _ in verify):
        return []
    return logits.argmax(dim=-1).tolist()


class SampleStage:
    def __init__(
        self,
        scheduler: Scheduler,
        table: RequestTable,
        beams: BeamSearch,
        grammars: GrammarCompiler | None,
        speculation: Speculation | None,
    ) -> None:
        self.scheduler, self.table, self.beams = scheduler, table, beams
        self.grammars, self.speculation = grammars, speculation

    def run(
        self,
        rows: list[tuple[Sequence, int]],
        verify: list[tuple[Sequence, slice]],
        logits: torch.Tensor,
    ) -> list[Sequence]:
        """Sample `rows` (sequence, logits row) and verify `verify` (sequence, its k + 1 rows);
        returns the sequences that got tokens."""
        for out in self.beams.report([(s, logits[r]) for s, r in rows if s.group is not None]):
            self.table.ended(out)  # a search that ended
        plain = [(s, r) for s, r in rows if s.group is None]
        if plain:
            self._sample([s for s, _ in plain], select_rows(logits, [r for _, r in plain]))
        argmax = greedy_argmax(verify, logits)
        for seq, run in verify:
            self._verify(seq, logits[run], argmax[run] if argmax else None)
        produced = [s for s, _ in plain] + [s for s, _ in verify]
        if self.speculation is not None:
            self.speculation.propose([s for s in produced if not s.finished])
        return produced

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        allowed = None
        if self.grammars is not None and any(s.sampling.constraint is not None for s in seqs):
            allowed = self.grammars.allowed_tokens([s.sampling.constraint for s in seqs])
        rows = [SampleRow(s.params, s.sampling.generator, s.token_ids, s.num_prompt_tokens) for s in seqs]
        for row, seq in zip(rows, seqs, strict=True):
            row.processors = seq.sampling.processors
        tokens, logprobs = sample(logits, rows, allowed)
        for seq, token, lp in zip(seqs, tokens, logprobs, strict=True):
            self.table.emit(seq, [token], lp)

    def _verify(self, seq: Sequence, logits: torch.Tensor, argmax: list[int] | None) -> None:
        """Keep the accepted proposals and the target's next token; the rest leave the cache."""
        assert self.speculation is not None
        try:
            emitted, rejected = self.speculation.verify(seq, logits, argmax)
        except GrammarError as e:  # its grammar failed under the drafts: this request ends, not the step
            self.table.finish(seq, "error", str(e))
            return
        self.scheduler.rollback(seq, rejected)
        self.table.emit(seq, emitted, None)
        if not seq.finished:
            self.scheduler.register_prefix(seq)
            self.speculation.proposer.on_verified(seq, len(emitted) - 1)
