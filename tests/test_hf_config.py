"""config.json as HF transformers reads it, for the spellings hub checkpoints use that the tiny
saved models of the parity tests (test_tiny_models.py, test_moe.py) never write: those are saved
by the installed transformers, which spells every field out. Configuration only: no weights."""

from __future__ import annotations

from typing import Any

import pytest
import transformers

from model_service.errors import ModelLoadError
from model_service.models.config import ModelConfig
from tests.conftest import TINY_CONFIGS

LAYERS = 6
# The fields each family requires, and nothing else: what is left out is what is tested.
# 6 heads: unlike every family's default K/V head count, so a dropped default shows
REQUIRED = {"vocab_size": 64, "hidden_size": 96, "intermediate_size": 32, "num_attention_heads": 6}
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
    # 16 experts: V3's default 8 groups must divide them
    "deepseek_v3": {**MLA, "n_routed_experts": 16, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
}
# Families whose attention takes `sliding_window` in every layer when the config has one.
SLIDING_EVERY_LAYER = ("mistral", "mixtral", "qwen3_moe", "phi3")


def both(family: str, **fields: Any) -> tuple[ModelConfig, Any]:
    """Ours and HF's reading of one config.json dict: the family's required fields and `fields`."""
    raw = {**REQUIRED, "num_hidden_layers": LAYERS, **FAMILY_REQUIRED.get(family, {}), **fields}
    hf = getattr(transformers, TINY_CONFIGS[family]["cls"])(**raw)
    return ModelConfig.from_hf({**raw, "architectures": [TINY_CONFIGS[family]["arch"]]}), hf


def hf_windows(family: str, hf: Any) -> list[int | None]:
    """Each layer's sliding window as HF's attention modules take it from the config."""
    window, layers = getattr(hf, "sliding_window", None) or None, hf.num_hidden_layers
    if family in SLIDING_EVERY_LAYER:
        return [window] * layers
    types = getattr(hf, "layer_types", None) or ["full_attention"] * layers
    return [window if t == "sliding_attention" else None for t in types]


@pytest.mark.parametrize("family", list(TINY_CONFIGS))
def test_sliding_layers_of_a_config_without_layer_types(family: str):
    """A config.json written before `layer_types` existed (most Qwen2 and Qwen2-MoE ones) slides
    the layers HF's own rule derives from `max_window_layers`, which differs between families."""
    ours, hf = both(family, use_sliding_window=True, sliding_window=8, max_window_layers=3)
    assert ours.sliding_windows == hf_windows(family, hf)


def hf_reading(family: str, hf: Any) -> dict[str, Any]:
    """What HF's modeling code takes from its config object, in the terms of `our_reading`."""
    rope = hf.rope_parameters["full_attention"] if family == "gemma3_text" else hf.rope_parameters
    reading: dict[str, Any] = {
        "rms_norm_eps": hf.rms_norm_eps,
        "rope_theta": rope["rope_theta"],
        "max_position_embeddings": hf.max_position_embeddings,
        "sliding_windows": hf_windows(family, hf),
    }
    if family in ("deepseek_v2", "deepseek_v3"):
        return reading | {
            "q_lora_rank": hf.q_lora_rank,
            "first_sparse_layer": hf.first_k_dense_replace,
            "shared_expert_intermediate_size": hf.moe_intermediate_size * hf.n_shared_experts,
            "norm_topk_prob": hf.norm_topk_prob and family == "deepseek_v3",  # V2's router ignores it
            "routing": (hf.routed_scaling_factor, hf.n_group or 1, hf.topk_group or 1),
        }
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    reading |= {"head_dim": head_dim, "num_kv_heads": hf.num_key_value_heads}
    if family in ("qwen3_next", "phi3"):
        reading["rotary_dim"] = int(head_dim * hf.rope_parameters["partial_rotary_factor"])
    if family == "granite":  # HF's attention scale is attention_multiplier, 1.0 when left out
        keys = ("logits_scaling", "embedding_multiplier", "residual_multiplier")
        reading |= {"softmax_scale": hf.attention_multiplier} | {k: getattr(hf, k) for k in keys}
    if family in ("mixtral", "qwen2_moe", "qwen3_moe", "qwen3_next"):
        reading["norm_topk_prob"] = family == "mixtral" or hf.norm_topk_prob
        reading["num_experts_per_tok"] = hf.num_experts_per_tok
    if family in ("qwen2_moe", "qwen3_next"):
        reading["shared_expert_intermediate_size"] = hf.shared_expert_intermediate_size
    if family in ("gemma2", "gemma3_text"):
        reading |= gemma_reading(family, hf)
    return reading


def gemma_reading(family: str, hf: Any) -> dict[str, Any]:
    """What HF's Gemma modeling code takes from its config beyond the Llama fields (its Gemma 3
    attention never passes `attn_logit_softcapping` on)."""
    local = hf.rope_parameters["sliding_attention"]["rope_theta"] if family == "gemma3_text" else None
    return {
        "softmax_scale": hf.query_pre_attn_scalar**-0.5,
        "final_logit_softcapping": hf.final_logit_softcapping,
        "attn_logit_softcapping": hf.attn_logit_softcapping if family == "gemma2" else None,
        "hidden_act": hf.hidden_activation,
        "tie_word_embeddings": hf.tie_word_embeddings,
        "eos_token_ids": [hf.eos_token_id],
        "sliding_rope": (local, {"rope_type": "default"}) if local else None,
    }


def our_reading(ours: ModelConfig, keys: list[str]) -> dict[str, Any]:
    derived = {
        "q_lora_rank": lambda: ours.latent_attention.q_lora_rank,
        "first_sparse_layer": lambda: [k.moe for k in ours.layer_kinds].index(True),
        "routing": lambda: (ours.routing.scaling_factor, ours.routing.num_groups, ours.routing.topk_groups),
    }
    return {k: derived[k]() if k in derived else getattr(ours, k) for k in keys}


@pytest.mark.parametrize("family", list(TINY_CONFIGS))
def test_a_left_out_field_means_what_transformers_defaults_it_to(family: str):
    """Only the required fields (and 30 layers, use_sliding_window: Qwen's default window and
    max_window_layers then show): head sizes, eps, theta, windows, rotary width, routing and
    Gemma's scale, caps and RoPE bases read as HF reads them, so the weights run as they were
    trained."""
    ours, hf = both(family, num_hidden_layers=30, use_sliding_window=True)
    expected = hf_reading(family, hf)
    assert our_reading(ours, list(expected)) == expected


def test_the_adapter_service_reads_left_out_fields_as_the_pod():
    """A Qwen3 config.json without head_dim: 128-wide heads for both, whatever hidden // heads is."""
    from adapter_service.base_model import _from_hf

    raw = {**REQUIRED, "num_hidden_layers": 2, "architectures": ["Qwen3ForCausalLM"]}
    base, ours = _from_hf("qwen3", raw), ModelConfig.from_hf(raw)
    assert (base.head_dim, base.num_kv_heads) == (ours.head_dim, ours.num_kv_heads) == (128, 32)


HALF = {"partial_rotary_factor": 0.5}


@pytest.mark.parametrize(
    "rope",
    [
        {"partial_rotary_factor": 0.5, "rope_scaling": {"type": "yarn", "factor": 4.0}},
        {"rope_scaling": {"type": "yarn", "factor": 4.0, "partial_rotary_factor": 0.5}},
        {"partial_rotary_factor": 0.75, "rope_parameters": {"rope_type": "linear", "factor": 2.0, **HALF}},
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0}},  # HF's 0.25 for Qwen3-Next
    ],
    ids=["top-level", "in-legacy-rope-scaling", "dict-over-top-level", "left-out"],
)
def test_partial_rotary_factor_read_where_hf_reads_it(rope: dict[str, Any]):
    """Qwen3-Next rotates the head dims HF does wherever config.json puts `partial_rotary_factor`,
    the legacy `rope_scaling` dict included, with the scaling type HF takes."""
    ours, hf = both("qwen3_next", **rope)
    assert ours.rotary_dim == int(hf.head_dim * hf.rope_parameters["partial_rotary_factor"])
    assert ours.rope_scaling["rope_type"] == hf.rope_parameters["rope_type"]


@pytest.mark.parametrize(
    "types",
    [
        ["sliding_attention"] * (LAYERS - 1),  # one layer short: an IndexError deep in the load
        ["sliding_attention"] * (LAYERS + 1),
        ["sliding", *["full_attention"] * (LAYERS - 1)],  # a typo: served as full attention
        ["chunked_attention"] * LAYERS,  # Llama 4's kind, which Qwen2 has no mask for: served as full
    ],
)
def test_a_layer_types_list_hf_cannot_run_is_refused(types: list[str]):
    """Qwen2 slides the layers `layer_types` names; a list that does not name each layer's
    attention is refused at load, naming the field (HF's config validation refuses the first
    three; its Qwen2 model has no mask for the fourth)."""
    raw = {**REQUIRED, "num_hidden_layers": LAYERS, "architectures": ["Qwen2ForCausalLM"]}
    raw |= {"use_sliding_window": True, "sliding_window": 8, "layer_types": types}
    with pytest.raises(ModelLoadError, match="layer_types must list 6"):
        ModelConfig.from_hf(raw)


@pytest.mark.parametrize(
    ("arch", "fields", "match"),
    [
        ("Gemma3ForCausalLM", {"query_pre_attn_scalar": None}, "query_pre_attn_scalar must be a number"),
        ("Gemma2ForCausalLM", {"head_dim": "256"}, "head_dim must be an integer, got '256'"),
        ("Phi3ForCausalLM", {"rms_norm_eps": None}, "rms_norm_eps must be a number"),
        ("Olmo2ForCausalLM", {"num_key_value_heads": 1.5}, "num_key_value_heads must be an integer"),
        ("GptOssForCausalLM", {"swiglu_limit": "7"}, "swiglu_limit must be a number"),
        ("GraniteForCausalLM", {"rope_scaling": "linear"}, "cannot be read"),
        ("Gemma2ForCausalLM", {"layer_types": 2}, "cannot be read"),
        ("Olmo2ForCausalLM", {"num_attention_heads": 0}, "cannot be read"),
    ],
)  # fmt: skip
def test_a_field_of_another_type_is_a_model_load_error(arch: str, fields: dict[str, Any], match: str):
    """A config.json value no reader expects is refused, the numeric ones by name (HF's strict
    config classes refuse them too): each was a TypeError, ValueError or ZeroDivisionError
    traceback ending the pod's start, and a numeric string was read as the number."""
    raw = {**REQUIRED, "num_hidden_layers": LAYERS, "architectures": [arch], "num_local_experts": 4}
    with pytest.raises(ModelLoadError, match=match):
        ModelConfig.from_hf({**raw, "num_experts_per_tok": 2, **fields})
