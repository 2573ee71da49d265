"""Granite: the Llama decoder with four multipliers (HF's `modeling_granite.py`).

The embeddings are scaled by `embedding_multiplier`, each attention and MLP output by
`residual_multiplier` before it joins the residual stream, the logits divided by `logits_scaling`;
`attention_multiplier` is the softmax scale, which the attention backend takes from
`ModelConfig.softmax_scale`. All of it is module code, so CUDA graphs capture it as it is.
"""

from __future__ import annotations

import torch

from model_service.models.config import ModelConfig
from model_service.models.context import ForwardContext, LayerOutput, Rope
from model_service.models.llama import DecoderLayer, DecoderModel, add_and_norm


class GraniteLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        self.residual_multiplier = cfg.residual_multiplier

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope, ctx: ForwardContext
    ) -> LayerOutput:
        """`PreNormLayer.forward` with both blocks' outputs scaled before the next add."""
        scale = self.residual_multiplier
        h, residual = add_and_norm(self.input_layernorm, x, residual, self.mixer())
        h = self.mix(h, rope, ctx) * scale
        h, residual = add_and_norm(self.post_attention_layernorm, h, residual, self.mlp)
        return self.mlp(h) * scale, residual


class GraniteModel(DecoderModel):
    layer_class = GraniteLayer

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids) * self.config.embedding_multiplier

    def logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return super().logits(hidden, rows) / self.config.logits_scaling
