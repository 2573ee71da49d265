"""The sparse mixture-of-experts MLP of Qwen2-MoE, Qwen3-MoE, Mixtral, DeepSeek-V2/V3 (and the
Qwen3-Next hybrid).

A router linear scores every expert for each token; softmax (float32) over all experts, the
top-k kept, renormalized to sum to one where the model says so (Mixtral always, Qwen by
`norm_topk_prob`), and the token's output is the weighted sum of those experts' SwiGLU MLPs.
DeepSeek routes within groups of experts and scores V3's by sigmoid (`route`, `Routing`).
Qwen2-MoE / Qwen3-Next add a shared expert that every token goes through, scaled by a sigmoid
gate of its own; DeepSeek's shared experts (`shared_experts`, one MLP as wide as all of them)
are added ungated.

Parameter names are transformers 5.x's (`gate` the router, `experts.gate_up_proj` [E, 2I, H],
`experts.down_proj` [E, H, I]); the loader stacks per-expert hub checkpoints into them
(expert_weights.py).

The block is shaped for expert parallelism: it holds the weights of a contiguous range of
experts (`experts`, all of them by default), routes over all experts, and returns only its own
experts' share, so the layer's output is the sum over the ranks that own the ranges
(distributed/sharding.py, which also splits the shared expert's columns over the ranks).

Where the shared expert is as wide as a whole number of experts, it is kept as the last experts of
the stack and routed to every token (`shared_expert_slots`): the experts' kernels compute it with
the routed ones, its GEMM launches gone from every decode step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model_service.kernels.experts import experts_capturable, experts_path, fused_experts
from model_service.kernels.fp8_gemm import dequantize_groups
from model_service.kernels.fused_moe import (
    ROUTER_MAX_ROWS,
    ExpertScales,
    fused_counters,
    route_hidden,
    route_topk,
)
from model_service.models.config import PLAIN_TOP_K, ModelConfig, Routing
from model_service.models.layers import MLP

# Rows a layer's kept arrival counters cover: every decode step and captured graph; a larger call
# (a prefill chunk on the fused path) makes zeroed ones of its own, a memset launch more.
COUNTED_TOKENS = 256


def route(
    logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    routing: Routing = PLAIN_TOP_K,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k]) from router logits [T, E], as HF routes.

    With groups, only experts of the `topk_groups` best groups may be chosen; `bias` (V3's
    correction) moves the choice, never the weights."""
    logits = logits.float()
    scores = torch.softmax(logits, dim=-1) if routing.scoring == "softmax" else logits.sigmoid()
    choice = scores if bias is None else scores + bias.float()
    if routing.group_score is not None:
        choice = _within_best_groups(choice, routing)
    ids = torch.topk(choice, top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)  # DeepSeek's guard; exact for Qwen
    return weights * routing.scaling_factor, ids


def _within_best_groups(choice: torch.Tensor, routing: Routing) -> torch.Tensor:
    """`choice` with the experts outside each token's `topk_groups` best groups masked out: to
    0 under V2's softmax (as DeepSeek's code; scores are positive), to -inf under V3's."""
    grouped = choice.view(choice.shape[0], routing.num_groups, -1)
    if routing.group_score == "max":
        group_scores = grouped.max(dim=-1).values
    else:
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
    best = torch.topk(group_scores, routing.topk_groups, dim=-1)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    fill = 0.0 if routing.group_score == "max" else float("-inf")
    return grouped.masked_fill(~keep[:, :, None], fill).view_as(choice)


class Router(nn.Linear):
    """The router's linear, plus V3's per-expert selection bias where the routing has one
    (`e_score_correction_bias`, its checkpoint name)."""

    def __init__(self, hidden: int, num_experts: int, correction_bias: bool) -> None:
        super().__init__(hidden, num_experts, bias=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts)) if correction_bias else None


class Experts(nn.Module):
    """A MoE layer's expert weights, of whatever family: what the executor asks before it
    captures decode steps in CUDA graphs."""

    def capturable(self, device: torch.device) -> bool:
        """Whether every call on `device` runs without a host sync (no token counts read back)."""
        raise NotImplementedError


class StackedExperts(Experts):
    """The SwiGLU weights of a contiguous range of experts, one tensor per projection. In FP8
    (quantized online, `fp8_linear.quantize_experts`, or an FP8 checkpoint's) they are e4m3 with
    float32 scales per expert, output row and `scale_group` input columns (0: one a row):
    `gate_up_scale` [E, 2I, G], `down_scale` [E, H, G']. Half the bytes a decode step reads,
    the bytes that bound it."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.register_buffer("gate_up_scale", None)
        self.register_buffer("down_scale", None)
        self.scale_group = 0

    def capturable(self, device: torch.device) -> bool:
        return experts_capturable(self.gate_up_proj.dtype, device)

    def scales(self) -> ExpertScales | None:
        """The scales of FP8 weights, None for weights in a float type."""
        if self.gate_up_scale is None:
            return None
        return ExpertScales(self.gate_up_scale, self.down_scale, self.scale_group)


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, experts: range | None = None) -> None:
        super().__init__()
        experts = experts if experts is not None else range(cfg.num_experts)
        if experts.step != 1 or not 0 <= experts.start < experts.stop <= cfg.num_experts:
            raise ValueError(f"expert range {experts} is not a contiguous part of 0..{cfg.num_experts}")
        self.expert_range = experts
        self.top_k, self.renormalize, self.routing = cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.routing
        self.gate = Router(cfg.hidden_size, cfg.num_experts, cfg.routing.correction_bias)
        self.shared_slots = shared_expert_slots(cfg)
        stacked = len(experts) + self.shared_slots
        self.experts = StackedExperts(stacked, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert_gate: nn.Module | None = None
        # Qwen's `shared_expert` behind `shared_expert_gate`; DeepSeek's `shared_experts`, ungated.
        self.shared_name = "shared_expert" if cfg.shared_expert_gated else "shared_experts"
        if cfg.shared_expert_intermediate_size:
            if not self.shared_slots:
                setattr(self, self.shared_name, MLP(cfg, cfg.shared_expert_intermediate_size))
            if cfg.shared_expert_gated:
                self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        self.arrivals: torch.Tensor | None = None  # the fused kernels' counters, made on first use

    def select_experts(
        self, x: torch.Tensor, counters: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(weights [T, k (+ shared slots)] float32, this block's local expert ids, the shared
        expert's gate [T] where the routing kernel computed it for a separate shared MLP, else
        None) of x's rows. On the fused path routing is one kernel (instead of ~8 launches, ~20
        with DeepSeek's groups, which cost as much as the experts in a decode step): up to
        ROUTER_MAX_ROWS rows with the router's logits, and Qwen's shared-expert gate, computed
        inside it (`route_hidden`, given the `counters`), more after the router's cuBLAS GEMM.
        With `shared_slots` every token's pairs end with the shared expert's slots."""
        gate, routing, first = self.gate, self.routing, self.expert_range.start
        bias = gate.e_score_correction_bias
        gate_up = self.experts.gate_up_proj
        pairs = self.top_k + self.shared_slots  # a token's, as `fused_experts` will count them
        fused = experts_path(x.shape[0], pairs, gate_up.shape[0], gate_up.dtype, x.device) == "fused"
        if fused and x.shape[0] <= ROUTER_MAX_ROWS and counters is not None:
            return self._route_in_kernel(x, counters)
        logits = F.linear(x.float(), gate.weight.float()) if routing.float32_logits else gate(x)
        if fused:
            weights, ids = route_topk(logits, self.top_k, self.renormalize, routing, bias, first)
        else:
            weights, ids = route(logits, self.top_k, self.renormalize, routing, bias)
            ids = ids - first
        if not self.shared_slots:
            return weights, ids, None
        gated = F.sigmoid(self.shared_expert_gate(x))[:, 0] if self.shared_expert_gate is not None else None
        return *with_shared_slots(weights, ids, self.shared_slots, len(self.expert_range), gated), None

    def _route_in_kernel(
        self, x: torch.Tensor, counters: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`select_experts` in the one routing launch (`route_hidden`), the shared expert's gate
        and slots included."""
        shared_gate, scale, gated = self.shared_expert_gate, None, None
        if type(shared_gate) is nn.Linear:  # a float weight the kernel reads as it is
            scale = torch.empty(x.shape[0], dtype=x.dtype, device=x.device)
            gated = (shared_gate.weight, scale)
        gate, first = self.gate, self.expert_range.start
        args = (self.top_k, self.renormalize, counters[:ROUTER_MAX_ROWS], self.routing)
        slots = (self.shared_slots, len(self.expert_range))
        weights, ids = route_hidden(x, gate.weight, *args, gate.e_score_correction_bias, first, gated, *slots)
        return weights, ids, None if self.shared_slots else scale

    def counters(self, x: torch.Tensor) -> torch.Tensor | None:
        """The fused kernels' arrival counters on x's device (the routing kernel's first, then the
        down kernel's for up to COUNTED_TOKENS rows; a larger call makes its own), made on the
        first call, which is eager (the warm-up before every graph capture); None when a capture
        comes first (made inside it, they would hold garbage until a replay zeroed them); None off
        CUDA, where they are unused."""
        if not x.is_cuda:
            return None
        if self.arrivals is None and not torch.cuda.is_current_stream_capturing():
            size = ROUTER_MAX_ROWS + fused_counters(COUNTED_TOKENS, self.gate.in_features)
            self.arrivals = torch.zeros(size, dtype=torch.int32, device=x.device)
        return self.arrivals if self.arrivals is not None and self.arrivals.device == x.device else None

    def checkpoint_split(self, prefix: str, tensors: dict[str, torch.Tensor]) -> None:
        """`tensors` (`layers.checkpoint_tensors`: checkpoint names, `prefix` this block's) with the
        shared expert's slots taken back out of the experts' stack under the shared expert's own
        names: the loader's stacking (`expert_weights._shared_slots`) undone."""
        if not self.shared_slots:
            return
        routed, experts, shared = len(self.expert_range), f"{prefix}experts", f"{prefix}{self.shared_name}"
        gate_up, down = tensors[f"{experts}.gate_up_proj"], tensors[f"{experts}.down_proj"]
        tensors[f"{experts}.gate_up_proj"], tensors[f"{experts}.down_proj"] = gate_up[:routed], down[:routed]
        mlp = slots_as_mlp(gate_up[routed:], down[routed:])
        tensors.update({f"{shared}.{p}.weight": w for p, w in zip(SHARED_PROJECTIONS, mlp, strict=True)})

    def unfuse_shared_expert(self, cfg: ModelConfig) -> None:
        """The shared expert's slots taken out of the stack into its own MLP again (the tensors
        `checkpoint_split` gives). Expert parallelism needs it: each rank holds whole experts, so
        fused the shared expert would live on one rank, which would compute it for every token
        while the others wait; as an MLP it is split by columns over all ranks (sharding). Slots
        quantized with the experts (`--quantization fp8`: e4m3, scales a slot's rows) come out
        dequantized to the router's (the compute) dtype, the values the fused block computed
        with: an MLP has no scales a slot, and bare e4m3 weights would not run."""
        if not self.shared_slots:
            return
        experts, routed = self.experts, len(self.expert_range)
        gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
        slots, scales = (gate_up[routed:], down[routed:]), experts.scales()
        if scales is not None:
            dtype = self.gate.weight.dtype
            slots = tuple(
                dequantize_groups(w, s[routed:], scales.group or w.shape[-1]).to(dtype)
                for w, s in zip(slots, (scales.gate_up, scales.down), strict=True)
            )
            experts.gate_up_scale, experts.down_scale = scales.gate_up[:routed], scales.down[:routed]
        gate, up, shared_down = slots_as_mlp(*slots)
        with torch.device("meta"):
            mlp = MLP(cfg, cfg.shared_expert_intermediate_size)
        mlp.gate_up_proj.weight = nn.Parameter(torch.cat([gate, up]), requires_grad=False)
        mlp.down_proj.weight = nn.Parameter(shared_down, requires_grad=False)
        experts.gate_up_proj = nn.Parameter(gate_up[:routed], requires_grad=False)
        experts.down_proj = nn.Parameter(down[:routed], requires_grad=False)
        setattr(self, self.shared_name, mlp)
        self.shared_slots = 0

    def shared_mlp(self) -> nn.Module | None:
        """The always-on expert, if the model has one (under its checkpoint name)."""
        return getattr(self, self.shared_name, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] -> [T, H]: this block's experts' weighted sum (plus the shared expert)."""
        experts, counters = self.experts, self.counters(x)
        weights, ids, gated = self.select_experts(x, counters)
        down = counters[ROUTER_MAX_ROWS:] if counters is not None else None
        out = fused_experts(x, experts.gate_up_proj, experts.down_proj, ids, weights, down, experts.scales())
        shared = self.shared_mlp()
        if shared is None:
            return out
        if gated is not None:  # the routing kernel's sigmoid(gate(x)): one launch for the scale and the sum
            return torch.addcmul(out, gated[:, None], shared(x))
        if self.shared_expert_gate is not None:
            return out + F.sigmoid(self.shared_expert_gate(x)) * shared(x)
        return out + shared(x)


SHARED_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # the shared expert's, by checkpoint name


def slots_as_mlp(
    gate_up: torch.Tensor, down: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The shared expert's (gate_proj, up_proj, down_proj) weights from its slots' stacked
    gate_up [S, 2I, H] and down [S, H, I]: the loader's split (`expert_weights._shared_slots`) undone."""
    gate, up = gate_up.chunk(2, dim=1)
    return gate.flatten(0, 1), up.flatten(0, 1), torch.cat(down.unbind(0), dim=1)


def shared_expert_slots(cfg: ModelConfig) -> int:
    """How many expert slots of the stack the shared expert takes (0: it stays a separate MLP).
    Fused (SGLang's "shared experts fusion"), the shared expert is n more experts of the routed
    experts' width at the end of `StackedExperts` (the loader moves its weights there,
    `expert_weights.stack_expert_tensors`) and routing gives every token n more pairs (weight
    sigmoid(shared gate) for Qwen, 1 for DeepSeek): the experts' kernels compute it with the
    routed ones, two GEMM launches and the add less a layer, summed with them in float32 before
    one rounding. It applies where the shared width is a whole number of expert widths (Qwen3-Next
    512 / 512; DeepSeek n_shared x moe_intermediate; Qwen1.5-MoE 4 x 1,408) and the weights are
    those of the experts' kind: not for an FP8 checkpoint, whose shared expert may be quantized
    otherwise than its experts (or not at all); online FP8 quantizes the fused stack as experts
    are (per row, W8A16). Tensor parallelism cuts every slot's columns as the experts'; expert
    parallelism takes them back out into the MLP (`SparseMoeBlock.unfuse_shared_expert`; online
    FP8's dequantized). LoRA on MoE layers' MLPs is refused whatever the layout (`lora.adapter`)."""
    width, inter = cfg.shared_expert_intermediate_size, cfg.moe_intermediate_size
    fusable = width and inter and width % inter == 0 and cfg.quantization is None and not cfg.mlp_bias
    return width // inter if fusable and cfg.hidden_act == "silu" else 0


def with_shared_slots(
    weights: torch.Tensor, ids: torch.Tensor, slots: int, first_id: int, gate: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids) [T, k] with `slots` pairs appended to each token: ids first_id.. (the
    shared expert's slots in the stack), weights `gate` [T] (Qwen's sigmoid, as its linear and
    sigmoid round it) or 1 (DeepSeek's ungated shared experts)."""
    tokens = ids.shape[0]
    extra_ids = torch.arange(first_id, first_id + slots, dtype=ids.dtype, device=ids.device)
    extra_ids = extra_ids.expand(tokens, -1)
    extra = gate.float()[:, None] if gate is not None else weights.new_ones(tokens, 1)
    return torch.cat([weights, extra.expand(-1, slots)], dim=1), torch.cat([ids, extra_ids], dim=1)


def mlp_for(cfg: ModelConfig, layer_idx: int) -> nn.Module:
    """Layer `layer_idx`'s MLP: the sparse-MoE block where the config marks the layer sparse,
    else the dense SwiGLU MLP."""
    return SparseMoeBlock(cfg) if cfg.layer_kinds[layer_idx].moe else MLP(cfg)
