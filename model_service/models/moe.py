"""The sparse mixture-of-experts MLP of Qwen2-MoE, Qwen3-MoE, Mixtral (and the Qwen3-Next hybrid).

A router linear scores every expert for each token; softmax (float32) over all experts, the
top-k kept, renormalized to sum to one where the model says so (Mixtral always, Qwen by
`norm_topk_prob`), and the token's output is the weighted sum of those experts' SwiGLU MLPs.
Qwen2-MoE / Qwen3-Next add a shared expert that every token goes through, scaled by a sigmoid
gate of its own.

Parameter names are transformers 5.x's (`gate` the router, `experts.gate_up_proj` [E, 2I, H],
`experts.down_proj` [E, H, I]); the loader stacks per-expert hub checkpoints into them
(expert_weights.py).

The block is shaped for expert parallelism: it holds the weights of a contiguous range of
experts (`experts`, all of them by default), routes over all experts, and returns only its own
experts' share, so the layer's output is the sum over the ranks that own the ranges
(distributed/sharding.py, which also splits the shared expert's columns over the ranks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model_service.kernels.experts import fused_experts
from model_service.models.config import ModelConfig
from model_service.models.layers import MLP


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k]) from router logits [T, E], as HF routes."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class StackedExperts(nn.Module):
    """The SwiGLU weights of a contiguous range of experts, one tensor per projection."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, experts: range | None = None) -> None:
        super().__init__()
        experts = experts if experts is not None else range(cfg.num_experts)
        if experts.step != 1 or not 0 <= experts.start < experts.stop <= cfg.num_experts:
            raise ValueError(f"expert range {experts} is not a contiguous part of 0..{cfg.num_experts}")
        self.expert_range = experts
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = StackedExperts(len(experts), cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert: nn.Module | None = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] -> [T, H]: this block's experts' weighted sum (plus the shared expert)."""
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        out = fused_experts(
            x, self.experts.gate_up_proj, self.experts.down_proj, ids - self.expert_range.start, weights
        )
        if self.shared_expert is not None:
            out = out + F.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def mlp_for(cfg: ModelConfig, layer_idx: int) -> nn.Module:
    """Layer `layer_idx`'s MLP: the sparse-MoE block where the config marks the layer sparse,
    else the dense SwiGLU MLP."""
    return SparseMoeBlock(cfg) if cfg.layer_kinds[layer_idx].moe else MLP(cfg)
