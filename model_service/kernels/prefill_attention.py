"""Paged attention for prefill chunks and mixed steps (varlen queries), in Triton, with the torch
reference CI runs.

Each program takes one tile of BLOCK_M query rows of one sequence and one query head, and walks
that sequence's keys through its block table in tiles of BLOCK_N, from the window's start (or 0)
to the tile's last query position: tiles wholly above the causal diagonal are never loaded, and
tiles wholly below it (no sliding window) skip the mask.
Online softmax in float32 (FlashAttention's recurrence). The tile table (which sequence, which
first row) is built on the host from the step's query offsets, so the grid fits the batch.
"""

from __future__ import annotations

import numpy as np
import torch

from model_service.kernels.paged_attention import attention_probs, cache_rows, dot_precision, triton

if triton is not None:
    import triton.language as tl

    from model_service.kernels.paged_attention import join_sink, soft_capped

    @triton.jit(do_not_specialize=["bt_stride"])  # the block table's width changes every step
    def _prefill_kernel(
        Q, KC, VC, Out, BlockTable, QueryStart, SeqLens, TileSeq, TileRow,
        q_stride_t, q_stride_h, o_stride_t, o_stride_h, kc_stride_slot, kc_stride_h, bt_stride,
        scale, window, softcap, Sinks,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
        SINKS: tl.constexpr,
    ):  # fmt: skip
        """SOFTCAP: the logits soft-capped (Gemma 2); SINKS: the head's sink (gpt-oss) joins every
        row's softmax after the last key tile."""
        tile, head = tl.program_id(0), tl.program_id(1)
        seq = tl.load(TileSeq + tile)
        m0 = tl.load(TileRow + tile)
        q_start = tl.load(QueryStart + seq)
        q_len = tl.load(QueryStart + seq + 1) - q_start
        seq_len = tl.load(SeqLens + seq)
        first_pos = seq_len - q_len  # position of the sequence's first query row
        rows = m0 + tl.arange(0, BLOCK_M)
        valid_m = rows < q_len
        pos_m = first_pos + rows
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(
            Q + (q_start + rows)[:, None] * q_stride_t + head * q_stride_h + d[None, :],
            mask=valid_m[:, None],
            other=0.0,
        )
        kvh = head // GROUP
        hi = tl.minimum(seq_len, first_pos + m0 + BLOCK_M)
        lo = tl.where(window > 0, tl.maximum(first_pos + m0 - window + 1, 0), 0)
        lo = (lo // BLOCK_N) * BLOCK_N
        # Key tiles that every query row of this tile sees in full (wholly at or before its first
        # row's position, no window) skip the mask; only the tiles on the diagonal pay for it.
        unmasked = tl.where(window > 0, 0, (tl.minimum(hi, first_pos + m0 + 1) - lo) // BLOCK_N)
        mid = lo + tl.maximum(unmasked, 0) * BLOCK_N
        m_i = tl.full([BLOCK_M], -1e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        table, head_offset = BlockTable + seq * bt_stride, kvh * kc_stride_h
        for n0 in range(lo, mid, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q, KC, VC, table, kc_stride_slot, head_offset, n0, hi, pos_m, window, scale, m_i, l_i, acc,
                softcap, HEAD_DIM, BLOCK_SIZE, BLOCK_N, PRECISION, False, SOFTCAP,
            )  # fmt: skip
        for n0 in range(mid, hi, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q, KC, VC, table, kc_stride_slot, head_offset, n0, hi, pos_m, window, scale, m_i, l_i, acc,
                softcap, HEAD_DIM, BLOCK_SIZE, BLOCK_N, PRECISION, True, SOFTCAP,
            )  # fmt: skip
        if SINKS:
            m_i, l_i, acc = join_sink(m_i, l_i, acc, tl.load(Sinks + head).to(tl.float32))
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            Out + (q_start + rows)[:, None] * o_stride_t + head * o_stride_h + d[None, :],
            out.to(Out.dtype.element_ty),
            mask=valid_m[:, None],
        )

    @triton.jit
    def _attend_tile(
        q, KC, VC, table, kc_stride_slot, head_offset, n0, hi, pos_m, window, scale, m_i, l_i, acc, softcap,
        HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr, MASKED: tl.constexpr, SOFTCAP: tl.constexpr,
    ):  # fmt: skip
        """One key tile's online-softmax update; MASKED applies the causal / window mask and the
        sequence's end (unmasked tiles are whole and visible to every row); SOFTCAP soft-caps the
        logits first."""
        pos_n = n0 + tl.arange(0, BLOCK_N)
        d = tl.arange(0, HEAD_DIM)
        valid_n = pos_n < hi
        block = tl.load(table + pos_n // BLOCK_SIZE, mask=valid_n, other=0)
        kv_off = (block * BLOCK_SIZE + pos_n % BLOCK_SIZE)[:, None] * kc_stride_slot + head_offset
        k = tl.load(KC + kv_off + d[None, :], mask=valid_n[:, None], other=0.0).to(q.dtype)  # FP8 widens
        v = tl.load(VC + kv_off + d[None, :], mask=valid_n[:, None], other=0.0).to(q.dtype)
        s = soft_capped(tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale, softcap, SOFTCAP)
        if MASKED:
            allowed = valid_n[None, :] & (pos_n[None, :] <= pos_m[:, None])
            allowed &= (window <= 0) | (pos_n[None, :] > pos_m[:, None] - window)
            s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return m_new, l_i, acc


def paged_prefill_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, H, D], each sequence's rows ending at position seq_len - 1; returns [T, H, D].
    `softcap` and `sinks`: `attention_probs`'."""
    out = torch.empty_like(q)
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    starts = query_start.tolist()
    for i, n in enumerate(seq_lens.tolist()):
        a, b = starts[i], starts[i + 1]
        pos = torch.arange(n, device=q.device)
        slots = block_table[i, pos // block_size] * block_size + pos % block_size
        k = cache_rows(k_cache, slots).float().repeat_interleave(heads // kv_heads, dim=1)  # [N, H, D]
        v = cache_rows(v_cache, slots).float().repeat_interleave(heads // kv_heads, dim=1)
        q_pos = torch.arange(n - (b - a), n, device=q.device)
        allowed = pos[None, :] <= q_pos[:, None]
        if window:
            allowed &= pos[None, :] > q_pos[:, None] - window
        scores = torch.einsum("qhd,nhd->hqn", q[a:b].float(), k) * scale
        probs = attention_probs(scores, allowed[None], softcap, sinks)
        out[a:b] = torch.einsum("hqn,nhd->qhd", probs, v).to(q.dtype)
    return out


def prefill_tiles(
    query_start: np.ndarray, block_m: int = 64, first_seq: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """(sequence, first row) of every BLOCK_M-row query tile of the step's sequences from
    `first_seq` on (those before it attend elsewhere: the decode kernel)."""
    lens = np.diff(query_start)[first_seq:]
    seqs = first_seq + np.repeat(np.arange(len(lens)), -(-lens // block_m))
    first = np.concatenate([np.arange(0, n, block_m) for n in lens]) if len(lens) else lens
    return seqs, first


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    scale: float,
    window: int | None,
    tiles: tuple[torch.Tensor, torch.Tensor],
    out: torch.Tensor | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Triton kernel on CUDA (the reference elsewhere); `tiles` from `prefill_tiles`, on the
    device. Writes the tiles' rows of `out` ([T, H, D], new if None) and returns it. `softcap`
    (Gemma 2) and `sinks` [H] (gpt-oss): compile-time switches of the kernel."""
    tokens, heads, dim = q.shape
    out = torch.empty(tokens, heads, dim, dtype=q.dtype, device=q.device) if out is None else out
    if triton is None or not q.is_cuda:
        want = paged_prefill_attention_reference(
            q, k_cache, v_cache, block_table, query_start, seq_lens, block_size, scale, window, softcap, sinks
        )
        first = int(query_start[int(tiles[0].min())]) if tiles[0].numel() else tokens
        out[first:] = want[first:]  # the tiles' rows: those of their first sequence on
        return out
    return prefill_attention_triton(
        q, k_cache, v_cache, block_table, query_start, seq_lens, block_size, scale, window, tiles, out,
        softcap, sinks,
    )  # fmt: skip


def prefill_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    scale: float,
    window: int | None,
    tiles: tuple[torch.Tensor, torch.Tensor],
    out: torch.Tensor,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    block_m: int = 64,
) -> torch.Tensor:
    """`paged_prefill_attention`'s launch, wherever Triton runs (its interpreter included: the
    tests); `block_m` must be the one `tiles` were cut with."""
    heads, dim = q.shape[1:]
    tile_seq, tile_row = tiles
    _prefill_kernel[(tile_seq.shape[0], heads)](
        q, k_cache, v_cache, out, block_table, query_start, seq_lens, tile_seq, tile_row,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        block_table.stride(0), scale, window or 0, softcap or 0.0, sinks if sinks is not None else q,
        GROUP=heads // k_cache.shape[1], HEAD_DIM=dim, BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=64,
        PRECISION=dot_precision(q.dtype), SOFTCAP=softcap is not None, SINKS=sinks is not None, num_stages=2,
    )  # fmt: skip
    return out
