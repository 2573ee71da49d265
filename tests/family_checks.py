"""What every windowed family's test checks against HF the same way (test_gemma.py,
test_gpt_oss.py): greedy tokens of a mixed-length batch, chunked, and after a prefix-cache hit."""

from __future__ import annotations

from typing import Any

import torch

from model_service.models.loader import LoadedModel
from tests.conftest import assert_all_blocks_free, make_engine
from tests.test_tiny_models import MAX_NEW, PROMPTS, random_prompt, request

LONG = random_prompt(30, seed=7)  # past a window of 8 and several 4-token blocks


def hf_greedy(hf: Any, ids: list[int], n: int = MAX_NEW) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids) :].tolist()


def check_batched_and_chunked(hf: Any, ours: LoadedModel) -> None:
    """Mixed-length prompts in one batch, and the same prompts prefilled in 5-token chunks over
    4-token blocks, decode HF's greedy tokens."""
    prompts = [*PROMPTS[:4], LONG]
    expected = [hf_greedy(hf, ids) for ids in prompts]
    for overrides in ({}, {"max_num_batched_tokens": 5, "block_size": 4}):
        engine = make_engine(ours, **overrides)
        assert [o.token_ids for o in engine.generate([request(ids) for ids in prompts])] == expected
        assert_all_blocks_free(engine)


def check_prefix_cache_hit(hf: Any, ours: LoadedModel) -> None:
    """A prompt that shares a cached 24-token prefix decodes as HF does from scratch."""
    engine = make_engine(ours, block_size=4)
    engine.generate([request(LONG)])
    longer = [*LONG[:24], *random_prompt(6, seed=8)]
    before = engine.stats().prefix_cache_hit_tokens
    assert engine.generate([request(longer)])[0].token_ids == hf_greedy(hf, longer)
    assert engine.stats().prefix_cache_hit_tokens - before >= 16
    assert_all_blocks_free(engine)
