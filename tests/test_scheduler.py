"""Scheduling policies: prefix cache, swap and recompute preemption, admission control, and a
randomized schedule that must never mix requests up or leak a block."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from model_service.engine.block_manager import BlockManager
from model_service.engine.sampling_params import SamplingParams
from model_service.engine.seq_state import SequenceState
from model_service.errors import CapacityError
from tests.conftest import assert_all_blocks_free, make_engine


def _prompts(n: int, seed: int = 0, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 320) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(3, 320) for _ in range(rng.randrange(5, 40))] for _ in range(n)]


def _run(engine, prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
    reqs = [
        {"prompt_token_ids": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        for p in prompts
    ]
    return [o.token_ids for o in engine.generate(reqs)]


@pytest.fixture(scope="module")
def tiny_reference(tiny_llama):
    engine = make_engine(tiny_llama, enable_prefix_caching=False)
    prompts = _prompts(6, shared_prefix=20)
    return prompts, [_run(engine, [p])[0] for p in prompts]


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("budget", [4, 17, 512])
@pytest.mark.parametrize("preemption", [None, "swap", "recompute"])
def test_outputs_identical_across_schedules(tiny_llama, tiny_reference, prefix_caching, budget, preemption):
    prompts, expected = tiny_reference
    kv = {"num_kv_blocks": 18, "block_size": 4, "preemption_mode": preemption} if preemption else {}
    engine = make_engine(
        tiny_llama, enable_prefix_caching=prefix_caching, max_num_batched_tokens=budget, **kv
    )
    assert _run(engine, prompts) == expected
    if preemption:
        assert engine.stats().num_preemptions > 0
    assert_all_blocks_free(engine)


def test_prefix_cache_skips_cached_tokens_and_reports_hits(tiny_llama, tiny_reference):
    prompts, expected = tiny_reference
    engine = make_engine(tiny_llama, block_size=4)
    assert _run(engine, prompts[:1]) == expected[:1]
    cold = engine.stats().num_computed_tokens
    assert _run(engine, prompts[:1]) == expected[:1]  # same prompt again: all full blocks hit
    warm = engine.stats().num_computed_tokens - cold
    assert warm < cold - 8
    assert engine.stats().prefix_cache_hit_rate > 0.3
    assert_all_blocks_free(engine)


def test_multi_turn_chat_hits_the_prefix_cache(smollm2):
    engine = make_engine(smollm2)
    history = [{"role": "user", "content": "Name a planet."}]
    for turn in range(3):
        out = engine.generate([{"messages": history, "max_tokens": 10, "temperature": 0}])[0]
        history += [
            {"role": "assistant", "content": out.text},
            {"role": "user", "content": f"And number {turn}?"},
        ]
    stats = engine.stats()
    assert stats.prefix_cache_hit_tokens > 0.5 * (stats.prefix_cache_query_tokens - 40)
    # Cold runs of the last turn give the same answer as the warm one.
    cold = make_engine(smollm2, enable_prefix_caching=False)
    warm_answer = engine.generate([{"messages": history, "max_tokens": 10, "temperature": 0}])[0].token_ids
    assert (
        cold.generate([{"messages": history, "max_tokens": 10, "temperature": 0}])[0].token_ids == warm_answer
    )
    assert_all_blocks_free(engine)


def test_smollm2_swap_preemption_matches_uninterrupted(smollm2):
    prompts = [
        smollm2.tokenizer.apply_chat_template([{"role": "user", "content": q}])
        for q in ("Count to five.", "Name three birds.", "What is ice?")
    ]
    expected = _run(make_engine(smollm2), prompts, max_tokens=10)
    engine = make_engine(smollm2, num_kv_blocks=24, block_size=4, preemption_mode="swap")
    assert _run(engine, prompts, max_tokens=10) == expected
    assert engine.stats().num_preemptions > 0
    assert_all_blocks_free(engine)


def test_full_queue_is_refused_and_serving_continues(tiny_llama, tiny_reference):
    prompts, expected = tiny_reference
    engine = make_engine(tiny_llama, max_waiting_requests=2)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    engine.add_request(prompt_token_ids=prompts[0], params=params, request_id="a")
    engine.add_request(prompt_token_ids=prompts[1], params=params, request_id="b")
    with pytest.raises(CapacityError, match="queue is full"):
        engine.add_request(prompt_token_ids=prompts[2], params=params)
    final = {}
    while engine.has_unfinished():
        final.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert [final["a"], final["b"]] == expected[:2]
    assert_all_blocks_free(engine)


def test_block_manager_lru_evicts_only_unreferenced_cached_blocks():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = SequenceState(seq_id=0)
    tokens = [1, 2, 3, 4, 5]
    assert bm.reserve(a, 5)
    a.num_computed = 5
    bm.register_full_blocks(a, tokens, adapter_id=0)
    assert bm.num_cached == 2
    bm.release(a)
    assert bm.num_free == 4 and bm.num_cached == 2
    # Same prefix, different adapter: no reuse.
    b = SequenceState(seq_id=1)
    assert bm.take_cached_prefix(b, tokens, adapter_id=7) == 0
    # Same adapter: both full blocks reused, held, and so never evicted.
    c = SequenceState(seq_id=2)
    assert bm.take_cached_prefix(c, tokens, adapter_id=0) == 4
    assert bm.num_free == 2
    d = SequenceState(seq_id=3)
    assert bm.reserve(d, 4)  # takes the two uncached free blocks
    assert not bm.reserve(d, 6)  # nothing left: the held cached blocks are not stolen
    assert bm.num_cached == 2
    bm.release(c)
    assert bm.reserve(d, 6)  # now the LRU cached block is evicted and reused
    assert bm.num_cached == 1
    bm.release(d)
    assert bm.num_free == 4


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    events=st.lists(
        st.tuples(
            st.sampled_from(["add", "add", "add", "abort", "step", "step"]),
            st.integers(0, 5),
            st.integers(0, 2),
        ),
        min_size=5,
        max_size=40,
    ),
    preemption=st.sampled_from(["swap", "recompute"]),
    budget=st.sampled_from([3, 8, 64]),
)
def test_random_schedules_never_mix_requests_or_leak_blocks(
    tiny_llama, tiny_reference, events, preemption, budget
):
    prompts, expected = tiny_reference
    engine = make_engine(
        tiny_llama, num_kv_blocks=18, block_size=4, preemption_mode=preemption, max_num_batched_tokens=budget
    )
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    which: dict[str, int] = {}
    aborted: set[str] = set()
    finals: dict[str, list[int]] = {}

    def collect(outs):
        for o in outs:
            if o.finished:
                finals[o.request_id] = o.token_ids

    for i, (kind, k, priority) in enumerate(events):
        if kind == "add":
            rid = f"r{i}"
            engine.add_request(prompt_token_ids=prompts[k], params=params, request_id=rid, priority=priority)
            which[rid] = k
        elif kind == "abort" and which:
            rid = sorted(which)[k % len(which)]
            if engine.abort(rid):
                aborted.add(rid)
        else:
            collect(engine.step())
    while engine.has_unfinished():
        collect(engine.step())
    for rid, k in which.items():
        if rid in aborted:
            assert expected[k][: len(finals[rid])] == finals[rid]  # a prefix of its own answer
        else:
            assert finals[rid] == expected[k]
    assert_all_blocks_free(engine)
