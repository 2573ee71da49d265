"""OLMo 2 (HF's `modeling_olmo2.py`): a Llama-shaped decoder whose blocks are normalized after,
not before: each layer is x + post_attention_layernorm(attn(x)), then
h + post_feedforward_layernorm(mlp(h)), and attention RMS-normalizes q and k over the whole
projection (all heads at once, one weight of num_heads * head_dim) before RoPE.

The whole-projection norms run here in the module, not in the attention backend (its fused
`HeadNorms` normalize each head on its own: another number). A norm over every head cannot be
split by heads, so tensor parallelism refuses this attention (`sharding._shard_layer` shards
only `llama.Attention`).
"""

from __future__ import annotations

import torch
from torch import nn

from model_service.kernels.fp8_gemm import QuantizedRows
from model_service.models.config import ModelConfig
from model_service.models.context import ForwardContext
from model_service.models.layers import PackedLinear, RMSNorm
from model_service.models.llama import DecoderModel
from model_service.models.moe import mlp_for


class Olmo2Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.layer_idx = layer_idx
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_sizes = (q, kv, kv)
        self.qkv_proj = PackedLinear(cfg.hidden_size, {"q_proj": q, "k_proj": kv, "v_proj": kv}, cfg.qkv_bias)
        self.o_proj = PackedLinear(q, {"o_proj": cfg.hidden_size}, cfg.o_proj_bias)
        self.q_norm = RMSNorm(q, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(kv, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor | QuantizedRows, rope: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        n = q.shape[0]
        q = self.q_norm(q).reshape(n, self.num_heads, self.head_dim)
        k = self.k_norm(k).reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        out = ctx.attention.forward(self.layer_idx, q, k, v, rope)
        return self.o_proj(out.reshape(n, -1))


class Olmo2Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(cfg, layer_idx)
        self.mlp = mlp_for(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, normalized; the stream before it), which the next layer or
        `DecoderModel.hidden_states` adds, as `PreNormLayer` returns them."""
        stream = x if residual is None else x + residual
        stream = stream + self.post_attention_layernorm(self.self_attn(stream, rope, ctx))
        return self.post_feedforward_layernorm(self.mlp(stream)), stream


class Olmo2Model(DecoderModel):
    layer_class = Olmo2Layer
