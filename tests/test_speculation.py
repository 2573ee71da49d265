"""Speculative decoding (n-gram proposals): the proposer, the acceptance rules, and the promises
that matter: greedy output with speculation is token-for-token the output without it, in mixed
batches with adapters, sampled rows, chunked prefill, prefix-cache hits and preemption; sampled
rows keep the target distribution exactly (rejection sampling)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from bench.lora import write_adapter
from model_service.engine.speculation import (
    NgramProposer,
    Proposal,
    SpeculativeConfig,
    accept_greedy,
    accept_sampled,
)
from model_service.errors import InvalidRequestError
from tests.conftest import assert_all_blocks_free, make_engine

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'


def test_ngram_proposer_continues_the_most_recent_match_of_the_longest_tail():
    p = NgramProposer(SpeculativeConfig(prompt_lookup_max=3, prompt_lookup_min=1))
    assert p.lookup([1, 2, 3, 9, 9, 1, 2, 3, 7, 1, 2, 3], 2) == [7, 1]  # latest "1 2 3" wins
    assert p.lookup([5, 6, 7, 8, 6, 7], 4) == [8, 6, 7]  # shorter tail "6 7"; the rest is short
    assert p.lookup([1, 2, 3, 4], 3) == []  # no earlier occurrence of any tail
    assert p.lookup([4], 3) == []


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"num_speculative_tokens": 2.5}, "num_speculative_tokens must be an integer, not 2.5"),
        ({"num_speculative_tokens": "4"}, "num_speculative_tokens must be an integer, not '4'"),
        ({"num_speculative_tokens": None}, "num_speculative_tokens must be an integer, not None"),
        ({"prompt_lookup_max": True}, "prompt_lookup_max must be an integer, not True"),
        ({"method": "draft", "model": 5}, "model must be a string, not 5"),
        ({"disable_by_batch_size": 4}, "unknown keys ['disable_by_batch_size'] (this engine reads ['method'"),
        ({"method": "eagle", "model": "x"}, "method 'eagle' (EAGLE-1/2 heads are not supported)"),
    ],
)
def test_speculative_configs_of_the_wrong_types_or_keys_are_refused_by_name(bad: dict, message: str):
    """A float or string count passed the range check (or crashed it with a TypeError), and a
    float then failed every request at its first proposal ("slice indices must be integers")."""
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        SpeculativeConfig.from_json(json.dumps(bad))
    with pytest.raises(InvalidRequestError, match="the config is a JSON object, not"):
        SpeculativeConfig.from_json("[4]")


def test_vllms_spellings_and_defaults_are_read_as_vllm_reads_them():
    """vLLM's older MTP names ("deepseek_mtp") are "mtp", its older "[ngram]" (as method or model)
    is "ngram" (as a model it was loaded as a draft: "neither a known alias nor an existing
    path"), and a prompt_lookup_min given alone is also the max (it was refused against our
    default max of 4)."""
    assert SpeculativeConfig.from_json('{"method": "deepseek_mtp", "num_speculative_tokens": 1}').is_mtp
    for old in ('{"model": "[ngram]", "prompt_lookup_max": 3}', '{"method": "[ngram]"}'):
        ngram = SpeculativeConfig.from_json(old)
        assert ngram is not None and ngram.method == "ngram" and ngram.model is None
    alone = SpeculativeConfig.from_json('{"method": "ngram", "prompt_lookup_min": 5}')
    assert alone is not None and (alone.prompt_lookup_min, alone.prompt_lookup_max) == (5, 5)
    both = SpeculativeConfig.from_json('{"prompt_lookup_max": 3}')
    assert both is not None and (both.prompt_lookup_min, both.prompt_lookup_max) == (1, 3)


def test_greedy_acceptance_keeps_matching_proposals_and_adds_the_target_token():
    def rows(*targets: int) -> torch.Tensor:
        return torch.nn.functional.one_hot(torch.tensor(targets), 10).float()

    assert accept_greedy([3, 4, 5], rows(3, 4, 5, 6)) == [3, 4, 5, 6]  # all accepted + bonus
    assert accept_greedy([3, 4, 5], rows(3, 8, 5, 6)) == [3, 8]  # second proposal rejected
    assert accept_greedy([3], rows(2, 7)) == [2]  # none accepted: still one token
    assert accept_greedy([], rows(9)) == [9]


def test_rejection_sampling_keeps_the_target_distribution():
    """Over many draws, the first emitted token is distributed as the first row's p, and after an
    accepted proposal the second is distributed as the second row's: whatever a draft model drew
    from its own q. (Point-mass proposals keep p by construction: the row draws from p as it
    would without speculation, next test.)"""
    probs = torch.tensor(
        [[0.1, 0.4, 0.2, 0.25, 0.05], [0.3, 0.05, 0.05, 0.5, 0.1], [0.2, 0.2, 0.2, 0.2, 0.2]]
    )
    q = torch.tensor([[0.5, 0.1, 0.1, 0.1, 0.2], [0.05, 0.05, 0.6, 0.2, 0.1]])
    trials = 20_000
    g = torch.Generator().manual_seed(0)
    first, second, accepted_first = torch.zeros(5), torch.zeros(5), 0
    for _ in range(trials):
        proposals = [int(torch.multinomial(row, 1, generator=g)) for row in q]
        out = accept_sampled(proposals, probs, g, q)
        first[out[0]] += 1
        if len(out) > 1:  # the first proposal was accepted
            accepted_first += 1
            second[out[1]] += 1
    tolerance = 4 * (0.25 / trials) ** 0.5  # four standard deviations at worst
    assert (first / trials - probs[0]).abs().max() < tolerance
    # accepted with probability sum(min(p, q)): 0.45 here, where treating a draft's d as a point
    # mass (still exact) would accept only sum(p * q) = 0.145
    assert abs(accepted_first / trials - torch.minimum(probs[0], q[0]).sum()) < tolerance
    assert (second / accepted_first - probs[1]).abs().max() < 4 * (0.25 / accepted_first) ** 0.5


class _Oracle:
    """Proposes, for a request's next positions, two tokens: the one a run without speculation
    drew there, then one it did not draw. So a verify that draws as that run did accepts one
    proposal and rejects the next."""

    def __init__(self, drawn: list[int], vocab_size: int) -> None:
        self.drawn, self.vocab_size = drawn, vocab_size

    def propose(self, seqs: list, room: list[int]) -> list[Proposal]:
        out = []
        for seq, k in zip(seqs, room, strict=True):
            ahead = self.drawn[seq.num_output_tokens : seq.num_output_tokens + 2][: min(k, 2)]
            out.append(Proposal([*ahead[:1], *[(t + 1) % self.vocab_size for t in ahead[1:]]]))
        return out

    def on_verified(self, seq, num_accepted: int) -> None:
        pass

    def on_finished(self, seq) -> None:
        pass


@pytest.mark.parametrize("budget", [2048, 3])
@pytest.mark.parametrize("sampling", [{"temperature": 0.8}, {"temperature": 1.3, "top_k": 20, "top_p": 0.9}])
def test_a_seeded_row_draws_the_tokens_it_draws_without_speculation(tiny_llama, budget, sampling):
    """Point-mass proposals (n-gram lookup) are checked against the row's own per-position draws,
    so a seeded request's tokens are those of a run without speculation, whether a step verified
    its proposals or (budget 3, beside another request's decode row) had no room to. They were a
    function of how many uniforms its generator had drawn, so of what else shared its steps."""
    request = {"prompt_token_ids": [5, 17, 33, 101, 250, 7], "max_tokens": 12, "seed": 7, "ignore_eos": True}
    request.update(sampling)
    drawn = make_engine(tiny_llama).generate([request])[0].token_ids
    engine = make_engine(tiny_llama, speculative_config=NGRAM, max_num_batched_tokens=budget)
    engine.speculation.proposer = _Oracle(drawn, tiny_llama.config.vocab_size)
    other = {"prompt_token_ids": [9, 64, 12], "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    assert engine.generate([other, request])[1].token_ids == drawn
    spec = engine.speculation
    assert 0 < spec.accepted < spec.proposed
    assert_all_blocks_free(engine)


def test_acceptance_is_exported_by_position_with_the_number_of_drafts(tiny_llama):
    """vLLM's spec-decode metrics: `num_drafts` (verify runs: 1 + accepted / drafts is the mean
    tokens a run emits, what dashboards plot) and `num_accepted_tokens_per_pos` were not
    exported, only the proposed and accepted totals. The oracle proposes the right token then a
    wrong one: every run accepts at position 0 and none at 1."""
    from prometheus_client import generate_latest

    from model_service.pod.metrics import PodMetrics, Snapshot
    from tests.test_observability import _strictly_parsed

    request = {
        "prompt_token_ids": [5, 17, 33, 101, 250, 7],
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
    }
    drawn = make_engine(tiny_llama).generate([request])[0].token_ids
    engine = make_engine(tiny_llama, speculative_config=NGRAM)
    engine.speculation.proposer = _Oracle(drawn, tiny_llama.config.vocab_size)
    assert engine.generate([request])[0].token_ids == drawn
    stats = engine.stats()
    drafts = stats.spec_drafts
    assert drafts > 0 and stats.spec_accepted_tokens == drafts and stats.spec_proposed_tokens > drafts
    assert stats.spec_accepted_per_position == (drafts, 0, 0, 0)
    text = generate_latest(PodMetrics("m", lambda: Snapshot(stats, max_adapters=1)).registry).decode()
    samples = _strictly_parsed(text)
    assert [s.value for s in samples["vllm:spec_decode_num_drafts_total"]] == [drafts]
    by_position = {
        s.labels["position"]: s.value for s in samples["vllm:spec_decode_num_accepted_tokens_per_pos_total"]
    }
    assert by_position == {"0": drafts, "1": 0, "2": 0, "3": 0}


@pytest.mark.parametrize(
    "text",
    ['{"method": "eagle"}', '{"method": "ngram", "num_speculative_tokens": 0}', "{not json", '{"k": 1}'],
)
def test_bad_speculative_configs_are_refused_with_a_message(text):
    with pytest.raises(InvalidRequestError, match="speculative-config"):
        SpeculativeConfig.from_json(text)


REPEAT = [{"role": "user", "content": "Repeat exactly, three times: the quick brown fox jumps over the dog."}]
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"
# The steps of this batch are what its tests cost (SmolLM2 on a CPU costs the same per step for
# one row or six) and the longest request sets them: 24 tokens rather than 40 keep the n-gram
# test's proof (a third of the proposals accepted, preemption in both modes, fewer steps) at
# three quarters of the steps. The REPEAT requests end by themselves, after 9 and 11 tokens.
MIXED_REQUESTS = [  # shared with tests/test_draft.py
    {"messages": REPEAT, "max_tokens": 48, "temperature": 0},
    {"messages": REPEAT, "max_tokens": 40, "temperature": 0, "adapter": "a"},  # LoRA rows verify too
    {"prompt": CODE, "max_tokens": 24, "temperature": 0},
    {"prompt": CODE + "    return a * b\n", "max_tokens": 24, "temperature": 0},  # a prefix-cache hit
    {"prompt": CODE, "max_tokens": 20, "temperature": 0.8, "seed": 3},  # sampled: rejection sampling
    {"messages": REPEAT, "max_tokens": 48, "temperature": 0, "stop": ["dog"]},
]


def _mixed_engine(smollm2, adapter, preemption_mode: str, spec: str | None):
    """The mixed batch's engine: a cache small enough to preempt, an adapter, `spec` or none."""
    return make_engine(
        smollm2,
        num_kv_blocks=12,
        max_num_batched_tokens=96,
        preemption_mode=preemption_mode,
        lora_modules={"a": str(adapter)},
        speculative_config=spec,
    )


@pytest.fixture(scope="module")
def mixed_adapter(smollm2, tmp_path_factory):
    return write_adapter(tmp_path_factory.mktemp("spec") / "a", smollm2.config, rank=8, seed=1)


@pytest.fixture(scope="module")
def plain_run(smollm2, mixed_adapter):
    """The mixed batch without speculation, once for both preemption modes (which a plain run's
    tokens do not depend on: tests/test_scheduler.py's swap test), and its step count."""
    engine = _mixed_engine(smollm2, mixed_adapter, "recompute", None)
    outputs = [(o.token_ids, o.text, o.finish_reason) for o in engine.generate(MIXED_REQUESTS)]
    assert_all_blocks_free(engine)
    return outputs, engine.num_steps


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_greedy_output_is_identical_with_speculation(smollm2, mixed_adapter, plain_run, preemption_mode):
    requests = MIXED_REQUESTS
    greedy = [i for i, r in enumerate(requests) if r["temperature"] == 0]
    plain, plain_steps = plain_run
    outputs, engines = {}, {}
    # The second config, the same again, shows a seeded sampled row reproducible; once is enough
    # (a sampled row does not depend on how the cache is preempted).
    for spec in (NGRAM, NGRAM + " ") if preemption_mode == "recompute" else (NGRAM,):
        engine = _mixed_engine(smollm2, mixed_adapter, preemption_mode, spec)
        outputs[spec] = [(o.token_ids, o.text, o.finish_reason) for o in engine.generate(requests)]
        engines[spec] = engine
        assert_all_blocks_free(engine)
    assert [outputs[NGRAM][i] for i in greedy] == [plain[i] for i in greedy]
    if preemption_mode == "recompute":
        assert outputs[NGRAM] == outputs[NGRAM + " "]  # a seeded sampled row is reproducible
    spec_engine = engines[NGRAM]
    assert (
        spec_engine.speculation.accepted > 0
        and spec_engine.speculation.proposed > spec_engine.speculation.accepted
    )
    assert spec_engine.stats().num_preemptions > 0  # the small cache really preempted
    assert spec_engine.num_steps < plain_steps


def test_sampled_rows_speculate_and_finish_cleanly(smollm2):
    engine = make_engine(smollm2, speculative_config=NGRAM)
    quote = [{"role": "user", "content": "Quote twice, word for word: 'the cat sat on the mat by the door'."}]
    out = engine.generate([{"messages": quote, "max_tokens": 40, "temperature": 0.7, "seed": 5}])[0]
    assert out.finish_reason in ("stop", "length") and 0 < len(out.token_ids) <= 40
    assert engine.speculation.proposed > 0 and engine.speculation.accepted > 0
    assert_all_blocks_free(engine)
