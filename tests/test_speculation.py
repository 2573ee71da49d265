"""Speculative decoding (n-gram proposals, greedy verification): the proposer, the acceptance
rule, and the promise that matters: greedy output with speculation is token-for-token the output
without it, in mixed batches with adapters, sampled rows, chunked prefill, prefix-cache hits
and preemption."""

from __future__ import annotations

import pytest
import torch

from bench.lora import write_adapter
from model_service.engine.speculation import NgramProposer, SpeculativeConfig, accept_greedy
from model_service.errors import InvalidRequestError
from tests.conftest import assert_all_blocks_free, make_engine

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'


def test_ngram_proposer_continues_the_most_recent_match_of_the_longest_tail():
    p = NgramProposer(SpeculativeConfig(prompt_lookup_max=3, prompt_lookup_min=1))
    assert p.propose([1, 2, 3, 9, 9, 1, 2, 3, 7, 1, 2, 3], 2) == [7, 1]  # latest "1 2 3" wins
    assert p.propose([5, 6, 7, 8, 6, 7], 4) == [8, 6, 7]  # shorter tail "6 7"; the rest is short
    assert p.propose([1, 2, 3, 4], 3) == []  # no earlier occurrence of any tail
    assert p.propose([4], 3) == []


def test_greedy_acceptance_keeps_matching_proposals_and_adds_the_target_token():
    def rows(*targets: int) -> torch.Tensor:
        return torch.nn.functional.one_hot(torch.tensor(targets), 10).float()

    assert accept_greedy([3, 4, 5], rows(3, 4, 5, 6)) == [3, 4, 5, 6]  # all accepted + bonus
    assert accept_greedy([3, 4, 5], rows(3, 8, 5, 6)) == [3, 8]  # second proposal rejected
    assert accept_greedy([3], rows(2, 7)) == [2]  # none accepted: still one token
    assert accept_greedy([], rows(9)) == [9]


@pytest.mark.parametrize(
    "text",
    ['{"method": "eagle"}', '{"method": "ngram", "num_speculative_tokens": 0}', "{not json", '{"k": 1}'],
)
def test_bad_speculative_configs_are_refused_with_a_message(text):
    with pytest.raises(InvalidRequestError, match="speculative-config"):
        SpeculativeConfig.from_json(text)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_greedy_output_is_identical_with_speculation(smollm2, tmp_path, preemption_mode):
    adapter = write_adapter(tmp_path / "a", smollm2.config, rank=8, seed=1)
    repeat = [
        {"role": "user", "content": "Repeat exactly, three times: the quick brown fox jumps over the dog."}
    ]
    code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"
    requests = [
        {"messages": repeat, "max_tokens": 48, "temperature": 0},
        {"messages": repeat, "max_tokens": 40, "temperature": 0, "adapter": "a"},  # LoRA rows verify too
        {"prompt": code, "max_tokens": 40, "temperature": 0},
        {"prompt": code + "    return a * b\n", "max_tokens": 24, "temperature": 0},  # a prefix-cache hit
        {"prompt": code, "max_tokens": 20, "temperature": 0.8, "seed": 3},  # sampled: no speculation
        {"messages": repeat, "max_tokens": 48, "temperature": 0, "stop": ["dog"]},
    ]
    outputs, engines = {}, {}
    for spec in (None, NGRAM):
        engine = make_engine(
            smollm2,
            num_kv_blocks=12,
            max_num_batched_tokens=96,
            preemption_mode=preemption_mode,
            lora_modules={"a": str(adapter)},
            speculative_config=spec,
        )
        outputs[spec] = [(o.token_ids, o.text, o.finish_reason) for o in engine.generate(requests)]
        engines[spec] = engine
        assert_all_blocks_free(engine)
    assert outputs[NGRAM] == outputs[None]
    spec_engine = engines[NGRAM]
    assert spec_engine.spec_accepted > 0 and spec_engine.spec_proposed > spec_engine.spec_accepted
    assert spec_engine.stats().num_preemptions > 0  # the small cache really preempted
    assert spec_engine.num_steps < engines[None].num_steps
