"""Seeded Llama models of random weights for engine tests on CUDA (and their CPU references)."""

from __future__ import annotations

import torch

from model_service.models.config import ModelConfig
from model_service.models.llama import DecoderModel


def random_llama(**shape: int) -> tuple[ModelConfig, DecoderModel]:
    """A small Llama (`shape` overrides its sizes) with weights drawn from N(0, 0.2) after
    seeding 0: wide logits, so greedy ties between two devices' roundings are vanishingly rare."""
    sizes = {
        "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_layers": 3,
        "num_heads": 4, "num_kv_heads": 2, "head_dim": 32,
    } | shape  # fmt: skip
    cfg = ModelConfig(family="llama", rms_norm_eps=1e-5, max_position_embeddings=1024, **sizes)
    torch.manual_seed(0)
    model = DecoderModel(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p, 0, 0.2)
    return cfg, model
