"""Sampling on CUDA without a probability tensor or a sort (Triton), with the torch references CI runs.

For rows that sample from softmax(logits / T) with no top-k, top-p or min-p (most sampled
traffic), the Gumbel-max trick draws the token as argmax(logits / T + G), G = -log(-log U), U
uniform: no softmax, no normalization, no probability tensor. Written in torch that is still
five or six passes over a [rows, vocab] float32 tensor (scale, softmax, noise, divide, argmax,
and the gather of the sampled rows): 0.29 ms of a 5.5 ms decode step at 64 rows of a 128k
vocabulary on the H200. The kernel reads each logit once and draws its uniform in registers
(Philox, keyed by the row's seed and the token's column), so a row's draw depends on its seed
only: a seeded request's tokens do not depend on what else shares its batch, and a request
resumed elsewhere from its first i tokens draws position i from the same seed.

Programs split the vocabulary in chunks (so that a batch of one still spreads over the SMs);
each writes its chunk's best score and column, and a small argmax over the chunks picks the
row's token. `philox_uniforms` returns the exact uniforms the kernel draws, so tests compare the
kernel with the reference token for token.

Rows with top-p, top-k or min-p take `truncated_sample`, which needs no sort either (the
rejection scheme of FlashInfer's sampling kernels, written here): draw a candidate by Gumbel-max
from the tokens still eligible, and keep it when the probability mass of the tokens strictly
more likely than it is below top_p, fewer than top_k tokens are strictly more likely, and its
probability is at least min_p times the most likely one's. Each test fails for every token at
most as likely as a candidate that fails it, so a rejection makes all of those ineligible and
the next round draws from the more likely ones only. Conditioned on acceptance, the draw is the
truncated distribution renormalized, what sorting and cutting gives (a tie at top-k's edge keeps
every tied token, as HF's warper does), in a few passes over the row instead of a sort of the
vocabulary. top-k with top-p is left to the sort: its top-p mass is that of the top k tokens, a
selection this scheme does not make. The reference is `truncated_sample_reference`, the same
rounds in torch on given uniforms.
"""

from __future__ import annotations

import torch

from model_service.kernels.paged_attention import triton

MAX_ROUNDS = 32  # each round at least halves the eligible tokens in expectation: 17 for 128k
CHUNK = 4096  # vocabulary columns a program walks: 32 programs a row for a 128k vocabulary
BLOCK = 1024
# The rejection kernel runs one program a row, whose passes over the row are latency-bound: wide
# tiles and many warps keep more loads in flight (H200, 128k vocabulary, one row, L2 flushed:
# 419 us at 1,024 x 4 warps, 172 at 4,096 x 16, 138 at 8,192 x 16; `bench/sampling.py --sweep`).
ROW_BLOCK, ROW_WARPS = 8192, 16
MARGIN = 1e-3  # below min-p's bound on scaled logits: far above the float error of log and exp

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _gumbel_max_kernel(
        Logits, Temps, Seeds, PartScore, PartCol, vocab, stride, num_chunks,
        CHUNK: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row, chunk = tl.program_id(0), tl.program_id(1)
        inv_t = 1.0 / tl.load(Temps + row)
        lo = chunk * CHUNK
        top, col = _gumbel_argmax(
            Logits + row * stride, lo, lo + CHUNK, vocab, inv_t, float("-inf"), tl.load(Seeds + row), 0, BLOCK
        )
        tl.store(PartScore + row * num_chunks + chunk, top)
        tl.store(PartCol + row * num_chunks + chunk, col)

    @triton.jit
    def _uniforms_kernel(Seeds, Out, vocab, rounds, BLOCK: tl.constexpr):
        row, block = tl.program_id(0), tl.program_id(1)
        cols = block * BLOCK + tl.arange(0, BLOCK)
        for r in range(rounds):
            u = tl.rand(tl.load(Seeds + row), r * vocab + cols)
            tl.store(Out + (row * rounds + r) * vocab + cols, u, mask=cols < vocab)

    @triton.jit
    def _truncated_kernel(
        Logits, Temps, TopP, TopK, MinP, Seeds, Out, vocab, stride,
        MAX_ROUNDS: tl.constexpr, MARGIN: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        inv_t = 1.0 / tl.load(Temps + row)
        base = Logits + row * stride
        top = tl.full([], float("-inf"), tl.float32)  # pass 0: the max, its column, the normalizer
        total = tl.zeros([], tl.float32)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_col = tl.zeros([BLOCK], tl.int32)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")) * inv_t
            new_top = tl.maximum(top, tl.max(x, 0))
            total = total * tl.exp(top - new_top) + tl.sum(tl.exp(x - new_top), 0)
            top = new_top
            best_col = tl.where(x > best, cols, best_col)
            best = tl.maximum(x, best)
        mass, top_k, min_p = tl.load(TopP + row) * total, tl.load(TopK + row), tl.load(MinP + row)
        seed = tl.load(Seeds + row)
        # Eligible: scaled logits strictly above `floor`. Min-p's bound is known now; the margin
        # keeps every token that passes its test (a token inside it is drawn, then rejected).
        floor = top + tl.log(min_p) - MARGIN
        token = tl.full([], -1, tl.int32)
        r = 0
        while (token < 0) & (r < MAX_ROUNDS):
            _, cand = _gumbel_argmax(base, 0, vocab, vocab, inv_t, floor, seed, r * vocab, BLOCK)
            cand_x = tl.load(base + cand) * inv_t
            pivot = 0.5 * (cand_x + top)  # a rejected candidate's floor may jump halfway to the top
            above = tl.zeros([], tl.float32)  # the mass and the count of tokens more likely
            count = tl.zeros([], tl.int32)
            above_pivot = tl.zeros([], tl.float32)
            count_pivot = tl.zeros([], tl.int32)
            for start in range(0, vocab, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")) * inv_t
                p = tl.exp(x - top)
                above += tl.sum(tl.where(x > cand_x, p, 0.0), 0)
                count += tl.sum((x > cand_x).to(tl.int32), 0)
                above_pivot += tl.sum(tl.where(x > pivot, p, 0.0), 0)
                count_pivot += tl.sum((x > pivot).to(tl.int32), 0)
            keep = (above < mass) & (count < top_k) & (tl.exp(cand_x - top) >= min_p)
            token = tl.where(keep, cand, -1)
            # Every test fails for all tokens at most as likely as one that fails it, so a pivot
            # that would fail moves the floor there (fewer rounds on a flat distribution).
            pivot_fails = (above_pivot >= mass) | (count_pivot >= top_k) | (tl.exp(pivot - top) < min_p)
            floor = tl.where(pivot_fails, pivot, cand_x)
            r += 1
        fallback = tl.min(tl.where(best == tl.max(best, 0), best_col, vocab), 0)  # the most likely
        tl.store(Out + row, tl.where(token >= 0, token, fallback))

    @triton.jit
    def _gumbel_argmax(base, lo, hi, vocab, inv_t, floor, seed, offset, BLOCK: tl.constexpr):
        """Gumbel-max over the columns in [lo, hi) whose scaled logit is above `floor`, with the
        uniforms of Philox stream `seed` at `offset` + column: (best score, its first column).
        U = 0 gives a score of -inf, so such a column is never drawn."""
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_col = tl.zeros([BLOCK], tl.int32)
        for start in range(lo, hi, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")) * inv_t
            gumbel = -tl.log(-tl.log(tl.rand(seed, offset + cols)))
            score = tl.where(x > floor, x + gumbel, float("-inf"))
            better = score > best
            best = tl.where(better, score, best)
            best_col = tl.where(better, cols, best_col)
        top = tl.max(best, 0)
        col = tl.min(tl.where(best == top, best_col, vocab), 0)
        return top, tl.minimum(col, vocab - 1)


def gumbel_max_reference(logits: torch.Tensor, temps: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """argmax(logits / T - log(-log U)) per row: one draw from softmax(logits / T) per row."""
    gumbel = -torch.log(-torch.log(uniforms))
    return (logits.float() * (1.0 / temps)[:, None] + gumbel).argmax(dim=-1)


def gumbel_max(logits: torch.Tensor, temps: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """One token per row of `logits` [N, vocab] (float32, CUDA), drawn at `temps` [N] from the
    Philox stream of `seeds` [N] (int64); nothing waits for the device."""
    rows, vocab = logits.shape
    num_chunks = triton.cdiv(vocab, CHUNK)
    score = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    col = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
    _gumbel_max_kernel[(rows, num_chunks)](
        logits, temps, seeds, score, col, vocab, logits.stride(0), num_chunks, CHUNK=CHUNK, BLOCK=BLOCK
    )
    return col.gather(1, score.argmax(dim=1, keepdim=True)).squeeze(1).long()


def truncated_sample_reference(
    logits: torch.Tensor,
    temps: torch.Tensor,
    truncation: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    uniforms: torch.Tensor,
) -> torch.Tensor:
    """The rounds of `truncated_sample` in torch; truncation: (top_p, top_k, min_p) per row;
    uniforms: [N, rounds, vocab] (round r's noise)."""
    rows = [
        _truncated_row(logits[i].float() * (1.0 / temps[i]), [float(c[i]) for c in truncation], uniforms[i])
        for i in range(len(logits))
    ]
    return torch.tensor(rows, device=logits.device)


def _truncated_row(x: torch.Tensor, cut: list[float], uniforms: torch.Tensor) -> int:
    """One row of the reference: x, the scaled logits; cut: (top_p, top_k, min_p)."""
    top_p, top_k, min_p = cut
    top = x.max()
    probs = torch.exp(x - top)

    def passes(value: torch.Tensor) -> bool:  # the three tests, for a token of scaled logit `value`
        more = x > value
        in_top_p = probs[more].sum() < top_p * probs.sum()
        return bool(in_top_p and more.sum() < top_k and torch.exp(value - top) >= min_p)

    floor = top + torch.log(torch.tensor(min_p)) - MARGIN
    for u in uniforms:
        cand = int(torch.where(x > floor, x - torch.log(-torch.log(u)), float("-inf")).argmax())
        if passes(x[cand]):
            return cand
        pivot = 0.5 * (x[cand] + top)
        floor = x[cand] if passes(pivot) else pivot
    return int(x.argmax())  # the fallback, as the kernel's


def truncated_sample(
    logits: torch.Tensor,
    temps: torch.Tensor,
    truncation: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    seeds: torch.Tensor,
) -> torch.Tensor:
    """One token per row from softmax(logits / T) cut by (top_p [N] float32, top_k [N] int32,
    the vocabulary for none, min_p [N] float32), no sort; one program per row. After
    MAX_ROUNDS rejections (not expected in practice) the row's most likely token."""
    top_p, top_k, min_p = truncation
    out = torch.empty(len(logits), dtype=torch.int32, device=logits.device)
    rows, vocab = logits.shape
    _truncated_kernel[(rows,)](
        logits, temps, top_p, top_k, min_p, seeds, out, vocab, logits.stride(0),
        MAX_ROUNDS=MAX_ROUNDS, MARGIN=MARGIN, BLOCK=ROW_BLOCK, num_warps=ROW_WARPS,
    )  # fmt: skip
    return out.long()


def philox_uniforms(seeds: torch.Tensor, vocab: int, rounds: int = 1) -> torch.Tensor:
    """[N, vocab] float32 (rounds = 1) or [N, rounds, vocab]: the uniforms the kernels draw for
    rows of these seeds (`gumbel_max` uses round 0; `truncated_sample` round r in its r-th round)."""
    out = torch.empty(len(seeds), rounds, vocab, dtype=torch.float32, device=seeds.device)
    _uniforms_kernel[(len(seeds), triton.cdiv(vocab, BLOCK))](seeds, out, vocab, rounds, BLOCK=BLOCK)
    return out[:, 0] if rounds == 1 else out
