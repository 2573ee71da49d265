"""OpenAI's gpt-oss (gpt-oss-20b / 120b): the Llama decoder (`llama.py`) with gpt-oss's
attention and MoE, as HF's modeling_gpt_oss.py defines them.

What differs, each read from `ModelConfig` (config.py's `_gpt_oss_from_hf`) or fixed here:
- Attention has q/k/v/o biases, alternates sliding-window and full layers (`layer_types`), rotates
  with YaRN, and each head has a learned sink: a logit that joins every softmax's denominator
  without a value (`SinkAttention`; both attention backends add it, the Triton kernels under
  their `SINKS` switch).
- Every layer's MLP is a MoE (`GptOssMoe`): a router with a bias, a softmax over the top-k logits
  (Mixtral's renormalized top-k), experts with biases whose activation is the clamped SwiGLU
  (`ModelConfig.expert_swiglu`) over gate/up columns interleaved as HF stores them. The experts
  run in torch (one matmul pair per expert with tokens): the fused MoE kernels compute neither
  the biases nor the clamp, so they are never handed these weights.
Parameter names and layouts are HF's (`mlp.router`, `mlp.experts.gate_up_proj` [E, H, 2I] and
its `_bias`, `down_proj` [E, I, H], `self_attn.sinks`); MXFP4 experts are dequantized to them at
load (mxfp4.py).
"""

from __future__ import annotations

import torch
from torch import nn

from model_service.models.config import ClampedSwiGLU, ModelConfig
from model_service.models.context import ForwardContext
from model_service.models.llama import Attention, DecoderLayer, DecoderModel


class SinkAttention(Attention):
    """Attention whose heads each add exp(sink) to their softmax's denominator."""

    shardable_by_heads = False  # tensor parallelism would have to cut the sinks too: refused (sharding.py)

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads))

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
        ctx: ForwardContext,
    ) -> torch.Tensor:  # fmt: skip
        return ctx.attention.forward(self.layer_idx, q, k, v, rope, self.head_norms(), sinks=self.sinks)


def clamped_swiglu(gate_up: torch.Tensor, act: ClampedSwiGLU) -> torch.Tensor:
    """HF's `GptOssExperts._apply_gate` over [rows, 2I] with gate and up interleaved column by
    column: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = gate clamped above."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(max=act.limit)
    up = up.clamp(min=-act.limit, max=act.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * act.alpha))


class GptOssExperts(nn.Module):
    """Every expert's weights and biases, stacked as HF keeps them ([in, out] per expert)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        experts, hidden, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(experts, hidden, 2 * inter))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(experts, 2 * inter))
        self.down_proj = nn.Parameter(torch.empty(experts, inter, hidden))
        self.down_proj_bias = nn.Parameter(torch.empty(experts, hidden))
        assert cfg.expert_swiglu is not None, "gpt-oss's config sets its experts' activation"
        self.act = cfg.expert_swiglu

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]): x [T, H], ids and weights [T, k]."""
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            rows, slots = torch.where(ids == e)
            h = clamped_swiglu(x[rows] @ self.gate_up_proj[e] + self.gate_up_proj_bias[e], self.act)
            y = h @ self.down_proj[e] + self.down_proj_bias[e]
            out.index_add_(0, rows, (y * weights[rows, slots, None]).to(x.dtype))
        return out


class GptOssMoe(nn.Module):
    """Router (with a bias) -> the top-k logits' softmax -> the experts' weighted sum."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=True)
        self.experts = GptOssExperts(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, ids = torch.topk(self.router(x), self.top_k, dim=-1)
        return self.experts(x, ids, torch.softmax(top, dim=-1))


class GptOssDecoderLayer(DecoderLayer):
    attention_class = SinkAttention

    def make_mlp(self, cfg: ModelConfig, layer_idx: int) -> nn.Module:
        return GptOssMoe(cfg)


class GptOssModel(DecoderModel):
    layer_class = GptOssDecoderLayer
