"""Multi-LoRA shrink and expand for steps whose rows come in runs of one adapter (prefill chunks),
as matrix tiles (SGMV-style, Triton).

The per-row kernels of kernels/lora.py read an adapter's A and B once per token row: right for
decode, where each row is another request, but a 2,048-token prefill chunk with one adapter
re-reads the same weights 2,048 times (from L2, ~0.5 ms a layer on the 8B shape). Here the
host cuts each run of equal slots into tiles of up to `TILE_ROWS` rows (`lora_tiles`), and one
program multiplies a tile of rows by its adapter's weights with `tl.dot`, so the weights are read
once per tile. The math and the arena layout (`AdapterTable`) are those of kernels/lora.py,
whose `lora_delta_reference` is the reference for both.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from model_service.kernels.lora import TENSOR_ALIGN, AdapterTable, num_sms, part_bounds
from model_service.kernels.paged_attention import dot_precision, triton

TILE_ROWS = 64

if triton is not None:
    import triton.language as tl

    from model_service.kernels.lora import per_part

    @triton.jit
    def _tile(Tiles, tile):
        return tl.load(Tiles + tile * 3), tl.load(Tiles + tile * 3 + 1), tl.load(Tiles + tile * 3 + 2)

    @triton.jit
    def _shrink_tiles_kernel(
        X, W, Entries, Tiles, XA, x_stride, e_stride, in_features, k_chunk,
        NUM_PARTS: tl.constexpr, MAX_RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
        VEC: tl.constexpr,
    ):  # fmt: skip
        tile, nb, ks = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        start, end, slot = _tile(Tiles, tile)
        if start < end:  # a static buffer's unused tiles are empty (piecewise graphs)
            n = nb * BLOCK_N + tl.arange(0, BLOCK_N)  # columns of xa: part * MAX_RANK + rank row
            part, row = n // MAX_RANK, slot * e_stride
            rank = per_part(Entries, row, part, 2, NUM_PARTS, 3)
            a_row = per_part(Entries, row, part, 0, NUM_PARTS, 3) + (n % MAX_RANK) * in_features
            live = ((n % MAX_RANK) < rank) & (n < NUM_PARTS * MAX_RANK)
            if tl.max(live.to(tl.int32), axis=0) > 0:  # rows of A the adapter has
                a_row = tl.multiple_of(a_row, VEC)  # VEC: in_features' alignment (arena_layout)
                m = start + tl.arange(0, BLOCK_M)
                acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                k_end = tl.minimum((ks + 1) * k_chunk, in_features)
                for k0 in range(ks * k_chunk, k_end, BLOCK_K):
                    k = k0 + tl.arange(0, BLOCK_K)
                    x_mask = m[:, None] < end
                    a_mask = live[:, None]
                    if not EVEN_K:
                        x_mask = x_mask & (k[None, :] < k_end)
                        a_mask = a_mask & (k[None, :] < k_end)
                    x = tl.load(X + m[:, None] * x_stride + k[None, :], mask=x_mask, other=0.0)
                    a = tl.load(W + a_row[:, None] + k[None, :], mask=a_mask, other=0.0)  # rows of A
                    acc = tl.dot(x, tl.trans(a), acc, input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
                xa_ptr = XA + m[:, None] * (NUM_PARTS * MAX_RANK) + n[None, :]
                mask = (m[:, None] < end) & live[None, :]
                if SPLIT_K:
                    tl.atomic_add(xa_ptr, acc, mask=mask)  # partial sums into a zeroed buffer
                else:
                    tl.store(xa_ptr, acc, mask=mask)

    @triton.jit
    def _expand_tiles_kernel(
        XA, W, Entries, Scaling, Tiles, Y, y_stride, e_stride, s_stride, out_features,
        NUM_PARTS: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr, MAX_RANK: tl.constexpr,
        RANK_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_O: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        tile, ob = tl.program_id(0), tl.program_id(1)
        start, end, slot = _tile(Tiles, tile)
        if start < end:
            m = start + tl.arange(0, BLOCK_M)
            o = ob * BLOCK_O + tl.arange(0, BLOCK_O)
            r = tl.arange(0, RANK_PAD)
            rows, cols = m < end, o < out_features
            acc = tl.zeros([BLOCK_M, BLOCK_O], tl.float32)
            hits = tl.zeros([BLOCK_O], tl.int32)  # columns some targeted part covers
            for j in tl.static_range(NUM_PARTS):  # a column block may straddle parts (q | k | v)
                lo = 0 if j == 0 else (B1 if j == 1 else B2)
                hi = B1 if j == 0 else (B2 if j == 1 else out_features)
                rank = tl.load(Entries + slot * e_stride + j * 3 + 2)  # the part's three values,
                b_off = tl.load(Entries + slot * e_stride + j * 3 + 1)  # loaded side by side
                scale = tl.load(Scaling + slot * s_stride + j)
                if (rank > 0) & (ob * BLOCK_O < hi) & (ob * BLOCK_O + BLOCK_O > lo):  # targeted, covered
                    in_part = cols & (o >= lo) & (o < hi)
                    in_rank = r[None, :] < rank
                    padded = (r[None, :] // 8) < (rank + 7) // 8  # B's zero padding: vector loads
                    xa_ptr = XA + m[:, None] * (NUM_PARTS * MAX_RANK) + j * MAX_RANK + r[None, :]
                    xa = tl.load(xa_ptr, mask=rows[:, None] & in_rank, other=0.0)
                    b_row = tl.multiple_of(b_off + (o - lo) * ((rank + 7) // 8 * 8), 8)  # aligned_up(rank)
                    b = tl.load(W + b_row[:, None] + r[None, :], mask=in_part[:, None] & padded, other=0.0)
                    acc += tl.dot(xa, tl.trans(b.to(tl.float32)), input_precision=PRECISION) * scale
                    hits += in_part.to(tl.int32)
            if tl.max(hits, axis=0) > 0:
                y_ptr = Y + m[:, None] * y_stride + o[None, :]
                mask = rows[:, None] & cols[None, :]
                y = tl.load(y_ptr, mask=mask, other=0.0)
                tl.store(y_ptr, (y.to(tl.float32) + acc).to(y.dtype), mask=mask)


def lora_tiles(host_slots: np.ndarray, tile_rows: int = TILE_ROWS) -> np.ndarray:
    """[tiles, 3] int32 (first row, end row, slot): every run of rows with the same adapter
    slot cut into tiles of at most `tile_rows` rows; base-model rows (slot -1) get none."""
    slots = np.asarray(host_slots, dtype=np.int64)
    if slots.size == 0:
        return np.zeros((0, 3), dtype=np.int32)
    run_starts = np.flatnonzero(np.diff(slots, prepend=slots[0] - 1))
    run_ends = np.append(run_starts[1:], slots.size)
    keep = slots[run_starts] >= 0
    run_starts, run_ends = run_starts[keep], run_ends[keep]
    per_run = -(-(run_ends - run_starts) // tile_rows)
    run = np.repeat(np.arange(run_starts.size), per_run)
    first = np.arange(run.size) - np.repeat(np.cumsum(per_run) - per_run, per_run)
    starts = run_starts[run] + first * tile_rows
    ends = np.minimum(starts + tile_rows, run_ends[run])
    return np.stack([starts, ends, slots[starts]], axis=1).astype(np.int32)


def lora_shrink_tiles(
    x: torch.Tensor, table: AdapterTable, tiles: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """xa [tokens, parts * max_rank] float32 for the rows `tiles` covers (others left as the
    buffer holds), like `lora_shrink`; `tiles` from `lora_tiles`, on the device. `out`: a buffer
    to write instead (zeroed where the tiles go: the programs may add partial sums into it)."""
    tokens, in_features = x.shape
    width = table.parts * table.max_rank
    # 16 columns of xa a program and 128 of the input a loop step (a sweep on an H200, 8B shape,
    # a 2,048-token chunk of one rank-16 adapter on all seven: 76 -> 64 us a layer at split 4);
    # with the expand's 128 columns below, `bench/lora_kernels.py`'s mixed step 354 -> 307 us.
    block_n = 16
    programs = tiles.shape[0] * triton.cdiv(width, block_n)
    # One tile of a few rows cannot fill the GPU: split the input dimension until there are
    # about two programs per SM (atomic partial sums into a zeroed buffer).
    split_k = max(1, min(triton.cdiv(2 * num_sms(x.device), programs), in_features // 256))
    k_chunk = triton.cdiv(triton.cdiv(in_features, split_k), 128) * 128
    alloc = torch.zeros if split_k > 1 else torch.empty
    xa = alloc(tokens, width, dtype=torch.float32, device=x.device) if out is None else out
    grid = (tiles.shape[0], triton.cdiv(width, block_n), triton.cdiv(in_features, k_chunk))
    _shrink_tiles_kernel[grid](
        x, table.weights, table.entries, tiles, xa, x.stride(0), table.entries.stride(0), in_features,
        k_chunk, NUM_PARTS=table.parts, MAX_RANK=table.max_rank, BLOCK_M=TILE_ROWS, BLOCK_N=block_n,
        BLOCK_K=128, SPLIT_K=split_k > 1, EVEN_K=in_features % 128 == 0, PRECISION=dot_precision(x.dtype),
        VEC=TENSOR_ALIGN if in_features % TENSOR_ALIGN == 0 else 1,
    )  # fmt: skip
    return xa


def lora_expand_tiles(
    xa: torch.Tensor, y: torch.Tensor, table: AdapterTable, tiles: torch.Tensor, starts: Sequence[int]
) -> None:
    """y += the LoRA delta of the rows `tiles` covers, like `lora_expand` (in place)."""
    _, out = y.shape
    max_rank = table.max_rank
    b1, b2 = part_bounds(starts, out)
    # 128 output columns a program: the sweep's chunk 135 -> 120 us a layer against 64.
    _expand_tiles_kernel[(tiles.shape[0], triton.cdiv(out, 128))](
        xa, table.weights, table.entries, table.scaling, tiles, y, y.stride(0), table.entries.stride(0),
        table.scaling.stride(0), out, NUM_PARTS=table.parts, B1=b1, B2=b2, MAX_RANK=max_rank,
        RANK_PAD=max(16, triton.next_power_of_2(max_rank)), BLOCK_M=TILE_ROWS, BLOCK_O=128,
        PRECISION=dot_precision(y.dtype),
    )  # fmt: skip
