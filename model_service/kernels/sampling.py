"""Sampling at a temperature in one pass over the logits (Triton), with the torch reference CI runs.

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
"""

from __future__ import annotations

import torch

from model_service.kernels.paged_attention import triton

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
    def _uniforms_kernel(Seeds, Out, vocab, BLOCK: tl.constexpr):
        row, block = tl.program_id(0), tl.program_id(1)
        cols = block * BLOCK + tl.arange(0, BLOCK)
        u = tl.rand(tl.load(Seeds + row), cols)
        tl.store(Out + row * vocab + cols, u, mask=cols < vocab)


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


def philox_uniforms(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, vocab] float32: the uniforms `gumbel_max` draws for rows of these seeds."""
    out = torch.empty(len(seeds), vocab, dtype=torch.float32, device=seeds.device)
    _uniforms_kernel[(len(seeds), triton.cdiv(vocab, BLOCK))](seeds, out, vocab, BLOCK=BLOCK)
    return out
