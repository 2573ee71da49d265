"""Granite, OLMo 2 and Phi-3 against HF transformers (and PEFT) on tiny random checkpoints.

Each variant sets the family's own math away from its neutral value (Granite's four multipliers,
OLMo 2's post-norms and whole-projection q/k norms, Phi-3's fused projections, partial rotary,
LongRoPE and sliding window), so a multiplier dropped or a norm over the wrong axis shows as a
logits or greedy-token mismatch against HF's forward on the same files.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model_service.errors import ModelLoadError
from model_service.models.config import ModelConfig
from tests.conftest import assert_all_blocks_free, make_engine
from tests.test_lora import make_adapter, peft_greedy
from tests.test_tiny_models import (
    PROMPTS,
    Case,
    Variant,
    last_token_logits,
    random_prompt,
    rel_err,
    request,
    save_checkpoint,
)

LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0, 1.3, 1.7, 2.2, 3.1, 4.0, 5.5, 7.0],
    "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 24.0, 32.0, 48.0],
}
pytestmark = pytest.mark.usefixtures("one_torch_thread")

VARIANTS: dict[str, Variant] = {
    "granite": Variant(
        "granite",
        {
            "embedding_multiplier": 6.0,
            "residual_multiplier": 0.3,
            "attention_multiplier": 0.125,  # not 1/sqrt(16) = 0.25
            "logits_scaling": 4.0,
            "attention_bias": True,
        },
    ),
    "olmo2": Variant("olmo2", {"attention_bias": True}),
    "phi3": Variant("phi3", {"sliding_window": 8, "pad_token_id": 0}),
    # rotary on 12 of 16 dims; LongRoPE past 128 of 512 positions: the short factors and an
    # attention factor of sqrt(1 + ln 4 / ln 128)
    "phi3-partial-longrope": Variant(
        "phi3",
        {
            "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 128,
            "pad_token_id": 0,
            "rope_parameters": {
                **LONGROPE,
                "short_factor": LONGROPE["short_factor"][:6],
                "long_factor": LONGROPE["long_factor"][:6],
            },
        },
    ),
}


@pytest.fixture(scope="module", params=list(VARIANTS), ids=list(VARIANTS))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    return Case(save_checkpoint(VARIANTS[request.param], tmp_path_factory.mktemp(request.param)))


def test_logits_and_greedy_tokens_match_hf(case: Case):
    """Last-token logits of a prompt in one pass and in 5-token chunks; greedy tokens of mixed-length
    prompts in one batch, chunked, over 4-token blocks."""
    for ids in (PROMPTS[0], PROMPTS[4]):
        with torch.no_grad():
            ref = case.hf(torch.tensor([ids])).logits[0, -1]
        assert rel_err(last_token_logits(case.ours, ids), ref) < 1e-4
    engine = make_engine(case.ours, max_num_batched_tokens=5, block_size=4)
    outs = engine.generate([request(ids) for ids in PROMPTS])
    assert [o.token_ids for o in outs] == [case.hf_greedy(i) for i in range(len(PROMPTS))]
    assert_all_blocks_free(engine)


def test_a_prefix_cache_hit_gives_hf_tokens(case: Case):
    """A prompt that shares 20 tokens (five 4-token blocks) with one served before reads their K/V
    from the prefix cache and still continues as HF does."""
    engine = make_engine(case.ours, block_size=4)
    engine.generate([request(PROMPTS[0])])
    assert engine.cache.blocks.num_cached >= 5
    ids = PROMPTS[0] + random_prompt(6, seed=7)
    with torch.no_grad():
        hf = case.hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids) :]
    assert engine.generate([request(ids)])[0].token_ids == hf.tolist()
    assert_all_blocks_free(engine)


PHI3_TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


@pytest.mark.parametrize(
    ("name", "targets"),
    [
        ("phi3", PHI3_TARGETS),
        ("granite", ["q_proj", "v_proj", "down_proj"]),
        ("olmo2", ["k_proj", "up_proj"]),
    ],
)
def test_a_peft_lora_gives_pefts_tokens(name: str, targets: list[str], tmp_path: Path):
    """Phi-3's LoRA on the fused qkv_proj and gate_up_proj is one A and one B over the whole
    output, as PEFT applies it; Granite's and OLMo 2's deltas go through their multipliers and norms."""
    case = Case(save_checkpoint(VARIANTS[name], tmp_path))
    adapter = make_adapter(
        case.hf, tmp_path / "lora", seed=5, scale=0.3, r=4, lora_alpha=8, target_modules=targets
    )
    expected = peft_greedy(case.hf, adapter, PROMPTS[:2], 8, eos=None)
    engine = make_engine(case.ours, max_loras=1, lora_modules={"a": str(adapter)})
    reqs = [{**request(ids), "max_tokens": 8, "adapter": "a"} for ids in PROMPTS[:2]]
    assert [o.token_ids for o in engine.generate(reqs)] == expected


def phi3_config(**fields) -> dict:
    return {
        "architectures": ["Phi3ForCausalLM"], "vocab_size": 64, "hidden_size": 64, "intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, **fields,
    }  # fmt: skip


def test_longrope_past_its_original_length_is_refused():
    """HF switches a sequence to the long factors, for every position, once it passes
    original_max_position_embeddings; a paged cache's keys cannot follow, so the context stops there."""
    cfg = ModelConfig.from_hf(
        phi3_config(max_position_embeddings=512, original_max_position_embeddings=128, rope_scaling=LONGROPE)
    )
    assert cfg.context_length(None) == 128 and cfg.context_length(100) == 100
    with pytest.raises(ModelLoadError, match="past original_max_position_embeddings 128"):
        cfg.context_length(129)


def test_longrope_factors_of_the_wrong_length_are_refused():
    with pytest.raises(ModelLoadError, match="short_factor must list 8 numbers"):
        ModelConfig.from_hf(phi3_config(rope_scaling={**LONGROPE, "short_factor": [1.0] * 7}))


def test_a_granite_multiplier_spelt_null_is_refused():
    raw = {**phi3_config(logits_scaling=None), "architectures": ["GraniteForCausalLM"]}
    with pytest.raises(ModelLoadError, match="logits_scaling must be a number"):
        ModelConfig.from_hf(raw)


@pytest.mark.parametrize(
    ("name", "match"),
    [("phi3", "fused in one projection"), ("olmo2", "Olmo2Attention")],
    ids=["phi3", "olmo2"],
)
def test_tensor_parallelism_refuses_what_a_rank_cannot_split(name: str, match: str, tmp_path: Path):
    """Phi-3's fused qkv_proj holds q, k and v rows a rank would keep three runs of; OLMo 2's q/k
    norm is over every head, which no rank holds: refused at the shard, not served wrong."""
    from model_service.distributed.sharding import Partition, shard_module
    from model_service.models.loader import load_model

    loaded = load_model(str(save_checkpoint(VARIANTS[name], tmp_path)), torch.float32, torch.device("cpu"))
    with pytest.raises(ModelLoadError, match=match):
        shard_module(loaded.module, Partition.of(loaded.config, 0, 2), None, torch.device("cpu"))


def test_the_adapter_service_accepts_the_fused_targets_the_pod_loads():
    """An upload is validated against the same shapes the pod loads adapters by: Phi-3's qkv_proj
    and gate_up_proj, and no q_proj (which a Phi-3 checkpoint does not have)."""
    from adapter_service.base_model import _from_hf
    from model_service.lora.adapter import module_shapes

    raw = phi3_config(num_key_value_heads=2)
    shapes = _from_hf("phi3", raw).projection_shapes()
    assert shapes == module_shapes(ModelConfig.from_hf(raw))
    assert (
        shapes["qkv_proj"] == (64, 64 + 2 * 32)
        and shapes["gate_up_proj"] == (64, 64)
        and "q_proj" not in shapes
    )
