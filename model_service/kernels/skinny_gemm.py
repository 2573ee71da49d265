"""Products of a few rows with a weight (decode steps of small batches), in Triton on CUDA.

A decode step of one sequence reads each weight once and does almost no arithmetic, so its
GEMMs run at the speed their kernels stream bytes. cuBLAS streams an 8B model's o_proj
(4,096 x 4,096) at ~2.6-3.2 TB/s, then launches a second kernel to add its split-K partial
sums. This kernel reads the weight tile by tile through `tl.dot` on a 16-row tile (rows
beyond the batch masked: the wasted arithmetic is free in a memory-bound kernel) and, where
the columns alone give too few programs to fill the GPU, splits K: the last program of each
column block to arrive (an arrival counter) adds the partial sums in a fixed order, so the
result is deterministic and there is no second launch. It then resets the counter for the
next call; CUDA graphs replay it as is.

FP8 weights (`Fp8Linear`, one scale a row) take the same kernel in W8A16: e4m3 tiles read where
they lie (rows contiguous, as `_scaled_mm` wants them) and converted to bf16 in registers, the
row scales applied to the float32 sums. One byte a weight: half the bytes of a bf16 decode step.
Weights with a scale per row and 128 columns (`--quantization fp8-g128`, block checkpoints in
row form) scale each 128-deep partial sum by its own (K tiles of 128 for `tl.dot`; the GEMV
sums its wider tiles in groups of 128 first): 4 more bytes of scale per 128 of weight.
A single row (batch-1 decode) with e4m3 weights takes a GEMV kernel instead (`fp8_gemv`), which
reads the weight's rows as they lie and sums without the tensor cores: 30% faster there.

H200, Llama-3-8B shapes, one row, 32 distinct weights in a graph (`devrun` bench of
2026-12-01 o, per product): qkv 15.38 -> 14.19 us, o 12.99 -> 11.54, gate_up 55.14 -> 54.64,
down 31.31 -> 30.20.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from model_service.kernels.fp8_gemm import BLOCK_COLS, E4M3, has_fp8_conversions
from model_service.kernels.paged_attention import triton
from model_service.kernels.pdl import pdl_args

if triton is not None:
    import triton.language as tl

    from model_service.kernels.arrivals import last_to_arrive
    from model_service.kernels.pdl import admit_dependents, wait_for_producers

MAX_ROWS = 16  # the kernel's row tile: more rows go to cuBLAS


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int
    block_k: int
    split_k: int
    num_stages: int


@functools.cache
def _device_limits(device: torch.device) -> tuple[int, int]:
    """(SMs, shared memory bytes a program may use) of `device`; (0, 0) before Ampere, whose
    tensor cores `tl.dot` cannot use in bf16."""
    props = torch.cuda.get_device_properties(device)
    if props.major < 8:
        return 0, 0
    return props.multi_processor_count, getattr(props, "shared_memory_per_block_optin", 49152)


def skinny_config(
    k: int, n: int, sms: int = 132, smem: int = 232_448, weight_bytes: int = 2, grouped: bool = False
) -> SkinnyConfig | None:
    """The tiling for a [*, k] x [k, n] product on a GPU of `sms` SMs and `smem` bytes of shared
    memory a program (measured on an H200: 132, 227 KiB), None where the kernel does not apply.
    bf16 weights (`weight_bytes` 2): wide outputs (qkv, gate_up) fill the GPU with one program
    per column block; narrow ones (o, down) split K four ways: one program per 64 columns of o
    gave 12.7 us, four 11.5. e4m3 weights (1) are read along K (rows contiguous), so a tile's
    runs are only block_k bytes: longer K tiles, narrower column blocks, K split unless the
    columns alone give four waves (`.gpuwheels`-style sweep of 54 tilings a shape, one row, H200,
    2026-12-02 t: qkv 20.7 -> 14.1 us, o 12.2 -> 11.2, gate_up 66.7 -> 42.6, down 32.2 -> 28.2).
    Qwen3-Next's shapes (hidden 2048, one row, H200 sweep of 2026-12-02 w): the wide outputs of a
    2,048-long K in [128, 128] tiles, 4 stages (in_proj_qkvz 16.0 -> 14.4 us, gate_up 14.8 -> 12.6,
    qkv 13.1 -> 11.9); a split grid under one wave (2,048 outputs) in 6 stages (o / out_proj
    9.1 -> 8.0, down 10.3 -> 8.9); the 8B shapes keep their tilings. `grouped` e4m3 weights (a
    scale per 128 columns) take K tiles of at most 128, one scale a column a tile."""
    if weight_bytes == 1:
        block_n = 32 if n // 32 >= 4 * sms else 64
        block_k, split_k, stages = (256, 1, 3) if block_n == 32 else (128, 4, 3)
    elif 3 * (n // 64) >= 2 * sms:  # two thirds of the SMs or more: qkv's 96 programs beat split-K
        block_n = 256 if 3 * (n // 256) >= 2 * sms else 64
        block_k, split_k, stages = (64, 1, 4) if block_n == 256 else (128, 1, 6)
        if block_n == 64 and k <= 2048 and n % 128 == 0:  # 16 K tiles: six stages fill slowly
            block_n, stages = 128, 4
    else:  # under one wave of programs (one an SM) each keeps more tiles in flight
        block_n, block_k, split_k = 64, 64, 4
        stages = 6 if 4 * (n // 64) < sms else 4
    if grouped:
        block_k = min(block_k, BLOCK_COLS)
    while weight_bytes == 1 and k % (block_k * split_k) and split_k > 1:  # a K four splits do not divide
        split_k //= 2
    # Each pipeline stage holds a [16, block_k] tile of x and a [block_k, block_n] one of the weight.
    stages = min(stages, smem // (block_k * (2 * MAX_ROWS + weight_bytes * block_n)))
    if stages < 2 or n % block_n or k % (block_k * split_k):
        return None
    return SkinnyConfig(block_n, block_k, split_k, stages)


def skinny_applies(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None) -> bool:
    """x [rows, in] @ weight [out, in].T through the kernel: CUDA, half precision, few rows, a
    tiling that divides the weight, and the weight either in x's dtype stored transposed
    (`layers.store_weights_transposed`), or (`weight_scale` given) e4m3 with contiguous rows, as
    `Fp8Linear` keeps it, and float32 scales, one a row or one a row and 128 columns (sm89+, whose
    FP8 conversions it uses)."""
    if not (
        triton is not None
        and x.is_cuda
        and x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.stride(1) == 1
    ):
        return False
    if weight_scale is None:
        stored = weight.dtype == x.dtype and weight.t().is_contiguous()
    else:
        stored = (
            weight.dtype == E4M3
            and weight.is_contiguous()
            and weight_scale.shape in ((weight.shape[0], 1), _groups(weight))
            and weight_scale.dtype == torch.float32
            and (weight_scale.is_contiguous() or weight_scale.shape[1] > 1)  # groups: any strides
            and has_fp8_conversions(x.device)
        )
    sms, smem = _device_limits(x.device)
    if not stored or sms == 0:
        return False
    n, k = weight.shape
    if weight_scale is not None and x.shape[0] == 1:  # the GEMV: any K (masked), N in whole column blocks
        return n % gemv_config(k).block_n == 0
    grouped = weight_scale is not None and weight_scale.shape[1] > 1
    return skinny_config(k, n, sms, smem, weight.element_size(), grouped) is not None


def _groups(weight: torch.Tensor) -> tuple[int, int]:
    """The shape of a weight's scales per row and 128 columns, where its K is whole groups
    (otherwise a shape no scale has)."""
    n, k = weight.shape
    return (n, k // BLOCK_COLS) if k % BLOCK_COLS == 0 else (-1, -1)


@dataclass(frozen=True)
class GemvConfig:
    """The one-row e4m3 GEMV's tiling (`fp8_gemv`): [block_n, block_k] weight tiles, K in
    `split` slices, `num_warps` and `num_stages` of Triton's."""

    block_n: int
    block_k: int
    split: int
    num_warps: int
    num_stages: int


def gemv_config(k: int) -> GemvConfig:
    """The GEMV's tiling for a [1, k] x [k, n] product: [4, 2048] tiles (four output columns a
    program, K in 2,048-wide loads; one power-of-two tile of a shorter K), no K split. On an H100
    (2026-12-07, `bench/fp8_gemm.py --sweep-gemv`: 61-77 tilings a shape, both formats, each
    checked) it was the fastest tiling of every 8B shape at one row against the earlier [8, 1024]
    (K split in two where K >= N) and [32, 256] ones: o 9.45 -> 7.63 us, qkv 11.1 -> 10.8,
    gate_up 48.8 -> 40.5, down 25.1 -> 22.2 (per channel); batch-1 decode 278.5 -> 291.5 tok/s
    per channel, fp8-g128 270.6 -> 271.2 (two runs each, one machine). More bytes in flight a
    program beat more programs; the split stays for a caller's `config` (the sweep)."""
    return GemvConfig(4, min(2048, 1 << (k - 1).bit_length()), 1, 4, 2)


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    arrivals: torch.Tensor,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias) where `skinny_applies` (F.linear is the reference: the tests
    compare against it, and every other case runs it). `arrivals`: int32 zeros, one per
    64 output columns, owned by the caller (one per layer) and left zeroed by every call.

    With `weight_scale` [out, 1] the weight is e4m3 and the product is W8A16: each weight tile is
    converted to x's dtype in registers (exact: e4m3 values are bf16 and fp16 values), the float32
    sums are multiplied by their column's scale, then the bias is added ([out, in / 128]: each
    128-deep partial sum by its column's scale of those 128). It reads one byte a
    weight, half of bf16's; x is not quantized, whatever the checkpoint's activation scheme, so
    for W8A8 schemes it is the reference with activations "none" (`fp8_linear_reference`): more
    accurate than the W8A8 product it stands in for."""
    rows, k = x.shape
    n = weight.shape[0]
    if rows == 1 and weight_scale is not None:
        return fp8_gemv(x, weight, bias, weight_scale, arrivals)
    groups = weight_scale.shape[1] if weight_scale is not None else 1
    cfg = skinny_config(k, n, *_device_limits(x.device), weight.element_size(), groups > 1)
    assert cfg is not None and (cfg.split_k == 1 or arrivals.numel() >= n // cfg.block_n)
    assert groups == 1 or cfg.block_k == BLOCK_COLS  # the kernel takes a K tile for a group
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    parts = torch.empty(cfg.split_k if cfg.split_k > 1 else 0, rows, n, dtype=torch.float32, device=x.device)
    _skinny_kernel[(n // cfg.block_n, cfg.split_k)](
        x, weight, bias if bias is not None else y, weight_scale if weight_scale is not None else y, y, parts,
        arrivals, rows, n, k, x.stride(0), weight.stride(1), weight.stride(0), *_scale_strides(weight_scale),
        HAS_BIAS=bias is not None, ROW_SCALE=weight_scale is not None and groups == 1, GROUPED=groups > 1,
        BLOCK_M=MAX_ROWS, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k, num_warps=4,
        num_stages=cfg.num_stages, **pdl_args(x.device),
    )  # fmt: skip
    return y


def fp8_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    scale: torch.Tensor,
    arrivals: torch.Tensor,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """One row times an e4m3 weight [n, k] without `tl.dot`: each program reads [block_n, block_k]
    tiles along K as the rows lie (long contiguous runs of bytes, no operand layout for the tensor
    cores to shuffle into), converts them to float32 and sums against x, one output column a row
    of the tile. A batch-1 decode step is all such products. H200, 8B shapes (one row, 24
    distinct weights in a graph, 2026-12-02 t): qkv 14.0 -> 9.3 us against the tuned `tl.dot`
    kernel, o 11.3 -> 7.8, gate_up 42.6 -> 29.9 (3.9 TB/s of weight bytes), down 28.0 -> 20.1.
    Where K is split (`gemv_config`, or the `config` a sweep gives), each slice's partial sums go
    to a float32 buffer and the last program of each 64 columns to arrive (its `arrivals`
    counter, left zeroed) adds them in slice order: deterministic, and no second launch."""
    k, n, groups = x.shape[1], weight.shape[0], scale.shape[1]
    cfg = config or gemv_config(k)
    assert n % cfg.block_n == 0 and (
        cfg.split == 1 or (64 % cfg.block_n == 0 and arrivals.numel() >= n // 64)
    )
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    parts = torch.empty(cfg.split if cfg.split > 1 else 0, n, dtype=torch.float32, device=x.device)
    _fp8_gemv_kernel[(n // cfg.block_n, cfg.split)](
        x, weight, scale, bias if bias is not None else y, y, parts, arrivals, n, k, *_scale_strides(scale),
        HAS_BIAS=bias is not None, GROUPED=groups > 1, GROUP=BLOCK_COLS, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, EVEN_K=k % (cfg.split * cfg.block_k) == 0, SPLIT_K=cfg.split,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(x.device),
    )  # fmt: skip
    return y


def _scale_strides(scale: torch.Tensor | None) -> tuple[int, int]:
    """(row, group) strides of a weight's scales: row-major or column-major groups, both taken."""
    return (scale.stride(0), scale.stride(1)) if scale is not None and scale.shape[1] > 1 else (1, 0)


if triton is not None:

    @triton.jit
    def _gemv_store(Y, Scale, Bias, acc, cols, HAS_BIAS: tl.constexpr, GROUPED: tl.constexpr):
        if not GROUPED:  # grouped sums were scaled group by group
            acc *= tl.load(Scale + cols)
        if HAS_BIAS:
            acc += tl.load(Bias + cols).to(tl.float32)
        tl.store(Y + cols, acc.to(Y.dtype.element_ty))

    @triton.jit
    def _gemv_tile(W, k, cols, K, EVEN_K: tl.constexpr):
        """One [BLOCK_N, BLOCK_K] tile of the weight (columns `cols`, K indices `k`) as stored."""
        if EVEN_K:
            return tl.load(W + cols[:, None] * K + k[None, :])
        return tl.load(W + cols[:, None] * K + k[None, :], mask=k[None, :] < K, other=0.0)

    @triton.jit
    def _gemv_step(
        X, w, k, k0, cols, Scale, scale_stride_n, scale_stride_g, K, EVEN_K: tl.constexpr,
        GROUPED: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """A tile's contribution to the columns' sums: its products with x, each 128-deep group
        scaled by its own scale when GROUPED."""
        x = tl.load(X + k) if EVEN_K else tl.load(X + k, mask=k < K, other=0.0)
        products = w.to(tl.float32) * x.to(tl.float32)[None, :]
        if GROUPED:
            sums = tl.sum(tl.reshape(products, [BLOCK_N, BLOCK_K // GROUP, GROUP]), axis=2)
            g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
            at = Scale + cols[:, None] * scale_stride_n + g[None, :] * scale_stride_g
            scales = tl.load(at, mask=g[None, :] < K // GROUP, other=0.0)
            return tl.sum(sums * scales, axis=1)
        return tl.sum(products, axis=1)

    @triton.jit
    def _fp8_gemv_kernel(
        X, W, Scale, Bias, Y, Parts, Arrivals, N, K, scale_stride_n, scale_stride_g, HAS_BIAS: tl.constexpr,
        GROUPED: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """Program (column block, K slice); with SPLIT_K > 1, the counter of 64 columns
        (64 / BLOCK_N column blocks) takes SPLIT_K * 64 / BLOCK_N arrivals. GROUPED: Scale is
        [N, K / GROUP] by its strides, a scale a row and GROUP columns (BLOCK_K a multiple of GROUP).
        The slice's first weight tile is loaded before the wait for the kernel ahead (kernels/pdl.py:
        weights are never written by a step), so under PDL its bytes are in flight while that
        kernel's last blocks finish."""
        col_block, k_slice = tl.program_id(0), tl.program_id(1)
        cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        per_slice = K // SPLIT_K
        first = k_slice * per_slice
        w = _gemv_tile(W, first + ks, cols, K, EVEN_K)
        wait_for_producers(PDL)
        acc = _gemv_step(
            X, w, first + ks, first, cols, Scale, scale_stride_n, scale_stride_g, K, EVEN_K, GROUPED, GROUP,
            BLOCK_N, BLOCK_K,
        )  # fmt: skip
        for k0 in range(first + BLOCK_K, (k_slice + 1) * per_slice, BLOCK_K):
            w = _gemv_tile(W, k0 + ks, cols, K, EVEN_K)
            acc += _gemv_step(
                X, w, k0 + ks, k0, cols, Scale, scale_stride_n, scale_stride_g, K, EVEN_K, GROUPED, GROUP,
                BLOCK_N, BLOCK_K,
            )  # fmt: skip
        admit_dependents(PDL)
        if SPLIT_K == 1:
            _gemv_store(Y, Scale, Bias, acc, cols, HAS_BIAS, GROUPED)
        else:
            tl.store(Parts + k_slice * N + cols, acc)
            group = col_block // (64 // BLOCK_N)
            if last_to_arrive(Arrivals + group, SPLIT_K * (64 // BLOCK_N)):
                group_cols = group * 64 + tl.arange(0, 64)
                total = tl.zeros([64], tl.float32)
                for s in range(SPLIT_K):  # in slice order, whichever arrived last: deterministic
                    total += tl.load(Parts + s * N + group_cols, cache_modifier=".cg")
                tl.atomic_xchg(Arrivals + group, 0)
                _gemv_store(Y, Scale, Bias, total, group_cols, HAS_BIAS, GROUPED)

    @triton.jit
    def _store_rows(Y, Bias, Scale, acc, out, cols, live, HAS_BIAS: tl.constexpr, ROW_SCALE: tl.constexpr):
        if ROW_SCALE:
            acc *= tl.load(Scale + cols)[None, :]
        if HAS_BIAS:
            acc += tl.load(Bias + cols)[None, :].to(tl.float32)
        tl.store(Y + out, acc.to(Y.dtype.element_ty), mask=live)

    @triton.jit
    def _skinny_kernel(
        X, W, Bias, Scale, Y, Parts, Arrivals, M, N, K, x_stride, w_stride_k, w_stride_n, scale_stride_n,
        scale_stride_g,
        HAS_BIAS: tl.constexpr, ROW_SCALE: tl.constexpr, GROUPED: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """Program (column block, K slice). W [K, N] by its strides: unit stride along N for a
        weight stored transposed, along K for an e4m3 one (Triton specializes a stride of 1).
        GROUPED: Scale is [N, K / BLOCK_K] by its strides, a scale a column and BLOCK_K (its group)
        rows of W."""
        wait_for_producers(PDL)
        col_block, k_slice = tl.program_id(0), tl.program_id(1)
        rows = tl.arange(0, BLOCK_M)
        cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        live = rows[:, None] < M
        per_slice = K // SPLIT_K
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(k_slice * per_slice, (k_slice + 1) * per_slice, BLOCK_K):
            x = tl.load(X + rows[:, None] * x_stride + (k0 + ks)[None, :], mask=live, other=0.0)
            w = tl.load(W + (k0 + ks)[:, None] * w_stride_k + cols[None, :] * w_stride_n)
            if GROUPED:
                at = Scale + cols * scale_stride_n + (k0 // BLOCK_K) * scale_stride_g
                acc += tl.dot(x, w.to(x.dtype)) * tl.load(at)[None, :]
            else:
                acc += tl.dot(x, w.to(x.dtype))
        admit_dependents(PDL)
        out = rows[:, None] * N + cols[None, :]
        if SPLIT_K == 1:
            _store_rows(Y, Bias, Scale, acc, out, cols, live, HAS_BIAS, ROW_SCALE)
        else:
            tl.store(Parts + k_slice * M * N + out, acc, mask=live)
            if last_to_arrive(Arrivals + col_block, SPLIT_K):
                total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for s in range(SPLIT_K):  # in slice order, whichever arrived last: deterministic
                    total += tl.load(Parts + s * M * N + out, mask=live, other=0.0, cache_modifier=".cg")
                tl.atomic_xchg(Arrivals + col_block, 0)
                _store_rows(Y, Bias, Scale, total, out, cols, live, HAS_BIAS, ROW_SCALE)
