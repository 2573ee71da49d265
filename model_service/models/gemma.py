"""Gemma 2 and Gemma 3 text: the Llama decoder (`llama.py`) with Gemma's arithmetic, as HF's
modeling_gemma2.py / modeling_gemma3.py define it.

What differs, each read from `ModelConfig` (config.py's `_gemma_from_hf`) or fixed here:
- Every RMSNorm scales by (1 + weight) in float32 (`ZeroCenteredRMSNorm`), and each block is
  sandwiched: the attention output and the MLP output are normalized again before the residual
  add (`post_attention_layernorm`, `post_feedforward_layernorm`), the MLP input by its own
  `pre_feedforward_layernorm`.
- Embeddings are multiplied by sqrt(hidden_size) rounded to the activations' dtype.
- The MLP is GELU-tanh gated (`hidden_activation`, `layers.MLP`).
- Attention logits are scaled by query_pre_attn_scalar ** -0.5 (`ModelConfig.softmax_scale`),
  and Gemma 2 soft-caps them (`attn_logit_softcapping`, which both attention backends take:
  the Triton kernels' `SOFTCAP` switch); both soft-cap the final logits (`final_logit_softcapping`).
- Gemma 3 normalizes each query and key head, by (1 + weight) too, before RoPE; its sliding
  layers rotate with their own base (`ModelConfig.sliding_rope`, `DecoderModel.layer_ropes`).
"""

from __future__ import annotations

import torch

from model_service.kernels.fp8_gemm import QuantizedRows
from model_service.kernels.paged_attention import HeadNorms
from model_service.models.config import ModelConfig
from model_service.models.context import ForwardContext, LayerOutput, Rope
from model_service.models.layers import ZeroCenteredRMSNorm
from model_service.models.llama import Attention, DecoderLayer, DecoderModel, add_and_norm


class GemmaAttention(Attention):
    """Gemma 3's q_norm / k_norm scale by 1 + weight, which the rotary kernels' `HeadNorms` do
    not: they are applied here, with the zero-centered norm's kernel, and the backend gets the
    heads already normalized."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        if cfg.qk_norm:
            self.q_norm = ZeroCenteredRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = ZeroCenteredRMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def project(self, x: torch.Tensor | QuantizedRows) -> tuple[torch.Tensor, ...]:
        q, k, v = super().project(x)
        if not self.qk_norm:
            return q, k, v
        return self._per_head(self.q_norm, q), self._per_head(self.k_norm, k), v

    def _per_head(self, norm: ZeroCenteredRMSNorm, x: torch.Tensor) -> torch.Tensor:
        """`norm` over each head_dim-wide head of x [T, heads * head_dim]."""
        return norm(x.unflatten(-1, (-1, self.head_dim))).flatten(-2)

    def head_norms(self) -> HeadNorms | None:
        return None


class GemmaDecoderLayer(DecoderLayer):
    """norm -> attention -> norm, add; norm -> MLP -> norm, add (the sandwich)."""

    attention_class = GemmaAttention
    norm_class = ZeroCenteredRMSNorm

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        self.pre_feedforward_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope, ctx: ForwardContext
    ) -> LayerOutput:
        """(this layer's output, the residual stream before it): the next norm adds the two."""
        h, residual = add_and_norm(self.input_layernorm, x, residual, self.mixer())
        h = self.post_attention_layernorm(self.mix(h, rope, ctx))
        h, residual = add_and_norm(self.pre_feedforward_layernorm, h, residual, self.mlp)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class GemmaModel(DecoderModel):
    layer_class = GemmaDecoderLayer
    norm_class = ZeroCenteredRMSNorm

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings times sqrt(hidden_size), the factor rounded to their dtype first (as HF)."""
        x = self.model.embed_tokens(input_ids)
        return x * float(torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype))

    def logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Float32 logits, soft-capped to (-cap, cap) where the config says (computed in float32;
        HF caps in the activations' dtype, the same values in a float32 run)."""
        logits = super().logits(hidden, rows)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
