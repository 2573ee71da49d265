"""The small per-layer ops of a decoder, each one Triton launch on CUDA, with the torch reference
that runs everywhere else (and that CI runs).

In a decode step these ops move few bytes but, written as plain torch, cost ~30 launches a
layer (RMSNorm alone is seven); inside a CUDA graph each still costs a couple of microseconds,
which on an 8B model was most of the gap between the step's GEMMs (4.1 ms) and the step (6.9 ms).
The references are the exact arithmetic of HF's implementations: normalize in float32, round
to the model's dtype, then scale by the weight.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from model_service.kernels.fp8_gemm import (
    ActivationQuant,
    QuantizedRows,
    quantized_rows,
    row_quant_outputs,
)
from model_service.kernels.paged_attention import FP8, HeadNorms, paged_decode_attention, store_kv, triton
from model_service.kernels.pdl import pdl_args

if triton is not None:
    import triton.language as tl

    from model_service.kernels.fp8_gemm import _row_scale, _to_e4m3, quantize_groups_of, quantize_row
    from model_service.kernels.paged_attention import cache_value, rms_apply, rms_scale, rotated_rows
    from model_service.kernels.pdl import wait_for_producers

    @triton.jit(do_not_specialize=["scale_stride"])  # the row count: no variant per batch size
    def _rms_norm_kernel(
        X, R, W, Y, RO, x_stride, dim, eps, Q, Scale, Static, scale_ub, scale_stride,
        HAS_RESIDUAL: tl.constexpr, ZERO_CENTERED: tl.constexpr, BLOCK: tl.constexpr, QUANT: tl.constexpr,
        STATIC: tl.constexpr, HAS_UB: tl.constexpr, MIN_AMAX: tl.constexpr, INV_MAX: tl.constexpr,
        MAX: tl.constexpr, GROUP: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """Program (row). With `QUANT` it also quantizes the normalized row it stores, from the
        registers (`fp8_gemm.quantize_row`: the rest of the arguments are that function's)."""
        wait_for_producers(PDL)
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < dim
        x = tl.load(X + row * x_stride + offs, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            x = x + tl.load(R + row * dim + offs, mask=mask, other=0.0)  # in the model's dtype, as torch
            tl.store(RO + row * dim + offs, x, mask=mask)
        y = _store_normed(Y + row * dim, x, W, offs, mask, dim, eps, ZERO_CENTERED)
        if QUANT:
            quantize_row(
                tl.reshape(y, [BLOCK]).to(tl.float32), mask, Q + row * dim, Scale + row, scale_stride, Static,
                scale_ub, STATIC, HAS_UB, MIN_AMAX, INV_MAX, MAX, GROUP,
            )  # fmt: skip

    @triton.jit
    def _store_normed(Y, x, W, offs, mask, dim, eps, ZERO_CENTERED: tl.constexpr):
        """RMSNorm of one row x [BLOCK] (zeros past `dim`) with weight W, stored at Y and returned
        ([1, BLOCK]); ZERO_CENTERED: `rms_norm_reference`'s."""
        rows = x[None, :]
        rstd, w = rms_scale(rows, dim, eps), tl.load(W + offs, mask=mask, other=0.0)
        normed = _zero_centered_apply(rows, rstd, w) if ZERO_CENTERED else rms_apply(rows, rstd, w)
        tl.store(Y + offs[None, :], normed, mask=mask[None, :])
        return normed

    @triton.jit
    def _zero_centered_apply(x, rstd, w):
        """Qwen3-Next's `rms_apply`: x [R, D] times its rows' `rstd` and 1 + w, in float32, rounded
        once."""
        return (x.to(tl.float32) * rstd[:, None] * (1.0 + w.to(tl.float32))[None, :]).to(x.dtype)

    @triton.jit
    def _head_norm_kernel(
        Q, K, WQ, WK, QO, KO, q_row, q_head, k_row, k_head, heads, dim, eps, BLOCK: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        """Program (token, head): a query head (head < heads) or a key head, read where it lies,
        normalized with its own weight into the contiguous output."""
        wait_for_producers(PDL)
        token, head = tl.program_id(0), tl.program_id(1)
        offs = tl.arange(0, BLOCK)
        mask = offs < dim
        if head < heads:
            x = tl.load(Q + token * q_row + head * q_head + offs, mask=mask, other=0.0)
            _store_normed(QO + (token * heads + head) * dim, x, WQ, offs, mask, dim, eps, False)
        else:
            kv_heads, kv = tl.num_programs(1) - heads, head - heads
            x = tl.load(K + token * k_row + kv * k_head + offs, mask=mask, other=0.0)
            _store_normed(KO + (token * kv_heads + kv) * dim, x, WK, offs, mask, dim, eps, False)

    @triton.jit
    def _silu_mul(X, row, col, inter, mask):
        """silu(gate) * up at columns `col` of `row`, in float32 then rounded as torch rounds it."""
        gate = tl.load(X + row * 2 * inter + col, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(X + row * 2 * inter + inter + col, mask=mask, other=0.0)
        return (gate / (1.0 + tl.exp(-gate))).to(up.dtype) * up

    @triton.jit
    def _silu_mul_kernel(X, Y, inter, BLOCK: tl.constexpr, PDL: tl.constexpr):
        wait_for_producers(PDL)
        row, col = tl.program_id(0), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = col < inter
        tl.store(Y + row * inter + col, _silu_mul(X, row, col, inter, mask), mask=mask)

    @triton.jit(do_not_specialize=["scale_stride"])  # the row count: no variant per batch size
    def _silu_mul_quant_kernel(
        X, Y, inter, Q, Scale, Static, scale_ub, scale_stride, BLOCK: tl.constexpr, STATIC: tl.constexpr,
        HAS_UB: tl.constexpr, MIN_AMAX: tl.constexpr, INV_MAX: tl.constexpr, MAX: tl.constexpr,
        GROUP: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """Program (row): `_silu_mul_kernel`'s values and their maximum in one pass, then their
        e4m3 values from the stored row (re-read from cache, as `_quantize_rows_kernel` does).
        GROUP > 0: each block of columns (whole groups) quantized from registers as it is made."""
        wait_for_producers(PDL)
        row, offs = tl.program_id(0), tl.arange(0, BLOCK)
        if GROUP > 0:
            for c0 in range(0, inter, BLOCK):
                mask = c0 + offs < inter
                y = _silu_mul(X, row, c0 + offs, inter, mask)
                tl.store(Y + row * inter + c0 + offs, y, mask=mask)
                scale_at = Scale + (c0 // GROUP) * scale_stride + row
                quantize_groups_of(
                    y.to(tl.float32), mask, Q + row * inter + c0, scale_at, scale_stride, MIN_AMAX, INV_MAX,
                    MAX, GROUP,
                )  # fmt: skip
        else:
            amax = tl.zeros([BLOCK], tl.float32)
            for c0 in range(0, inter, BLOCK):
                mask = c0 + offs < inter
                y = _silu_mul(X, row, c0 + offs, inter, mask)
                tl.store(Y + row * inter + c0 + offs, y, mask=mask)
                amax = tl.maximum(amax, tl.abs(y.to(tl.float32)))  # masked columns are 0
            scale = _row_scale(tl.max(amax, axis=0), Static, scale_ub, STATIC, HAS_UB, MIN_AMAX, INV_MAX)
            tl.store(Scale + row, scale)
            tl.debug_barrier()  # every thread's stores are visible before any reads them back
            for c0 in range(0, inter, BLOCK):
                mask = c0 + offs < inter
                y = tl.load(Y + row * inter + c0 + offs, mask=mask, other=0.0).to(tl.float32)
                tl.store(Q + row * inter + c0 + offs, _to_e4m3(y, scale, Q.dtype.element_ty, MAX), mask=mask)

    @triton.jit
    def _rope_kernel(X, Cos, Sin, row_stride, head_stride, HALF: tl.constexpr, PDL: tl.constexpr):
        wait_for_producers(PDL)
        token, head = tl.program_id(0), tl.program_id(1)
        offs = tl.arange(0, HALF)
        base = X + token * row_stride + head * head_stride
        x1 = tl.load(base + offs)
        x2 = tl.load(base + HALF + offs)
        cos1 = tl.load(Cos + token * 2 * HALF + offs)
        cos2 = tl.load(Cos + token * 2 * HALF + HALF + offs)
        sin1 = tl.load(Sin + token * 2 * HALF + offs)
        sin2 = tl.load(Sin + token * 2 * HALF + HALF + offs)
        tl.store(base + offs, x1 * cos1 - x2 * sin1)
        tl.store(base + HALF + offs, x2 * cos2 + x1 * sin2)

    @triton.jit
    def _rope_store_kv_kernel(
        Q, K, V, Cos, Sin, KC, VC, Slots, NormQ, NormK, eps, q_row, q_head, k_row, k_head, v_row, v_head,
        c_slot, c_head, HEADS: tl.constexpr, HALF: tl.constexpr, TO_FP8: tl.constexpr, NORM: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        """Program (token, head): a query head rotates in place; a KV head rotates its key into
        the pool and copies its value there (a negative slot, a padding row, writes nothing).
        Under NORM both are RMS-normalized first (Qwen3's q_norm and k_norm)."""
        wait_for_producers(PDL)
        token, head = tl.program_id(0), tl.program_id(1)
        d = tl.arange(0, 2 * HALF)
        one = tl.arange(0, 1)
        cos, sin = tl.load(Cos + token * 2 * HALF + d), tl.load(Sin + token * 2 * HALF + d)
        if head < HEADS:
            rows = token * q_row + head * q_head + one
            q = rotated_rows(Q, rows, d, cos, sin, one == 0, NormQ, eps, HALF, NORM)
            tl.store(Q + rows[:, None] + d[None, :], q)
        else:
            slot = tl.load(Slots + token)
            if slot >= 0:
                kv = head - HEADS
                rows = token * k_row + kv * k_head + one
                k = rotated_rows(K, rows, d, cos, sin, one == 0, NormK, eps, HALF, NORM)
                dst = slot * c_slot + kv * c_head + d[None, :]
                tl.store(KC + dst, cache_value(k, TO_FP8))
                v = tl.load(V + token * v_row + kv * v_head + d)[None, :]
                tl.store(VC + dst, cache_value(v, TO_FP8))


def _on_gpu(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False
) -> torch.Tensor:
    """HF's RMSNorm: normalized in float32, rounded, times the weight; `zero_centered` (Qwen3-Next's
    norms, which store weight - 1) times 1 + weight in float32, rounded once at the end."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centered:
        return (h * (1.0 + weight.float())).to(x.dtype)
    return weight * h.to(x.dtype)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    quant: ActivationQuant | None = None,
    zero_centered: bool = False,
) -> tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual); without a residual, (RMSNorm(x), x).
    x: [T, dim] with unit stride in its last dimension. With `quant` the normalized rows come as
    `QuantizedRows` for an FP8 projection: on CUDA quantized by the same launch, from registers
    (one launch and a pass over the rows fewer than `fp8_gemm.quantize_rows` after the norm),
    bit for bit that reference, which runs everywhere else. `zero_centered`: `rms_norm_reference`'s."""
    if not _on_gpu(x) or x.dim() != 2 or x.stride(-1) != 1:
        summed = x if residual is None else x + residual
        out = rms_norm_reference(summed, weight, eps, zero_centered)
        return (out if quant is None else quantized_rows(out, quant)), summed
    return rms_norm_triton(x, weight, eps, residual, quant, zero_centered)


def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    quant: ActivationQuant | None = None,
    zero_centered: bool = False,
) -> tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
    """`rms_norm`'s kernel, wherever Triton runs (its interpreter included: the tests)."""
    rows, dim = x.shape
    out = torch.empty(rows, dim, dtype=x.dtype, device=x.device)
    summed = torch.empty_like(out) if residual is not None else x
    args, result = row_quant_outputs(out, quant)
    _rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out, summed, x.stride(0), dim, eps,
        HAS_RESIDUAL=residual is not None, ZERO_CENTERED=zero_centered, BLOCK=triton.next_power_of_2(dim),
        QUANT=quant is not None, **args, **pdl_args(x.device),
    )  # fmt: skip
    return result, summed


def head_rms_norm(q: torch.Tensor, k: torch.Tensor, norms: HeadNorms) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over each head of q [T, H, D] and of k [T, KVH, D], each with its weight [D]
    (Qwen3's q_norm and k_norm), where no RoPE kernel applies them (`rotary_store_kv`). On CUDA
    one launch for both, reading the heads where the qkv projection left them: as two `RMSNorm`s
    they were two launches, and past one row two copies more (a strided [T, H, D] view does not
    flatten to rows)."""
    if not _on_gpu(q) or q.stride(-1) != 1 or k.stride(-1) != 1:
        q_weight, k_weight, eps = norms
        return rms_norm_reference(q, q_weight, eps), rms_norm_reference(k, k_weight, eps)
    return _head_rms_norm(q, k, norms)


def _head_rms_norm(q: torch.Tensor, k: torch.Tensor, norms: HeadNorms) -> tuple[torch.Tensor, torch.Tensor]:
    """The launch of `head_rms_norm` (also what the tests run under Triton's interpreter)."""
    q_weight, k_weight, eps = norms
    tokens, heads, dim = q.shape
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    _head_norm_kernel[(tokens, heads + k.shape[1])](
        q, k, q_weight, k_weight, q_out, k_out, q.stride(0), q.stride(1), k.stride(0), k.stride(1), heads,
        dim, eps, BLOCK=triton.next_power_of_2(dim), **pdl_args(q.device),
    )  # fmt: skip
    return q_out, k_out


def silu_and_mul(x: torch.Tensor, quant: ActivationQuant | None = None) -> torch.Tensor | QuantizedRows:
    """silu(x[:, :I]) * x[:, I:] for the fused gate/up output [T, 2I]. With `quant`, as
    `QuantizedRows` for an FP8 down projection: on CUDA quantized by the same launch (bit for
    bit `fp8_gemm.quantize_rows` of the product, the reference everywhere else)."""
    if not _on_gpu(x):
        gate, up = x.chunk(2, dim=-1)
        out = F.silu(gate) * up
        return out if quant is None else quantized_rows(out, quant)
    return silu_and_mul_triton(x, quant)


def silu_and_mul_triton(
    x: torch.Tensor, quant: ActivationQuant | None = None
) -> torch.Tensor | QuantizedRows:
    """`silu_and_mul`'s kernels, wherever Triton runs (its interpreter included: the tests). A
    row's scale needs the whole row, so quantizing takes one program a row (columns in blocks of
    2,048, the row then re-read from cache to quantize it); without, 1,024 columns a program."""
    rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    if quant is None:
        _silu_mul_kernel[(rows, triton.cdiv(inter, 1024))](
            x.contiguous(), out, inter, BLOCK=1024, **pdl_args(x.device)
        )
        return out
    args, result = row_quant_outputs(out, quant)
    block = min(2048, triton.next_power_of_2(inter))
    _silu_mul_quant_kernel[(rows,)](
        x.contiguous(), out, inter, BLOCK=block, num_warps=8, **args, **pdl_args(x.device)
    )
    return result


def apply_rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos/sin: [tokens, head_dim] (half-rotation layout, as HF)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on q or k; on CUDA in place, one launch for every token and head."""
    half = x.shape[-1] // 2
    if not _on_gpu(x) or half & (half - 1) or x.stride(-1) != 1:
        return apply_rotary_reference(x, cos, sin)
    _rope_kernel[(x.shape[0], x.shape[1])](
        x, cos.contiguous(), sin.contiguous(), x.stride(0), x.stride(1), HALF=half, **pdl_args(x.device)
    )
    return x


def _rope_in_kernels(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the Triton kernels can rotate and store these heads where they lie: CUDA, a
    power-of-two half head, unit-stride head vectors (the views the qkv projection leaves)."""
    half = q.shape[-1] // 2
    strided = all(t.stride(-1) == 1 and t.stride(1) == 2 * half for t in (q, k, v))
    return _on_gpu(q) and not half & (half - 1) and strided and k_cache.stride(1) == 2 * half


def rotary_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    norms: HeadNorms | None = None,
) -> torch.Tensor:
    """RoPE on q and k (RMS-normalized first with `norms`), then k and v into their pool slots;
    returns the rotated q. On CUDA one launch does it all and reads k and v where the qkv
    projection left them: separately, the two rotations, two `.contiguous()` copies and the
    store were five launches a layer (Qwen3's norms one more)."""
    cos, sin = rope
    half = q.shape[-1] // 2
    if not _rope_in_kernels(q, k, v, k_cache):
        if norms is not None:
            q, k = head_rms_norm(q, k, norms)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        store_kv(k.contiguous(), v.contiguous(), k_cache, v_cache, slots)
        return q
    norm_q, norm_k, eps = norms if norms is not None else (q, q, 0.0)
    _rope_store_kv_kernel[(q.shape[0], q.shape[1] + k.shape[1])](
        q, k, v, cos.contiguous(), sin.contiguous(), k_cache, v_cache, slots, norm_q, norm_k, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0),
        k_cache.stride(1), HEADS=q.shape[1], HALF=half, TO_FP8=k_cache.dtype == FP8, NORM=norms is not None,
        **pdl_args(q.device),
    )  # fmt: skip
    return q


def rotary_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    norms: HeadNorms | None = None,
    **attention: Any,
) -> torch.Tensor:
    """A decode step's RoPE (after `norms`, if any), K/V write and attention
    (`paged_decode_attention`'s keyword arguments in `attention`). On CUDA the attention kernel
    does it all, one launch a layer fewer than `rotary_store_kv` and then attention; elsewhere it
    is exactly that pair."""
    if not _rope_in_kernels(q, k, v, k_cache):
        q = rotary_store_kv(q, k, v, rope, k_cache, v_cache, slots, norms)
        return paged_decode_attention(q, k_cache, v_cache, **attention)
    rope_kv = (k, v, rope[0].contiguous(), rope[1].contiguous(), slots)
    return paged_decode_attention(q, k_cache, v_cache, rope_kv=rope_kv, norms=norms, **attention)
