"""The experts of a sparse MoE layer over stacked weights: each token's top-k experts, weighted
and summed. A torch reference (one matmul per expert that has tokens); on Hopper/Blackwell in
bf16, a grouped path: two `grouped_mm` launches for all experts, no Python loop over experts and
no host synchronization; and on CUDA with Triton, the fused kernels (kernels/fused_moe.py), which
read each selected expert's weights once for decode-sized batches. `experts_path` is the one
place that picks among them.

Weights are stacked as transformers 5.x keeps them in memory: gate_up [E, 2I, H] (gate rows
first) and down [E, H, I]. `ids` are expert indices *local* to these weights: an id outside
[0, E) is an expert that lives elsewhere (another rank, under expert parallelism) and adds
nothing here, so the layer's output is the sum of every owner's partial output.

gpt-oss's experts add biases (`ExpertBiases`: gate_up's [E, 2I], down's [E, H], the latter
weighted by the routing weight with the rest of the expert's output, as HF computes it) and
activate with the clamped SwiGLU (`ClampedSwiGLU`) instead of SiLU(gate) * up; the reference and
the fused kernels take both (their `biases` and `swiglu`), the grouped path neither.

FP8 experts (e4m3 weights with `ExpertScales`: float32 scales per expert, output row and, for
block-quantized checkpoints, 128 input columns) take the fused kernels at every size where the
device converts e4m3 (sm89+), else the reference, which dequantizes each expert it runs.

`grouped_mm` on CUDA runs its CUTLASS kernel only for bf16 on sm90/sm100; for any other dtype it
falls back to a loop that copies the offsets to the host, which is slower than the reference and
breaks graph capture, so those cases take the reference and the model reports itself not
capturable (`grouped_experts_apply`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model_service.kernels.fp8_gemm import dequantize_groups
from model_service.kernels.fused import silu_and_mul
from model_service.kernels.fused_moe import ExpertBiases, ExpertScales, fused_moe, fused_moe_supported
from model_service.models.config import ClampedSwiGLU

# Where `grouped_mm` could run too, a call takes the fused kernels while its rows average at most
# this many an expert (tokens x top-k / local experts), the CUTLASS grouped GEMM past it; without
# grouped_mm the fused kernels take every size. One layer's experts on an H200, eager as MoE
# prefill runs (`bench/moe.py --tokens ...`, 2026-12-02 y), fused against grouped_mm:
# Qwen3-30B-A3B (128 experts, top-8, I 768) at 32 / 128 / 512 rows an expert -37% / -24% / -4%;
# DeepSeek-V2-Lite's shape (64, top-6, I 1,408) at 48 / 192 / 768 -23% / 0% / +6%; Mixtral's (8,
# top-2, H 4,096, I 14,336) at 128 / 512 -10% / +36%. (Before: fused up to 256 tokens whatever
# the shape, 16 rows an expert on Qwen3-30B-A3B.)
FUSED_MAX_ROWS_PER_EXPERT = 128


def grouped_experts_apply(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `fused_experts` runs the grouped path for weights of this dtype on this device."""
    if device.type != "cuda" or dtype != torch.bfloat16 or not hasattr(F, "grouped_mm"):
        return False
    return torch.cuda.get_device_capability(device)[0] in (9, 10)


def experts_capturable(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether every call `fused_experts` makes for weights of this dtype runs without a host
    sync (so decode steps may be captured in CUDA graphs): the grouped or the fused path."""
    return grouped_experts_apply(dtype, device) or fused_moe_supported(dtype, device)


def experts_path(tokens: int, top_k: int, experts: int, dtype: torch.dtype, device: torch.device) -> str:
    """ "fused", "grouped" or "reference": which implementation `fused_experts` runs for `tokens`
    rows (a Python int, fixed for a captured graph) routed to `top_k` of `experts` local experts
    with weights of `dtype` on `device`. Under expert parallelism a rank holds a share of the
    experts and receives that share of the pairs, so counting its local experts switches to
    grouped_mm earlier than the rows an expert would: conservative, and the same on every rank."""
    grouped = grouped_experts_apply(dtype, device)
    few_rows = tokens * top_k <= FUSED_MAX_ROWS_PER_EXPERT * experts
    if fused_moe_supported(dtype, device) and (few_rows or not grouped):
        return "fused"
    return "grouped" if grouped else "reference"


def fused_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    arrivals: torch.Tensor | None = None,
    scales: ExpertScales | None = None,
) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) for the experts held here.

    x: [T, H]; gate_up: [E, 2I, H]; down: [E, H, I]; ids: [T, k] local expert ids; weights: [T, k]
    float32 routing weights; `scales` with e4m3 weights. Returns [T, H] in x's dtype.
    `arrivals`: the fused path's counters (`fused_moe`), if the caller keeps them.
    """
    path = experts_path(x.shape[0], ids.shape[1], gate_up.shape[0], gate_up.dtype, x.device)
    if path == "fused":
        return fused_moe(x, gate_up, down, ids, weights, arrivals=arrivals, scales=scales)
    if path == "grouped":
        return experts_grouped(x, gate_up, down, ids, weights)
    return experts_reference(x, gate_up, down, ids, weights, scales)


def _expert_weight(
    stack: torch.Tensor, scale: torch.Tensor | None, group: int, expert: int, dtype: torch.dtype
) -> torch.Tensor:
    """Expert `expert`'s weight [N, K] of `stack` in `dtype`: as stored, or e4m3 times its
    scales [N, G] (`group` columns each; 0: one a row)."""
    w = stack[expert]
    return w if scale is None else dequantize_groups(w, scale[expert], group or w.shape[1]).to(dtype)


def clamped_swiglu(gate_up: torch.Tensor, act: ClampedSwiGLU) -> torch.Tensor:
    """HF's `GptOssExperts._apply_gate` over [rows, 2I] with the gate's columns first, then up's
    (the kernels' layout; HF interleaves them, `gpt_oss.kernel_layout` splits them at load):
    (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = gate clamped above at limit."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=act.limit)
    up = up.clamp(min=-act.limit, max=act.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * act.alpha))


def experts_reference(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    scales: ExpertScales | None = None,
    biases: ExpertBiases | None = None,
    swiglu: ClampedSwiGLU | None = None,
) -> torch.Tensor:
    """HF's arithmetic (weight in the model's dtype, index_add into the output), with the token
    rows sorted by expert once instead of a mask per expert; FP8 experts dequantized as used;
    `biases` added to each projection's output and `swiglu` the activation where given
    (gpt-oss's experts), SiLU(gate) * up otherwise."""
    num_experts, top_k = gate_up.shape[0], ids.shape[1]
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat[(flat >= 0) & (flat < num_experts)], minlength=num_experts).tolist()
    start = int((flat[order] < 0).sum())  # remote experts with negative ids sort first
    row_weights = weights.flatten().to(x.dtype)
    gate_up_scale, down_scale = (scales.gate_up, scales.down) if scales is not None else (None, None)
    group = scales.group if scales is not None else 0
    out = torch.zeros_like(x)
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        rows = order[start : start + n]
        tokens = rows // top_k
        w1 = _expert_weight(gate_up, gate_up_scale, group, expert, x.dtype)
        w2 = _expert_weight(down, down_scale, group, expert, x.dtype)
        b1, b2 = (biases.gate_up[expert], biases.down[expert]) if biases is not None else (None, None)
        g = F.linear(x[tokens], w1, b1)
        h = silu_and_mul(g) if swiglu is None else clamped_swiglu(g, swiglu)
        out.index_add_(0, tokens, F.linear(h, w2, b2) * row_weights[rows, None])
        start += n
    return out


def experts_grouped(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Rows sorted by expert, `offs[e]` the end of expert e's rows, every shape fixed by T and k:
    nothing here waits for the device. Rows of remote experts sort last, past offs[-1], where
    grouped_mm leaves them undefined; they are masked out before the combine, a batched
    [1, k] x [k, H] product per token (float32 accumulation, deterministic, unlike an atomic
    index_add in bf16)."""
    num_experts = gate_up.shape[0]
    tokens, top_k = ids.shape
    flat = ids.flatten()
    local = (flat >= 0) & (flat < num_experts)
    key = torch.where(local, flat, num_experts)
    order = key.argsort(stable=True)
    bounds = torch.arange(num_experts, device=x.device, dtype=key.dtype)
    offs = torch.searchsorted(key[order], bounds, right=True).to(torch.int32)
    rows = x[order // top_k]
    h = silu_and_mul(F.grouped_mm(rows, gate_up.transpose(1, 2), offs=offs))
    y = F.grouped_mm(h, down.transpose(1, 2), offs=offs)
    y = torch.empty_like(y).index_copy_(0, order, y)  # back to token-major order
    y = torch.where(local[:, None], y, 0.0).view(tokens, top_k, -1)
    row_weights = torch.where(local, weights.flatten(), 0.0).to(x.dtype).view(tokens, 1, top_k)
    return torch.bmm(row_weights, y).view(tokens, -1)
