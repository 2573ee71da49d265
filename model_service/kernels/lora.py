"""Multi-LoRA shrink and expand for one fused projection, over the stacked slot buffers (Triton),
with the torch reference CI runs.

Each token row picks its adapter by `slots[t]` (-1: the base model, skipped). Shrink computes
`xa[t] = A[slot] @ x[t]` for every part of the projection at once (A: [max_loras, parts,
max_rank, in], read as [parts * max_rank, in]); expand adds `scaling[slot, part] * B[slot] @ xa`
into each part's output columns (B: [max_loras, out, max_rank]). One launch each, for every row
of every adapter, so a decode step with 64 different adapters is 2 launches per projection
instead of 64 x (gather + 2 matmuls + scatter), and both fit in a CUDA graph: they read only
device tensors at fixed addresses. Zero-padded ranks add zeros. Shrink needs only the
projection's input, so the layer runs it beside the base GEMM (lora/layers.py).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from model_service.kernels.paged_attention import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _shrink_kernel(
        X, A, Slots, XA, x_stride, a_stride_slot, in_features, width, k_chunk,
        BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    ):  # fmt: skip
        t, rb, ks = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        slot = tl.load(Slots + t)
        if slot >= 0:
            r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
            acc = tl.zeros([BLOCK_R], tl.float32)
            k_end = tl.minimum((ks + 1) * k_chunk, in_features)
            for k0 in range(ks * k_chunk, k_end, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(X + t * x_stride + k, mask=k < k_end, other=0.0).to(tl.float32)
                a_off = slot * a_stride_slot + r[:, None] * in_features + k[None, :]
                a = tl.load(A + a_off, mask=(r[:, None] < width) & (k[None, :] < k_end), other=0.0)
                acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
            if SPLIT_K:
                tl.atomic_add(XA + t * width + r, acc, mask=r < width)  # partial sums
            else:
                tl.store(XA + t * width + r, acc, mask=r < width)

    @triton.jit
    def _expand_kernel(
        XA, B, Scaling, Slots, Y, Bounds, y_stride, b_stride_slot, out_features, width, num_parts,
        MAX_RANK: tl.constexpr, BLOCK_O: tl.constexpr,
    ):  # fmt: skip
        t, ob = tl.program_id(0), tl.program_id(1)
        slot = tl.load(Slots + t)
        if slot >= 0:
            o = ob * BLOCK_O + tl.arange(0, BLOCK_O)
            valid = o < out_features
            y_ptr = Y + t * y_stride + o
            y = tl.load(y_ptr, mask=valid, other=0.0)  # first: its latency hides under xa's and B's
            part = tl.zeros([BLOCK_O], tl.int32)
            for j in range(1, num_parts):
                part += (o >= tl.load(Bounds + j)).to(tl.int32)
            r = tl.arange(0, MAX_RANK)
            xa = tl.load(
                XA + t * width + part[:, None] * MAX_RANK + r[None, :], mask=valid[:, None], other=0.0
            )
            b_off = slot * b_stride_slot + o[:, None] * MAX_RANK + r[None, :]
            b = tl.load(B + b_off, mask=valid[:, None], other=0.0).to(tl.float32)
            scale = tl.load(Scaling + slot * num_parts + part, mask=valid, other=0.0)
            delta = tl.sum(xa * b, axis=1) * scale
            tl.store(y_ptr, (y.to(tl.float32) + delta).to(y.dtype), mask=valid)

    @triton.jit
    def _silu_mul_rows_kernel(
        Y, XA, B, Scaling, Slots, Out, y_stride, xa_stride, b_stride_slot, inter,
        MAX_RANK: tl.constexpr, BLOCK_O: tl.constexpr,
    ):  # fmt: skip
        t, ob = tl.program_id(0), tl.program_id(1)
        o = ob * BLOCK_O + tl.arange(0, BLOCK_O)
        valid = o < inter
        gate = tl.load(Y + t * y_stride + o, mask=valid, other=0.0)
        up = tl.load(Y + t * y_stride + inter + o, mask=valid, other=0.0)
        slot = tl.load(Slots + t)
        if slot >= 0:  # the expand's arithmetic (`_expand_kernel`) for part 0 (gate) and 1 (up)
            r = tl.arange(0, MAX_RANK)
            b_ptr = B + slot * b_stride_slot + o[:, None] * MAX_RANK + r[None, :]
            xa = tl.load(XA + t * xa_stride + r)
            b = tl.load(b_ptr, mask=valid[:, None], other=0.0).to(tl.float32)
            delta = tl.sum(xa[None, :] * b, axis=1) * tl.load(Scaling + slot * 2)
            gate = (gate.to(tl.float32) + delta).to(gate.dtype)
            xa = tl.load(XA + t * xa_stride + MAX_RANK + r)
            b = tl.load(b_ptr + inter * MAX_RANK, mask=valid[:, None], other=0.0).to(tl.float32)
            delta = tl.sum(xa[None, :] * b, axis=1) * tl.load(Scaling + slot * 2 + 1)
            up = (up.to(tl.float32) + delta).to(up.dtype)
        g = gate.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(up.dtype)  # as kernels/fused.py's SiLU-mul rounds it
        tl.store(Out + t * inter + o, act * up, mask=valid)


@functools.cache
def num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def lora_delta_reference(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scaling: torch.Tensor,
    slots: torch.Tensor,
    output_sizes: tuple[int, ...],
) -> None:
    """y[t] += LoRA delta of slot `slots[t]` (in place; rows with slot -1 untouched), in float32."""
    rows = torch.nonzero(slots >= 0).flatten()
    if rows.numel() == 0:
        return
    s = slots[rows]
    xa = torch.einsum("ti,tpri->tpr", x[rows].float(), a[s].float())  # [rows, parts, rank]
    lo = 0
    for part, size in enumerate(output_sizes):
        delta = torch.einsum("tr,tor->to", xa[:, part], b[s, lo : lo + size].float())
        y[rows, lo : lo + size] += (delta * scaling[s, part, None]).to(y.dtype)
        lo += size


def few_rows_split(in_features: int) -> int:
    """How many parts a per-row shrink splits its input dimension into when it has few rows."""
    return max(1, min(16, in_features // 512))


def lora_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    slots: torch.Tensor,
    out: torch.Tensor | None = None,
    split_k: int | None = None,
    zeroed: bool = False,
) -> torch.Tensor:
    """xa [tokens, parts * max_rank] in float32: every row's input times its slot's A (Triton,
    CUDA only); rows of slot -1 are left at whatever the buffer holds (zero when `split_k` > 1).
    `out`: rows of a larger buffer to write (a mixed step's decode rows, beside the tile
    kernels' rows). `split_k`: the split for a caller that knows its live rows better; `zeroed`:
    `out` holds zeros already (no memset)."""
    tokens, in_features = x.shape
    _, parts, max_rank, _ = a.shape
    width = parts * max_rank
    # A decode step of few rows splits the input dimension (atomic partial sums into a zeroed
    # buffer) so it still starts ~1,000+ programs; with rows enough to fill the SMs twice over,
    # each program sums its whole row and stores it: no memset launch, no atomics.
    if split_k is None:
        programs = tokens * triton.cdiv(width, 16)
        split_k = 1 if programs >= 2 * num_sms(x.device) else few_rows_split(in_features)
    k_chunk = triton.cdiv(triton.cdiv(in_features, split_k), 128) * 128
    xa = torch.empty(tokens, width, dtype=torch.float32, device=x.device) if out is None else out
    if split_k > 1 and not zeroed:
        xa.zero_()  # the programs add their partial sums into it
    _shrink_kernel[(tokens, triton.cdiv(width, 16), triton.cdiv(in_features, k_chunk))](
        x, a, slots, xa, x.stride(0), a.stride(0), in_features, width, k_chunk,
        BLOCK_R=16, BLOCK_K=128, SPLIT_K=split_k > 1,
    )  # fmt: skip
    return xa


def lora_expand(
    xa: torch.Tensor,
    y: torch.Tensor,
    b: torch.Tensor,
    scaling: torch.Tensor,
    slots: torch.Tensor,
    bounds: torch.Tensor,
) -> None:
    """y[t] += scaling[slot, part] * B[slot] @ xa[t] for every part (Triton, CUDA only, in place);
    `bounds` holds each part's first output column, on the device."""
    tokens, out = y.shape
    parts = scaling.shape[1]
    max_rank = b.shape[2]
    _expand_kernel[(tokens, triton.cdiv(out, 128))](
        xa, b, scaling, slots, y, bounds, y.stride(0), b.stride(0), out, parts * max_rank, parts,
        MAX_RANK=max_rank, BLOCK_O=128,
    )  # fmt: skip


def silu_mul_lora_rows(
    y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """silu(gate) * up of a SwiGLU gate_up output `y` [T, 2I] whose LoRA expand was left out,
    each row's delta (its slot's B times `xa` [T, 2 * max_rank], parts gate and up) added as the
    activation reads the row: the expand's read and write of y and a launch are not paid. Rows
    of slot -1 take the activation alone. Same arithmetic as `lora_expand` then `silu_and_mul`."""
    rows, inter = y.shape[0], y.shape[1] // 2
    out = torch.empty(rows, inter, dtype=y.dtype, device=y.device)
    _silu_mul_rows_kernel[(rows, triton.cdiv(inter, 128))](
        y, xa, b, scaling, slots, out, y.stride(0), xa.stride(0), b.stride(0), inter,
        MAX_RANK=b.shape[2], BLOCK_O=128,
    )  # fmt: skip
    return out


def silu_mul_lora_reference(
    y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """The fused activation (`silu_mul_lora_rows`) in torch: the expand
    (float32, rounded to y's dtype) then SiLU-mul."""
    inter, max_rank = y.shape[1] // 2, b.shape[2]
    rows = torch.nonzero(slots >= 0).flatten()
    full = y.clone()
    if rows.numel():
        s = slots[rows]
        for part in range(2):
            cols = slice(part * inter, (part + 1) * inter)
            part_xa = xa[rows, part * max_rank : (part + 1) * max_rank].float()
            delta = torch.einsum("tr,tor->to", part_xa, b[s, cols].float()) * scaling[s, part, None]
            full[rows, cols] = (y[rows, cols].float() + delta).to(y.dtype)
    gate, up = full.chunk(2, dim=-1)
    return (F.silu(gate.float()).to(y.dtype) * up).to(y.dtype)
