"""Gemma 2 and Gemma 3 text against HF transformers (and PEFT) on tiny random checkpoints.

Each checkpoint turns on everything that distinguishes the family: three layers of sliding
(window 8, shorter than the long prompts) and full attention, an attention scale from
`query_pre_attn_scalar` unlike the head width's, soft-capped final logits, Gemma 3's second RoPE
base (and a linear scaling of the first), Gemma 2's soft-capped attention logits. Every weight is
random, the (1 + weight) norms' too: HF's zero init would hide a norm that scales by the weight.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from model_service.errors import ModelLoadError
from model_service.models.config import ModelConfig
from model_service.models.loader import LoadedModel, load_model
from tests.conftest import make_engine, prefill_logits
from tests.family_checks import (
    LONG,
    check_batched_and_chunked,
    check_cuda_matches_cpu,
    check_lora_matches_peft,
    check_prefix_cache_hit,
    check_triton_backend,
)
from tests.test_tiny_models import PROMPTS, VOCAB, rel_err

SHAPE = {
    "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "sliding_window": 8,
    "query_pre_attn_scalar": 24, "final_logit_softcapping": 0.5,
}  # fmt: skip
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "sliding_window_pattern": 3,  # sliding, sliding, full
            "rope_local_base_freq": 100.0,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        },
    ),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"attn_logit_softcapping": 2.0}),
}
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def save_gemma(family: str, path: Path, seed: int = 0) -> Any:
    """Save a tiny random `family` checkpoint at `path`; returns HF's model of it (the oracle)."""
    import transformers

    cls, arch, extra = FAMILIES[family]
    config = getattr(transformers, cls)(**SHAPE, **extra, architectures=[arch])
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
        # Tied and scaled by sqrt(64), 0.2-wide embeddings outweigh the blocks' outputs: every
        # greedy run would repeat its last token, and a broken block go unseen.
        model.model.embed_tokens.weight.mul_(0.1)
    model.save_pretrained(path)
    model.generation_config.eos_token_id = None
    return model.eval()


@pytest.fixture(scope="module", params=list(FAMILIES))
def gemma(request: pytest.FixtureRequest, tmp_path_factory: Any) -> tuple[Any, LoadedModel]:
    """(HF's model, ours) of one family's checkpoint."""
    path = tmp_path_factory.mktemp(request.param)
    hf = save_gemma(request.param, path)
    return hf, load_model(str(path), torch.float32, torch.device("cpu"))


def test_gemma_logits_match_hf_past_the_sliding_window(gemma):
    hf, ours = gemma
    assert ours.config.softmax_scale == 24**-0.5 and ours.config.sliding_windows == hf_windows(hf.config)
    for ids in (PROMPTS[1], LONG):
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0, -1]
        assert rel_err(prefill_logits(make_engine(ours), ids), ref) < 1e-4


def hf_windows(hf_config: Any) -> list[int | None]:
    return [hf_config.sliding_window if t == "sliding_attention" else None for t in hf_config.layer_types]


def test_gemma_greedy_batched_and_chunked_match_hf(gemma):
    check_batched_and_chunked(*gemma)


def test_gemma_prefix_cache_hit_matches_hf(gemma):
    check_prefix_cache_hit(*gemma)


def test_gemma_lora_on_attention_and_mlp_matches_peft(gemma, tmp_path: Path):
    hf, ours = gemma
    check_lora_matches_peft(
        hf, ours, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], tmp_path
    )


GEMMA3 = {**SHAPE, "architectures": ["Gemma3ForCausalLM"]}


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"use_bidirectional_attention": True}, "EmbeddingGemma"),
        ({"hidden_activation": "relu"}, "unsupported hidden_activation 'relu'"),
        ({"layer_types": ["sliding_attention"] * 3, "sliding_window": None}, "sliding_window is not set"),
        ({"final_logit_softcapping": 0.0}, "must be positive"),
    ],
)
def test_a_gemma_config_the_engine_cannot_run_as_hf_is_refused(fields: dict[str, Any], match: str):
    with pytest.raises(ModelLoadError, match=match):
        ModelConfig.from_hf({**GEMMA3, **fields})


def test_gemma3_hub_rope_fields_read_as_transformers_reads_them():
    """A hub config.json (rope_theta, rope_scaling, rope_local_base_freq, no rope_parameters) gives
    the RoPEs transformers builds for each layer type."""
    import transformers

    raw = {**GEMMA3, "rope_theta": 5e5, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    raw |= {"rope_local_base_freq": 123.0}
    ours, hf = ModelConfig.from_hf(raw), transformers.Gemma3TextConfig(**raw).rope_parameters
    assert (ours.rope_theta, ours.rope_scaling["factor"]) == (hf["full_attention"]["rope_theta"], 8.0)
    assert ours.sliding_rope == (hf["sliding_attention"]["rope_theta"], {"rope_type": "default"})


def test_gemma_takes_the_triton_backend_where_kernels_apply(gemma, monkeypatch: pytest.MonkeyPatch):
    """Gemma 2's soft-capped attention and Gemma 3's keep the Triton kernels and graphs, at
    query_pre_attn_scalar's scale (not head_dim's), and decode HF's tokens through them."""
    backend = check_triton_backend(*gemma, monkeypatch, graphs=True)
    assert backend.scale == 24**-0.5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gemma_on_cuda_gives_the_cpu_tokens(gemma):
    check_cuda_matches_cpu(gemma[1], graphs=True)
