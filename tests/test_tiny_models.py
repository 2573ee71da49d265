"""Our decoder against HF transformers on tiny random Llama/Mistral/Qwen2/Qwen3 checkpoints.

Each variant flips one architectural switch (tied embeddings, GQA/MHA, biases, QK-norm, RoPE
scaling, sliding windows, sharded weights) so a mistake in that switch shows up as a logits or
greedy-token mismatch against HF's own forward pass on the same files.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_service.models.layers import checkpoint_tensors
from model_service.models.loader import LoadedModel, load_model
from tests.conftest import assert_all_blocks_free, make_engine, make_tiny_checkpoint, prefill_logits

VOCAB = 320  # make_tiny_checkpoint's vocab_size
MAX_NEW = 16
PROMPT_LENS = [20, 7, 13, 1, 26]


@dataclass(frozen=True)
class Variant:
    family: str
    overrides: dict[str, Any] = field(default_factory=dict)
    max_shard_size: str | None = None  # save sharded (index + several files) when set


VARIANTS: dict[str, Variant] = {
    "llama": Variant("llama"),
    "llama-tied": Variant("llama", {"tie_word_embeddings": True}),
    "llama-mha": Variant("llama", {"num_key_value_heads": 4}),
    "llama-mqa": Variant("llama", {"num_key_value_heads": 1}),
    "llama-attn-mlp-bias": Variant("llama", {"attention_bias": True, "mlp_bias": True}),
    "llama-rope-linear": Variant(
        "llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}}
    ),
    "llama-rope-llama3": Variant(
        "llama",
        {
            # head_dim 16, theta 1e4: wavelengths 6..2e4, so orig 256 puts some below 64 (kept),
            # one in [64, 256] (smoothed) and the rest above 256 (divided by factor).
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            }
        },
    ),
    "llama-rope-yarn": Variant(
        "llama",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
            }
        },
    ),
    # Within max_position_embeddings, dynamic NTK is the default frequencies (HF's, and ours).
    "llama-rope-dynamic": Variant(
        "llama", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}}
    ),
    "llama-sharded": Variant("llama", max_shard_size="100KB"),
    "llama-gelu": Variant("llama", {"hidden_act": "gelu_pytorch_tanh"}),
    "mistral": Variant("mistral"),
    "mistral-sliding8": Variant("mistral", {"sliding_window": 8}),
    "qwen2": Variant("qwen2"),
    "qwen2-tied-mha": Variant("qwen2", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    # Sliding window only on layers >= max_window_layers (here: layer 1 of 2).
    "qwen2-sliding-upper": Variant(
        "qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}
    ),
    "qwen3": Variant("qwen3"),
    "qwen3-bias": Variant("qwen3", {"attention_bias": True}),
    "qwen3-tied-mha": Variant("qwen3", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    "qwen3-rope-yarn": Variant(
        "qwen3",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1000000.0,
                "factor": 2.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
}


def _randomize_biases(path: Path, seed: int) -> None:
    """make_tiny_checkpoint leaves biases at HF's zero init, where a dropped bias changes nothing."""
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    gen = torch.Generator().manual_seed(seed)
    biases = [k for k in tensors if k.endswith(".bias")]
    for k in biases:
        tensors[k] = torch.randn(tensors[k].shape, generator=gen) * 0.2
    if biases:
        save_file(tensors, str(file), metadata={"format": "pt"})


def save_checkpoint(variant: Variant, root: Path, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM

    path = make_tiny_checkpoint(variant.family, root / "ckpt", seed=seed, **variant.overrides)
    _randomize_biases(path, seed)
    if variant.max_shard_size is None:
        return path
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    sharded = root / "sharded"
    hf.save_pretrained(sharded, max_shard_size=variant.max_shard_size)
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) >= 3
    assert not (sharded / "model.safetensors").exists()
    return sharded


def random_prompt(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=gen).tolist()  # skip pad/bos/eos ids


PROMPTS = [random_prompt(n, seed=100 + i) for i, n in enumerate(PROMPT_LENS)]


class Case:
    """One variant's checkpoint, HF's load of it (the oracle), ours, and memoized greedy outputs."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.path = path
        self.hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        # Never stop at EOS on either side: both must produce exactly MAX_NEW tokens.
        self.hf.generation_config.eos_token_id = None
        self.ours: LoadedModel = load_model(str(path), torch.float32, torch.device("cpu"))
        self._hf_greedy: dict[int, list[int]] = {}

    def hf_greedy(self, i: int) -> list[int]:
        if i not in self._hf_greedy:
            ids = PROMPTS[i]
            with torch.no_grad():
                out = self.hf.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False)
            self._hf_greedy[i] = out[0, len(ids) :].tolist()
            assert len(self._hf_greedy[i]) == MAX_NEW
        return self._hf_greedy[i]


def request(ids: list[int]) -> dict[str, Any]:
    return {"prompt_token_ids": ids, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}


def last_token_logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    engine = make_engine(loaded)
    logits = prefill_logits(engine, ids)
    assert_all_blocks_free(engine)
    return logits


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """These models are tiny: a second intra-op thread buys nothing, and on a shared 2-core box its
    spin-waiting makes every op stall behind other processes (seconds per step instead of ms)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=list(VARIANTS), ids=list(VARIANTS))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    root = tmp_path_factory.mktemp(request.param)
    return Case(save_checkpoint(VARIANTS[request.param], root))


def test_config_switches_reach_our_model(case: Case):
    """Guard the variants themselves: each must really exercise the switch it is named for."""
    cfg, hf_cfg = case.ours.config, case.hf.config
    assert cfg.num_kv_heads == hf_cfg.num_key_value_heads
    assert cfg.tie_word_embeddings == hf_cfg.tie_word_embeddings
    if cfg.tie_word_embeddings:
        assert case.ours.module.lm_head.weight is case.ours.module.model.embed_tokens.weight
    hf_rope = hf_cfg.rope_parameters
    assert cfg.rope_scaling["rope_type"] == hf_rope["rope_type"]
    assert cfg.rope_theta == hf_rope["rope_theta"]
    hf_windows = [
        getattr(hf_cfg, "sliding_window", None) if t == "sliding_attention" else None
        for t in (getattr(hf_cfg, "layer_types", None) or ["sliding_attention"] * cfg.num_layers)
    ]
    assert cfg.sliding_windows == hf_windows
    ours_params = checkpoint_tensors(case.ours.module)  # fused projections split into their parts
    for name, p in case.hf.named_parameters():
        if name in ours_params:
            torch.testing.assert_close(ours_params[name], p, rtol=0, atol=0)
        else:
            assert name == "lm_head.weight" and cfg.tie_word_embeddings, name


def test_last_token_logits_match_hf(case: Case):
    for ids in (PROMPTS[0], PROMPTS[4]):
        with torch.no_grad():
            ref = case.hf(torch.tensor([ids])).logits[0, -1]
        ours = last_token_logits(case.ours, ids)
        assert ours.dtype == torch.float32 and ours.shape == (VOCAB,)
        assert rel_err(ours, ref) < 1e-4


def test_greedy_tokens_match_hf(case: Case):
    engine = make_engine(case.ours)
    for i in (0, 1, 3):
        assert engine.generate([request(PROMPTS[i])])[0].token_ids == case.hf_greedy(i), f"prompt {i}"
    assert_all_blocks_free(engine)


def test_batched_generation_equals_each_alone(case: Case):
    engine = make_engine(case.ours)
    alone = [engine.generate([request(ids)])[0].token_ids for ids in PROMPTS]
    batched = [o.token_ids for o in engine.generate([request(ids) for ids in PROMPTS])]
    assert batched == alone
    assert alone[2] == case.hf_greedy(2)
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("name", ["llama", "mistral-sliding8", "qwen3-bias"])
def test_chunked_prefill_matches_hf(name: str, tmp_path: Path):
    """Prompts split into 5-token chunks (and 4-token KV blocks) still give HF's greedy tokens."""
    case = Case(save_checkpoint(VARIANTS[name], tmp_path))
    engine = make_engine(case.ours, max_num_batched_tokens=5, block_size=4)
    outs = engine.generate([request(ids) for ids in PROMPTS])
    assert [o.token_ids for o in outs] == [case.hf_greedy(i) for i in range(len(PROMPTS))]
    assert_all_blocks_free(engine)
    # The whole prompt still agrees when it arrives in many prefill chunks through the model API.
    ids = PROMPTS[4]
    logits = prefill_logits(engine, ids, chunk=5)
    with torch.no_grad():
        ref = case.hf(torch.tensor([ids])).logits[0, -1]
    assert rel_err(logits, ref) < 1e-4
