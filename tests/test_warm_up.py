"""The engine's warm-up prefills (engine/warm_up.py): what they cover, that they leave nothing
behind, and on a GPU that serving after them compiles no kernel."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model_service.engine.engine import Engine
from model_service.engine.warm_up import decode_counts, prefill_lengths, run_requests, warm_up_batches
from model_service.models.loader import LoadedModel, load_model
from tests.conftest import assert_all_blocks_free, make_engine
from tests.hybrid_models import make_tiny_hybrid
from tests.random_models import random_llama
from tests.test_moe import VARIANTS
from tests.test_tiny_models import save_checkpoint


def test_prefill_lengths_take_both_sides_of_every_power_of_two():
    assert prefill_lengths(2048, 8192) == [1] + [n for p in range(4, 12) for n in (2**p - 1, 2**p)]
    assert prefill_lengths(100, 8192) == [1, 15, 16, 31, 32, 63, 64]
    assert prefill_lengths(2048, 40) == [1, 15, 16, 31, 32]


def test_decode_counts_take_each_power_of_two_and_the_most():
    assert decode_counts(256) == [1, 2, 4, 8, 16, 32, 64, 128, 255]
    assert decode_counts(16) == [1, 2, 4, 8, 15] and decode_counts(9) == [1, 2, 4, 8]
    assert decode_counts(1) == []


def test_mixed_batches_chunk_a_prompt_beside_each_count_of_sampled_decodes():
    batches = warm_up_batches(token_budget=64, longest=1000, vocab=50, max_seqs=8)
    lengths = prefill_lengths(64, 998)  # each leaves room for its two output tokens
    singles, mixed = batches[: len(lengths)], batches[len(lengths) :]
    assert [len(b[0]["prompt_token_ids"]) for b in singles] == lengths
    assert [len(b) - 1 for b in mixed] == decode_counts(8)
    for *short, long in mixed:
        assert len(long["prompt_token_ids"]) > 64  # chunked, after the short ones are decoding
        assert all(r["max_tokens"] > 1 and len(r["prompt_token_ids"]) < 64 for r in short)
    assert {"top_p" in r for *short, _ in mixed for r in short} == {True, False}  # both sampling kernels
    ids = [t for b in batches for r in b for t in r["prompt_token_ids"]]
    assert min(ids) >= 0 and max(ids) < 50
    short_context = warm_up_batches(token_budget=64, longest=20, vocab=50, max_seqs=8)
    assert all(len(r["prompt_token_ids"]) + r["max_tokens"] <= 20 for b in short_context for r in b)


def _tokens(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    reqs = [{"prompt_token_ids": p, "max_tokens": 6, "temperature": 0, "ignore_eos": True} for p in prompts]
    return [o.token_ids for o in engine.generate(reqs)]


def test_warm_up_leaves_no_cached_prefix_state_slot_or_count(tmp_path: Path):
    """A hybrid (K/V blocks, recurrent-state slots and their prefix snapshots) after the warm-up
    prefills: every block and slot free, nothing cached, every counter at zero, and the same
    tokens as an engine that never warmed up (only `num_steps` counts the warm-up's steps)."""
    loaded = load_model(str(make_tiny_hybrid(tmp_path / "ckpt")), torch.float32, torch.device("cpu"))
    prompts = [[(7 * i + j) % 90 + 3 for j in range(5 + 9 * i)] for i in range(4)]
    config = {"max_num_batched_tokens": 32, "block_size": 4, "max_num_seqs": 8}
    cold, warm = make_engine(loaded, **config), make_engine(loaded, **config)
    run_requests(warm)  # what `warm_up` runs on CUDA
    stats = warm.stats()
    assert_all_blocks_free(warm)
    assert stats.kv_blocks_cached == stats.state_slots_cached == 0
    assert stats.state_slots_free == stats.state_slots_total > 0
    assert stats.num_steps > 0 and stats.num_computed_tokens == stats.prefix_cache_query_tokens == 0
    assert _tokens(warm, prompts) == _tokens(cold, prompts)


def _cuda_model(kind: str, root: Path) -> LoadedModel:
    cuda = torch.device("cuda")
    if kind == "llama":
        cfg, model = random_llama()
        return LoadedModel("random", cfg, model.to(cuda, torch.bfloat16).eval(), None)
    if kind == "qwen3-moe":
        return load_model(str(save_checkpoint(VARIANTS[kind], root)), torch.bfloat16, cuda)
    moe = {"mlp_only_layers": [0], "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    return load_model(str(make_tiny_hybrid(root / "ckpt", **moe)), torch.bfloat16, cuda)


@pytest.mark.parametrize("kind", ["llama", "qwen3-moe", "qwen3-next-moe"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_serving_after_warm_up_compiles_no_kernel(kind: str, tmp_path: Path):
    """After `warm_up`, requests of lengths it never ran, alone and together (chunked, mixed with
    decodes, sampled), launch only kernels Triton has compiled: a first request pays no compile."""
    from bench.first_requests import recorded_compiles

    loaded = _cuda_model(kind, tmp_path)
    engine = make_engine(loaded, device="cuda", dtype="bfloat16", max_num_batched_tokens=256)
    engine.warm_up()
    with recorded_compiles() as compiled:
        lengths = [2, 9, 40, 100, 200, 300, 450]  # the tiny models' context is 512
        for n in lengths:
            _tokens(engine, [[(5 * n + j) % 90 + 3 for j in range(n)]])
        reqs = [
            {"prompt_token_ids": [(3 * n + j) % 90 + 3 for j in range(n)], "max_tokens": 3 + i,
             "temperature": 0.7 * (i % 2), "top_p": 0.95 if i % 3 else 1.0, "ignore_eos": True}
            for i, n in enumerate(lengths * 3)
        ]  # fmt: skip
        assert all(not o.error for o in engine.generate(reqs))
    assert compiled == []
    assert_all_blocks_free(engine)
