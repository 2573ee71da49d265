"""gpt-oss against HF transformers (and PEFT) on a tiny random checkpoint, and MXFP4 experts.

The checkpoint turns on everything that distinguishes the family: sliding (window 8, shorter than
the long prompt) and full layers, attention sinks, q/k/v/o biases, YaRN (transformers' default
for gpt-oss), a biased router over 4 experts (top-2), biased experts and a SwiGLU clamp low
enough (0.25) to bind. Every weight is random, the sinks and biases too: HF's zero init would hide
a dropped bias.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from model_service.errors import ModelLoadError
from model_service.lora.adapter import AdapterError, load_peft_adapter
from model_service.models.config import ModelConfig
from model_service.models.loader import LoadedModel, load_model
from model_service.models.mxfp4 import dequantize
from tests.conftest import make_engine, prefill_logits
from tests.family_checks import (
    LONG,
    check_batched_and_chunked,
    check_cuda_matches_cpu,
    check_lora_matches_peft,
    check_prefix_cache_hit,
    check_triton_backend,
    hf_greedy,
)
from tests.test_lora import make_adapter
from tests.test_tiny_models import PROMPTS, VOCAB, rel_err, request

SHAPE = {
    "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512,
    "sliding_window": 8, "num_local_experts": 4, "num_experts_per_tok": 2, "swiglu_limit": 0.25,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "architectures": ["GptOssForCausalLM"],
}  # fmt: skip
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def save_gpt_oss(path: Path, seed: int = 0) -> Any:
    """Save a tiny random gpt-oss checkpoint at `path`; returns HF's model of it (the oracle)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.GptOssConfig(**SHAPE), dtype=torch.float32
    )
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(path)
    model.generation_config.eos_token_id = None
    return model.eval()


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: Any) -> tuple[Any, LoadedModel]:
    """(HF's model, ours) of one checkpoint."""
    path = tmp_path_factory.mktemp("gpt_oss")
    hf = save_gpt_oss(path)
    return hf, load_model(str(path), torch.float32, torch.device("cpu"))


def test_gpt_oss_logits_match_hf_past_the_sliding_window(gpt_oss):
    hf, ours = gpt_oss
    assert ours.config.sliding_windows == [8, None] and ours.config.rope_scaling["rope_type"] == "yarn"
    for ids in (PROMPTS[1], LONG):
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0, -1]
        assert rel_err(prefill_logits(make_engine(ours), ids), ref) < 1e-4
        assert rel_err(prefill_logits(make_engine(ours, block_size=4), ids, chunk=5), ref) < 1e-4


def test_gpt_oss_greedy_batched_and_chunked_match_hf(gpt_oss):
    check_batched_and_chunked(*gpt_oss)


def test_gpt_oss_prefix_cache_hit_matches_hf(gpt_oss):
    check_prefix_cache_hit(*gpt_oss)


def test_gpt_oss_lora_on_attention_matches_peft_and_expert_lora_is_refused(gpt_oss, tmp_path: Path):
    hf, ours = gpt_oss
    check_lora_matches_peft(hf, ours, ["q_proj", "k_proj", "v_proj", "o_proj"], tmp_path)
    # PEFT adapts gpt-oss's experts through `target_parameters`: refused by name, not ignored.
    experts = make_adapter(
        hf, tmp_path / "experts", 6, r=4, target_modules=[], target_parameters=["mlp.experts.gate_up_proj"]
    )
    with pytest.raises(AdapterError, match="adapts mixture-of-experts experts"):
        load_peft_adapter("e", experts, ours.config, max_lora_rank=8)


def test_gpt_oss_takes_the_triton_backend_and_graphs_where_kernels_apply(gpt_oss, monkeypatch):
    """The sinks keep the Triton kernels, and decode HF's tokens through them; CUDA graphs where
    the fused MoE kernels run the experts (biases and clamped SwiGLU in the kernels, routing on
    the device: no host sync), none where they do not (the torch reference reads each step's
    experts on the host). Under Triton's interpreter the experts run the fused kernels on the CPU
    too, so the tokens checked against HF's are theirs."""
    import os

    from model_service.models import gpt_oss as gpt_oss_module

    executor = make_engine(gpt_oss[1]).executor
    with monkeypatch.context() as patch:  # the experts' answer alone, no forward through it
        for supported in (False, True):
            patch.setattr(gpt_oss_module, "fused_moe_supported", lambda dtype, device, ok=supported: ok)
            assert executor._graphs_apply() == supported
    # below, graphs are decided as where the kernels apply, whether they run the experts or not
    monkeypatch.setattr(gpt_oss_module.GptOssExperts, "capturable", lambda self, device: True)
    rows: list[int] = []  # the rows of each fused call: one (the GEMVs) and more (the tiles)
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    if interpreting:
        fused = gpt_oss_module.fused_moe
        monkeypatch.setattr(gpt_oss_module, "fused_moe_supported", lambda dtype, device: True)
        monkeypatch.setattr(
            gpt_oss_module, "fused_moe", lambda x, *a, **k: rows.append(len(x)) or fused(x, *a, **k)
        )
    check_triton_backend(*gpt_oss, monkeypatch, graphs=True)
    assert (1 in rows and max(rows) > 1) if interpreting else not rows


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpt_oss_on_cuda_under_graphs_gives_the_cpu_tokens(gpt_oss):
    """The fused MoE kernels (GEMVs at one token, tiles past it) under decode graphs."""
    check_cuda_matches_cpu(gpt_oss[1], graphs=True)


def test_gpt_oss_experts_of_another_shape_are_named_in_the_checkpoints_terms():
    """The experts are split into the kernels' layout at load: a tensor of the wrong shape is named
    with HF's shape, not the transposed one the module holds."""
    from model_service.models.gpt_oss import kernel_layout

    cfg = ModelConfig.from_hf({**SHAPE, "model_type": "gpt_oss"})
    name = "model.layers.0.mlp.experts.gate_up_proj"
    with pytest.raises(ModelLoadError, match=r"gate_up_proj.*\(4, 64, 48\), expected \(4, 64, 64\)"):
        kernel_layout({name: torch.zeros(4, 64, 48)}, cfg)


def test_gpt_oss_tensor_parallelism_is_refused(gpt_oss):
    from model_service.distributed.sharding import Partition

    with pytest.raises(ModelLoadError, match="serve it on one device"):
        Partition.of(gpt_oss[1].config, 0, 2)


def test_mxfp4_dequantization_of_a_hand_built_block():
    """Byte 0x2F is codes 0xF (low nibble, first: -6) and 0x2 (1.0); exponent byte 128 is 2**1,
    126 is 2**-1. Each row's 16 bytes are 32 weights."""
    blocks = torch.zeros(1, 2, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0, 0], blocks[0, 0, 0, 15] = 0x2F, 0x91  # 0x1 (0.5), 0x9 (-0.5)
    blocks[0, 1, 0, :] = 0x77  # 6.0, 6.0
    scales = torch.tensor([[[128], [126]]], dtype=torch.uint8)
    want = torch.zeros(1, 2, 32)
    want[0, 0, :2] = torch.tensor([-12.0, 2.0])
    want[0, 0, 30:] = torch.tensor([1.0, -1.0])
    want[0, 1, :] = 3.0
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(dequantize(blocks, scales, dtype), want.to(dtype))


def test_mxfp4_checkpoint_serves_as_hf_with_the_dequantized_experts(tmp_path: Path):
    """The hub's layout (`*_blocks` / `*_scales`, quantization_config mxfp4) of random codes loads
    as transformers' own dequantization of them: HF's model holding those weights gives the same
    greedy tokens."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    src = tmp_path / "mxfp4"
    hf = save_gpt_oss(src)
    tensors, gen = load_file(str(src / "model.safetensors")), torch.Generator().manual_seed(3)
    for name in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, in_f, out_f = tensors.pop(name).shape  # HF's [E, in, out]; blocks: [E, out, in / 32, 16]
        blocks = torch.randint(0, 256, (experts, out_f, in_f // 32, 16), generator=gen).to(torch.uint8)
        scales = torch.randint(121, 126, blocks.shape[:-1], generator=gen).to(torch.uint8)
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        hf.get_parameter(name).data = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    save_file(tensors, str(src / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}
    (src / "config.json").write_text(json.dumps(config))
    engine = make_engine(load_model(str(src), torch.float32, torch.device("cpu")))
    assert [o.token_ids for o in engine.generate([request(LONG)])] == [hf_greedy(hf, LONG)]


def test_gpt_oss_config_defaults_are_transformers():
    """A config.json with only the required fields reads as GptOssConfig's defaults."""
    import transformers

    raw = {"vocab_size": 64, "hidden_size": 96, "intermediate_size": 32, "num_attention_heads": 6}
    raw |= {"num_hidden_layers": 4}
    hf, ours = transformers.GptOssConfig(**raw), ModelConfig.from_hf({**raw, "model_type": "gpt_oss"})
    assert (ours.num_kv_heads, ours.head_dim, ours.rms_norm_eps) == (8, 64, 1e-5)
    assert ours.sliding_windows == [128 if t == "sliding_attention" else None for t in hf.layer_types]
    params = dict(hf.rope_parameters)
    assert ours.rope_theta == params.pop("rope_theta") and ours.rope_scaling == params
    assert (ours.num_experts, ours.num_experts_per_tok, ours.moe_intermediate_size) == (128, 4, 32)
    assert ours.qkv_bias and ours.o_proj_bias and ours.attention_sinks
    assert (ours.expert_swiglu.alpha, ours.expert_swiglu.limit) == (hf.swiglu_alpha, hf.swiglu_limit)


def test_a_hub_gpt_oss_config_reads_its_legacy_rope_and_mxfp4_fields():
    """openai/gpt-oss-20b's config.json spells RoPE as `rope_theta` + `rope_scaling` and marks its
    experts MXFP4 (no FP8 scheme); an MXFP4 config on another family stays refused."""
    yarn = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
    yarn |= {"original_max_position_embeddings": 4096}
    mxfp4 = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}
    raw = {**SHAPE, "rope_theta": 150000, "rope_scaling": yarn, "quantization_config": mxfp4}
    ours = ModelConfig.from_hf(raw)
    assert ours.mxfp4_experts and ours.quantization is None
    assert (ours.rope_theta, ours.rope_scaling) == (150000.0, yarn)
    with pytest.raises(ModelLoadError, match="mxfp4"):
        ModelConfig.from_hf({**raw, "architectures": ["MixtralForCausalLM"]})
