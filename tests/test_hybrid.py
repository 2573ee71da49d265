"""The hybrid Qwen3-Next decoder (Gated DeltaNet + gated attention) against HF transformers, and the
engine paths that must carry its recurrent state: chunked prefill, mixed batches, speculative
verify rollback, swap preemption and prefix-cache state snapshots.

The checkpoint is tests/hybrid_models.py's tiny hybrid (4 layers, linear / full alternating, 1-D
weights randomized so a wrong norm or a dropped state shows).
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from adapter_service import base_model, validate
from model_service.engine.engine import Engine
from model_service.engine.speculation import NgramProposer, SpeculativeConfig
from model_service.errors import BeyondCapacityError, ModelLoadError
from model_service.lora.adapter import AdapterError, load_peft_adapter
from model_service.models.config import Mixer
from model_service.models.gated_delta import chunked_scan, recurrent_scan
from model_service.models.layers import PackedLinear, checkpoint_tensors
from model_service.models.loader import load_model
from model_service.models.step import StepBatch
from tests.conftest import assert_all_blocks_free, make_engine, prefill_logits
from tests.hybrid_models import make_tiny_hybrid
from tests.test_beam_search import _hf_beams
from tests.test_lora import make_adapter, peft_greedy
from tests.test_tiny_models import (
    MAX_NEW,
    PROMPTS,
    VOCAB,
    Case,
    _one_torch_thread,
    random_prompt,
    rel_err,
    request,
)

__all__ = ["_one_torch_thread"]  # the module-scoped fixture applies here too

SPEC = '{"method": "ngram", "num_speculative_tokens": 3}'


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> Case:
    return Case(make_tiny_hybrid(tmp_path_factory.mktemp("qwen3_next") / "ckpt", seed=0))


def _state_slots_all_back(engine: Engine) -> None:
    """Every state slot is free or holds a prefix-cache snapshot: none leaked, none held twice."""
    assert_all_blocks_free(engine)
    stats, cache = engine.stats(), engine.cache
    assert stats.state_slots_free == stats.state_slots_total == engine.executor.state_tensors[0].shape[0]
    assert stats.state_slots_cached == cache.num_cached_states
    assert len(set(cache._free_state_slots) | set(cache._cached_states.values())) == stats.state_slots_free


def test_config_and_weights_match_hf(case: Case):
    cfg = case.ours.config
    assert [k.mixer for k in cfg.layer_kinds] == [Mixer.LINEAR_ATTENTION, Mixer.FULL_ATTENTION] * 2
    assert cfg.num_state_layers == 2 and not any(k.moe for k in cfg.layer_kinds)
    assert cfg.rotary_dim == 4  # partial_rotary_factor 0.25 of head_dim 16
    ours = checkpoint_tensors(case.ours.module)
    hf = dict(case.hf.named_parameters())
    assert set(ours) == set(hf)
    for name, p in hf.items():
        torch.testing.assert_close(ours[name], p, rtol=0, atol=0)


@pytest.mark.parametrize("shared", [48, 32])
def test_sparse_moe_layers_match_hf(tmp_path: Path, shared: int):
    """Qwen3-Next's sparse-MoE MLPs (router, top-k renormalized, shared expert behind a sigmoid
    gate) on three of the four layers: logits and greedy tokens as HF's. Issue 37's launches (a
    batch-1 decode step spent a third of its time in few-row GEMMs, ~7 us each): a DeltaNet
    layer projects x in one GEMM (in_proj_qkvz and in_proj_ba packed), and a shared expert as
    wide as the experts (32, as Qwen3-Next's 512 / 512) runs as the experts' last slot, so a
    sparse layer's GEMMs are its mixer's two (were 5 a DeltaNet layer, 4 an attention one)."""
    moe = {"mlp_only_layers": [0], "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    sparse = Case(make_tiny_hybrid(tmp_path / "ckpt", seed=1, **moe, shared_expert_intermediate_size=shared))
    assert [k.moe for k in sparse.ours.config.layer_kinds] == [False, True, True, True]
    assert sparse.ours.module.model.layers[1].mlp.shared_slots == (shared == 32)
    ours = checkpoint_tensors(sparse.ours.module)
    for name, p in sparse.hf.named_parameters():
        torch.testing.assert_close(ours[name], p, rtol=0, atol=0)
    gemms = Counter[int]()
    for i, layer in enumerate(sparse.ours.module.model.layers):
        for sub in layer.modules():
            if isinstance(sub, PackedLinear):
                sub.register_forward_hook(lambda *_, i=i: gemms.update([i]))
    engine = make_engine(sparse.ours, block_size=4)
    with torch.no_grad():
        ref = sparse.hf(torch.tensor([PROMPTS[0]])).logits[0, -1]
    assert rel_err(prefill_logits(engine, PROMPTS[0]), ref) < 1e-4
    sparse_gemms = 2 if shared == 32 else 4  # the shared expert's gate_up and down apart
    assert gemms == {0: 4, 1: sparse_gemms, 2: sparse_gemms, 3: sparse_gemms}  # layer 0: a dense MLP's 2 more
    outs = engine.generate([request(ids) for ids in PROMPTS[:3]])
    assert [o.token_ids for o in outs] == [sparse.hf_greedy(i) for i in range(3)]
    _state_slots_all_back(engine)


def test_lora_on_gated_attention_matches_peft_and_delta_net_targets_are_refused(case: Case, tmp_path: Path):
    """Gated attention's q_proj writes each head's query and its output gate, twice the heads'
    width: PEFT adapters on it were refused as made for another base model. LoRA on a Gated
    DeltaNet layer, on its own projections or on attention ones it lacks (a KeyError at load),
    is refused naming the layer, by the pod and the adapter service alike."""
    service = base_model.load(str(case.path))

    def service_check(d: Path) -> validate.Summary:
        config = (d / "adapter_config.json").read_bytes()
        return validate.validate(config, d / "adapter_model.safetensors", service, 64)

    attention = ["q_proj", "k_proj", "v_proj", "o_proj"]
    adapter = make_adapter(case.hf, tmp_path / "a", seed=7, scale=0.3, r=4, target_modules=attention)
    engine = make_engine(case.ours, max_loras=1, lora_modules={"a": str(adapter)})
    outs = engine.generate([{**request(ids), "adapter": "a"} for ids in PROMPTS[:2]])
    want = peft_greedy(case.hf, adapter, PROMPTS[:2], MAX_NEW, eos=None)
    assert [o.token_ids for o in outs] == want and want != [case.hf_greedy(i) for i in range(2)]
    assert service_check(adapter).target_modules == sorted(attention)
    delta_net = make_adapter(case.hf, tmp_path / "dn", seed=8, r=4, target_modules=["in_proj_qkvz"])
    moved = shutil.copytree(adapter, tmp_path / "moved")  # layer 1's attention LoRA on layer 0
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    renamed = {k.replace("layers.1.self_attn", "layers.0.self_attn"): v for k, v in tensors.items()}
    save_file(renamed, str(moved / "adapter_model.safetensors"))
    for d in (delta_net, moved):
        # (pod and service refuse the DeltaNet adapter's config already: it names no attention projection)
        with pytest.raises(AdapterError, match=r"layer 0 is a linear-attention|'in_proj_qkvz'"):
            load_peft_adapter("x", d, case.ours.config, 64)
        with pytest.raises(validate.ValidationError, match=r"layer 0 is a linear-attention|'in_proj_qkvz'"):
            service_check(d)


def test_a_model_of_recurrent_layers_only_sizes_its_tables_and_matches_hf(tmp_path: Path):
    """No attention layer: a K/V block stores no bytes, yet the block tables still count each
    sequence's positions. The pool sized by the memory budget divided by zero bytes a block
    (seen with bench/hybrid.py --small --layers 2); now every sequence slot gets a whole table."""
    only = Case(make_tiny_hybrid(tmp_path / "ckpt", seed=2, layer_types=["linear_attention"] * 4))
    engine = make_engine(only.ours, num_kv_blocks=None, block_size=4, max_num_seqs=8, max_model_len=64)
    assert engine.cache.num_total_blocks == 8 * 64 // 4 and engine.max_model_len == 64
    outs = engine.generate([request(ids) for ids in PROMPTS[:2]])
    for ids, out in zip(PROMPTS[:2], outs, strict=True):
        expected = list(ids)  # HF's cache holds no attention layer to count positions: no cache
        for _ in range(len(out.token_ids)):
            with torch.no_grad():
                logits = only.hf(torch.tensor([expected]), use_cache=False).logits[0, -1]
            expected.append(int(logits.argmax()))
        assert out.token_ids == expected[len(ids) :]
    _state_slots_all_back(engine)


def test_logits_match_hf_in_one_pass_and_in_chunks(case: Case):
    engine = make_engine(case.ours, block_size=4)
    for ids in (PROMPTS[0], PROMPTS[4], random_prompt(150, seed=21)):  # the last one in chunked form
        with torch.no_grad():
            ref = case.hf(torch.tensor([ids])).logits[0, -1]
        assert rel_err(prefill_logits(engine, ids), ref) < 1e-4
        assert rel_err(prefill_logits(engine, ids, chunk=3), ref) < 1e-4
    assert_all_blocks_free(engine)


def test_greedy_tokens_match_hf_alone_batched_and_chunked(case: Case):
    """Alone (each reusing the slot the one before freed), all at once (mixed prefill + decode
    steps), and with 5-token chunks of prefill interleaved with other sequences' decodes."""
    expected = [case.hf_greedy(i) for i in range(len(PROMPTS))]
    engine = make_engine(case.ours)
    assert [engine.generate([request(ids)])[0].token_ids for ids in PROMPTS] == expected
    assert [o.token_ids for o in engine.generate([request(ids) for ids in PROMPTS])] == expected
    _state_slots_all_back(engine)
    chunked = make_engine(case.ours, max_num_batched_tokens=5, block_size=4)
    assert [o.token_ids for o in chunked.generate([request(ids) for ids in PROMPTS])] == expected
    _state_slots_all_back(chunked)


class _FlawedOracle(NgramProposer):
    """Proposes the known greedy continuation with one wrong token, at a position that cycles with
    the length, so verify steps accept every count of proposals from 0 to k: each count rolls the
    recurrent state back to a different checkpoint (k: none)."""

    def __init__(self, sequences: list[list[int]]) -> None:
        super().__init__(SpeculativeConfig())
        self.sequences = sequences

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        full = next(s for s in self.sequences if s[: len(token_ids)] == token_ids)
        out = full[len(token_ids) : len(token_ids) + k]
        wrong = len(token_ids) % (k + 1)
        if wrong < len(out):
            out[wrong] = (out[wrong] + 1) % VOCAB
        return out


def test_speculative_decoding_rolls_state_back_exactly(case: Case):
    prompts = [PROMPTS[0], PROMPTS[2], random_prompt(9, seed=5)]
    reqs = [{**request(ids), "max_tokens": 24} for ids in prompts]
    plain = [o.token_ids for o in make_engine(case.ours).generate(reqs)]
    ngram = make_engine(case.ours, speculative_config=SPEC)
    assert [o.token_ids for o in ngram.generate(reqs)] == plain
    assert ngram.stats().spec_proposed_tokens > 0  # all rejected: a random model does not repeat itself
    _state_slots_all_back(ngram)
    oracle = make_engine(case.ours, speculative_config=SPEC)
    oracle.speculation.proposer = _FlawedOracle([ids + out for ids, out in zip(prompts, plain, strict=True)])
    assert [o.token_ids for o in oracle.generate(reqs)] == plain
    stats = oracle.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_proposed_tokens
    _state_slots_all_back(oracle)


def test_beam_search_forks_recurrent_state(case: Case):
    """Each continuing beam is a fork: its state slot starts as a copy of its parent's."""
    engine = make_engine(case.ours, block_size=4)
    for ids, beams in ((PROMPTS[1], 3), (PROMPTS[2], 2)):
        expected = _hf_beams(case.hf, ids, eos=None, num_beams=beams, max_new_tokens=10)
        req = {"prompt_token_ids": ids, "max_tokens": 10, "num_beams": beams, "ignore_eos": True}
        assert engine.generate([req])[0].token_ids == expected
    _state_slots_all_back(engine)


def test_a_hybrid_drafting_itself_is_refused_at_start(case: Case):
    """A draft model naming the target's own checkpoint skipped the draft checks: a hybrid engine
    started, and every request failed after its first token (the draft's cache has no state
    slots). It is refused as any recurrent draft is."""
    spec = json.dumps({"method": "draft", "model": str(case.path), "num_speculative_tokens": 2})
    with pytest.raises(ModelLoadError, match="has recurrent layers"):
        make_engine(case.ours, speculative_config=spec)


def test_beam_search_holds_a_state_slot_per_beam_and_ends_clearly_past_them(case: Case):
    """max_num_seqs 1 gives 2 state slots. Two beams fit: the parents a step drops give their
    slots back before the forks take theirs (forking first failed the search, "no recurrent-state
    slot is free; check can_allocate() first"). Three beams never can: they were queued, computed
    the prompt and ended "capacity" (RESOURCE_EXHAUSTED: "retry"), however idle the engine; now
    they are refused at admission as beyond its capacity (OUT_OF_RANGE), saying by how much. A
    search short of slots only while others hold them still ends "capacity", and the slots come back."""
    engine = make_engine(case.ours, block_size=4, max_num_seqs=1)
    ids = PROMPTS[2]
    req = {"prompt_token_ids": ids, "max_tokens": 8, "num_beams": 2, "ignore_eos": True}
    want = _hf_beams(case.hf, ids, eos=None, num_beams=2, max_new_tokens=8)
    assert engine.generate([req])[0].token_ids == want
    with pytest.raises(BeyondCapacityError, match=r"3 beams .* this engine has 2 \(1 too many; --max-num"):
        engine.add_request_dict({**req, "num_beams": 3, "request_id": "never"})
    assert not engine.has_unfinished()
    busy = make_engine(case.ours, block_size=4, max_num_seqs=2)  # 4 slots, one held by `plain`
    plain = {"prompt_token_ids": PROMPTS[1], "max_tokens": 8, "ignore_eos": True, "temperature": 0}
    outs = busy.generate([plain, {**req, "num_beams": 4}])
    assert outs[0].finish_reason == "length"
    assert outs[1].finish_reason == "capacity" and "a recurrent-state slot per beam" in outs[1].error
    _state_slots_all_back(busy)
    _state_slots_all_back(engine)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_keeps_recurrent_state(case: Case, mode: str):
    """A KV pool too small for all five: sequences are preempted (their state swapped out with
    their K/V, or dropped and recomputed) and still produce exactly HF's tokens; the swap budget
    is charged what a swap stores, state included."""
    engine = make_engine(case.ours, num_kv_blocks=14, block_size=4, preemption_mode=mode)
    outs = engine.generate([request(ids) for ids in PROMPTS])
    assert [o.token_ids for o in outs] == [case.hf_greedy(i) for i in range(len(PROMPTS))]
    assert engine.stats().num_preemptions > 0
    _state_slots_all_back(engine)
    # The swap budget got back what it was charged: it was charged the K/V only and given back
    # the state too, so it went below zero and `--swap-space` bound nothing.
    assert engine.scheduler.swap_used == 0 and engine.scheduler.num_swapped == 0


def test_warm_multi_turn_request_resumes_from_a_state_snapshot(case: Case):
    """Turn 2 resends turn 1's prompt and answer plus a new message: it reuses the cached blocks
    and the recurrent state kept at the last block boundary turn 1 computed, prefills only the
    rest, and answers exactly as a cold engine does."""
    first = random_prompt(37, seed=11)
    warm = make_engine(case.ours, block_size=4)
    answer = warm.generate([{**request(first), "max_tokens": 10}])[0].token_ids
    second = first + answer + random_prompt(6, seed=12)  # 53 tokens
    before = warm.stats()
    warm_out = warm.generate([request(second)])[0].token_ids
    after = warm.stats()
    # Turn 1 computed 46 tokens (its last answer token is never fed back): 11 full blocks, with
    # a state snapshot at 44, so turn 2 computes 53 - 44 prompt tokens and 15 decode rows.
    assert after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens == 44
    assert after.num_computed_tokens - before.num_computed_tokens == (53 - 44) + 15
    cold = make_engine(case.ours, block_size=4, enable_prefix_caching=False)
    assert warm_out == cold.generate([request(second)])[0].token_ids
    _state_slots_all_back(warm)
    assert warm.cache.num_cached_states > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_hf_with_speculation_and_prefix_cache(case: Case):
    """The same checkpoint on CUDA (Triton attention and RoPE, the step kernels for decode and
    verify steps in CUDA graphs, the torch recurrence for prefill) gives HF's greedy tokens, with
    speculative rollback and prefix-state reuse on."""
    torch.backends.cuda.matmul.allow_tf32 = False
    loaded = load_model(str(case.path), torch.float32, torch.device("cuda"))
    engine = make_engine(loaded, device="cuda", block_size=16, speculative_config=SPEC)
    for _ in range(2):  # the second round resumes from the prefix cache's state snapshots
        outs = engine.generate([request(ids) for ids in PROMPTS])
        assert [o.token_ids for o in outs] == [case.hf_greedy(i) for i in range(len(PROMPTS))]
    assert engine.stats().prefix_cache_hit_tokens > 0
    _state_slots_all_back(engine)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decode_graphs_on_cuda_give_the_eager_tokens(case: Case, monkeypatch: pytest.MonkeyPatch):
    """Decode and verify steps of a hybrid replay CUDA graphs (the step kernels over static state
    runs): waves padded to three batch sizes reuse slots and blocks, a one-token prompt starts
    from zeros inside a graph, prefix-cache snapshots and verify checkpoints are written from
    inside it and rolled back to. Tokens: the eager steps' and HF's."""
    from model_service.engine.cuda_graphs import DecodeGraphs

    replayed: list[int] = []
    run = DecodeGraphs.run

    def counting_run(self: DecodeGraphs, batch: StepBatch) -> torch.Tensor:
        replayed.append(batch.max_query_len)
        return run(self, batch)

    monkeypatch.setattr(DecodeGraphs, "run", counting_run)
    torch.backends.cuda.matmul.allow_tf32 = False
    loaded = load_model(str(case.path), torch.float32, torch.device("cuda"))
    # Padded to 8, 4 and 16 rows; the last wave's one-token prompt is a decode-shaped step itself.
    order = [[0, 1, 2, 3, 4], [1, 2, 3], [2, 3, 4, 0, 1, 2, 3, 4, 0], [3]]
    expected = [[case.hf_greedy(i) for i in wave] for wave in order]
    for eager in (True, False):
        engine = make_engine(loaded, device="cuda", block_size=4, max_num_seqs=16, enforce_eager=eager)
        outs = [engine.generate([request(PROMPTS[i]) for i in wave]) for wave in order]
        assert [[o.token_ids for o in wave] for wave in outs] == expected
        assert (engine.executor.graphs is None) == eager and bool(replayed) != eager
        _state_slots_all_back(engine)
    assert len(engine.executor.graphs.graphs) >= 3

    replayed.clear()
    oracle = make_engine(loaded, device="cuda", block_size=4, max_num_seqs=16, speculative_config=SPEC)
    oracle.speculation.proposer = _FlawedOracle([PROMPTS[i] + case.hf_greedy(i) for i in range(len(PROMPTS))])
    outs = oracle.generate([request(ids) for ids in PROMPTS])
    assert [o.token_ids for o in outs] == [case.hf_greedy(i) for i in range(len(PROMPTS))]
    assert 0 < oracle.stats().spec_accepted_tokens < oracle.stats().spec_proposed_tokens
    assert max(replayed) > 1  # verify steps replayed graphs too
    _state_slots_all_back(oracle)


def test_chunked_scan_equals_the_token_by_token_recurrence():
    """Three chunks (the last one padded), grouped by sequence, from a nonzero state."""
    gen = torch.Generator().manual_seed(3)
    seqs, length, heads, dk, dv = 2, 150, 3, 8, 4

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    q, k = (torch.nn.functional.normalize(rand(seqs, length, heads, dk), dim=-1) for _ in range(2))
    v, state = rand(seqs, length, heads, dv), rand(seqs, heads, dk, dv)
    g = -torch.rand(seqs, length, heads, generator=gen) * 0.3
    beta = torch.rand(seqs, length, heads, generator=gen)
    ref_out, ref_state = recurrent_scan(q, k, v, g, beta, state)
    out, final = chunked_scan(q, k, v, g, beta, state)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final, ref_state, rtol=1e-4, atol=1e-4)


def test_an_fp8_kv_cache_holds_the_attention_layers_and_leaves_the_recurrent_state(case: Case):
    """`--kv-cache-dtype fp8` on a hybrid: its attention layers' K/V in FP8 (logits near HF's,
    not equal), its recurrent state float32 as before, every slot back after a run."""
    engine = make_engine(case.ours, block_size=4, kv_cache_dtype="fp8")
    assert engine.executor.kv_cache.data.dtype == torch.float8_e4m3fn
    assert all(t.dtype == torch.float32 for t in engine.executor.state_tensors)
    ids = random_prompt(40, seed=5)
    with torch.no_grad():
        ref = case.hf(torch.tensor([ids])).logits[0, -1]
    assert 0 < rel_err(prefill_logits(engine, ids, chunk=7), ref) < 0.1
    engine.generate([request(p) for p in PROMPTS[:3]])
    _state_slots_all_back(engine)


def test_the_hybrid_bench_builds_fp8_models_a_layer_at_a_time():
    """`bench/hybrid.py --moe --quantization fp8` quantizes each layer as it is built (48 layers of
    Qwen3-Next-80B's experts do not fit an H200 in bf16): every projection and expert stack ends
    in e4m3, the engine decodes, and the model's embeddings, head and RoPE are the usual ones."""
    from bench.hybrid import _config, _engine
    from model_service.kernels.fp8_gemm import E4M3
    from model_service.models.fp8_linear import Fp8Linear
    from model_service.models.layers import PackedLinear
    from model_service.models.moe import StackedExperts

    cfg = _config(4, small=True, moe=True)
    engine = _engine(cfg, "cpu", torch.float32, fp8=True, block_size=16, enable_prefix_caching=False)
    module = engine.executor.module
    assert len(module.model.layers) == 4 and module.config.num_layers == 4
    assert not any(type(m) is PackedLinear for m in module.model.layers.modules())
    assert any(isinstance(m, Fp8Linear) for m in module.model.layers.modules())
    stacks = [m for m in module.modules() if isinstance(m, StackedExperts)]
    assert len(stacks) == 4 and all(s.gate_up_proj.dtype == E4M3 for s in stacks)
    assert module.rotary.inv_freq.isfinite().all() and module.lm_head.weight.dtype == torch.float32
    greedy = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    out = engine.generate([{"prompt_token_ids": [5, 6, 7], **greedy}])
    assert len(out[0].token_ids) == 4
