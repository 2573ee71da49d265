"""MLA decode attention over the paged latent cache, in Triton, with the torch reference CI runs.

A decode row of a multi-head latent attention layer (models/deepseek.py) arrives with its
weights absorbed: per head, a query [latent + rope] in the cache rows' own space. Every head of
a sequence attends over the same cached rows (one shared "KV head": the latent is both the key's
first `latent` dims and the value), so one program takes a block of heads of one sequence and
reads each tile of rows once for all of them: scores are two dots (latent part, rope part) and
the output is the probabilities times the latent part. Split-KV as `paged_attention.py`'s decode
kernel: program (sequence, head block, split) walks its share of the context and writes a
partial output and log-sum-exp, merged by that module's merge kernel; one split writes the output
directly. Widths are padded to powers of two with masks (a 64-wide rope part needs none).
"""

from __future__ import annotations

import torch

from model_service.kernels.paged_attention import cache_rows, dot_precision, triton
from model_service.kernels.pdl import pdl_args

if triton is not None:
    import triton.language as tl

    from model_service.kernels.paged_attention import _merge_splits_kernel


def mla_decode_attention_reference(
    q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
    scale: float, latent: int,
) -> torch.Tensor:  # fmt: skip
    """q: [S, H, latent + rope] (one absorbed query per head, at position seq_len - 1); cache:
    [slots, 1, latent + rope]. Returns [S, H, latent] in q's dtype, computed in float32; a
    sequence of length 0 (padding) gets zeros."""
    out = q.new_zeros(*q.shape[:2], latent)
    for i, n in enumerate(seq_lens.tolist()):
        if n == 0:
            continue
        pos = torch.arange(n, device=q.device)
        rows = cache_rows(cache, block_table[i, pos // block_size] * block_size + pos % block_size)[
            :, 0
        ].float()
        scores = torch.einsum("hd,nd->hn", q[i].float(), rows) * scale
        out[i] = (scores.softmax(-1) @ rows[:, :latent]).to(q.dtype)
    return out


if triton is not None:

    @triton.jit(do_not_specialize=["bt_stride", "num_heads"])
    def _mla_decode_split_kernel(
        Q, Cache, BlockTable, SeqLens, PartOut, PartLse, Out,
        q_stride_s, q_stride_h, c_stride_slot, bt_stride, po_stride_s, po_stride_h, po_stride_split,
        pl_stride_s, pl_stride_h, num_heads, scale,
        LATENT: tl.constexpr, ROPE: tl.constexpr, ROPE_PAD: tl.constexpr, HEAD_BLOCK: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        seq, head_block, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        seq_len = tl.load(SeqLens + seq)
        per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = split * per_split
        end = tl.minimum(start + per_split, seq_len)
        h = head_block * HEAD_BLOCK + tl.arange(0, HEAD_BLOCK)
        hm = h < num_heads
        dl = tl.arange(0, LATENT)
        dr = tl.arange(0, ROPE_PAD)
        rm = dr < ROPE
        q_rows = seq * q_stride_s + h * q_stride_h
        q_lat = tl.load(Q + q_rows[:, None] + dl[None, :], mask=hm[:, None], other=0.0)
        q_rope = tl.load(
            Q + q_rows[:, None] + LATENT + dr[None, :], mask=hm[:, None] & rm[None, :], other=0.0
        )
        m = tl.full([HEAD_BLOCK], float("-inf"), tl.float32)
        denom = tl.zeros([HEAD_BLOCK], tl.float32)
        acc = tl.zeros([HEAD_BLOCK, LATENT], tl.float32)
        for tile in range(start, end, BLOCK_N):
            pos = tile + tl.arange(0, BLOCK_N)
            valid = pos < end
            block = tl.load(BlockTable + seq * bt_stride + pos // BLOCK_SIZE, mask=valid, other=0)
            row = (block * BLOCK_SIZE + pos % BLOCK_SIZE) * c_stride_slot
            c = tl.load(Cache + row[:, None] + dl[None, :], mask=valid[:, None], other=0.0).to(q_lat.dtype)
            kr = tl.load(
                Cache + row[:, None] + LATENT + dr[None, :], mask=valid[:, None] & rm[None, :], other=0.0
            ).to(q_lat.dtype)
            s = tl.dot(q_lat, tl.trans(c), input_precision=PRECISION)
            s += tl.dot(q_rope, tl.trans(kr), input_precision=PRECISION)
            s = tl.where(valid[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            denom = denom * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=PRECISION)
            m = m_new
        lse = tl.where(denom > 0, m + tl.log(denom), float("-inf"))
        out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
        if NUM_SPLITS == 1:  # nothing to merge: the output itself, [S, H, LATENT] contiguous
            out_off = (seq * num_heads + h[:, None]) * LATENT + dl[None, :]
            tl.store(Out + out_off, out.to(Out.dtype.element_ty), mask=hm[:, None])
            return
        part = PartOut + seq * po_stride_s + h[:, None] * po_stride_h + split * po_stride_split + dl[None, :]
        tl.store(part, out, mask=hm[:, None])
        tl.store(PartLse + seq * pl_stride_s + h * pl_stride_h + split, lse, mask=hm)


def mla_kernel_applies(device: torch.device, latent: int) -> bool:
    """The kernel runs on CUDA for a power-of-two latent of at least 16 (DeepSeek's 512)."""
    return triton is not None and device.type == "cuda" and latent >= 16 and latent & (latent - 1) == 0


def mla_decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    scale: float,
    latent: int,
    num_splits: int = 1,
) -> torch.Tensor:
    """The Triton kernel where `mla_kernel_applies` (the reference elsewhere); the reference's
    contract. q must be contiguous."""
    if not mla_kernel_applies(q.device, latent):
        return mla_decode_attention_reference(q, cache, block_table, seq_lens, block_size, scale, latent)
    num_seqs, heads, width = q.shape
    rope = width - latent
    out = torch.empty(num_seqs, heads, latent, dtype=q.dtype, device=q.device)
    part_out = torch.empty(num_seqs, heads, num_splits, latent, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(num_seqs, heads, num_splits, dtype=torch.float32, device=q.device)
    head_block = 16
    _mla_decode_split_kernel[(num_seqs, triton.cdiv(heads, head_block), num_splits)](
        q, cache, block_table, seq_lens, part_out, part_lse, out,
        q.stride(0), q.stride(1), cache.stride(0), block_table.stride(0), part_out.stride(0),
        part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1), heads, scale,
        LATENT=latent, ROPE=rope, ROPE_PAD=max(16, triton.next_power_of_2(rope)), HEAD_BLOCK=head_block,
        BLOCK_SIZE=block_size, BLOCK_N=32 if latent >= 256 else 64, NUM_SPLITS=num_splits,
        PRECISION=dot_precision(q.dtype),
    )  # fmt: skip
    if num_splits > 1:
        _merge_splits_kernel[(num_seqs * heads,)](
            part_out, part_lse, out, num_splits, HEAD_DIM=latent, SPLITS=triton.next_power_of_2(num_splits),
            **pdl_args(q.device),
        )  # fmt: skip
    return out
