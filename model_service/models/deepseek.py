"""DeepSeek-V2 / V3: multi-head latent attention (MLA) and DeepSeek's MoE, over the paged cache.

What differs from the Llama-family decoder (`llama.py`, whose stack, residual stream and LM head
it reuses):
- Attention compresses each token to a `kv_lora_rank` latent (`kv_a_proj_with_mqa`, then
  `kv_a_layernorm`) plus one `qk_rope_head_dim` rotary key shared by all heads; per head,
  `kv_b_proj` expands the latent into the key's non-rotary part and the value. The cache keeps
  only the latent and the rotated key (attention/kv_cache.py gives the bytes); the backend
  decides how to attend over it (`LatentAttentionBackend`: decode rows with the absorbed
  weights, prefill rows decompressing K/V), so a layer never sees its context directly.
- Queries come from one `q_proj` (V2-Lite) or a low-rank `q_a_proj` -> RMSNorm -> `q_b_proj` (V3);
  each head's query is a non-rotary part and a rotary part.
- RoPE covers only the rotary dims, which DeepSeek lays out as adjacent pairs: they are
  de-interleaved (evens, then odds) before the half-rotation every backend applies; queries and
  keys get the same permutation, so their dot products are the checkpoint's.
- The attention scale carries YaRN's `mscale_all_dim` correction (`ModelConfig.softmax_scale`).
- The MLP is dense for the first `first_k_dense_replace` layers, else DeepSeek's MoE (moe.py).

The latents' RMSNorms use DeepSeek's fixed eps 1e-6, not `rms_norm_eps` (as its code and HF's).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from model_service.kernels.fused import apply_rotary
from model_service.models.config import LatentAttentionShape, ModelConfig
from model_service.models.context import ForwardContext
from model_service.models.layers import PackedLinear, RMSNorm
from model_service.models.llama import DecoderLayer, DecoderModel
from model_service.models.step import LatentAttentionBackend

LATENT_NORM_EPS = 1e-6


def rotate_deepseek_rope(
    x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], interleaved: bool
) -> torch.Tensor:
    """RoPE on x [T, H, R] whose rotary pairs are (x0, x1), (x2, x3), ... when `interleaved`; the
    result is in half-rotation layout (evens first), as HF's `apply_rotary_pos_emb_interleave`."""
    if interleaved:
        x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    return apply_rotary(x.contiguous(), *rope)


class LatentAttention(nn.Module):
    """MLA. With a q LoRA rank, `q_a_proj` and `kv_a_proj_with_mqa` read the same input and are
    one matmul (`a_proj`); the loader packs them by name, LoRA adapts each part on its columns."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        assert cfg.latent_attention is not None
        self.shape: LatentAttentionShape = cfg.latent_attention
        self.layer_idx, self.num_heads = layer_idx, cfg.num_heads
        m, heads, bias = self.shape, cfg.num_heads, cfg.qkv_bias
        kv_a = {"kv_a_proj_with_mqa": m.cache_dim}
        if m.q_lora_rank is None:
            self.q_proj = PackedLinear(cfg.hidden_size, {"q_proj": heads * m.qk_head_dim}, False)
            self.a_proj = PackedLinear(cfg.hidden_size, kv_a, bias)
        else:
            self.a_proj = PackedLinear(cfg.hidden_size, {"q_a_proj": m.q_lora_rank, **kv_a}, bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = PackedLinear(m.q_lora_rank, {"q_b_proj": heads * m.qk_head_dim}, False)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS)
        # A plain linear, which LoRA does not wrap: the backend multiplies cached latents of
        # earlier steps (and absorbs it into decode queries), rows no adapter's plan covers.
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = PackedLinear(heads * m.v_head_dim, {"o_proj": cfg.hidden_size}, cfg.o_proj_bias)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext
    ) -> torch.Tensor:
        m, n = self.shape, x.shape[0]
        projected = self.a_proj(x)
        if m.q_lora_rank is None:
            q, kv = self.q_proj(x), projected
        else:
            q_latent, kv = projected.split([m.q_lora_rank, m.cache_dim], dim=-1)
            q = self.q_b_proj(self.q_a_layernorm(q_latent.contiguous()))
        q_nope, q_rope = q.view(n, self.num_heads, m.qk_head_dim).split(
            [m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1
        )
        latent, k_rope = kv.split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        q_rope = rotate_deepseek_rope(q_rope, rope, m.rope_interleave)
        k_rope = rotate_deepseek_rope(k_rope[:, None, :], rope, m.rope_interleave)[:, 0]
        cache_row = torch.cat((self.kv_a_layernorm(latent.contiguous()), k_rope), dim=-1)
        backend = cast(LatentAttentionBackend, ctx.attention)  # the executor picks one for MLA models
        kv_up = self.kv_b_proj.weight.view(self.num_heads, -1, m.kv_lora_rank)
        out = backend.forward_latent(self.layer_idx, q_nope.contiguous(), q_rope, cache_row, kv_up)
        return self.o_proj(out.reshape(n, -1))


class DeepseekDecoderLayer(DecoderLayer):
    """A Llama-style pre-norm layer whose attention is MLA over the latent cache."""

    attention_class = LatentAttention


class DeepseekModel(DecoderModel):
    layer_class = DeepseekDecoderLayer
