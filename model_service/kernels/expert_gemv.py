"""A MoE layer's experts at one token as GEMVs: the dense FP8 GEMV's idea (kernels/skinny_gemm.py,
`fp8_gemv`) applied per expert.

At batch 1 a step reads top_k experts' gate_up and down rows and does a dot product per row.
The fused kernels (kernels/fused_moe.py) run it through `tl.dot` on 16-row tiles, 15 rows of them
masked, with each weight tile laid out as a GEMM operand; on an H100 (2026-12-07 ag, Qwen3-30B-A3B's
shapes) gate_up streamed 2.5 TB/s of its bytes and down 1.6. Here each program reads [BLOCK_N,
BLOCK_K] tiles of an expert's rows as they lie (runs of 2 KB along K), widens them to float32 and
sums them against the token's row: no operand layout, no padded rows, and many small programs.

- gate_up: program (pair, column block) computes BLOCK_N gate and up sums of its pair's expert,
  then SiLU(gate) * up in float32, stored in the activations' type (as the fused kernel rounds h).
- down: program (token, column block) loops over the token's top_k slots in slot order, adding
  weight * (h[pair] . down[e, cols]) in float32, and rounds once: deterministic, no arrival
  counters, no float32 slot rows. Slots whose expert is outside [0, E) (another rank's, under
  expert parallelism) add nothing, as in `fused_moe`.

FP8 experts (`ExpertScales`): one scale an output row, applied after the K loop, or one a row and
128 input columns, applied per group inside the tile (a tile holds whole groups).

Measured (H100, 2026-12-07 ah, docs/gpu-notebook.md): e4m3 experts at one token 36.5 -> 31.3 us
a layer (still only ~1.2 TB/s of their 37.7 MB: latency, not bytes, bounds them), the engine
+8%; bf16 experts no faster than the tiles (19.4 + 17.7 us against 20.2 + 16.1), so
`fused_moe_config` takes this path for e4m3 only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_service.kernels.paged_attention import triton
from model_service.kernels.pdl import pdl_args

if triton is not None:
    import triton.language as tl

    from model_service.kernels.pdl import admit_dependents, wait_for_producers

RUN_BYTES = 2048  # a program's contiguous bytes of a weight row a K step (the dense GEMV's tile)


@dataclass(frozen=True)
class ExpertGemvTiling:
    block_n: int
    block_k: int


def expert_gemv_tiling(k: int, item_bytes: int, group: int = 0) -> ExpertGemvTiling:
    """Four rows a program and 2 KB of each a K step (the dense FP8 GEMV's [4, 2048] e4m3 tile,
    its fastest at every 8B shape at one row); a shorter K in one power-of-two tile. Block
    scales need whole groups in a tile."""
    block_k = min(RUN_BYTES // item_bytes, triton.next_power_of_2(k))
    return ExpertGemvTiling(4, max(block_k, group))


def expert_gemv_applies(tokens: int, gate_up: torch.Tensor, down: torch.Tensor, group: int = 0) -> bool:
    """One token, both weights contiguous along K (their rows are what a program streams), and
    block scales whose groups tile a power-of-two K step."""
    whole_groups = group == 0 or (group & (group - 1) == 0 and group <= RUN_BYTES)
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
) -> torch.Tensor:
    """`fused_moe`'s result (same arguments; e4m3 weights with their [E, rows, G] float32 scales,
    `group` input columns a scale, 0 for one a row) in two launches of GEMV programs."""
    tokens, top_k = ids.shape
    num_experts, two_inter, hidden = gate_up.shape
    inter = two_inter // 2
    h = torch.empty(tokens * top_k, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    w8 = gate_up_scale is not None
    gate_up_scale = gate_up_scale.contiguous() if w8 else weights  # weights: unread stand-ins
    down_scale = down_scale.contiguous() if w8 else weights
    up = expert_gemv_tiling(hidden, gate_up.element_size(), group)
    _gemv_gate_up_kernel[(tokens * top_k, triton.cdiv(inter, up.block_n))](
        x, gate_up, gate_up_scale, ids, h, top_k, num_experts, inter, hidden, x.stride(0), gate_up.stride(0),
        gate_up.stride(1), gate_up_scale.stride(0), gate_up_scale.stride(1), gate_up_scale.shape[-1],
        W8=w8, GROUP=group, BLOCK_N=up.block_n, BLOCK_K=up.block_k, num_warps=4, **pdl_args(x.device),
    )  # fmt: skip
    dn = expert_gemv_tiling(inter, down.element_size(), group)
    _gemv_down_kernel[(tokens, triton.cdiv(hidden, dn.block_n))](
        h, down, down_scale, ids, weights, out, top_k, num_experts, hidden, inter, down.stride(0),
        down.stride(1), down_scale.stride(0), down_scale.stride(1), down_scale.shape[-1], W8=w8, GROUP=group,
        BLOCK_N=dn.block_n, BLOCK_K=dn.block_k, num_warps=4, **pdl_args(x.device),
    )  # fmt: skip
    return out


if triton is not None:

    @triton.jit
    def _row_dots(
        X, W, Scale, rows, row_ok, K, w_stride_n, s_stride_n, groups, W8: tl.constexpr, GROUP: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """[BLOCK_N] float32 dot products of weight rows `rows` (W and Scale at their expert,
        each row contiguous along K) with the vector at X, scaled (W8) per row or per group."""
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + ks
            x = tl.load(X + k, mask=k < K, other=0.0).to(tl.float32)
            at = W + rows[:, None].to(tl.int64) * w_stride_n + k[None, :]
            w = tl.load(at, mask=row_ok[:, None] & (k < K)[None, :], other=0.0)
            products = w.to(tl.float32) * x[None, :]
            if W8 and GROUP > 0:
                sums = tl.sum(tl.reshape(products, [BLOCK_N, BLOCK_K // GROUP, GROUP]), axis=2)
                g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
                scales = tl.load(
                    Scale + rows[:, None] * s_stride_n + g[None, :],
                    mask=row_ok[:, None] & (g < groups)[None, :],
                    other=0.0,
                )
                acc += tl.sum(sums * scales, axis=1)
            else:
                acc += tl.sum(products, axis=1)
        if W8 and GROUP == 0:
            acc *= tl.load(Scale + rows * s_stride_n, mask=row_ok, other=0.0)
        return acc

    @triton.jit
    def _gemv_gate_up_kernel(
        X, W, Scale, Ids, Hout, TOP_K, E, N, K, x_stride, w_stride_e, w_stride_n, s_stride_e, s_stride_n,
        groups, W8: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        """h[pair, cols] = SiLU(x[token] . W[e, cols]) * (x[token] . W[e, N + cols]), N = I,
        token = pair // TOP_K (Ids [T, TOP_K] read flat); nothing for another rank's expert."""
        wait_for_producers(PDL)
        pair = tl.program_id(0)
        expert = tl.load(Ids + pair).to(tl.int64)
        if (expert >= 0) & (expert < E):
            cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = cols < N
            w, s, x = W + expert * w_stride_e, Scale + expert * s_stride_e, X + (pair // TOP_K) * x_stride
            wn, sn = w_stride_n, s_stride_n
            gate = _row_dots(x, w, s, cols, col_ok, K, wn, sn, groups, W8, GROUP, BLOCK_N, BLOCK_K)
            up = _row_dots(x, w, s, N + cols, col_ok, K, wn, sn, groups, W8, GROUP, BLOCK_N, BLOCK_K)
            admit_dependents(PDL)
            h = gate / (1.0 + tl.exp(-gate)) * up
            tl.store(Hout + pair * N + cols, h.to(Hout.dtype.element_ty), mask=col_ok)

    @triton.jit
    def _gemv_down_kernel(
        Hin, W, Scale, Ids, Weights, Out, TOP_K, E, N, K, w_stride_e, w_stride_n, s_stride_e, s_stride_n,
        groups, W8: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        """out[token, cols] = sum over the token's slots, in slot order, of weight * (h[pair] .
        W[e, cols]) in float32, N = H, rounded once; another rank's experts add nothing."""
        wait_for_producers(PDL)
        token = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        wn, sn = w_stride_n, s_stride_n
        total = tl.zeros([BLOCK_N], tl.float32)
        for j in range(TOP_K):
            pair = token * TOP_K + j
            expert = tl.load(Ids + pair).to(tl.int64)
            if (expert >= 0) & (expert < E):
                w, s = W + expert * w_stride_e, Scale + expert * s_stride_e
                h = Hin + pair * K
                acc = _row_dots(h, w, s, cols, col_ok, K, wn, sn, groups, W8, GROUP, BLOCK_N, BLOCK_K)
                total += tl.load(Weights + pair) * acc
        admit_dependents(PDL)
        tl.store(Out + token * N + cols, total.to(Out.dtype.element_ty), mask=col_ok)
