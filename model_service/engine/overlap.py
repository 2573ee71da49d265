"""Async scheduling: a step's sampled tokens stay on the device while the host prepares the next.

Without it every step ends in a device-to-host wait for the sampled tokens, and the device then
idles while the host appends them, detokenizes, checks stop conditions, schedules and packs the
next batch: at 256 decode rows that is as long as a third of the step. With it, the engine
launches step N + 1 before it reads step N's tokens: a decode row whose last token is still on
the device gets a placeholder input id, which the executor overwrites on the device from step N's
token tensor (in stream order, so no wait; `Executor.execute`'s `fed`), and step N's tokens are
read (`InFlight.wait`) once step N + 1 is queued behind them.

The price, as in vLLM's async scheduling: a request that step N finishes by a stop token or
string has already been given a row in step N + 1, whose token is dropped; its K/V write lands
in blocks that were its own (freed only after, in stream order). One that step N finishes by
`max_tokens` gets no such row (`Sequence.num_pending` is 0 once its last token is in flight).
A step overlaps only when every row's sampling needs nothing the host learns from step N but a
grammar's state: no penalties (they count the history), no logits processors (min_tokens and bad
words read it), no logprobs, no beams, no speculation;
any other step reads step N's tokens first, as before. A structured-output row's mask needs its
matcher advanced by step N's token, so such a step's forward is queued first, step N's tokens
are read while it runs, and its sampling is queued under the masks after (`launch_masked`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from model_service.engine.batch_builder import StepItem
from model_service.engine.config import EngineConfig
from model_service.engine.grammar import GrammarCompiler
from model_service.engine.sampler import AllowedTokens, SampleRow, sample_on_device, select_rows
from model_service.engine.sequence import Sequence

# The input id of a row whose token is still on the device; the executor replaces it before the forward.
PLACEHOLDER = 0


@dataclass
class InFlight:
    """One launched step's sampled tokens: `seqs[i]`'s token is `tokens[i]`."""

    seqs: list[Sequence]
    tokens: torch.Tensor  # [n] on the device
    host: torch.Tensor  # [n] (pinned on CUDA): the same tokens once `ready` has fired
    ready: torch.cuda.Event | None
    row_of: dict[int, int] = field(default_factory=dict)  # id(seq) -> its index in `tokens`

    def wait(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()


def can_overlap(seq: Sequence) -> bool:
    """Whether `seq`'s next forward can be queued before its previous token reaches the host (a
    structured-output row's sampling then waits for that token: `Overlap.launch_masked`)."""
    p = seq.params
    return seq.group is None and not p.needs_penalties and not p.needs_processors and p.logprobs is None


def launch(seqs: list[Sequence], logits: torch.Tensor, allowed: AllowedTokens | None = None) -> InFlight:
    """Sample one token per row of `logits` (one row per sequence) on the device, each row limited
    to the tokens `allowed` lets it take, and start copying them to the host; marks each sequence
    as having one more token in flight."""
    rows = [
        SampleRow(s.params, s.sampling.generator, s.token_ids, s.num_prompt_tokens, s.in_flight) for s in seqs
    ]
    tokens = sample_on_device(logits if allowed is None else allowed.apply(logits), rows)
    if tokens.is_cuda:
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        ready: torch.cuda.Event | None = torch.cuda.Event()
        ready.record()
    else:
        host, ready = tokens, None
    for seq in seqs:
        seq.in_flight += 1
    return InFlight(seqs, tokens, host, ready, {id(s): i for i, s in enumerate(seqs)})


class Overlap:
    """The loop's async scheduling, in one owner: whether steps overlap, and the step whose tokens
    are still on the device. It plugs into three stages: the batch (`item`, and the `tokens` the
    executor feeds in), sampling (`launch`) and outputs (`drain`, which the engine calls wherever
    a step's tokens are needed)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.inflight: InFlight | None = None

    @staticmethod
    def wanted(config: EngineConfig, device: torch.device, with_speculation: bool) -> bool:
        """Whether steps may overlap: asked for, or by default on CUDA, one GPU or several (rank 0
        sends the in-flight tokens on over the device group: TP = 2 on the 8B shape went 227.9 ->
        279.3 tok/s at batch 1, 11,348 -> 15,341 at 64). On the CPU the host is the device, so
        there is nothing to overlap. Speculation needs each step's tokens on the host."""
        if config.async_scheduling == "off" or with_speculation:
            return False
        return config.async_scheduling == "on" or device.type == "cuda"

    @property
    def busy(self) -> bool:
        """Whether a step's tokens are still on the device."""
        return self.inflight is not None

    def item(self, seq: Sequence) -> StepItem:
        """`seq`'s row when its last token is still on the device: a placeholder the executor
        overwrites with that token."""
        assert self.inflight is not None and seq.state is not None
        return StepItem(seq.state, [PLACEHOLDER], 1, self.inflight.row_of[id(seq)])

    @property
    def tokens(self) -> torch.Tensor | None:
        """The in-flight step's tokens, on the device, which the executor writes into the next
        step's placeholder rows; None when nothing is in flight."""
        return self.inflight.tokens if self.inflight is not None else None

    def overlaps(self, work: list[tuple[Sequence, int]]) -> bool:
        """Whether the step's `work` samples on the device (speculation turns overlap off, so no
        verify row gets here)."""
        return self.enabled and all(can_overlap(seq) for seq, _ in work)

    def launch(
        self, work: list[tuple[Sequence, int]], rows: list[tuple[Sequence, int]], logits: torch.Tensor
    ) -> InFlight | None:
        """Sample the step's `rows` (sequence, logits row) on the device before the step
        before's tokens are read; None when its `work` does not overlap, or when a row's
        grammar mask needs those tokens first (`launch_masked` then samples after the drain)."""
        if not self.overlaps(work) or any(s.sampling.constraint is not None for s, _ in rows):
            return None
        return launch([s for s, _ in rows], select_rows(logits, [r for _, r in rows]))

    def launch_masked(
        self, rows: list[tuple[Sequence, int]], logits: torch.Tensor, grammars: GrammarCompiler | None
    ) -> None:
        """Sample `rows` on the device under their grammars' masks, computed once the step
        before's tokens advanced the matchers (after the drain). This step's forward was
        queued before that read, so the device runs it while the host fills the masks: a
        structured-output step no longer waits for its tokens and idles the device while the
        host prepares the next (issue 31; vLLM's async scheduling keeps its grammar bitmask
        out of the forward the same way). Its tokens are in flight after, as `launch`'s. The
        read may have finished every constrained row (a stop, a complete grammar): the rows
        left are then sampled with no mask."""
        assert self.inflight is None, "the step before is read before its masks are computed"
        assert grammars is not None  # a constrained row needs them
        allowed = grammars.allowed_tokens([s.sampling.constraint for s, _ in rows])
        self.inflight = launch([s for s, _ in rows], select_rows(logits, [r for _, r in rows]), allowed)

    def drain(self, then: InFlight | None = None) -> list[tuple[Sequence, int]]:
        """The in-flight step's tokens, read: (sequence, token) for each sequence not finished
        meanwhile (by a stop, an abort). `then`, the step just launched, is in flight after."""
        inflight, self.inflight = self.inflight, then
        if inflight is None:
            return []
        got = []
        for seq, token in zip(inflight.seqs, inflight.wait(), strict=True):
            seq.in_flight -= 1
            if not seq.finished:
                got.append((seq, token))
        return got
