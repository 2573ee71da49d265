"""Tiny random Qwen3-Next hybrids (Gated DeltaNet + gated attention), shared by the hybrid tests.

4 layers, linear / full alternating, every MLP dense unless overridden, with the 1-D weights
randomized too: HF initializes the zero-centered norms to 0 and the decay so strong that the state
forgets within a token or two, where a wrong (1 + weight) or a dropped state would go unseen.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tests.conftest import make_tiny_checkpoint

HYBRID = {
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "full_attention"] * 2,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,  # two value heads per key head (grouped)
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "num_experts": 4,
    "mlp_only_layers": [0, 1, 2, 3],  # every MLP dense here; test_sparse_moe_layers_match_hf has MoE
}


def make_tiny_hybrid(path: Path, seed: int = 0, **overrides: Any) -> Path:
    """Save a tiny random hybrid checkpoint (HYBRID, then `overrides`) to `path`, 1-D weights
    randomized with `seed`; returns the path."""
    make_tiny_checkpoint("qwen3_next", path, **{**HYBRID, **overrides})
    _randomize_1d(path, seed)
    return path


def _randomize_1d(path: Path, seed: int) -> None:
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    gen = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        if name.endswith("A_log"):  # decay rates exp(A_log) * softplus(.) well below 1 per token
            tensors[name] = torch.empty(t.shape).uniform_(0.02, 0.5, generator=gen).log()
        elif t.dim() == 1:  # norms (zero-centered and gated) and dt_bias
            tensors[name] = t + torch.randn(t.shape, generator=gen) * 0.3
    save_file(tensors, str(file), metadata={"format": "pt"})
