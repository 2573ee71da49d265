"""Products of activations with FP8 (e4m3) weights: the reference, and `torch._scaled_mm` on CUDA.

A weight is e4m3 [out, in] with float32 scales [out, groups]: one per output row when `groups`
is 1 (per channel; a checkpoint's per-tensor scale is repeated down the rows, so fused parts
keep their own), else one per row and `group` input columns (128x128 block checkpoints, whose
block scales are repeated down each block's 128 rows at load). Activations are quantized the way
the checkpoint was calibrated for: dynamically (scale = row maximum / 448, per token, or per
token and `group` columns), statically (one scale from the checkpoint), or not at all
(weight-only).

The reference quantizes activations exactly that way, dequantizes both operands and multiplies
in the activations' dtype: in float32 (the CPU path) it is the oracle the GPU path is tested
against.

On CUDA (sm89+, bfloat16), per-channel W8A8 products go to `torch._scaled_mm` with row-wise
scales (activations [M, 1], weights [1, N]): cuBLASLt's FP8 tensor-core GEMM, the rescale fused
into its epilogue; the activations are quantized for it by one Triton launch (`quantize_rows`,
bit for bit the torch ops' result). Products whose scales cover 128 columns (the `fp8-g128`
scheme, and 128x128 block checkpoints in their row form) go to `torch._scaled_mm` with 1x128
block scaling on both operands on sm90 with CUDA 12.9+ (cuBLASLt scales each 128-deep partial
sum), their activations quantized per token and 128 columns by one Triton launch
(`quantize_column_groups`). Everything else there (weight-only schemes, block-wise ones
elsewhere) takes the reference in bfloat16, i.e. dequantize-then-matmul: correct, and slower
than bfloat16 weights (each call writes and reads a bf16 copy of the weight). Decode steps of
<= 16 rows (scales per row or per 128 columns) do not come here: `Fp8Linear` sends them to the
few-row kernels of `kernels/skinny_gemm.py` in W8A16 (cuBLASLt is poor at M = 1). Producers of
an FP8 projection's input quantize it for `_scaled_mm` themselves (`row_quant_outputs`,
`quantize_row`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from model_service.kernels.paged_attention import triton

if triton is not None:
    import triton.language as tl

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
# A row of zeros (padding rows of a CUDA graph's batch) gets this scale, not 0: x / 0 is NaN.
_MIN_AMAX = 1e-12
BLOCK_COLS = 128  # the columns one scale covers in cuBLASLt's 1x128 block scaling


@dataclass(frozen=True)
class ActivationQuant:
    """How a layer's inputs are quantized: `mode` dynamic, static or none; `group` columns per
    dynamic scale (the input width for per-token); `scale` the static one; `scale_ub` the cap on
    a dynamic row maximum (fbgemm's `activation_scale_ub`)."""

    mode: str
    group: int
    scale: torch.Tensor | None = None
    scale_ub: float | None = None


def quantize_groups(
    x: torch.Tensor, group: int, scale_ub: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [M, K], float32 scales [M, ceil(K / group)]) of x [M, K], each `group` columns of a
    row scaled so its largest magnitude maps to 448. Used for dynamic activations and for
    quantizing weights online (per channel: group = K)."""
    m, k = x.shape
    groups = -(-k // group)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    amax = padded.abs().amax(dim=-1)
    if scale_ub is not None:
        amax = amax.clamp(max=scale_ub)
    scale = amax.clamp(min=_MIN_AMAX) / E4M3_MAX
    q = (padded / scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q.view(m, groups * group)[:, :k], scale


def dequantize_groups(q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """float32 q * scale, `scale` [..., M, groups] covering `group` columns each (any leading
    dimensions: a stack of experts' weights too)."""
    return q.float() * scale.repeat_interleave(group, dim=-1)[..., : q.shape[-1]]


def quantize_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 x / scale (one float32 scale for the tensor), saturating at +-448."""
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    group: int,
    bias: torch.Tensor | None,
    acts: ActivationQuant,
) -> torch.Tensor:
    """x [..., K] @ dequantized weight [N, K].T (+ bias), in x's dtype; `group`: the input
    columns each weight scale covers (K per channel)."""
    flat = x.reshape(-1, x.shape[-1])
    if scaled_mm_applies(flat, weight, weight_scale, acts):
        y = _scaled_mm(flat, weight, weight_scale, bias, acts)
    else:
        y = fp8_linear_reference(flat, weight, weight_scale, group, bias, acts)
    return y.view(*x.shape[:-1], weight.shape[0])


def _activations(x: torch.Tensor, acts: ActivationQuant) -> torch.Tensor:
    """x as the GEMM sees it, float32: quantized and dequantized again (unchanged for weight-only)."""
    if acts.mode == "dynamic":
        return dequantize_groups(*quantize_groups(x, acts.group, acts.scale_ub), acts.group)
    if acts.mode == "static":
        return quantize_static(x, acts.scale).float() * acts.scale
    return x.float()


def fp8_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    group: int,
    bias: torch.Tensor | None,
    acts: ActivationQuant,
) -> torch.Tensor:
    """x [M, K] through the FP8 layer in x's dtype: both operands' quantization applied, then one
    matmul (in float32, no other rounding)."""
    w = dequantize_groups(weight, weight_scale, group).to(x.dtype)
    y = _activations(x, acts).to(x.dtype) @ w.T
    return y if bias is None else y + bias.to(x.dtype)


@functools.cache
def has_fp8_conversions(device: torch.device) -> bool:
    """Whether the CUDA `device` has FP8 tensor cores and conversions (sm89+)."""
    return torch.cuda.get_device_capability(device) >= (8, 9)


@functools.cache
def has_block_scaled_mm(device: torch.device) -> bool:
    """Whether `torch._scaled_mm` takes 1x128 block scales on `device`: cuBLASLt's block scaling
    (CUDA 12.9+), which torch runs on sm90 only."""
    cuda = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    return torch.cuda.get_device_capability(device) == (9, 0) and cuda >= (12, 9)


def scaled_mm_applies(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, acts: ActivationQuant
) -> bool:
    """Whether x [M, K] @ weight.T runs on `torch._scaled_mm`: CUDA with FP8 tensor cores,
    bfloat16, W8A8 with per-channel weight scales (or, where the block scaling exists, scales of
    128 columns on both sides), K and N multiples of 16 (cuBLASLt's FP8 alignment) and a weight
    of contiguous rows (its transpose is the column-major operand)."""
    return (
        x.is_cuda
        and x.dtype == torch.bfloat16
        and acts.mode != "none"
        and (weight_scale.shape[1] == 1 or _block_scaled(x, weight, weight_scale, acts))
        and weight.shape[1] % 16 == 0
        and weight.shape[0] % 16 == 0
        and weight.is_contiguous()
        and has_fp8_conversions(x.device)
    )


def _block_scaled(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, acts: ActivationQuant
) -> bool:
    k = weight.shape[1]
    return (
        acts.mode == "dynamic"
        and acts.group == BLOCK_COLS
        and k % BLOCK_COLS == 0
        and weight_scale.shape[1] == k // BLOCK_COLS
        and has_block_scaled_mm(x.device)
    )


@dataclass(frozen=True)
class QuantizedRows:
    """An activation made for an FP8 projection by the kernel that produced it (RMSNorm, SiLU-mul:
    `kernels/fused.py`): `x` [M, K] in the compute dtype (what a LoRA shrink and the few-row kernel
    read), and its per-row quantization `q` (e4m3 [M, K]) with `scale` (float32 [M, 1], or [M, K /
    group] column-major for column groups), bit for bit what `quantize_rows(x, acts)` gives, so
    that the GEMM does not launch that quantization itself. Only a producer asked by its
    consumer's `input_quant` makes one."""

    x: torch.Tensor
    q: torch.Tensor
    scale: torch.Tensor


def plain(x: torch.Tensor | QuantizedRows) -> torch.Tensor:
    """The activation in the compute dtype, whether or not its producer quantized it too."""
    return x.x if isinstance(x, QuantizedRows) else x


def quantized_rows(x: torch.Tensor, acts: ActivationQuant) -> QuantizedRows:
    """x with its per-row quantization: the unfused reference of the producers' fused kernels."""
    return QuantizedRows(x, *quantize_rows(x, acts))


def _scaled_mm(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    acts: ActivationQuant,
) -> torch.Tensor:
    return scaled_mm_rows(quantized_rows(x, acts), weight, weight_scale, bias)


def scaled_mm_rows(
    rows: QuantizedRows, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """rows [..., K] (quantized) @ weight [N, K].T in rows.x's dtype: `torch._scaled_mm`, the
    rescale in cuBLASLt's epilogue (the bias added after). Row-wise scales (activations [M, 1],
    weights [1, N]), or 1x128 blocks on both: the activations' [M, K/128] column-major, the
    weight's as the transpose of the weight operand takes them, [K/128, N] with rows contiguous
    (torch checks `scale_b.t()` against `weight`: [N, K/128], column-major). The weight's scales
    are stored column-major on CUDA (`layers.store_weights_transposed`), so that is a view; a
    row-major one is copied."""
    q = rows.q.reshape(-1, rows.q.shape[-1])
    m = q.shape[0]
    if weight_scale.shape[1] == 1:
        scale_a, scale_b = rows.scale.view(-1, 1), weight_scale.view(1, -1)
    else:
        (q, scale_a), scale_b = _rows_in_fours(q, rows.scale), weight_scale.t().contiguous()
    y = torch._scaled_mm(q, weight.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=rows.x.dtype)[:m]
    y = y if bias is None else y + bias
    return y.view(*rows.x.shape[:-1], weight.shape[0])


def _rows_in_fours(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) of M rows padded with zero rows (scales 1) to a multiple of 4, the activations'
    scales still column-major. cuBLASLt's 1x128 block scaling refuses other row counts
    (CUBLAS_STATUS_NOT_SUPPORTED; H100, torch 2.11 + CUDA 13.0: 64 and 300 rows ran, 5 did not):
    the scales' leading dimension must span whole 16 bytes. The padding rows' outputs are dropped."""
    pad = -q.shape[0] % 4
    if not pad:
        return q, scale
    q = torch.cat([q, torch.zeros(pad, q.shape[1], dtype=q.dtype, device=q.device)])
    scale = torch.cat([scale, scale.new_ones(pad, scale.shape[1])]).t().contiguous().t()
    return q, scale


def quantize_rows(x: torch.Tensor, acts: ActivationQuant) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [M, K], float32 scales [M, 1]) of x [M, K] for a per-token dynamic or a static
    scheme: on CUDA one Triton launch (`quantize_groups` / `quantize_static` as separate torch
    ops were ~6 launches and as many passes over x before every GEMM), bit for bit their result;
    elsewhere those references. Per token and `acts.group` columns: `quantize_column_groups`."""
    m, k = x.shape
    if grouped(acts, k):
        return quantize_column_groups(x, acts.group)
    if triton is None or not x.is_cuda or x.stride(1) != 1:
        if acts.mode == "dynamic":
            return quantize_groups(x, k, acts.scale_ub)
        return quantize_static(x, acts.scale), acts.scale.expand(m, 1).contiguous()
    return quantize_rows_triton(x, acts)


def quantize_column_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [M, K], float32 scales [M, K / group] stored column-major, as cuBLASLt's block
    scaling wants them) of x [M, K], K a multiple of `group`: `quantize_groups`' values; on CUDA
    one Triton launch, bit for bit those torch ops (~6 launches and a copy for the layout)."""
    if triton is None or not x.is_cuda or x.stride(1) != 1:
        q, scale = quantize_groups(x, group)
        return q, scale.t().contiguous().t()
    return quantize_column_groups_triton(x, group)


def quantize_column_groups_triton(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_column_groups`' kernel, wherever Triton runs (its interpreter included: the tests)."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=E4M3, device=x.device)
    scale = torch.empty(k // group, m, dtype=torch.float32, device=x.device).t()
    _quantize_groups_kernel[(m, k // group)](
        x, x.stride(0), m, k, q, scale, MIN_AMAX=_MIN_AMAX, INV_MAX=1 / E4M3_MAX, MAX=E4M3_MAX, GROUP=group
    )
    return q, scale


def grouped(acts: ActivationQuant, k: int) -> bool:
    """Whether `acts` quantizes an input of `k` columns in groups of columns (a scale per token
    and group) rather than whole rows."""
    return acts.mode == "dynamic" and acts.group < k


def quantize_rows_triton(x: torch.Tensor, acts: ActivationQuant) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows`' kernel, wherever Triton runs (its interpreter included: the tests)."""
    m, k = x.shape
    if grouped(acts, k):
        return quantize_column_groups_triton(x, acts.group)
    args, rows = row_quant_outputs(x, acts)
    _quantize_rows_kernel[(m,)](x, x.stride(0), k, BLOCK=min(1024, triton.next_power_of_2(k)), **args)
    return rows.q, rows.scale


def row_quant_outputs(
    out: torch.Tensor, acts: ActivationQuant | None
) -> tuple[dict, torch.Tensor | QuantizedRows]:
    """For a kernel that writes `out` [M, K] and, given `acts`, its per-row quantization too:
    (the arguments of that quantization, which every such kernel takes: `Q`, `Scale` and those of
    `_row_scale` and `_to_e4m3`; what the kernel's caller returns: `out`, or the `QuantizedRows`
    the kernel fills). One place says how a scheme becomes a scale, so the fused producers and
    `_quantize_rows_kernel` cannot drift apart. Without `acts` the kernel is to write `out` alone
    (the arguments are placeholders). A scheme of column groups (`grouped`) takes a scale per
    row and `GROUP` columns, stored column-major ([M, K / GROUP], `scale_stride` M apart)."""
    m, k = out.shape
    quant, static = acts is not None, acts is not None and acts.mode == "static"
    group = acts.group if quant and grouped(acts, k) else 0
    assert not group or k % group == 0, f"{k} columns are not whole groups of {group}"
    q = torch.empty(m, k, dtype=E4M3, device=out.device) if quant else out
    scale = torch.empty(m, 1, dtype=torch.float32, device=out.device) if quant else out
    if group:
        scale = torch.empty(k // group, m, dtype=torch.float32, device=out.device).t()
    ub = acts.scale_ub if quant else None
    args = {
        "Q": q, "Scale": scale, "Static": acts.scale if static else scale,
        "scale_ub": ub if ub is not None else 0.0, "STATIC": static, "HAS_UB": ub is not None,
        "MIN_AMAX": _MIN_AMAX, "INV_MAX": 1 / E4M3_MAX, "MAX": E4M3_MAX, "scale_stride": m, "GROUP": group,
    }  # fmt: skip
    return args, QuantizedRows(out, q, scale) if quant else out


if triton is not None:

    @triton.jit
    def _row_scale(
        row_max, Static, scale_ub, STATIC: tl.constexpr, HAS_UB: tl.constexpr, MIN_AMAX: tl.constexpr,
        INV_MAX: tl.constexpr,
    ):  # fmt: skip
        """A row's scale, as `quantize_groups` computes it on CUDA: the row maximum (capped by
        `scale_ub`) times float32(1 / 448), since torch's `amax / 448` is a multiply by the
        reciprocal there (the CPU divides, which can differ in the last bit); static: the
        checkpoint's (`row_max` unused)."""
        if STATIC:
            scale = tl.load(Static)
        else:
            if HAS_UB:
                row_max = tl.minimum(row_max, scale_ub)
            scale = tl.maximum(row_max, MIN_AMAX) * INV_MAX
        return scale

    @triton.jit
    def _to_e4m3(x, scale, dtype: tl.constexpr, MAX: tl.constexpr):
        """float32 x / scale in e4m3 as torch rounds it: a correctly rounded division (`div_rn`:
        Triton's `/` is approximate), the clamp to +-448, the round-to-nearest-even cast."""
        return tl.minimum(tl.maximum(tl.div_rn(x, scale), -MAX), MAX).to(dtype)

    @triton.jit(do_not_specialize=["scale_stride"])  # the row count: no variant per batch size
    def _quantize_rows_kernel(
        X, x_stride, K, Q, Scale, Static, scale_ub, scale_stride, BLOCK: tl.constexpr, STATIC: tl.constexpr,
        HAS_UB: tl.constexpr, MIN_AMAX: tl.constexpr, INV_MAX: tl.constexpr, MAX: tl.constexpr,
        GROUP: tl.constexpr,
    ):  # fmt: skip
        """Program (row): its maximum in one pass over the row, its e4m3 values in a second (the
        row is re-read from cache). Whole rows only (`quantize_rows_triton` sends column groups
        to `_quantize_groups_kernel`)."""
        tl.static_assert(GROUP == 0)
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        x_row = X + row * x_stride
        amax = tl.zeros([BLOCK], tl.float32)
        if not STATIC:
            for k0 in range(0, K, BLOCK):
                x = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0)
                amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        scale = _row_scale(tl.max(amax, axis=0), Static, scale_ub, STATIC, HAS_UB, MIN_AMAX, INV_MAX)
        tl.store(Scale + row, scale)
        for k0 in range(0, K, BLOCK):
            live = k0 + offs < K
            x = tl.load(x_row + k0 + offs, mask=live, other=0.0).to(tl.float32)
            tl.store(Q + row * K + k0 + offs, _to_e4m3(x, scale, Q.dtype.element_ty, MAX), mask=live)

    @triton.jit
    def quantize_groups_of(
        y, live, q_at, scale_at, scale_stride, MIN_AMAX: tl.constexpr, INV_MAX: tl.constexpr,
        MAX: tl.constexpr, GROUP: tl.constexpr,
    ):  # fmt: skip
        """Values `y` [BLOCK] in registers (float32; `live` masks columns past the row, in whole
        groups), BLOCK a multiple of GROUP: each GROUP's scale, `scale_stride` apart from
        `scale_at` on, and their e4m3 values from `q_at` on, as `_quantize_groups_kernel` makes them."""
        groups = tl.reshape(tl.where(live, y, 0.0), [y.shape[0] // GROUP, GROUP])
        scales = _row_scale(tl.max(tl.abs(groups), axis=1), scale_at, 0.0, False, False, MIN_AMAX, INV_MAX)
        g = tl.arange(0, y.shape[0] // GROUP)
        whole = tl.max(tl.reshape(live.to(tl.int32), [y.shape[0] // GROUP, GROUP]), axis=1) > 0
        tl.store(scale_at + g * scale_stride, scales, mask=whole)
        q = _to_e4m3(groups, scales[:, None], q_at.dtype.element_ty, MAX)
        tl.store(q_at + tl.arange(0, y.shape[0]), tl.reshape(q, [y.shape[0]]), mask=live)

    @triton.jit(do_not_specialize=["M"])  # the row count: no variant per batch size
    def _quantize_groups_kernel(
        X, x_stride, M, K, Q, Scale, MIN_AMAX: tl.constexpr, INV_MAX: tl.constexpr, MAX: tl.constexpr,
        GROUP: tl.constexpr,
    ):  # fmt: skip
        """Program (row, group): the group's scale (column-major [M, K / GROUP]) and e4m3 values."""
        row, g = tl.program_id(0), tl.program_id(1)
        offs = g * GROUP + tl.arange(0, GROUP)
        x = tl.load(X + row * x_stride + offs).to(tl.float32)
        scale = _row_scale(tl.max(tl.abs(x), axis=0), Scale, 0.0, False, False, MIN_AMAX, INV_MAX)
        tl.store(Scale + g * M + row, scale)
        tl.store(Q + row * K + offs, _to_e4m3(x, scale, Q.dtype.element_ty, MAX))

    @triton.jit
    def quantize_row(
        y, live, q_row, scale_at, scale_stride, Static, scale_ub, STATIC: tl.constexpr, HAS_UB: tl.constexpr,
        MIN_AMAX: tl.constexpr, INV_MAX: tl.constexpr, MAX: tl.constexpr, GROUP: tl.constexpr,
    ):  # fmt: skip
        """A producer's row held whole in registers, `y` (float32 of the values it stored in the
        compute dtype; `live` masks a power-of-two block's tail): its scale into `scale_at`, its
        e4m3 values from `q_row` on, as `_quantize_rows_kernel` would make them from the row.
        GROUP > 0: a scale per GROUP columns (`quantize_groups`), `scale_stride` apart."""
        if GROUP > 0:
            quantize_groups_of(y, live, q_row, scale_at, scale_stride, MIN_AMAX, INV_MAX, MAX, GROUP)
        else:
            row_max = tl.max(tl.where(live, tl.abs(y), 0.0), axis=0)
            scale = _row_scale(row_max, Static, scale_ub, STATIC, HAS_UB, MIN_AMAX, INV_MAX)
            tl.store(scale_at, scale)
            offs = tl.arange(0, y.shape[0])
            tl.store(q_row + offs, _to_e4m3(y, scale, q_row.dtype.element_ty, MAX), mask=live)
