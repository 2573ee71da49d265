"""Multi-LoRA shrink and expand for one fused projection, over the adapter arena (Triton), with
the torch reference CI runs.

Each token row picks its adapter by `slots[t]` (-1: the base model, skipped). An adapter's
weights lie in one flat arena at their own rank and only for the parts it targets
(`AdapterTable`): `entries[slot, part]` gives A's and B's offsets and the rank, 0 for a part it
does not target. Shrink computes `xa[t] = A @ x[t]` for every part of the projection at once
(`xa` is [tokens, parts * max_rank]: each part's first `rank` columns are written, the rest are
never read); expand adds `scaling[slot, part] * B @ xa` into each part's output columns. One
launch each, for every row of every adapter, so a decode step with 64 different adapters is 2
launches per projection instead of 64 x (gather + 2 matmuls + scatter), and both fit in a CUDA
graph: they read only device tensors at fixed addresses. A program reads exactly its adapter's
rank and skips parts its adapter does not target, so a rank-8 q/v adapter costs the o, gate_up
and down projections one table read a row, not a padded rank-64 product (issue 30's padding).
Shrink needs only the projection's input, so the layer runs it beside the base GEMM
(lora/layers.py).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model_service.kernels.paged_attention import triton

# Where each A and B starts in the arena, and B's row stride, are multiples of this many elements
# (16 bytes of bf16), and B's padding columns hold zeros: the kernels then load whole vectors from
# offsets they read from a table, which the compiler cannot prove aligned on its own.
TENSOR_ALIGN = 8

# Output columns a per-row expand program takes: 256 measured best of 128-1,024 at 2-8 warps
# (8B shape, 64 decode rows of rank-16 adapters on all seven projections: 81 -> 74 us of LoRA a
# layer; the rotation benchmark's r16-all +4%). Smaller programs were latency-bound.
ROW_BLOCK_O = 256


def aligned_up(elements: int) -> int:
    return -(-elements // TENSOR_ALIGN) * TENSOR_ALIGN


@dataclass(frozen=True)
class AdapterTable:
    """One fused projection's view of the adapter arena.

    `weights`: the arena, 1-D in the model's dtype, shared by every projection of the model.
    `entries[slot, part]`: (A's offset, B's offset, rank) in elements of `weights`, offsets
    multiples of `TENSOR_ALIGN`; A is [rank, in_features] row-major, B [part's out_features,
    rank] with rows `aligned_up(rank)` apart, zeros in the padding (`lora.adapter.arena_layout`,
    which the host copy shares, so a load is one transfer). `scaling[slot, part]`: float32. Both tables
    are views of the model-wide tables (their row stride is not `parts`). `max_rank`: each
    part's width in `xa`."""

    weights: torch.Tensor
    entries: torch.Tensor  # [slots, parts, 3] int64
    scaling: torch.Tensor  # [slots, parts] float32
    max_rank: int

    @property
    def parts(self) -> int:
        return self.entries.shape[1]

    def part_weights(
        self, slot: int, part: int, in_features: int, out_features: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(A, B) of `slot`'s adapter for `part` as views of the arena, or None when untargeted
        (reads the table: for references and tests, not for the engine's steps)."""
        return arena_views(self.weights, self.entries[slot, part].tolist(), in_features, out_features)


def arena_views(
    weights: torch.Tensor, entry: Sequence[int], in_features: int, out_features: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(A, B) that a table entry (A's offset, B's offset, rank) points at, or None for rank 0."""
    a_off, b_off, rank = (int(v) for v in entry)
    if rank == 0:
        return None
    stride = aligned_up(rank)
    return (
        weights[a_off : a_off + rank * in_features].view(rank, in_features),
        weights[b_off : b_off + out_features * stride].view(out_features, stride)[:, :rank],
    )


if triton is not None:
    import triton.language as tl

    from model_service.kernels.arrivals import last_to_arrive

    @triton.jit
    def per_part(Table, row, part, field: tl.constexpr, NUM_PARTS: tl.constexpr, STRIDE: tl.constexpr):
        """Each element's value of its part's `field` in one adapter's table row (`row`: where
        the row starts; `STRIDE`: values per part): one scalar load per part, all issued at
        once, and a select, so nothing waits on a gather of per-element addresses (a chain of
        dependent loads made the per-row kernels latency-bound)."""
        value = tl.load(Table + row + field) + tl.zeros_like(part)
        for p in tl.static_range(1, NUM_PARTS):
            value = tl.where(part == p, tl.load(Table + row + p * STRIDE + field), value)
        return value

    @triton.jit
    def _shrink_kernel(
        X, W, Entries, Slots, XA, Parts, Arrivals, x_stride, e_stride, in_features, k_chunk,
        NUM_PARTS: tl.constexpr, MAX_RANK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr, VEC: tl.constexpr,
    ):  # fmt: skip
        t, rb, ks = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        slot = tl.load(Slots + t)
        if slot >= 0:
            r = rb * BLOCK_R + tl.arange(0, BLOCK_R)  # columns of xa: part * MAX_RANK + rank row
            part, row = r // MAX_RANK, slot * e_stride
            rank = per_part(Entries, row, part, 2, NUM_PARTS, 3)
            a_row = per_part(Entries, row, part, 0, NUM_PARTS, 3) + (r % MAX_RANK) * in_features
            live = ((r % MAX_RANK) < rank) & (r < NUM_PARTS * MAX_RANK)
            if tl.max(live.to(tl.int32), axis=0) > 0:  # a block of rows the adapter has
                a_row = tl.multiple_of(a_row, VEC)  # VEC: in_features' alignment (arena_layout)
                acc = tl.zeros([BLOCK_R], tl.float32)
                k_end = tl.minimum((ks + 1) * k_chunk, in_features)
                for k0 in range(ks * k_chunk, k_end, BLOCK_K):
                    k = k0 + tl.arange(0, BLOCK_K)
                    x = tl.load(X + t * x_stride + k, mask=k < k_end, other=0.0).to(tl.float32)
                    mask = live[:, None] & (k[None, :] < k_end)
                    a = tl.load(W + a_row[:, None] + k[None, :], mask=mask, other=0.0)
                    acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
                xa = XA + t * NUM_PARTS * MAX_RANK + r
                if SPLIT_K == 1:
                    tl.store(xa, acc, mask=live)
                else:
                    _sum_slices(xa, acc, Parts, Arrivals, t, rb, r, live, NUM_PARTS * MAX_RANK, SPLIT_K)

    @triton.jit
    def _sum_slices(XA, acc, Parts, Arrivals, t, rb, r, live, width, SPLIT_K: tl.constexpr):
        """The K slices' partial sums of one block of xa: each slice stores its own; the last to
        arrive (a counter per block) adds them in slice order and resets the counter for the next
        call (kernels/arrivals.py). No zeroed buffer, so no memset launch before the shrink,
        and the sum is deterministic, which atomic adds into xa were not."""
        rows = tl.num_programs(0)
        ks = tl.program_id(2)
        tl.store(Parts + (ks * rows + t) * width + r, acc, mask=live)
        counter = Arrivals + t * tl.num_programs(1) + rb
        if last_to_arrive(counter, SPLIT_K):
            total = tl.zeros_like(acc)
            for s in range(SPLIT_K):  # in slice order, whichever arrived last: deterministic
                part = Parts + (s * rows + t) * width + r
                total += tl.load(part, mask=live, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(counter, 0)
            tl.store(XA, total, mask=live)

    @triton.jit
    def _row_delta(
        XA, W, Entries, Scaling, xa_row, slot, e_stride, s_stride, part, o_in_part, valid,
        NUM_PARTS: tl.constexpr, MAX_RANK: tl.constexpr,
    ):  # fmt: skip
        """Each output column's delta for one row: its part's B row (at the adapter's own rank,
        rows `aligned_up(rank)` apart) times the row's xa, scaled; 0 where the part is not
        targeted. Also the block's largest rank: 0 when no column of it is targeted."""
        rank = tl.where(valid, per_part(Entries, slot * e_stride, part, 2, NUM_PARTS, 3), 0)
        b_row = per_part(Entries, slot * e_stride, part, 1, NUM_PARTS, 3) + o_in_part * ((rank + 7) // 8 * 8)
        scale = per_part(Scaling, slot * s_stride, part, 0, NUM_PARTS, 1)
        r = tl.arange(0, MAX_RANK)
        live = valid[:, None] & (r[None, :] < rank[:, None])
        xa = tl.load(XA + xa_row + part[:, None] * MAX_RANK + r[None, :], mask=live, other=0.0)
        # B's padding columns (rank up to aligned_up(rank)) hold zeros: masking whole 8-element
        # groups keeps its loads vectorized, where an exact-rank mask made them scalar.
        padded = valid[:, None] & ((r[None, :] // 8) < ((rank[:, None] + 7) // 8))
        b = tl.load(W + tl.multiple_of(b_row, 8)[:, None] + r[None, :], mask=padded, other=0.0)
        return tl.sum(xa * b.to(tl.float32), axis=1) * scale, tl.max(rank, axis=0)

    @triton.jit
    def _expand_kernel(
        XA, W, Entries, Scaling, Slots, Y, y_stride, e_stride, s_stride, out_features,
        NUM_PARTS: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr, MAX_RANK: tl.constexpr,
        BLOCK_O: tl.constexpr,
    ):  # fmt: skip
        t, ob = tl.program_id(0), tl.program_id(1)
        slot = tl.load(Slots + t)
        if slot >= 0:
            o = ob * BLOCK_O + tl.arange(0, BLOCK_O)
            valid = o < out_features
            y_ptr = Y + t * y_stride + o
            part = (o >= B1).to(tl.int32) + (o >= B2).to(tl.int32)  # B1, B2: parts 1 and 2 start
            lo = tl.where(part == 0, 0, tl.where(part == 1, B1, B2))
            delta, top = _row_delta(
                XA, W, Entries, Scaling, t * NUM_PARTS * MAX_RANK, slot, e_stride, s_stride, part, o - lo,
                valid, NUM_PARTS, MAX_RANK,
            )  # fmt: skip
            if top > 0:  # some column of this block is targeted: read and write y
                y = tl.load(y_ptr, mask=valid, other=0.0)
                tl.store(y_ptr, (y.to(tl.float32) + delta).to(y.dtype), mask=valid)

    @triton.jit
    def _silu_mul_rows_kernel(
        Y, XA, W, Entries, Scaling, Slots, Out, y_stride, xa_stride, e_stride, s_stride, inter,
        MAX_RANK: tl.constexpr, BLOCK_O: tl.constexpr,
    ):  # fmt: skip
        t, ob = tl.program_id(0), tl.program_id(1)
        o = ob * BLOCK_O + tl.arange(0, BLOCK_O)
        valid = o < inter
        gate = tl.load(Y + t * y_stride + o, mask=valid, other=0.0)
        up = tl.load(Y + t * y_stride + inter + o, mask=valid, other=0.0)
        slot = tl.load(Slots + t)
        if slot >= 0:  # the expand's arithmetic (`_expand_kernel`) for part 0 (gate) and 1 (up)
            zero, xa_row = tl.zeros([BLOCK_O], tl.int32), t * xa_stride
            delta, _ = _row_delta(
                XA, W, Entries, Scaling, xa_row, slot, e_stride, s_stride, zero, o, valid, 2, MAX_RANK
            )  # fmt: skip
            gate = (gate.to(tl.float32) + delta).to(gate.dtype)
            delta, _ = _row_delta(
                XA, W, Entries, Scaling, xa_row, slot, e_stride, s_stride, zero + 1, o, valid, 2, MAX_RANK
            )  # fmt: skip
            up = (up.to(tl.float32) + delta).to(up.dtype)
        g = gate.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(up.dtype)  # as kernels/fused.py's SiLU-mul rounds it
        tl.store(Out + t * inter + o, act * up, mask=valid)


@functools.cache
def num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def lora_delta_reference(
    x: torch.Tensor, y: torch.Tensor, table: AdapterTable, slots: torch.Tensor, output_sizes: tuple[int, ...]
) -> None:
    """y[t] += LoRA delta of slot `slots[t]` (in place; rows with slot -1 untouched), in float32."""
    for slot in torch.unique(slots[slots >= 0]).tolist():
        rows = torch.nonzero(slots == slot).flatten()
        lo = 0
        for part, size in enumerate(output_sizes):
            weights = table.part_weights(slot, part, x.shape[1], size)
            if weights is not None:
                a, b = (w.float() for w in weights)
                delta = (x[rows].float() @ a.T) @ b.T * table.scaling[slot, part].float()
                y[rows, lo : lo + size] += delta.to(y.dtype)
            lo += size


def few_rows_split(in_features: int) -> int:
    """How many parts a per-row shrink splits its input dimension into when it has few rows."""
    return max(1, min(16, in_features // 512))


def lora_shrink(
    x: torch.Tensor,
    table: AdapterTable,
    slots: torch.Tensor,
    arrivals: torch.Tensor,
    out: torch.Tensor | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """xa [tokens, parts * max_rank] in float32: every row's input times its adapter's A (Triton,
    CUDA only); columns beyond a part's rank, and rows of slot -1, are left as the buffer holds.
    `arrivals`: int32 zeros (`shrink_arrivals`), owned by the caller and left zeroed by every
    call. `out`: rows of a larger buffer to write (a mixed step's decode rows, beside the tile
    kernels' rows). `split_k`: the split for a caller that knows its live rows better."""
    tokens, in_features = x.shape
    width = table.parts * table.max_rank
    blocks = triton.cdiv(width, 16)
    # A decode step of few rows splits the input dimension so it still starts ~1,000+ programs;
    # with rows enough to fill the SMs twice over, each program sums its whole row.
    if split_k is None:
        split_k = 1 if tokens * blocks >= 2 * num_sms(x.device) else few_rows_split(in_features)
    if tokens * blocks > arrivals.numel():
        split_k = 1  # more blocks than counters: never the case at the rows that split
    k_chunk = triton.cdiv(triton.cdiv(in_features, split_k), 128) * 128
    slices = triton.cdiv(in_features, k_chunk)  # rounding the chunk up may leave fewer than asked
    xa = torch.empty(tokens, width, dtype=torch.float32, device=x.device) if out is None else out
    parts = torch.empty(slices if slices > 1 else 0, tokens, width, dtype=torch.float32, device=x.device)
    _shrink_kernel[(tokens, blocks, slices)](
        x, table.weights, table.entries, slots, xa, parts, arrivals, x.stride(0), table.entries.stride(0),
        in_features, k_chunk, NUM_PARTS=table.parts, MAX_RANK=table.max_rank, BLOCK_R=16, BLOCK_K=128,
        SPLIT_K=slices, VEC=TENSOR_ALIGN if in_features % TENSOR_ALIGN == 0 else 1,
    )  # fmt: skip
    return xa


def shrink_arrivals(device: torch.device, max_rows: int = 1024) -> torch.Tensor:
    """The split shrink's arrival counters: one per (row, 16 columns of xa) for up to `max_rows`
    rows of the widest projection (3 parts of rank 64); zeros, as every call leaves them."""
    return torch.zeros(max_rows * 12, dtype=torch.int32, device=device)


def part_bounds(starts: Sequence[int], out_features: int) -> tuple[int, int]:
    """Where parts 1 and 2 of a projection begin (`out_features` for a part it does not have):
    compile-time constants of the expand kernels, which then find a column's part without loads."""
    padded = [*starts[1:], out_features, out_features]
    return padded[0], padded[1]


def lora_expand(
    xa: torch.Tensor, y: torch.Tensor, table: AdapterTable, slots: torch.Tensor, starts: Sequence[int]
) -> None:
    """y[t] += scaling[slot, part] * B @ xa[t] for every part (Triton, CUDA only, in place);
    `starts`: each part's first output column."""
    tokens, out = y.shape
    b1, b2 = part_bounds(starts, out)
    _expand_kernel[(tokens, triton.cdiv(out, ROW_BLOCK_O))](
        xa, table.weights, table.entries, table.scaling, slots, y, y.stride(0), table.entries.stride(0),
        table.scaling.stride(0), out, NUM_PARTS=table.parts, B1=b1, B2=b2, MAX_RANK=table.max_rank,
        BLOCK_O=ROW_BLOCK_O,
    )  # fmt: skip


def silu_mul_lora_rows(
    y: torch.Tensor, xa: torch.Tensor, table: AdapterTable, slots: torch.Tensor
) -> torch.Tensor:
    """silu(gate) * up of a SwiGLU gate_up output `y` [T, 2I] whose LoRA expand was left out,
    each row's delta (its adapter's B times `xa` [T, 2 * max_rank], parts gate and up) added as
    the activation reads the row: the expand's read and write of y and a launch are not paid.
    Rows of slot -1 take the activation alone. Same arithmetic as `lora_expand` then `silu_and_mul`."""
    rows, inter = y.shape[0], y.shape[1] // 2
    out = torch.empty(rows, inter, dtype=y.dtype, device=y.device)
    _silu_mul_rows_kernel[(rows, triton.cdiv(inter, ROW_BLOCK_O))](
        y, xa, table.weights, table.entries, table.scaling, slots, out, y.stride(0), xa.stride(0),
        table.entries.stride(0), table.scaling.stride(0), inter, MAX_RANK=table.max_rank, BLOCK_O=ROW_BLOCK_O,
    )  # fmt: skip
    return out


def silu_mul_lora_reference(
    y: torch.Tensor, xa: torch.Tensor, table: AdapterTable, slots: torch.Tensor
) -> torch.Tensor:
    """The fused activation (`silu_mul_lora_rows`) in torch: the expand
    (float32, rounded to y's dtype) then SiLU-mul."""
    inter, max_rank = y.shape[1] // 2, table.max_rank
    full = y.clone()
    for t in torch.nonzero(slots >= 0).flatten().tolist():
        slot = int(slots[t])
        for part in range(2):
            weights = table.part_weights(slot, part, 0, inter)
            if weights is None:
                continue
            b = weights[1].float()
            cols = slice(part * inter, (part + 1) * inter)
            part_xa = xa[t, part * max_rank : part * max_rank + b.shape[1]].float()
            delta = b @ part_xa * table.scaling[slot, part]
            full[t, cols] = (y[t, cols].float() + delta).to(y.dtype)
    gate, up = full.chunk(2, dim=-1)
    return (F.silu(gate.float()).to(y.dtype) * up).to(y.dtype)
