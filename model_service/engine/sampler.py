"""Turns one step's logits into one token per row, for rows with different settings.

All rows are processed together as tensors; the only per-row Python work is drawing
the random noise of seeded rows from their own generator, which is what makes a seeded
request's tokens independent of whatever else shares its batch.

Sampling uses the Gumbel trick. On CUDA, rows at a temperature with no top-k, top-p or min-p
take one fused kernel that draws argmax(logits / T + Gumbel noise) in one pass over the logits
(kernels/sampling.py: sampled decode at 64 rows of the 8B shape went 11,246-11,342 -> 11,704-
11,776 tok/s, greedy's speed); rows with top-p, top-k or min-p a kernel that draws from the
truncated distribution by rejection, without sorting the vocabulary. Rows with both top-k and
top-p (and every row on the CPU) use its exponential-race form, argmax(p / E) with E ~ Exp(1),
on the truncated, renormalized probabilities.

A seeded row's noise is a function of (seed, output position): its generator (or the kernel's
Philox stream) is seeded from both before each draw. So the token at position i depends on the
seed and the history only, not on how many draws came before: a request resumed on another
server from its first i output tokens (a pod failed mid-stream) goes on exactly as it would have.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from model_service.engine.logits_processors import LogitsProcessors, add_bias, banned_mask
from model_service.engine.sampling_params import SamplingParams
from model_service.kernels.paged_attention import triton
from model_service.kernels.sampling import gumbel_max, truncated_sample
from model_service.models import step


@dataclass
class SampleRow:
    """One row's settings and history. The history is the sequence's own list, sliced only when
    a penalty needs it: copying every prompt every step costs milliseconds at large batches."""

    params: SamplingParams
    generator: torch.Generator | None
    token_ids: list[int]
    num_prompt_tokens: int
    in_flight: int = 0  # tokens already sampled on the device and not yet in `token_ids`
    processors: LogitsProcessors | None = None  # logit_bias, allowed ids, min_tokens, bad words

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass
class AllowedTokens:
    """The tokens some rows of a step may take (structured output, engine/grammar.py): row
    `rows[j]` may take token t when bit t % 32 of word t // 32 of `bits[j]` is set. `bits` is
    built on the host (pinned on CUDA) and crosses to the device in one copy."""

    rows: list[int]
    bits: torch.Tensor  # [len(rows), ceil(vocab / 32)] int32

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of `logits` with every token a row may not take at -inf; nothing here waits for
        the device (the copy and the unpacking are queued behind the step)."""
        device, vocab = logits.device, logits.shape[1]
        bits = self.bits.to(device, non_blocking=True)
        shifts = torch.arange(32, device=device, dtype=torch.int32)
        allowed = ((bits[:, :, None] >> shifts) & 1).view(len(self.rows), -1)[:, :vocab].bool()
        rows = to_device(self.rows, device)
        out = logits.clone()
        out[rows] = out[rows].masked_fill(~allowed, float("-inf"))
        return out


RowSampler = Callable[[torch.Tensor, list[SampleRow]], torch.Tensor]  # logits rows -> a token each


@dataclass
class TokenLogprobs:
    logprob: float
    top: list[tuple[int, float]]


def sample(
    logits: torch.Tensor, rows: list[SampleRow], allowed: AllowedTokens | None = None
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits: [N, vocab] float32 (not modified). Returns (token ids, logprobs or None) per row.
    Logprobs are the model's own (before processors, penalties and `allowed`), as vLLM returns them."""
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    raw_logprobs = torch.log_softmax(logits, dim=-1) if want else None
    tokens = sample_on_device(_processed(logits, rows, allowed), rows)
    out: list[TokenLogprobs | None] = [None] * len(rows)
    if raw_logprobs is None:
        return tokens.tolist(), out
    top_n = [rows[i].params.logprobs or 0 for i in want]
    chosen, top_vals, top_ids = _logprobs(raw_logprobs, tokens, want, max(top_n))
    token_list = tokens.tolist()  # the one wait for the device; the lists below are ready then
    for i, n, logprob, vals, ids in zip(
        want, top_n, chosen.tolist(), top_vals.tolist(), top_ids.tolist(), strict=True
    ):
        out[i] = TokenLogprobs(logprob, list(zip(ids[:n], vals[:n], strict=True)))
    return token_list, out


def _processed(logits: torch.Tensor, rows: list[SampleRow], allowed: AllowedTokens | None) -> torch.Tensor:
    """The logits the draw is from: the rows' biases (engine/logits_processors.py), penalties, the
    grammar's mask and the processors' bans. A row the bans would leave no token (allowed ids the
    grammar refuses, or all held back by min_tokens) has them lifted for this step: a draw from
    nothing would be an arbitrary token (an all -inf row's argmax is token 0)."""
    processors = [r.processors for r in rows]
    with_processors = any(p is not None for p in processors)
    logits = add_bias(logits, processors) if with_processors else logits
    logits = _apply_penalties(logits, rows) if any(r.params.needs_penalties for r in rows) else logits
    masked = allowed.apply(logits) if allowed is not None else logits
    if not with_processors:
        return masked
    outputs = [r.output_ids if r.processors is not None else [] for r in rows]
    banned = banned_mask(processors, outputs, logits.shape[1], logits.device)
    if banned is None:
        return masked
    out = masked.masked_fill(banned, float("-inf"))
    return torch.where(torch.isneginf(out).all(dim=-1, keepdim=True), masked, out)


def _logprobs(
    raw: torch.Tensor, tokens: torch.Tensor, want: list[int], k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For rows `want`, all at once: the sampled token's logprob, and the top k logprobs and
    their ids (a row asking for fewer takes the first of them); no wait for the device here."""
    idx = to_device(want, raw.device)
    sub = raw[idx]
    vals, ids = sub.topk(k, dim=-1)
    return sub.gather(1, tokens[idx, None])[:, 0], vals, ids


def sample_on_device(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """One token per row, left on the device: nothing here waits for the device, so the host can
    prepare the next step while this one runs (penalties, if any, are already in `logits`).
    On CUDA, rows at a temperature take the one-pass Gumbel-max kernel, rows with top-p, top-k
    or min-p the sort-free rejection kernel whatever the batch (a seeded row's draw must not
    depend on what else is in it; the kernel runs one program a row, 1.5% slower a step than
    sorting at one row, 17% faster at 64, 40% at 256 on the 8B shape with top-p); rows with
    both top-k and top-p sort."""
    fused = logits.is_cuda and triton is not None
    groups: dict[RowSampler, list[int]] = {}
    for i, r in enumerate(rows):
        if not r.params.greedy:
            groups.setdefault(_sampler_for(r.params, fused), []).append(i)
    if len(groups) == 1 and len(next(iter(groups.values()))) == len(rows):
        draw_rows = next(iter(groups))  # the whole batch in one launch: no argmax, no gather
        return draw_rows(logits, rows)
    tokens = logits.argmax(dim=-1)
    for draw_rows, group in groups.items():
        idx = to_device(group, logits.device)
        tokens[idx] = draw_rows(logits[idx], [rows[i] for i in group])
    return tokens


def sample_positions(logits: torch.Tensor, row: SampleRow) -> list[int]:
    """A token for each of `row`'s next len(logits) output positions, from logits row i for
    position i, each drawn as `sample_on_device` draws that position alone (a seeded row keyed by
    it): a speculative verify that checks point-mass proposals against these emits exactly the
    tokens the request gets without speculation, however many of its steps verified."""
    draws = [
        sample_on_device(logits[i : i + 1], [replace(row, in_flight=row.in_flight + i)])
        for i in range(len(logits))
    ]
    return torch.cat(draws).tolist()


def _sampler_for(params: SamplingParams, fused: bool) -> RowSampler:
    if not fused or (params.top_k > 0 and params.top_p < 1.0):
        return _filtered_sample
    return _truncated_sample if params.truncates else _gumbel_sample


def _gumbel_sample(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    temps = to_device([r.params.temperature for r in rows], logits.device, torch.float32)
    return gumbel_max(logits, temps, _kernel_seeds(rows, logits.device))


def _truncated_sample(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    device, vocab, params = logits.device, logits.shape[1], [r.params for r in rows]
    # One copy of three lists, each padded to 16 bytes: Triton specializes the kernel on each
    # pointer's alignment, so unpadded views would compile it anew for odd and even row counts.
    pad = [0.0] * (-len(rows) % 4)
    fields = ([p.temperature for p in params], [p.top_p for p in params], [p.min_p for p in params])
    floats = [x for values in fields for x in values + pad]
    temps, top_p, min_p = to_device(floats, device, torch.float32).view(3, -1)[:, : len(rows)]
    top_k = to_device([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device, torch.int32)
    return truncated_sample(logits, temps, (top_p, top_k, min_p), _kernel_seeds(rows, device))


def _kernel_seeds(rows: list[SampleRow], device: torch.device) -> torch.Tensor:
    """The kernels' Philox seeds: from (seed, output position) for a seeded row, from torch's
    global generator otherwise (so torch.manual_seed repeats a run); int64 holds 63 bits."""
    drawn = torch.randint(1 << 62, (len(rows),)).tolist()
    seeds = [d if r.params.seed is None else _position_seed(r) >> 1 for d, r in zip(drawn, rows, strict=True)]
    return to_device(seeds, device)


def _filtered_sample(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    probs = filtered_probs(logits, [r.params for r in rows])
    for r in rows:
        _key_by_position(r)
    return draw(probs, [r.generator for r in rows])


def to_device(
    values: list[float] | np.ndarray, device: torch.device, dtype: torch.dtype = torch.long
) -> torch.Tensor:
    """`models.step.to_device` with the sampler's default: index and seed lists (an empty one
    too) are int64."""
    return step.to_device(values, device, dtype)


def select_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """`logits`' rows `rows` (distinct, ascending): the whole tensor, uncopied, when that is all of them."""
    if len(rows) == len(logits):
        return logits
    return logits[to_device(rows, logits.device)]


def _apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Repetition penalty (HF: over the prompt and the output), then presence and frequency
    (OpenAI: over the output), for all rows at once on the (row, token) pairs of their histories:
    one pinned copy of the pairs a kind and a few gathers and scatters, nothing that waits for the
    device, where a loop over rows cost a synchronous copy and half a dozen launches a row (and
    4-6x the CPU time: 64 rows of 1,280 tokens 30 -> 7 ms). `logits` is not modified."""
    logits = logits.clone()
    device, dtype = logits.device, logits.dtype
    rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if rep:
        row, token = to_device(_history_pairs(rep, [rows[i].token_ids for i in rep]), device)
        penalty = to_device([r.params.repetition_penalty for r in rows], device, dtype)[row]
        score = logits[row, token]  # a token seen twice writes the same value twice
        logits[row, token] = torch.where(score < 0, score * penalty, score / penalty)
    additive = [i for i, r in enumerate(rows) if _additive(r)]
    if additive:
        pairs, vocab = _history_pairs(additive, [rows[i].output_ids for i in additive]), logits.shape[1]
        key, counts = np.unique(pairs[0] * vocab + pairs[1], return_counts=True)  # on the host: no sync
        row, token, count = to_device(np.stack([key // vocab, key % vocab, counts]), device)
        scales = [r.params.frequency_penalty for r in rows] + [r.params.presence_penalty for r in rows]
        frequency, presence = to_device(scales, device, dtype).view(2, len(rows))
        logits[row, token] -= frequency[row] * count.to(dtype) + presence[row]
    return logits


def _additive(row: SampleRow) -> bool:
    """Whether presence or frequency penalties change this row (they count output tokens only)."""
    p, has_output = row.params, row.num_prompt_tokens < len(row.token_ids)
    return has_output and (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0)


def _history_pairs(rows: list[int], histories: list[list[int]]) -> np.ndarray:
    """[2, tokens]: (row, token) for every token of every history, on the host."""
    lengths = np.fromiter(map(len, histories), dtype=np.int64, count=len(histories))
    pairs = np.empty((2, int(lengths.sum())), dtype=np.int64)
    pairs[0] = np.repeat(np.asarray(rows, dtype=np.int64), lengths)
    pairs[1] = np.fromiter(itertools.chain.from_iterable(histories), dtype=np.int64, count=pairs.shape[1])
    return pairs


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p (HF's order); returns renormalized probabilities.

    Only rows that ask for truncation pay for the full-vocabulary sort.
    """
    device = logits.device
    temps = to_device([p.temperature for p in params], device, logits.dtype)
    logits = logits / temps[:, None]
    truncated = [i for i, p in enumerate(params) if p.truncates]
    if not truncated:
        return logits.softmax(dim=-1)
    idx = to_device(truncated, device)
    logits[idx] = _truncate(logits[idx], [params[i] for i in truncated])
    return logits.softmax(dim=-1)


def _truncate(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Set the logits that top-k, top-p and min-p remove to -inf. Each cut keeps every token tied
    with the last one it keeps, as HF's and vLLM's top-k and the CUDA kernel's three cuts do (a
    cut by sorted rank would keep an arbitrary few of them: bfloat16 logits tie often)."""
    device = logits.device
    vocab = logits.shape[1]
    top_k = to_device([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device)
    top_p = to_device([p.top_p for p in params], device, logits.dtype)
    min_p = to_device([p.min_p for p in params], device, logits.dtype)

    sorted_logits, order = logits.sort(dim=-1, descending=True)
    remove = _cut_ties(sorted_logits, top_k)
    sorted_probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always survives): drop a
    # token when it and everything ranked below it hold at most 1 - top_p. Summing from the tail (as
    # HF does) keeps the float error off the cut, so top_p=1 drops no token of nonzero probability.
    mass_from = sorted_probs.flip(-1).cumsum(dim=-1).flip(-1)
    kept_by_top_p = (mass_from > 1.0 - top_p[:, None]).sum(dim=-1).clamp(min=1)
    remove |= _cut_ties(sorted_logits, kept_by_top_p)
    remove |= sorted_probs < min_p[:, None] * sorted_probs[:, :1]
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)


def _cut_ties(sorted_logits: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Which of each row's descending `sorted_logits` fall below its `keep[row]`-th (>= 1): the
    first `keep` and every token tied with the last of them stay."""
    return sorted_logits < sorted_logits.gather(1, (keep - 1)[:, None])


def draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of `probs` [N, vocab], row i drawn with `generators[i]` (None: the global one)."""
    return (probs / _exponential_noise(probs, generators)).argmax(dim=-1)


def position_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded row's draw at output `position` (64 bits, well mixed)."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _key_by_position(row: SampleRow) -> None:
    """Re-seed a seeded row's generator for the draw at its current output position."""
    if row.generator is not None and row.params.seed is not None:
        row.generator.manual_seed(_position_seed(row))


def _position_seed(row: SampleRow) -> int:
    assert row.params.seed is not None
    return position_seed(row.params.seed, len(row.token_ids) + row.in_flight - row.num_prompt_tokens)


def _exponential_noise(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    noise = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        rows = to_device(unseeded, probs.device)
        noise[rows] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_()
    for i, g in enumerate(generators):
        if g is not None:
            noise[i] = torch.empty(probs.shape[1], device=probs.device).exponential_(generator=g)
    return noise
