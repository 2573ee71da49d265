"""Prompt logprobs (vLLM's `prompt_logprobs`): each prompt token after the first, its logprob
under the model given the tokens before it, and the top N alternatives.

A sequence that asks for them has a logits row for every prompt position, not only its last:
each prefill chunk brings the rows of its positions that predict a prompt token not yet scored
(`StepItem.prompt_rows`, just before its sampling row when the chunk ends the prompt), and the
LM head runs over those rows only. They are scored here in the step that computed them, before
its tokens are sampled: raw model logprobs (float32 `log_softmax`, before penalties,
temperature and grammar masks, as the sampled tokens' `logprobs` are).

Such a sequence skips the prefix cache while its prompt is unscored (`Scheduler._attach_state`):
a cached prefix is never computed, and its positions would have no rows. It still publishes its
blocks for others. Scores are kept in order from prompt token 1; a sequence preempted and
recomputed from position 0 runs rows only past the last one kept, so the rows a step brings
always start where the kept scores end.
"""

from __future__ import annotations

import torch

from model_service.engine.sampler import TokenLogprobs, to_device
from model_service.engine.sequence import Sequence

# Prompt positions scored in one step, all sequences together: each is a float32 row of the
# vocabulary, twice (logits, then log_softmax): 512 rows of a 152k vocabulary are ~0.6 GB, where
# a whole 8k-token chunk would be ~10 GB.
MAX_SCORED_ROWS = 512


def scored_chunk(seq: Sequence, n: int, rows_left: int) -> tuple[int, int]:
    """(tokens of `n` that `seq` runs this step, prompt rows they score): all of them, unless
    its prompt is being scored and the step has fewer than its rows left (`rows_left`), when
    its chunk stops at the last position those rows allow (0 tokens: it waits a step)."""
    if not pending(seq):
        return n, 0
    start = seq.num_computed
    rows = prompt_rows(seq, start, n)
    if rows <= rows_left:
        return n, rows
    first = max(start, len(seq.output.prompt_logprobs or ()))  # the first position it scores
    return first + rows_left - start, rows_left


def pending(seq: Sequence) -> bool:
    """Whether `seq` asked for prompt logprobs and has prompt tokens not yet scored."""
    scored = seq.output.prompt_logprobs
    return scored is not None and len(scored) < seq.num_prompt_tokens - 1


def prompt_rows(seq: Sequence, start: int, n: int) -> int:
    """How many of the positions [start, start + n) that a step runs for `seq` predict a prompt
    token not yet scored: the last of them (before the prompt's last position, which samples)."""
    scored = seq.output.prompt_logprobs
    if scored is None:
        return 0
    return max(0, min(start + n, seq.num_prompt_tokens - 1) - max(start, len(scored)))


def score(prompt: list[tuple[Sequence, slice]], logits: torch.Tensor) -> None:
    """Append to each (sequence, its prompt rows of `logits`) the scores of the prompt tokens
    those rows predict; one `log_softmax` and one transfer for the step."""
    if not prompt:
        return
    targets: list[int] = []
    for seq, run in prompt:
        first = len(seq.output.prompt_logprobs or ()) + 1
        targets += seq.token_ids[first : first + run.stop - run.start]
    rows = torch.cat([logits[run] for _, run in prompt]) if len(prompt) > 1 else logits[prompt[0][1]]
    raw = torch.log_softmax(rows.float(), dim=-1)
    chosen = raw.gather(1, to_device(targets, raw.device)[:, None])[:, 0].tolist()
    vals, ids = _top(raw, max(seq.params.prompt_logprobs or 0 for seq, _ in prompt))
    at = 0
    for seq, run in prompt:
        n, k = run.stop - run.start, seq.params.prompt_logprobs or 0
        scored = seq.output.prompt_logprobs
        assert scored is not None
        scored += [
            TokenLogprobs(chosen[i], list(zip(ids[i][:k], vals[i][:k], strict=True)))
            for i in range(at, at + n)
        ]
        at += n


def _top(raw: torch.Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
    """The top `k` logprobs of each row of `raw`, and their token ids (empty lists for k = 0)."""
    if not k:
        return [[] for _ in range(len(raw))], [[] for _ in range(len(raw))]
    vals, ids = raw.topk(k, dim=-1)
    return vals.tolist(), ids.tolist()
