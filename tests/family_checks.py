"""What every windowed family's test checks against HF the same way (test_gemma.py,
test_gpt_oss.py): greedy tokens of a mixed-length batch, chunked, after a prefix-cache hit, and
under a PEFT adapter."""

from __future__ import annotations

from pathlib import Path
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


def check_lora_matches_peft(hf: Any, ours: LoadedModel, targets: list[str], root: Path) -> None:
    """A PEFT adapter on `targets` decodes PEFT's greedy tokens, which differ from the base's."""
    from tests.test_lora import make_adapter, peft_greedy

    adapter = make_adapter(hf, root / "lora", 5, scale=0.1, r=4, lora_alpha=8, target_modules=targets)
    engine = make_engine(ours, max_loras=1, lora_modules={"a": str(adapter)})
    prompts = [PROMPTS[0], LONG]
    got = [o.token_ids for o in engine.generate([{**request(ids), "adapter": "a"} for ids in prompts])]
    assert got == peft_greedy(hf, adapter, prompts, MAX_NEW, eos=None)
    assert got != [hf_greedy(hf, ids) for ids in prompts]  # the adapter changes the answer
