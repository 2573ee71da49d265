"""DeepSeek-V2/V3 (multi-head latent attention, DeepSeek MoE) against HF transformers on tiny
random checkpoints, through the engine paths that read the latent cache: batched prefill and
decode, chunked prefill, a prefix-cache hit, preemption; and the pieces alone: the routers
against HF's, absorbed decode against decompressed attention, the cache's bytes per token.

Two shapes, each exercising what its family is known for:
- V2-Lite-shaped: one q_proj (no q LoRA), softmax routing limited to the best groups
  (`group_limited_greedy`), two shared experts, YaRN with mscale = mscale_all_dim (rotary tables
  unscaled, the softmax scale corrected), a dense first layer.
- V3-shaped: q_a_proj -> norm -> q_b_proj, sigmoid routing with the correction bias over groups
  (`noaux_tc`), renormalized and scaled top-k, YaRN with mscale != mscale_all_dim (both
  corrections), a dense first layer, MoE only every layer after it.
The 1-D weights (norms, the correction bias) are randomized: HF initializes them to ones and
zeros, where a dropped norm or bias would go unseen.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_service.attention.kv_cache import cache_bytes_per_block
from model_service.attention.reference import TorchReferenceBackend
from model_service.attention.triton_latent import TritonLatentBackend
from model_service.distributed.sharding import Partition
from model_service.errors import ModelLoadError
from model_service.kernels import mla_decode
from model_service.kernels.mla_decode import mla_decode_attention, mla_decode_attention_reference
from model_service.lora.adapter import AdapterError, load_peft_adapter
from model_service.models.config import ModelConfig
from model_service.models.context import ForwardContext
from model_service.models.layers import checkpoint_tensors
from model_service.models.loader import load_model
from model_service.models.moe import route
from model_service.models.step import StaticRows
from tests.conftest import (
    assert_all_blocks_free,
    forward,
    make_engine,
    make_tiny_checkpoint,
    new_sequence,
    prefill_logits,
)
from tests.test_beam_search import _hf_beams
from tests.test_lora import make_adapter, peft_greedy
from tests.test_tiny_models import (  # noqa: F401 (_one_torch_thread: the module fixture, no conftest needed)
    PROMPTS,
    Case,
    _one_torch_thread,
    random_prompt,
    rel_err,
    request,
)

MLA = {
    "num_attention_heads": 4,
    "num_key_value_heads": 4,  # HF's MLA repeats K/V by heads // kv_heads: MLA has one per head
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "head_dim": 8,  # HF rotates qk_rope_head_dim dims only if head_dim says so (make_tiny_checkpoint sets 16)
    "v_head_dim": 12,  # unlike the query width: a mixed-up K and V dim shows as a shape error
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "moe_intermediate_size": 24,
    "num_experts_per_tok": 2,
}
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "v2-lite": (
        "deepseek_v2",
        {
            **MLA,
            "q_lora_rank": None,
            "n_routed_experts": 8,
            "n_shared_experts": 2,
            "topk_method": "group_limited_greedy",
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 1.5,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
                "original_max_position_embeddings": 16,
            },
        },
    ),
    "v3": (
        "deepseek_v3",
        {
            **MLA,
            "q_lora_rank": 24,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "n_group": 4,
            "topk_group": 2,
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
            "num_mtp_layers": 0,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "mscale": 1.0,
                "mscale_all_dim": 0.8,
                "original_max_position_embeddings": 16,
                "beta_fast": 32,
                "beta_slow": 1,
            },
        },
    ),
}


def make_tiny_deepseek(name: str, path: Path, seed: int = 0) -> Path:
    family, overrides = SHAPES[name]
    make_tiny_checkpoint(family, path, seed=seed, **overrides)
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    gen = torch.Generator().manual_seed(seed)
    for key, t in tensors.items():
        if key.endswith("e_score_correction_bias"):  # comparable to the sigmoid scores: it moves choices
            tensors[key] = torch.rand(t.shape, generator=gen) * 0.5
        elif t.dim() == 1:
            tensors[key] = t + torch.randn(t.shape, generator=gen) * 0.3
    save_file(tensors, str(file), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module", params=list(SHAPES), ids=list(SHAPES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    return Case(make_tiny_deepseek(request.param, tmp_path_factory.mktemp(request.param) / "ckpt"))


def test_config_and_weights_match_hf(case: Case):
    """Which layers are sparse, the attention scale, and every HF weight (stacked experts, the
    correction bias, the fused q_a/kv_a projection) exactly ours."""
    cfg, hf_cfg = case.ours.config, case.hf.config
    assert [k.moe for k in cfg.layer_kinds] == [
        hasattr(layer.mlp, "experts") for layer in case.hf.model.layers
    ]
    assert [k.moe for k in cfg.layer_kinds] == [False, True, True]
    assert cfg.softmax_scale == pytest.approx(case.hf.model.layers[0].self_attn.scaling, rel=1e-12)
    assert cfg.softmax_scale != cfg.head_dim**-0.5  # the mscale_all_dim correction applies
    assert case.ours.module.rotary.attention_factor == pytest.approx(
        case.hf.model.rotary_emb.attention_scaling
    )
    assert cfg.latent_attention is not None and cfg.latent_attention.q_lora_rank == hf_cfg.q_lora_rank
    ours = checkpoint_tensors(case.ours.module)
    hf = dict(case.hf.named_parameters()) | {
        k: b for k, b in case.hf.named_buffers() if k.endswith("e_score_correction_bias")
    }
    assert set(ours) == set(hf)
    for name, p in hf.items():
        torch.testing.assert_close(ours[name], p, rtol=0, atol=0)


def test_the_cache_holds_one_latent_row_per_token_and_layer(case: Case):
    """[layers, 1 plane, slots, 1 head, kv_lora_rank + qk_rope_head_dim]: no per-head K or V."""
    engine = make_engine(case.ours, num_kv_blocks=8, block_size=4)
    mla = case.ours.config.latent_attention
    assert engine.executor.kv_cache.data.shape == (3, 1, 32, 1, mla.kv_lora_rank + mla.qk_rope_head_dim)
    assert engine.cache.kv_bytes_per_token == 3 * (32 + 8) * 4


def test_bytes_per_token_of_the_published_shapes():
    """The docs' figures: 576 values per token and layer, against 128 (V3) or 16 (V2-Lite) heads of
    192-wide keys and 128-wide values."""
    v3 = _published("deepseek_v3", heads=128, layers=61, q_lora_rank=1536)
    v2_lite = _published("deepseek_v2", heads=16, layers=27, q_lora_rank=None)
    for cfg, heads in ((v3, 128), (v2_lite, 16)):
        latent = cache_bytes_per_block(cfg, 1, torch.bfloat16)
        assert latent == cfg.num_layers * 576 * 2
        assert cfg.num_layers * heads * (192 + 128) * 2 / latent == pytest.approx(heads * 320 / 576)


def _published(family: str, heads: int, layers: int, q_lora_rank: int | None) -> ModelConfig:
    arch = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}[family]
    return ModelConfig.from_hf({
        "architectures": [arch], "vocab_size": 1000, "hidden_size": 2048, "intermediate_size": 10944,
        "num_hidden_layers": layers, "num_attention_heads": heads, "kv_lora_rank": 512,
        "q_lora_rank": q_lora_rank, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "n_routed_experts": 64, "num_experts_per_tok": 6, "moe_intermediate_size": 1408, "n_group": 8,
        "topk_group": 4,
    })  # fmt: skip


def test_logits_match_hf_in_one_pass_and_in_chunks(case: Case):
    engine = make_engine(case.ours, block_size=4)
    for ids in (PROMPTS[0], random_prompt(45, seed=21)):
        with torch.no_grad():
            ref = case.hf(torch.tensor([ids])).logits[0, -1]
        assert rel_err(prefill_logits(engine, ids), ref) < 1e-4
        assert rel_err(prefill_logits(engine, ids, chunk=6), ref) < 1e-4
    assert_all_blocks_free(engine)


def test_greedy_tokens_match_hf_batched_and_chunked(case: Case):
    """Five prompts of 1 to 26 tokens at once (mixed prefill and decode steps), then with 5-token
    prefill chunks interleaved with the others' decode rows."""
    expected = [case.hf_greedy(i) for i in range(len(PROMPTS))]
    engine = make_engine(case.ours)
    assert [o.token_ids for o in engine.generate([request(ids) for ids in PROMPTS])] == expected
    assert_all_blocks_free(engine)
    chunked = make_engine(case.ours, max_num_batched_tokens=5, block_size=4)
    assert [o.token_ids for o in chunked.generate([request(ids) for ids in PROMPTS])] == expected
    assert_all_blocks_free(chunked)


def test_prefix_cache_hit_gives_the_cold_run_tokens(case: Case):
    """Turn 2 resends turn 1's prompt and answer plus more: its prefill computes only the new
    tokens, whose attention must still reach the cached prefix's latents (a layer that attended
    only over the tokens it is handed would lose them and answer differently)."""
    first = random_prompt(29, seed=11)
    warm = make_engine(case.ours, block_size=4)
    answer = warm.generate([{**request(first), "max_tokens": 8}])[0].token_ids
    second = first + answer + random_prompt(6, seed=12)  # 43 tokens
    before = warm.stats()
    warm_out = warm.generate([request(second)])[0].token_ids
    hit = warm.stats().prefix_cache_hit_tokens - before.prefix_cache_hit_tokens
    assert hit >= 32  # turn 1 computed 36 tokens: its full blocks
    cold = make_engine(case.ours, block_size=4, enable_prefix_caching=False)
    assert warm_out == cold.generate([request(second)])[0].token_ids
    with torch.no_grad():
        ref = case.hf.generate(torch.tensor([second]), max_new_tokens=16, do_sample=False)
    assert warm_out == ref[0, len(second) :].tolist()
    assert_all_blocks_free(warm)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_keeps_hf_tokens(case: Case, mode: str):
    engine = make_engine(case.ours, num_kv_blocks=14, block_size=4, preemption_mode=mode)
    outs = engine.generate([request(ids) for ids in PROMPTS])
    assert [o.token_ids for o in outs] == [case.hf_greedy(i) for i in range(len(PROMPTS))]
    assert engine.stats().num_preemptions > 0
    assert_all_blocks_free(engine)


def test_speculative_verify_and_beam_search_keep_hf_tokens(case: Case):
    """n-gram verify runs (several query rows a sequence over the latent cache, rejected rows'
    latents overwritten later) and beams (forked blocks of latents) as HF decodes."""
    spec = make_engine(case.ours, speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    outs = spec.generate([request(ids) for ids in PROMPTS[:3]])
    assert [o.token_ids for o in outs] == [case.hf_greedy(i) for i in range(3)]
    assert spec.stats().spec_proposed_tokens > 0
    assert_all_blocks_free(spec)
    engine = make_engine(case.ours, block_size=4)
    expected = _hf_beams(case.hf, PROMPTS[1], eos=None, num_beams=3, max_new_tokens=10)
    req = {"prompt_token_ids": PROMPTS[1], "max_tokens": 10, "num_beams": 3, "ignore_eos": True}
    assert engine.generate([req])[0].token_ids == expected
    assert_all_blocks_free(engine)


def test_absorbed_decode_equals_decompressed_attention(case: Case):
    """One decode step of three sequences, attended in latent space (the decode path) and with
    K/V decompressed from the same cached rows (the prefill path): the same output."""
    engine = make_engine(case.ours, block_size=4)
    backend = engine.executor.attention
    states = [new_sequence(engine, n + 1) for n in (9, 4, 14)]
    forward(engine, [(s, random_prompt(n, seed=n), 0) for s, n in zip(states, (9, 4, 14), strict=True)])
    from model_service.engine.batch_builder import StepItem

    batch = engine.builder.build([StepItem(s, [7], 1) for s in states])
    backend.prepare(batch)
    assert backend._num_decode == 3
    gen = torch.Generator().manual_seed(0)
    heads, mla = case.ours.config.num_heads, case.ours.config.latent_attention
    q_nope = torch.randn(3, heads, mla.qk_nope_head_dim, generator=gen)
    q_rope = torch.randn(3, heads, mla.qk_rope_head_dim, generator=gen)
    row = torch.randn(3, mla.cache_dim, generator=gen)
    kv_up = case.ours.module.model.layers[1].self_attn.kv_b_proj.weight.view(heads, -1, mla.kv_lora_rank)
    absorbed = backend.forward_latent(1, q_nope, q_rope, row, kv_up)
    backend._num_decode = 0  # every sequence through the decompressing path
    decompressed = backend.forward_latent(1, q_nope, q_rope, row, kv_up)
    torch.testing.assert_close(absorbed, decompressed, rtol=1e-5, atol=1e-5)
    # The decode kernel's reference (per sequence, through the block table) as the backend's grid.
    q = torch.randn(3, heads, mla.cache_dim, generator=gen)
    cache = engine.executor.kv_cache.latent(1)
    want = backend._latent_attention(cache, q, mla.kv_lora_rank)
    got = mla_decode_attention_reference(
        q, cache, batch.block_table, batch.seq_lens, 4, backend.scale, mla.kv_lora_rank
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for s in states:
        engine.cache.free(s)


def test_lora_on_the_mla_projections_matches_peft(case: Case, tmp_path: Path):
    """A PEFT adapter on every MLA projection LoRA can serve (the query path, the latent
    projection, o_proj): greedy tokens as PEFT's. One on kv_b_proj is
    refused by name: it multiplies latents cached by earlier steps, which no step's adapter covers."""
    mla = case.ours.config.latent_attention
    query = ["q_proj"] if mla.q_lora_rank is None else ["q_a_proj", "q_b_proj"]
    targets = [*query, "kv_a_proj_with_mqa", "o_proj"]
    adapter = make_adapter(
        case.hf, tmp_path / "mla", seed=7, scale=0.3, r=4, lora_alpha=8, target_modules=targets
    )
    engine = make_engine(case.ours, max_loras=1, lora_modules={"mla": str(adapter)})
    want = peft_greedy(case.hf, adapter, PROMPTS[:3], 16, eos=None)
    outs = engine.generate([{**request(ids), "adapter": "mla"} for ids in PROMPTS[:3]])
    assert [o.token_ids for o in outs] == want
    assert want != [case.hf_greedy(i) for i in range(3)], "the adapter does not change the output"
    assert_all_blocks_free(engine)
    kv_b = make_adapter(case.hf, tmp_path / "kv_b", seed=8, r=4, target_modules=["kv_b_proj"])
    with pytest.raises(AdapterError, match=r"'kv_b_proj' \(kv_b_proj decompresses the cached latents"):
        load_peft_adapter("kv_b", kv_b, case.ours.config, max_lora_rank=8)


def test_an_fp8_cache_holds_the_latents(case: Case):
    """`--kv-cache-dtype fp8`: the latent rows in e4m3 (logits near HF's, not equal: three
    mantissa bits on random weights of spread 0.2)."""
    engine = make_engine(case.ours, block_size=4, kv_cache_dtype="fp8")
    assert engine.executor.kv_cache.data.dtype == torch.float8_e4m3fn
    ids = random_prompt(30, seed=5)
    with torch.no_grad():
        ref = case.hf(torch.tensor([ids])).logits[0, -1]
    assert 0 < rel_err(prefill_logits(engine, ids, chunk=7), ref) < 0.3  # e4m3 on wide random weights
    engine.generate([request(p) for p in PROMPTS[:2]])
    assert_all_blocks_free(engine)


def test_two_tensor_parallel_ranks_split_the_heads(case: Case, tmp_path: Path):
    """Two ranks (gloo, two processes), two query heads each over a whole latent cache apiece:
    HF's greedy tokens, and with a LoRA adapter on the MLA projections PEFT's. The V2 shape's
    experts are tensor-parallel (each expert's rows split), the V3 shape's expert-parallel (four
    whole experts a rank, V3's biased group routing replicated)."""
    assert Partition.of(case.ours.config, 1, 2).q_heads == range(2, 4)
    mla = case.ours.config.latent_attention
    query = ["q_proj"] if mla.q_lora_rank is None else ["q_a_proj", "q_b_proj"]
    adapter = make_adapter(
        case.hf,
        tmp_path / "mla",
        seed=7,
        scale=0.3,
        r=4,
        target_modules=[*query, "kv_a_proj_with_mqa", "o_proj"],
    )
    want = peft_greedy(case.hf, adapter, PROMPTS[:2], 16, eos=None)
    engine = make_engine(
        case.ours, tensor_parallel_size=2, max_loras=1, lora_modules={"mla": str(adapter)},
        enable_expert_parallel=mla.q_lora_rank is not None,
    )  # fmt: skip
    try:
        outs = engine.generate([request(ids) for ids in PROMPTS[:3]])
        assert [o.token_ids for o in outs] == [case.hf_greedy(i) for i in range(3)]
        outs = engine.generate([{**request(ids), "adapter": "mla"} for ids in PROMPTS[:2]])
        assert [o.token_ids for o in outs] == want
    finally:
        engine.executor.teardown()


def test_the_kernel_backends_bookkeeping_on_the_cpu(case: Case):
    """`TritonLatentBackend` with the kernel's torch reference standing in: eagerly, HF's greedy
    tokens; and a decode step replayed as a CUDA graph would be (static buffers filled for a
    padded batch, padding rows with slot -1 writing nothing), the eager step's logits."""
    engine = make_engine(case.ours, block_size=4)
    cfg = case.ours.config
    kernel_backend = TritonLatentBackend(
        engine.executor.kv_cache, cfg.sliding_windows, cfg.head_dim, cfg.softmax_scale
    )
    engine.executor.attention = kernel_backend
    outs = engine.generate([request(ids) for ids in PROMPTS[:3]])
    assert [o.token_ids for o in outs] == [case.hf_greedy(i) for i in range(3)]
    states = [new_sequence(engine, n + 1) for n in (6, 11)]
    forward(engine, [(s, random_prompt(n, seed=n), 0) for s, n in zip(states, (6, 11), strict=True)])
    from model_service.engine.batch_builder import StepItem

    batch = engine.builder.build([StepItem(s, [9], 1) for s in states])
    rows = StaticRows(4, torch.device("cpu"))
    kernel_backend.init_graph_capture(rows, 64)
    kernel_backend.prepare_for_capture(4)
    rows.fill(batch)
    kernel_backend.prepare_for_replay(batch)
    pool_before = engine.executor.kv_cache.data.clone()
    with torch.inference_mode():
        ctx = ForwardContext(kernel_backend, torch.arange(4))
        replayed = engine.executor.module(rows.input_ids[:4], rows.positions[:4], ctx)[:2]
    written = (engine.executor.kv_cache.data != pool_before).any(dim=(0, 1, 3, 4)).nonzero().flatten()
    assert sorted(written.tolist()) == sorted(batch.slot_mapping.tolist())  # the padding rows wrote nothing
    engine.executor.kv_cache.data.copy_(pool_before)
    eager = engine.executor.execute(batch)
    torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)
    for s in states:
        engine.cache.free(s)


def test_a_cuda_executor_picks_the_kernel_backend_and_graphs(case: Case, monkeypatch: pytest.MonkeyPatch):
    """The wiring, without a GPU: an MLA executor on a (stand-in) CUDA device with Triton builds
    `TritonLatentBackend` and decode graphs over it (no piecewise graphs); on the CPU the reference."""
    import model_service.engine.executor as executor_module

    engine = make_engine(case.ours)
    executor = engine.executor
    assert type(executor.attention) is TorchReferenceBackend and executor.graphs is None
    monkeypatch.setattr(executor_module, "triton", object())
    monkeypatch.setattr(executor_module, "mla_kernel_applies", lambda device, latent: True)
    monkeypatch.setattr(executor_module.ModelExecutor, "_graphs_apply", lambda self: True)
    monkeypatch.setattr(executor_module, "DecodeGraphs", lambda module, backend, *rest: ("graphs", backend))
    monkeypatch.setattr(executor, "device", SimpleNamespace(type="cuda"))
    backend, graphs, pieces = executor._attention(engine.config)
    assert isinstance(backend, TritonLatentBackend) and graphs == ("graphs", backend) and pieces is None


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy", "noaux_tc"])
@pytest.mark.parametrize("norm", [False, True])
def test_routing_matches_hf_routers(method: str, norm: bool):
    """Our `route` against HF's DeepSeek routers on the same logits: the same experts, the same
    weights. (HF's V2 router ignores norm_topk_prob, which no V2 checkpoint sets: not compared.)"""
    from transformers import DeepseekV2Config, DeepseekV3Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    if norm and method != "noaux_tc":
        pytest.skip("HF's V2 router ignores norm_topk_prob (no V2 checkpoint sets it)")
    sizes = {
        "hidden_size": 16, "num_attention_heads": 2, "n_routed_experts": 16, "num_experts_per_tok": 4,
        "n_group": 4, "topk_group": 2,
    }  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    if method == "noaux_tc":
        hf_cfg = DeepseekV3Config(**sizes, norm_topk_prob=norm, routed_scaling_factor=2.5)
        hf_router = DeepseekV3TopkRouter(hf_cfg)
        hf_router.e_score_correction_bias.copy_(torch.rand(16, generator=gen) * 0.3)
        bias = hf_router.e_score_correction_bias
    else:
        hf_cfg = DeepseekV2Config(**sizes, topk_method=method, routed_scaling_factor=16.0)
        hf_router, bias = DeepseekV2TopkRouter(hf_cfg), None
    with torch.no_grad():
        hf_router.weight.copy_(torch.randn(16, 16, generator=gen))
        x = torch.randn(64, 16, generator=gen)
        _, hf_weights, hf_ids = hf_router(x)
    raw = hf_cfg.to_dict() | {"architectures": [type(hf_cfg).__name__.replace("Config", "ForCausalLM")]}
    raw |= {"vocab_size": 8, "intermediate_size": 8, "num_hidden_layers": 1}
    cfg = ModelConfig.from_hf(raw)
    weights, ids = route(x @ hf_router.weight.T, 4, cfg.norm_topk_prob, cfg.routing, bias)
    hf_order, order = hf_ids.argsort(dim=-1), ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
    torch.testing.assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order))
    if method != "greedy":  # every token's experts within its two best groups of four
        assert all(len(set(groups)) <= 2 for groups in (ids // 4).tolist())


def test_mtp_layers_skipped_bad_routing_refused_and_moe_layer_freq(tmp_path: Path):
    """A V3 checkpoint's MTP layers (after the last decoder layer) are not part of the target's
    load (MTP speculation loads them: test_mtp.py); an unknown V2 `topk_method` and a quantization
    scheme other than FP8 are refused by name; `moe_layer_freq` spaces the sparse layers."""
    path = make_tiny_deepseek("v3", tmp_path / "ckpt")
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(tensors, str(file), metadata={"format": "pt"})
    config = path / "config.json"
    config.write_text(
        config.read_text().replace('"num_nextn_predict_layers": 0', '"num_nextn_predict_layers": 1')
    )
    loaded = load_model(str(path), torch.float32, torch.device("cpu"))
    assert (loaded.config.num_layers, loaded.config.mtp_layers) == (3, 1)
    raw = {
        "architectures": ["DeepseekV2ForCausalLM"], "topk_method": "noaux_tc", "vocab_size": 8,
        "hidden_size": 16, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
        "kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
    }  # fmt: skip
    with pytest.raises(ModelLoadError, match="topk_method 'noaux_tc'"):
        ModelConfig.from_hf(raw)
    awq = {"quant_method": "awq", "bits": 4}  # FP8 loads (test_fp8.py); other schemes are refused by name
    with pytest.raises(ModelLoadError, match="awq"):
        ModelConfig.from_hf({**raw, "topk_method": "greedy", "quantization_config": awq})
    # Sparse from layer first_k_dense_replace on, every moe_layer_freq-th (DeepSeek's own rule).
    spaced = ModelConfig.from_hf({**raw, "topk_method": "greedy", "num_hidden_layers": 5,
                                  "first_k_dense_replace": 1, "moe_layer_freq": 2})  # fmt: skip
    assert [k.moe for k in spaced.layer_kinds] == [False, False, True, False, True]


def _check_mla_decode(device: str, dtype: torch.dtype, splits: int, shape: tuple[int, int, int]) -> None:
    """Fresh inputs: contexts of 0 (a padding row), 1, 17 and 300 tokens in shuffled blocks of
    16, heads not a multiple of the kernel's head block; the reference on the CPU."""
    heads, latent, rope = shape
    gen = torch.Generator().manual_seed(5)
    lens = torch.tensor([0, 1, 17, 300])
    blocks = torch.randperm(80, generator=gen)
    table = torch.stack([blocks[i * 20 : (i + 1) * 20] for i in range(4)])
    cache = torch.randn(80 * 16, 1, latent + rope, generator=gen).to(dtype)
    q = torch.randn(4, heads, latent + rope, generator=gen).to(dtype)
    scale = (128 + 64) ** -0.5
    want = mla_decode_attention_reference(q, cache, table, lens, 16, scale, latent)
    on = [t.to(device) for t in (q, cache, table, lens)]
    got = mla_decode_attention(*on[:2], on[2], on[3], 16, scale, latent, num_splits=splits)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.cpu().float(), want.float(), rtol=tol, atol=tol)
    assert got[0].abs().max() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("shape", [(20, 512, 64), (4, 32, 8)], ids=["v3-latent-20-heads", "tiny"])
def test_mla_decode_kernel_matches_its_reference(
    dtype: torch.dtype, splits: int, shape: tuple[int, int, int]
):
    """Both the published and the tiny widths."""
    _check_mla_decode("cuda", dtype, splits, shape)


@pytest.mark.skipif(
    mla_decode.triton is None or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs Triton's interpreter",
)
@pytest.mark.parametrize("splits", [1, 4])
def test_mla_decode_kernel_matches_its_reference_under_the_interpreter(
    monkeypatch: pytest.MonkeyPatch, splits: int
):
    """The tiny widths in float32 on the CPU (the device check bypassed); four splits go through
    the merge kernel."""
    monkeypatch.setattr(mla_decode, "mla_kernel_applies", lambda device, latent: True)
    _check_mla_decode("cpu", torch.float32, splits, (4, 32, 8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_hf_with_the_mla_kernel(case: Case):
    """The checkpoint on CUDA: decode rows through the Triton latent kernel, prefill decompressed,
    a prefix-cache hit on the second round; HF's greedy tokens."""
    torch.backends.cuda.matmul.allow_tf32 = False
    loaded = load_model(str(case.path), torch.float32, torch.device("cuda"))
    engine = make_engine(loaded, device="cuda", block_size=16)
    assert isinstance(engine.executor.attention, TritonLatentBackend)
    for _ in range(2):
        outs = engine.generate([request(ids) for ids in PROMPTS])
        assert [o.token_ids for o in outs] == [case.hf_greedy(i) for i in range(len(PROMPTS))]
    assert engine.stats().prefix_cache_hit_tokens > 0
    assert_all_blocks_free(engine)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_equal_eager_for_mla(case: Case):
    """Decode steps replayed from CUDA graphs (the experts' fused kernels and the latent kernel
    inside them) give the eager engine's tokens and HF's, with n-gram verify runs replayed as
    token rows. In float32: eager verify runs attend through the decompressed reference and
    replayed ones through the absorbed kernel, and padded graph batches change the experts'
    tiling, so in bf16 the two would part after a few tokens by rounding alone."""
    torch.backends.cuda.matmul.allow_tf32 = False
    loaded = load_model(str(case.path), torch.float32, torch.device("cuda"))
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    runs = []
    for eager in (False, True):
        engine = make_engine(loaded, device="cuda", enforce_eager=eager, speculative_config=spec)
        assert (engine.executor.graphs is None) == eager
        runs.append([o.token_ids for o in engine.generate([request(ids) for ids in PROMPTS])])
        assert_all_blocks_free(engine)
    assert runs[0] == runs[1] == [case.hf_greedy(i) for i in range(len(PROMPTS))]
