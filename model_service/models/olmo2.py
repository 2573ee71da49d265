"""OLMo 2 (HF's `modeling_olmo2.py`): a Llama-shaped decoder whose blocks are normalized after,
not before: each layer is x + post_attention_layernorm(attn(x)), then
h + post_feedforward_layernorm(mlp(h)), and attention RMS-normalizes q and k over the whole
projection (all heads at once, one weight of num_heads * head_dim) before RoPE.

The whole-projection norms run here in the module, not in the attention backend (its fused
`HeadNorms` normalize each head on its own: another number). A norm over every head cannot be
split by heads, so tensor parallelism refuses this attention (`shardable_by_heads`).
"""

from __future__ import annotations

import torch
from torch import nn

from model_service.kernels.fp8_gemm import QuantizedRows
from model_service.models.config import ModelConfig
from model_service.models.context import ForwardContext, LayerOutput, Rope
from model_service.models.layers import RMSNorm
from model_service.models.llama import Attention, DecoderModel
from model_service.models.moe import mlp_for


class Olmo2Attention(Attention):
    shardable_by_heads = False

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)  # cfg.qk_norm is off: no per-head norms
        self.q_norm = RMSNorm(self.qkv_sizes[0], cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.qkv_sizes[1], cfg.rms_norm_eps)

    def project(self, x: torch.Tensor | QuantizedRows) -> tuple[torch.Tensor, ...]:
        q, k, v = super().project(x)
        return self.q_norm(q), self.k_norm(k), v


class Olmo2Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(cfg, layer_idx)
        self.mlp = mlp_for(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope, ctx: ForwardContext
    ) -> LayerOutput:
        """(this layer's MLP output, normalized; the stream before it), which the next layer or
        `DecoderModel.hidden_states` adds, as `PreNormLayer` returns them."""
        stream = x if residual is None else x + residual
        stream = stream + self.post_attention_layernorm(self.self_attn(stream, rope, ctx))
        return self.post_feedforward_layernorm(self.mlp(stream)), stream


class Olmo2Model(DecoderModel):
    layer_class = Olmo2Layer
