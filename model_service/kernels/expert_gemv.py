"""A MoE layer's experts at one token as GEMVs: the dense FP8 GEMV's idea (kernels/skinny_gemm.py,
`fp8_gemv`) applied per expert.

At batch 1 a step reads top_k experts' gate_up and down rows and does a dot product per row.
The fused kernels (kernels/fused_moe.py) run it through `tl.dot` on 16-row tiles, 15 rows of them
masked, with each weight tile laid out as a GEMM operand; on an H100 (2026-12-07 ag, Qwen3-30B-A3B's
shapes) gate_up streamed 2.5 TB/s of its bytes and down 1.6. Here each program reads tiles of an
expert's rows as they lie (contiguous along K), widens them to float32 and sums them against the
token's row: no operand layout, no padded rows, and many small programs. At one token the time
is latency, not bytes, so what matters is how many loads each program has in flight at once:

- gate_up: program (pair, column block) loads its BLOCK_N gate rows and BLOCK_N up rows as one
  [2, BLOCK_N, BLOCK_K] tile a K step, then SiLU(gate) * up in float32, stored in the
  activations' type (as the fused kernel rounds h).
- down: program (token, column block) loads every slot's rows as one [SLOTS, BLOCK_N, BLOCK_K]
  tile a K step (SLOTS: top_k padded to a power of two), weighs each slot's sums and adds them in
  float32 in a fixed order, rounding once: deterministic, no arrival counters, no float32 slot
  rows. Slots whose expert is outside [0, E) (another rank's, under expert parallelism) add
  nothing, as in `fused_moe`.

gpt-oss's experts (`fused_moe`'s `biases` and `swiglu`, constexpr switches that leave every
other family's kernels as they were): gate_up's bias added to the gate and up sums before the
clamped SwiGLU (`glu`), down's to each slot's sums before its routing weight.

FP8 experts (`ExpertScales`): one scale an output row, applied after the K loop, or one a row and
128 input columns, applied per group inside the tile (a tile holds whole groups).

Measured (H100, docs/gpu-notebook.md). 2026-12-07 ah, gate before up and slot after slot, each
waiting for the one before: e4m3 experts 36.5 -> 31.3 us a layer against the tiles, the engine
+8%; bf16 no faster. 2026-12-07 ai, whole tiles (one layer graph-replayed with a sync each call,
us: old GEMVs / these / tiles): e4m3 34.2 / 25.7 / 43.0, per 128 columns 33.7 / 27.7 / 44.2, bf16
48.0 / 44.2 / 47.8; the engine at batch 1 (24 layers) e4m3 590.8-621.3 -> 675 tok/s, bf16 tiles
483-490 -> 492-502, so `fused_moe_config` takes this path at one token for every weight type.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_service.kernels.paged_attention import triton
from model_service.kernels.pdl import pdl_args
from model_service.models.config import ClampedSwiGLU

if triton is not None:
    import triton.language as tl

    from model_service.kernels.pdl import admit_dependents, wait_for_producers

TILE_ELEMENTS = 8192  # a program's weight elements a K step: 64 float32 a thread at 4 warps


@dataclass(frozen=True)
class ExpertGemvTiling:
    """A kernel's tile: `block_n` output columns a program, `block_k` of K a step, `num_warps`."""

    block_n: int
    block_k: int
    num_warps: int = 4


def expert_gemv_tiling(
    k: int, rows_a_column: int, group: int = 0, block_n: int = 4, elements: int = TILE_ELEMENTS
) -> ExpertGemvTiling:
    """`block_n` columns a program, each needing `rows_a_column` weight rows (gate and up: 2; down:
    the padded top_k), and the longest power-of-two K step that keeps the program's tile within
    `elements` (one step for a short K). Block scales need whole groups in a step."""
    block_k = max(16, elements // (rows_a_column * block_n))
    block_k = min(block_k, triton.next_power_of_2(k))
    return ExpertGemvTiling(block_n, max(block_k, group))


def engine_tilings(hidden: int, inter: int, top_k: int, group: int = 0) -> tuple[ExpertGemvTiling, ...]:
    """gate_up's and down's tilings. gate_up: 8 columns a program, K in 2,048-long steps (tiles of
    32K elements); down: 4 columns, tiles of 8K (256-long steps at top_k 8). Best or within 1% of
    it at Qwen3-30B-A3B's shapes in bf16, e4m3 and e4m3 per 128 columns (H100, 2026-12-07 ai,
    `bench/moe.py --tokens 1 --sweep`; docs/gpu-notebook.md)."""
    slots = triton.next_power_of_2(top_k)
    return (
        expert_gemv_tiling(hidden, 2, group, block_n=8, elements=4 * TILE_ELEMENTS),
        expert_gemv_tiling(inter, slots, group),
    )


def expert_gemv_applies(tokens: int, gate_up: torch.Tensor, down: torch.Tensor, group: int = 0) -> bool:
    """One token, both weights contiguous along K (their rows are what a program streams), and
    block scales whose groups tile a power-of-two K step."""
    whole_groups = group == 0 or (group & (group - 1) == 0 and group <= TILE_ELEMENTS // 16)
    return tokens == 1 and gate_up.stride(2) == 1 and down.stride(2) == 1 and whole_groups


def expert_gemv(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
    group: int = 0,
    tilings: tuple[ExpertGemvTiling, ExpertGemvTiling] | None = None,
    biases: tuple[torch.Tensor, torch.Tensor] | None = None,
    swiglu: ClampedSwiGLU | None = None,
) -> torch.Tensor:
    """`fused_moe`'s result (same arguments; e4m3 weights with their [E, rows, G] float32 scales,
    `group` input columns a scale, 0 for one a row; `biases` gate_up's [E, 2I] and down's [E, H])
    in two launches of GEMV programs; `tilings` (gate_up's, down's) for sweeps, else
    `expert_gemv_tiling`'s."""
    tokens, top_k = ids.shape
    num_experts, two_inter, hidden = gate_up.shape
    inter = two_inter // 2
    slots = triton.next_power_of_2(top_k)
    up, dn = tilings or engine_tilings(hidden, inter, top_k, group)
    h = torch.empty(tokens * top_k, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    w8 = gate_up_scale is not None
    gate_up_scale = gate_up_scale.contiguous() if w8 else weights  # weights: unread stand-ins
    down_scale = down_scale.contiguous() if w8 else weights
    up_bias, down_bias = (b.contiguous() for b in biases) if biases is not None else (weights, weights)
    _gemv_gate_up_kernel[(tokens * top_k, triton.cdiv(inter, up.block_n))](
        x, gate_up, gate_up_scale, ids, h, top_k, num_experts, inter, hidden, x.stride(0), gate_up.stride(0),
        gate_up.stride(1), gate_up_scale.stride(0), gate_up_scale.stride(1), gate_up_scale.shape[-1],
        up_bias, up_bias.stride(0), *glu_args(biases, swiglu), W8=w8, GROUP=group, BLOCK_N=up.block_n,
        BLOCK_K=up.block_k, num_warps=up.num_warps, **pdl_args(x.device),
    )  # fmt: skip
    _gemv_down_kernel[(tokens, triton.cdiv(hidden, dn.block_n))](
        h, down, down_scale, ids, weights, out, top_k, num_experts, hidden, inter, down.stride(0),
        down.stride(1), down_scale.stride(0), down_scale.stride(1), down_scale.shape[-1], down_bias,
        down_bias.stride(0), W8=w8, GROUP=group, HAS_BIAS=biases is not None, SLOTS=slots,
        BLOCK_N=dn.block_n, BLOCK_K=dn.block_k, num_warps=dn.num_warps, **pdl_args(x.device),
    )  # fmt: skip
    return out


def glu_args(biases: object | None, swiglu: ClampedSwiGLU | None) -> tuple[float, float, bool, bool]:
    """(ALPHA, LIMIT, HAS_BIAS, CLAMPED) of the gate_up kernels: gpt-oss's clamped SwiGLU where
    `swiglu` is given (else SiLU, the floats unread), its biases where `biases` are."""
    act = swiglu or ClampedSwiGLU()
    return act.alpha, act.limit, biases is not None, swiglu is not None


if triton is not None:

    @triton.jit
    def glu(gate, up, Bias, cols, col_ok, N, ALPHA, LIMIT, HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr):
        """The activation of float32 gate and up sums [.., BLOCK_N] of columns `cols` < N: with
        HAS_BIAS their biases (`Bias`: the expert's [2I] row, gate's first) added, then under
        CLAMPED gpt-oss's SwiGLU, (clamp(up, -LIMIT, LIMIT) + 1) * g * sigmoid(ALPHA * g) with g
        the gate clamped above at LIMIT, else SiLU(gate) * up."""
        if HAS_BIAS:
            gate += tl.load(Bias + cols, mask=col_ok, other=0.0).to(tl.float32)
            up += tl.load(Bias + N + cols, mask=col_ok, other=0.0).to(tl.float32)
        if CLAMPED:
            gate = tl.minimum(gate, LIMIT)
            up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
            return (up + 1.0) * (gate / (1.0 + tl.exp(-ALPHA * gate)))
        return gate / (1.0 + tl.exp(-gate)) * up

    @triton.jit
    def _tile_dots(
        x, W, Scale, rows, s_rows, ok, k0, K, groups, W8: tl.constexpr, GROUP: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """[S, N] float32 partial dot products over K step `k0` of the weight rows starting at
        element offsets `rows` [S, N] of W with `x` [S, 1, BLOCK_K] (float32), block-scaled per
        group (W8 with GROUP > 0: the rows' scales at offsets `s_rows` of Scale); per-row scales
        are the caller's, after K."""
        k = k0 + tl.arange(0, BLOCK_K)
        at = W + rows[:, :, None] + k[None, None, :]
        w = tl.load(at, mask=ok[:, :, None] & (k < K)[None, None, :], other=0.0)
        products = w.to(tl.float32) * x
        if W8 and GROUP > 0:
            S: tl.constexpr = products.shape[0]
            N: tl.constexpr = products.shape[1]
            sums = tl.sum(tl.reshape(products, [S, N, BLOCK_K // GROUP, GROUP]), axis=3)
            g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
            scales = tl.load(
                Scale + s_rows[:, :, None] + g[None, None, :],
                mask=ok[:, :, None] & (g < groups)[None, None, :],
                other=0.0,
            )
            return tl.sum(sums * scales, axis=2)
        return tl.sum(products, axis=2)

    @triton.jit
    def _gemv_gate_up_kernel(
        X, W, Scale, Ids, Hout, TOP_K, E, N, K, x_stride, w_stride_e, w_stride_n, s_stride_e, s_stride_n,
        groups, Bias, b_stride_e, ALPHA, LIMIT, HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr,
        W8: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        """h[pair, cols] = SiLU(x[token] . W[e, cols]) * (x[token] . W[e, N + cols]), N = I,
        token = pair // TOP_K (Ids [T, TOP_K] read flat); nothing for another rank's expert.
        Gate and up rows are one [2, BLOCK_N, BLOCK_K] tile a K step: both in flight at once.
        gpt-oss's biases and clamped SwiGLU under HAS_BIAS and CLAMPED (`glu`)."""
        wait_for_producers(PDL)
        pair = tl.program_id(0)
        expert = tl.load(Ids + pair).to(tl.int64)
        if (expert >= 0) & (expert < E):
            cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            part = tl.arange(0, 2)
            row = part[:, None] * N + cols[None, :]  # [2, BLOCK_N]: gate's rows, then up's
            rows, s_rows = expert * w_stride_e + row * w_stride_n, expert * s_stride_e + row * s_stride_n
            ok = (cols < N)[None, :] & (part < 2)[:, None]
            x_row = X + (pair // TOP_K) * x_stride
            acc = tl.zeros([2, BLOCK_N], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)[None, None, :]
                acc += _tile_dots(x, W, Scale, rows, s_rows, ok, k0, K, groups, W8, GROUP, BLOCK_K)
            admit_dependents(PDL)
            if W8 and GROUP == 0:
                acc *= tl.load(Scale + s_rows, mask=ok, other=0.0)
            gate = tl.sum(tl.where(part[:, None] == 0, acc, 0.0), axis=0)
            up = tl.sum(tl.where(part[:, None] == 1, acc, 0.0), axis=0)
            h = glu(gate, up, Bias + expert * b_stride_e, cols, cols < N, N, ALPHA, LIMIT, HAS_BIAS, CLAMPED)
            tl.store(Hout + pair * N + cols, h.to(Hout.dtype.element_ty), mask=cols < N)

    @triton.jit
    def _gemv_down_kernel(
        Hin, W, Scale, Ids, Weights, Out, TOP_K, E, N, K, w_stride_e, w_stride_n, s_stride_e, s_stride_n,
        groups, Bias, b_stride_e, W8: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
        SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """out[token, cols] = sum over the token's slots of weight * (h[pair] . W[e, cols]
        (+ Bias[e, cols] under HAS_BIAS)) in float32, N = H, rounded once; another rank's experts
        add nothing. Every slot's rows are one [SLOTS, BLOCK_N, BLOCK_K] tile a K step (SLOTS:
        top_k padded to a power of two), so no slot's loads wait for another's."""
        wait_for_producers(PDL)
        token = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        slot = tl.arange(0, SLOTS)
        pair = token * TOP_K + slot
        expert = tl.load(Ids + pair, mask=slot < TOP_K, other=-1).to(tl.int64)
        used = (slot < TOP_K) & (expert >= 0) & (expert < E)
        expert = tl.where(used, expert, 0)
        rows = expert[:, None] * w_stride_e + cols[None, :] * w_stride_n  # [SLOTS, BLOCK_N]
        s_rows = expert[:, None] * s_stride_e + cols[None, :] * s_stride_n
        ok = used[:, None] & (cols < N)[None, :]
        acc = tl.zeros([SLOTS, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            h_ok = used[:, None] & (k < K)[None, :]
            h = tl.load(Hin + pair[:, None] * K + k[None, :], mask=h_ok, other=0.0)
            acc += _tile_dots(
                h.to(tl.float32)[:, None, :], W, Scale, rows, s_rows, ok, k0, K, groups, W8, GROUP, BLOCK_K,
            )  # fmt: skip
        admit_dependents(PDL)
        if W8 and GROUP == 0:
            acc *= tl.load(Scale + s_rows, mask=ok, other=0.0)
        if HAS_BIAS:
            bias = tl.load(Bias + expert[:, None] * b_stride_e + cols[None, :], mask=ok, other=0.0)
            acc += bias.to(tl.float32)
        weight = tl.load(Weights + pair, mask=used, other=0.0)
        total = tl.sum(acc * weight[:, None], axis=0)
        tl.store(Out + token * N + cols, total.to(Out.dtype.element_ty), mask=cols < N)
