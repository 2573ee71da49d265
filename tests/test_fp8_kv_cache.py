"""`--kv-cache-dtype fp8`: the K/V pool in float8 e4m3, half of bfloat16's bytes. What it must
keep: the memory budget buys proportionally more blocks, logits stay close to the unquantized
cache's (and differ: the pool really is FP8), values beyond e4m3's range saturate instead of
turning into NaN, and swapping blocks out and back in loses nothing."""

from __future__ import annotations

import pytest
import torch

from model_service.attention.kv_cache import cache_dtype
from model_service.engine.config import EngineConfig
from model_service.kernels.paged_attention import FP8, store_kv_reference
from tests.conftest import assert_all_blocks_free, make_engine, prefill_logits


def test_the_same_budget_holds_four_times_the_blocks_of_float32(tiny_llama):
    budget = {"num_kv_blocks": None, "kv_cache_memory_bytes": 1 << 22}
    full = make_engine(tiny_llama, **budget)
    fp8 = make_engine(tiny_llama, kv_cache_dtype="fp8", **budget)
    assert fp8.executor.kv_cache.data.dtype == FP8
    assert full.executor.kv_cache.data.dtype == torch.float32
    assert fp8.executor.kv_cache.num_blocks == 4 * full.executor.kv_cache.num_blocks
    assert fp8.executor.kv_cache.data.nbytes == pytest.approx(full.executor.kv_cache.data.nbytes, rel=0.01)


def test_smollm2_logits_with_an_fp8_cache_stay_close(smollm2):
    """Chunked prefill, so later chunks attend to K/V read back from the pool."""
    ids = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": "Why is the sky blue?"}])
    full = prefill_logits(make_engine(smollm2), ids, chunk=8)
    fp8 = prefill_logits(make_engine(smollm2, kv_cache_dtype="fp8"), ids, chunk=8)
    rel = ((fp8 - full).norm() / full.norm()).item()
    assert 0 < rel < 0.1, rel  # 0.039 on this prompt; 0 would mean nothing was quantized
    assert fp8.argmax() == full.argmax()


def test_values_beyond_e4m3_saturate_instead_of_becoming_nan():
    k = torch.tensor([[[1000.0, -1000.0, 3.0, 0.5]]])
    k_cache, v_cache = (torch.zeros(4, 1, 4, dtype=FP8) for _ in range(2))
    store_kv_reference(k, -k, k_cache, v_cache, torch.tensor([2]))
    assert k_cache[2, 0].float().tolist() == [448.0, -448.0, 3.0, 0.5]
    assert v_cache[2, 0].float().tolist() == [-448.0, 448.0, -3.0, -0.5]


def test_swap_preemption_with_an_fp8_cache_matches_uninterrupted(smollm2):
    prompts = [
        smollm2.tokenizer.apply_chat_template([{"role": "user", "content": q}])
        for q in ("Count to five.", "Name three birds.", "What is ice?")
    ]
    requests = [{"prompt_token_ids": p, "max_tokens": 10, "temperature": 0} for p in prompts]
    expected = [o.token_ids for o in make_engine(smollm2, kv_cache_dtype="fp8").generate(requests)]
    small = {"num_kv_blocks": 24, "block_size": 4, "preemption_mode": "swap"}
    engine = make_engine(smollm2, kv_cache_dtype="fp8", **small)
    assert [o.token_ids for o in engine.generate(requests)] == expected
    assert engine.stats().num_preemptions > 0
    assert_all_blocks_free(engine)


def test_an_unknown_cache_dtype_or_an_old_gpu_is_refused(monkeypatch):
    with pytest.raises(ValueError, match=r"--kv-cache-dtype must be one of \[.auto., .fp8.\]"):
        EngineConfig(kv_cache_dtype="int8")
    assert cache_dtype("auto", torch.bfloat16, torch.device("cpu")) == torch.bfloat16
    assert cache_dtype("fp8", torch.float32, torch.device("cpu")) == FP8
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"compute capability 8\.9 or later.*A100 is 8\.0"):
        cache_dtype("fp8", torch.bfloat16, torch.device("cuda"))


def test_tensor_parallel_fp8_pools_swap_their_heads_back_byte_for_byte(tiny_llama):
    """Two gloo ranks, each holding its KV heads in FP8: logits stay those of one process, and a
    swap-out gathers every rank's heads (as bytes) in head order; swapped back in elsewhere, each
    rank writes its own heads and the blocks read back identical."""
    from model_service.engine.batch_builder import StepItem
    from tests.conftest import new_sequence

    ids = [(7 * j) % 300 + 3 for j in range(21)]
    expected = prefill_logits(make_engine(tiny_llama, kv_cache_dtype="fp8"), ids)
    tp = make_engine(tiny_llama, kv_cache_dtype="fp8", tensor_parallel_size=2)
    try:
        torch.testing.assert_close(prefill_logits(tp, ids, chunk=8), expected, atol=2e-2, rtol=0)
        state, other = new_sequence(tp, len(ids)), new_sequence(tp, len(ids))
        tp.executor.execute(tp.builder.build([StepItem(state, ids, 1)]))
        saved = tp.executor.save_blocks(state.block_table, len(ids))
        assert saved.dtype == torch.uint8 and saved.shape[3] == tiny_llama.config.num_kv_heads
        assert saved.any()
        tp.executor.load_blocks(saved, other.block_table)
        assert torch.equal(tp.executor.save_blocks(other.block_table, len(ids)), saved)
    finally:
        tp.executor.teardown()


def test_a_prefix_cache_hit_on_fp8_blocks_gives_the_cold_tokens(tiny_llama):
    shared = [(11 * j) % 300 + 3 for j in range(40)]
    request = {"prompt_token_ids": [*shared, 7, 8, 9], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    cold = make_engine(tiny_llama, kv_cache_dtype="fp8", block_size=4).generate([request])[0].token_ids
    warm = make_engine(tiny_llama, kv_cache_dtype="fp8", block_size=4)
    warm.generate([{**request, "prompt_token_ids": [*shared, 5]}])
    assert warm.generate([request])[0].token_ids == cold
    assert warm.stats().prefix_cache_hit_tokens >= 40
    assert_all_blocks_free(warm)
