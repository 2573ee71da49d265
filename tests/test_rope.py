"""Our RoPE frequencies (and the config normalization feeding them) against HF's on the same config."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from model_service.errors import ModelLoadError
from model_service.kernels.fused import apply_rotary
from model_service.models.config import ModelConfig
from model_service.models.rope import RotaryEmbedding, inverse_frequencies

LLAMA31 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# (head_dim, max_position_embeddings, rope_parameters as a transformers-5 config.json spells them)
CASES: dict[str, tuple[int, int, dict[str, Any]]] = {
    "default": (64, 2048, {"rope_type": "default", "rope_theta": 10000.0}),
    "default-theta1e6-hd128": (128, 32768, {"rope_type": "default", "rope_theta": 1000000.0}),
    "linear-2": (64, 4096, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    "linear-8-hd16": (16, 4096, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 8.0}),
    "llama3.1": (128, 131072, LLAMA31),
    "llama3.2-factor32": (64, 131072, {**LLAMA31, "factor": 32.0}),
    # Small original length, so every band (kept / smoothed / divided) is populated at head_dim 16.
    "llama3-small": (16, 2048, {**LLAMA31, "rope_theta": 10000.0, "original_max_position_embeddings": 256}),
    "yarn-qwen": (
        128,
        131072,
        {
            "rope_type": "yarn",
            "rope_theta": 1000000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32768,
        },
    ),
    "yarn-beta": (
        64,
        16384,
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 16,
            "beta_slow": 2,
        },
    ),
    "yarn-mscale": (
        64,
        163840,
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
        },
    ),
    "yarn-attention-factor": (
        64,
        8192,
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 2.0,
            "original_max_position_embeddings": 4096,
            "attention_factor": 1.25,
        },
    ),
    "yarn-no-truncate": (
        64,
        32768,
        {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 8.0,
            "original_max_position_embeddings": 4096,
            "truncate": False,
        },
    ),
}


def raw_config(head_dim: int, max_pos: int, **rope: Any) -> dict[str, Any]:
    """A minimal Llama config.json dict; `rope` holds the RoPE keys in whichever spelling is tested."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 32,
        "hidden_size": 4 * head_dim,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": head_dim,
        "max_position_embeddings": max_pos,
        **rope,
    }


def hf_reference(raw: dict[str, Any]) -> tuple[torch.Tensor, float]:
    config = LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"})
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[rope_type](config, None)


def ours_via_config(raw: dict[str, Any]) -> tuple[torch.Tensor, float]:
    cfg = ModelConfig.from_hf(raw)
    return inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)


def assert_matches(ours: tuple[torch.Tensor, float], ref: tuple[torch.Tensor, float]) -> None:
    assert ours[0].dtype == torch.float32
    torch.testing.assert_close(ours[0], ref[0].float(), rtol=0, atol=0)  # HF's float32 values, bit for bit
    assert ours[1] == pytest.approx(float(ref[1]), rel=1e-6)


@pytest.mark.parametrize("name", list(CASES))
def test_inverse_frequencies_match_hf(name: str):
    head_dim, max_pos, rope = CASES[name]
    raw = raw_config(head_dim, max_pos, rope_parameters=dict(rope))
    ref = hf_reference(raw)
    assert ref[0].shape == (head_dim // 2,)
    # Directly, on the dict as written...
    params = {k: v for k, v in rope.items() if k != "rope_theta"}
    assert_matches(inverse_frequencies(head_dim, rope["rope_theta"], params), ref)
    # ...and through our config.json normalization.
    assert_matches(ours_via_config(raw), ref)


def test_scaling_cases_really_scale():
    """Guard the cases: each scaling changes frequencies, and YaRN's attention factor is not 1."""
    for name, (head_dim, _, rope) in CASES.items():
        inv, factor = inverse_frequencies(head_dim, rope["rope_theta"], rope)
        base, _ = inverse_frequencies(head_dim, rope["rope_theta"], {"rope_type": "default"})
        if rope["rope_type"] == "default":
            continue
        assert not torch.allclose(inv, base), name
        if rope["rope_type"] == "yarn":
            assert factor > 1.0, name
        else:
            assert factor == 1.0, name
    # The small llama3 case hits all three bands: unchanged, smoothed, divided by factor.
    head_dim, _, rope = CASES["llama3-small"]
    inv, _ = inverse_frequencies(head_dim, rope["rope_theta"], rope)
    base, _ = inverse_frequencies(head_dim, rope["rope_theta"], {"rope_type": "default"})
    ratio = base / inv
    assert (ratio == 1).any() and torch.isclose(ratio, torch.tensor(8.0)).any()
    assert ((ratio > 1.01) & (ratio < 7.99)).any()


@pytest.mark.parametrize(
    "rope",
    [
        # transformers 4.x spelling: top-level rope_theta, `rope_scaling` with the old `type` key.
        {"rope_theta": 50000.0, "rope_scaling": {"type": "linear", "factor": 4.0}},
        {"rope_theta": 500000.0, "rope_scaling": {k: v for k, v in LLAMA31.items() if k != "rope_theta"}},
        {"rope_theta": 10000.0, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},  # orig := max_pos
        # llama3 without original_max_position_embeddings: HF falls back to max_position_embeddings.
        {"rope_parameters": {k: v for k, v in LLAMA31.items() if k != "original_max_position_embeddings"}},
        {"rope_theta": 20000.0},  # no scaling dict at all
        {},  # nothing: theta 10000
        # Both fields, as after following a model card's "add rope_scaling to config.json" on a config
        # transformers 5 saved: HF takes `rope_scaling` (and the top-level theta), not `rope_parameters`.
        {
            "rope_theta": 20000.0,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
        },
        # A top-level original_max_position_embeddings overrides the scaling dict's (HF's Phi-3 rule).
        {"original_max_position_embeddings": 2048, "rope_parameters": {**LLAMA31}},
        {
            "original_max_position_embeddings": 1024,
            "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
        },
    ],
    ids=[
        "legacy-linear",
        "legacy-llama3",
        "legacy-yarn-no-orig",
        "llama3-no-orig",
        "theta-only",
        "bare",
        "both-fields",
        "top-level-orig-llama3",
        "top-level-orig-yarn",
    ],
)
def test_legacy_and_partial_spellings_match_hf(rope: dict[str, Any]):
    import copy

    raw = raw_config(64, 16384, **rope)
    assert_matches(ours_via_config(copy.deepcopy(raw)), hf_reference(copy.deepcopy(raw)))


@settings(max_examples=40, deadline=None)
@given(
    head_dim=st.sampled_from([8, 16, 32, 64, 80, 128, 256]),
    theta=st.sampled_from([10000.0, 100000.0, 500000.0, 1000000.0]),
    factor=st.floats(1.0, 64.0),
    orig=st.sampled_from([64, 512, 2048, 8192]),
    low=st.floats(0.5, 2.0),
    high_over_low=st.floats(1.5, 8.0),
)
def test_llama3_random_configs_match_hf(head_dim, theta, factor, orig, low, high_over_low):
    rope = {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": low * high_over_low,
        "original_max_position_embeddings": orig,
    }
    raw = raw_config(head_dim, orig * 4, rope_parameters=rope)
    assert_matches(
        ours_via_config(raw), hf_reference(raw_config(head_dim, orig * 4, rope_parameters=dict(rope)))
    )


@settings(max_examples=40, deadline=None)
@given(
    head_dim=st.sampled_from([8, 16, 32, 64, 80, 128, 256]),
    theta=st.sampled_from([10000.0, 100000.0, 1000000.0]),
    factor=st.floats(1.0, 64.0),
    orig=st.sampled_from([64, 512, 4096, 32768]),
    betas=st.sampled_from([(None, None), (32, 1), (16, 2), (64, 0.5)]),
    mscales=st.sampled_from([(None, None), (1.0, 0.707), (0.707, 0.707), (1.0, 1.0)]),
    truncate=st.booleans(),
)
def test_yarn_random_configs_match_hf(head_dim, theta, factor, orig, betas, mscales, truncate):
    rope: dict[str, Any] = {
        "rope_type": "yarn",
        "rope_theta": theta,
        "factor": factor,
        "original_max_position_embeddings": orig,
        "truncate": truncate,
    }
    for key, value in zip(
        ("beta_fast", "beta_slow", "mscale", "mscale_all_dim"), betas + mscales, strict=True
    ):
        if value is not None:
            rope[key] = value
    raw = raw_config(head_dim, int(orig * factor), rope_parameters=rope)
    assert_matches(
        ours_via_config(raw),
        hf_reference(raw_config(head_dim, int(orig * factor), rope_parameters=dict(rope))),
    )


@pytest.mark.parametrize(
    "name", ["default", "default-theta1e6-hd128", "linear-2", "llama3.1", "yarn-qwen", "yarn-mscale"]
)
def test_cos_sin_and_rotation_match_hf(name: str):
    """The attention factor is applied to cos/sin as HF does, and the half-rotation layout matches."""
    head_dim, max_pos, rope = CASES[name]
    raw = raw_config(head_dim, max_pos, rope_parameters=dict(rope))
    cfg = ModelConfig.from_hf(raw)
    ours = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    hf = LlamaRotaryEmbedding(LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"}))
    # Far positions too: an inv_freq one float32 ulp off HF's moves angle p by ~p * 6e-8 radians,
    # 7e-3 in cos at 128k, so the frequencies must be HF's to the bit, not merely close.
    positions = torch.tensor([0, 1, 2, 17, 255, 1000, 4095, 65537, 131071])
    cos, sin = ours(positions, torch.float32)
    hf_cos, hf_sin = hf(torch.zeros(1, dtype=torch.float32), positions[None])
    torch.testing.assert_close(cos, hf_cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, hf_sin[0], rtol=0, atol=1e-6)

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(len(positions), 4, head_dim, generator=gen)  # [tokens, heads, dim]
    k = torch.randn(len(positions), 2, head_dim, generator=gen)
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin)
    # Same cos/sin on both sides: this checks the rotation layout alone, so it can be tight.
    torch.testing.assert_close(
        apply_rotary(q, hf_cos[0], hf_sin[0]), hf_q[0].transpose(0, 1), rtol=1e-6, atol=1e-6
    )
    torch.testing.assert_close(
        apply_rotary(k, hf_cos[0], hf_sin[0]), hf_k[0].transpose(0, 1), rtol=1e-6, atol=1e-6
    )


def test_a_context_past_max_positions_is_served_with_a_warning(caplog: pytest.LogCaptureFixture):
    """Static RoPE past max_position_embeddings runs as HF would, but the operator is told: the
    checkpoint never saw those positions (vLLM refuses it without an opt-in)."""
    cfg = ModelConfig.from_hf(raw_config(64, 4096))
    with caplog.at_level("WARNING", logger="model_service.models.config"):
        assert cfg.context_length(4096) == 4096
        assert not caplog.records
        assert cfg.context_length(8192) == 8192
    assert "max_position_embeddings 4096" in caplog.text


def test_a_yarn_config_serves_the_context_its_scaling_reaches(caplog: pytest.LogCaptureFixture):
    """Qwen2.5's model card adds YaRN (factor 4 over 32,768 pretraining positions) to a config.json
    whose max_position_embeddings stays 32,768: the context is the 131,072 positions the scaling
    reaches, as vLLM serves it, not 32,768 (every longer prompt was refused) or a warning at
    --max-model-len 131072. Past that reach the operator is warned as before; a YaRN that reaches
    fewer than max_position_embeddings (DeepSeek-V2-Lite-like) keeps the longer."""
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    cfg = ModelConfig.from_hf(raw_config(64, 32768, rope_scaling=yarn))
    with caplog.at_level("WARNING", logger="model_service.models.config"):
        assert cfg.context_length(None) == cfg.context_length(131072) == 131072
        assert not caplog.records
        assert cfg.context_length(131073) == 131073
    assert "131072 positions" in caplog.text
    short = {**yarn, "original_max_position_embeddings": 4096}
    assert ModelConfig.from_hf(raw_config(64, 163840, rope_scaling=short)).context_length(None) == 163840


def test_dynamic_ntk_runs_hf_frequencies_up_to_max_positions_and_no_further():
    """HF's dynamic NTK keeps the default frequencies while a sequence is within
    max_position_embeddings and past it rescales them by the sequence's current length (path
    dependent: a paged cache holds keys rotated at earlier lengths), so the context stops there."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    raw = raw_config(64, 4096, rope_theta=50000.0, rope_scaling={"type": "dynamic", "factor": 4.0})
    cfg = ModelConfig.from_hf(raw)
    hf = LlamaRotaryEmbedding(LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"}))
    positions = torch.arange(0, 4096, 97)
    hf_cos, hf_sin = hf(torch.zeros(1), positions[None])
    cos, sin = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)(positions, torch.float32)
    torch.testing.assert_close(cos, hf_cos[0], rtol=0, atol=1e-3)
    torch.testing.assert_close(sin, hf_sin[0], rtol=0, atol=1e-3)
    assert cfg.context_length(None) == cfg.context_length(4096) == 4096
    assert cfg.context_length(1000) == 1000
    with pytest.raises(ModelLoadError, match="dynamic"):
        cfg.context_length(4097)
    static = ModelConfig.from_hf(raw_config(64, 4096, rope_scaling={"type": "linear", "factor": 4.0}))
    assert static.context_length(16384) == 16384  # an operator's longer context, served as HF would


def test_unsupported_and_incomplete_scaling_are_refused():
    with pytest.raises(ModelLoadError, match="factor"):
        ModelConfig.from_hf(raw_config(64, 4096, rope_scaling={"type": "dynamic"}))
    with pytest.raises(ModelLoadError, match="longrope"):
        ModelConfig.from_hf(raw_config(64, 4096, rope_scaling={"type": "longrope", "short_factor": [1.0]}))
    with pytest.raises(ModelLoadError, match="factor"):
        ModelConfig.from_hf(raw_config(64, 4096, rope_parameters={"rope_type": "linear", "rope_theta": 1e4}))
    with pytest.raises(ModelLoadError, match="low_freq_factor"):
        ModelConfig.from_hf(
            raw_config(64, 4096, rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0})
        )
