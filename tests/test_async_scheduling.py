"""Async scheduling (engine/overlap.py): a step's tokens stay on the device while the next step is
built and launched. On the CPU it gains nothing, but it runs the same code, so these tests hold
it to the synchronous engine's outputs token for token: greedy and seeded sampling, stop tokens,
stop strings, max_tokens, chunked prefill mixed with decode, preemption, aborts, and steps that
must read their tokens at once (penalties, logprobs) interleaved with ones that overlap."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import make_engine
from tests.overlap_helpers import (
    ABORTS,
    PREEMPTING,
    assert_same_but_aborts,
    count_launches,
    long_requests,
    mixed_requests,
    run_steps,
)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("chunk", [2048, 16])
def test_async_scheduling_gives_the_synchronous_tokens(tiny_llama, monkeypatch, chunk):
    reqs = mixed_requests(tiny_llama.config.vocab_size)
    config = {"max_num_batched_tokens": chunk, "max_loras": 0}
    expected = run_steps(make_engine(tiny_llama, async_scheduling="off", **config), reqs)
    launches = count_launches(monkeypatch)
    engine = make_engine(tiny_llama, async_scheduling="on", **config)
    assert engine.overlap.enabled
    assert run_steps(engine, reqs) == expected
    assert len(launches) > 10, "no step overlapped"


def test_async_scheduling_through_preemption_and_aborts(tiny_llama, monkeypatch):
    reqs = long_requests(tiny_llama.config.vocab_size)
    config = {**PREEMPTING, "max_loras": 0}
    sync = make_engine(tiny_llama, async_scheduling="off", **config)
    expected = run_steps(sync, reqs, ABORTS)
    assert sync.scheduler.num_preemptions > 0, "the KV budget should force preemption"
    launches = count_launches(monkeypatch)
    engine = make_engine(tiny_llama, async_scheduling="on", **config)
    assert_same_but_aborts(run_steps(engine, reqs, ABORTS), expected, ABORTS)
    assert engine.scheduler.num_preemptions > 0 and launches


def test_async_scheduling_with_stop_strings_and_eos(smollm2, monkeypatch):
    questions = ("What is the capital of France?", "Count from one to ten in words.", "Name three colours.")
    chat = [smollm2.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    greedy = {"max_tokens": 24, "temperature": 0}
    reqs = [
        {"prompt_token_ids": chat[0], **greedy, "request_id": "eos"},
        {"prompt_token_ids": chat[1], **greedy, "stop": ["4."], "request_id": "stop"},
        {"prompt_token_ids": chat[2], "max_tokens": 12, "temperature": 0.7, "seed": 5, "request_id": "s"},
    ]
    expected = run_steps(make_engine(smollm2, async_scheduling="off"), reqs)
    assert expected["eos"][1] == "stop" and expected["stop"][1] == "stop"
    launches = count_launches(monkeypatch)
    assert run_steps(make_engine(smollm2, async_scheduling="on"), reqs) == expected
    assert launches


def test_async_scheduling_is_off_on_the_cpu_by_default_and_with_speculation(tiny_llama):
    assert not make_engine(tiny_llama, max_loras=0).overlap.enabled
    spec = '{"method": "ngram", "num_speculative_tokens": 2}'
    assert not make_engine(
        tiny_llama, max_loras=0, async_scheduling="on", speculative_config=spec
    ).overlap.enabled


def test_a_request_whose_last_token_is_on_the_device_gets_no_more_rows(tiny_llama, monkeypatch):
    """max_tokens is known in advance, so the step after a request's last token does not compute
    a row for it that would be dropped: max_tokens = n costs n forward rows, with or without
    overlap (a 1-token request, the time-to-first-token case, costs one step, not two)."""
    engine = make_engine(tiny_llama, async_scheduling="on", max_loras=0)
    rows: list[int] = []
    execute = engine.executor.execute

    def counted(batch, fed):
        rows.append(len(batch.input_ids))
        return execute(batch, fed)

    monkeypatch.setattr(engine.executor, "execute", counted)
    prompt = list(range(3, 40))
    for n in (1, 2, 5):
        rows.clear()
        out = engine.generate([{"prompt_token_ids": prompt, "max_tokens": n, "ignore_eos": True}])[0]
        assert len(out.token_ids) == n
        assert len(rows) == n and sum(rows[1:]) == n - 1  # one prefill step (cached prefix), then decode
