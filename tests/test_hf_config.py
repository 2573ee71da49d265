"""config.json as HF transformers reads it, for the spellings hub checkpoints use that the tiny
saved models of the parity tests (test_tiny_models.py, test_moe.py) never write: those are saved
by the installed transformers, which spells every field out. Configuration only: no weights."""

from __future__ import annotations

from typing import Any

import pytest
import transformers

from model_service.models.config import ModelConfig
from tests.conftest import TINY_CONFIGS

LAYERS = 6
# The fields each family requires, and nothing else: what is left out is what is tested.
REQUIRED = {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 32, "num_attention_heads": 4}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
MLA = {"kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8}
FAMILY_REQUIRED: dict[str, dict[str, Any]] = {
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": MOE,
    "qwen3_moe": MOE,
    "qwen3_next": {
        **MOE,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 8,
        "linear_conv_kernel_dim": 4,
    },
    "deepseek_v2": {**MLA, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
    "deepseek_v3": {**MLA, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
}
# Families whose attention takes `sliding_window` in every layer when the config has one.
SLIDING_EVERY_LAYER = ("mistral", "mixtral", "qwen3_moe")


def both(family: str, **fields: Any) -> tuple[ModelConfig, Any]:
    """Ours and HF's reading of one config.json dict: the family's required fields and `fields`."""
    raw = {**REQUIRED, "num_hidden_layers": LAYERS, **FAMILY_REQUIRED.get(family, {}), **fields}
    hf = getattr(transformers, TINY_CONFIGS[family]["cls"])(**raw)
    return ModelConfig.from_hf({**raw, "architectures": [TINY_CONFIGS[family]["arch"]]}), hf


def hf_windows(family: str, hf: Any) -> list[int | None]:
    """Each layer's sliding window as HF's attention modules take it from the config."""
    window = getattr(hf, "sliding_window", None) or None
    if family in SLIDING_EVERY_LAYER:
        return [window] * LAYERS
    types = getattr(hf, "layer_types", None) or ["full_attention"] * LAYERS
    return [window if t == "sliding_attention" else None for t in types]


@pytest.mark.parametrize("family", list(TINY_CONFIGS))
def test_sliding_layers_of_a_config_without_layer_types(family: str):
    """A config.json written before `layer_types` existed (most Qwen2 and Qwen2-MoE ones) slides
    the layers HF's own rule derives from `max_window_layers`, which differs between families."""
    ours, hf = both(family, use_sliding_window=True, sliding_window=8, max_window_layers=3)
    assert ours.sliding_windows == hf_windows(family, hf)
