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

Top-p (nucleus) rows take `top_p_sample`, which needs no sort either (the rejection scheme of
FlashInfer's sampling kernels, written here): draw a candidate by Gumbel-max from the tokens
still eligible; it is in the nucleus when the probability mass of the tokens strictly more
likely than it is below top_p; if not, every token at most as likely is out too, so the next
round draws from the more likely ones only. Conditioned on acceptance, the draw is the nucleus
distribution renormalized, exactly what sorting and cutting gives (ties aside), in a few passes
over the row instead of a sort of the vocabulary. The reference is `top_p_sample_reference`, the
same rounds in torch on given uniforms.
"""

from __future__ import annotations

import torch

from model_service.kernels.paged_attention import triton

MAX_ROUNDS = 32  # each round at least halves the eligible tokens in expectation: 17 for 128k
CHUNK = 8192  # vocabulary columns a program walks: 16 programs a row for a 128k vocabulary
BLOCK = 1024

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _gumbel_max_kernel(
        Logits, Temps, Seeds, PartScore, PartCol, vocab, stride, num_chunks,
        CHUNK: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row, chunk = tl.program_id(0), tl.program_id(1)
        inv_t = 1.0 / tl.load(Temps + row)
        seed = tl.load(Seeds + row)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_col = tl.zeros([BLOCK], tl.int32)
        for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            keep = cols < vocab
            x = tl.load(Logits + row * stride + cols, mask=keep, other=float("-inf"))
            gumbel = -tl.log(-tl.log(tl.rand(seed, cols)))  # U = 0 gives -inf: never drawn
            score = tl.where(keep, x * inv_t + gumbel, float("-inf"))
            better = score > best
            best = tl.where(better, score, best)
            best_col = tl.where(better, cols, best_col)
        top = tl.max(best, 0)
        col = tl.min(tl.where(best == top, best_col, vocab), 0)  # the first column among equals
        tl.store(PartScore + row * num_chunks + chunk, top)
        tl.store(PartCol + row * num_chunks + chunk, tl.minimum(col, vocab - 1))

    @triton.jit
    def _uniforms_kernel(Seeds, Out, vocab, rounds, BLOCK: tl.constexpr):
        row, block = tl.program_id(0), tl.program_id(1)
        cols = block * BLOCK + tl.arange(0, BLOCK)
        for r in range(rounds):
            u = tl.rand(tl.load(Seeds + row), r * vocab + cols)
            tl.store(Out + (row * rounds + r) * vocab + cols, u, mask=cols < vocab)

    @triton.jit
    def _top_p_kernel(
        Logits, Temps, TopP, Seeds, Out, vocab, stride, MAX_ROUNDS: tl.constexpr, BLOCK: tl.constexpr
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
        mass = tl.load(TopP + row) * total
        floor = tl.full([], float("-inf"), tl.float32)  # eligible: scaled logits strictly above it
        token = tl.full([], -1, tl.int32)
        r = 0
        while (token < 0) & (r < MAX_ROUNDS):
            cand, cand_x = _draw_above(base, vocab, inv_t, floor, tl.load(Seeds + row), r * vocab, BLOCK)
            above = tl.zeros([], tl.float32)
            for start in range(0, vocab, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")) * inv_t
                above += tl.sum(tl.where(x > cand_x, tl.exp(x - top), 0.0), 0)
            token = tl.where(above < mass, cand, -1)
            floor = cand_x
            r += 1
        fallback = tl.min(tl.where(best == tl.max(best, 0), best_col, vocab), 0)  # the most likely
        tl.store(Out + row, tl.where(token >= 0, token, fallback))

    @triton.jit
    def _draw_above(base, vocab, inv_t, floor, seed, offset, BLOCK: tl.constexpr):
        """Gumbel-max over the tokens whose scaled logit is above `floor`: (column, scaled logit)."""
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_col = tl.zeros([BLOCK], tl.int32)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")) * inv_t
            gumbel = -tl.log(-tl.log(tl.rand(seed, offset + cols)))
            score = tl.where(x > floor, x + gumbel, float("-inf"))
            better = score > best
            best = tl.where(better, score, best)
            best_col = tl.where(better, cols, best_col)
        cand = tl.min(tl.where(best == tl.max(best, 0), best_col, vocab), 0)
        cand = tl.minimum(cand, vocab - 1)
        return cand, tl.load(base + cand) * inv_t


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


def top_p_sample_reference(
    logits: torch.Tensor, temps: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor
) -> torch.Tensor:
    """The rounds of `top_p_sample` in torch; uniforms: [N, rounds, vocab] (round r's noise)."""
    tokens = []
    for i in range(len(logits)):
        x = logits[i].float() * (1.0 / temps[i])
        probs = torch.exp(x - x.max())
        floor, token = float("-inf"), int(x.argmax())  # the fallback, as the kernel's
        for u in uniforms[i]:
            cand = int(torch.where(x > floor, x - torch.log(-torch.log(u)), float("-inf")).argmax())
            if probs[x > x[cand]].sum() < top_p[i] * probs.sum():
                token = cand
                break
            floor = float(x[cand])
        tokens.append(token)
    return torch.tensor(tokens, device=logits.device)


def top_p_sample(
    logits: torch.Tensor, temps: torch.Tensor, top_p: torch.Tensor, seeds: torch.Tensor
) -> torch.Tensor:
    """One token per row from the top-p nucleus of softmax(logits / T), no sort; one program per
    row. After MAX_ROUNDS rejections (not expected in practice) the row's most likely token."""
    out = torch.empty(len(logits), dtype=torch.int32, device=logits.device)
    rows, vocab = logits.shape
    _top_p_kernel[(rows,)](
        logits, temps, top_p, seeds, out, vocab, logits.stride(0), MAX_ROUNDS=MAX_ROUNDS, BLOCK=BLOCK
    )
    return out.long()


def philox_uniforms(seeds: torch.Tensor, vocab: int, rounds: int = 1) -> torch.Tensor:
    """[N, vocab] float32 (rounds = 1) or [N, rounds, vocab]: the uniforms the kernels draw for
    rows of these seeds (`gumbel_max` uses round 0; `top_p_sample` round r in its r-th round)."""
    out = torch.empty(len(seeds), rounds, vocab, dtype=torch.float32, device=seeds.device)
    _uniforms_kernel[(len(seeds), triton.cdiv(vocab, BLOCK))](seeds, out, vocab, rounds, BLOCK=BLOCK)
    return out[:, 0] if rounds == 1 else out
