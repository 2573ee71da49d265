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
A step overlaps only when every row's sampling needs nothing the host learns from step N: no
penalties (they count the history), no logprobs, no beams, no speculation, no structured output
(its next mask needs the matcher advanced by step N's token); any other step reads step N's
tokens first, as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from model_service.engine.sampler import SampleRow, sample_on_device
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
    """Whether `seq`'s next token can be sampled before its previous one reaches the host."""
    p = seq.params
    return seq.group is None and not p.needs_penalties and p.logprobs is None and seq.constraint is None


def launch(seqs: list[Sequence], logits: torch.Tensor) -> InFlight:
    """Sample one token per row of `logits` (one row per sequence) on the device and start copying
    them to the host; marks each sequence as having one more token in flight."""
    rows = [SampleRow(s.params, s.generator, s.token_ids, s.num_prompt_tokens, s.in_flight) for s in seqs]
    tokens = sample_on_device(logits, rows)
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
