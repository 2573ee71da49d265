"""Async scheduling (engine/overlap.py): a step's tokens stay on the device while the next step is
built and launched. On the CPU it gains nothing, but it runs the same code, so these tests hold
it to the synchronous engine's outputs token for token: greedy and seeded sampling, stop tokens,
stop strings, max_tokens, chunked prefill mixed with decode, preemption, aborts, and steps that
must read their tokens at once (penalties, logprobs) interleaved with ones that overlap."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from model_service.engine.sampling_params import SamplingParams
from tests.conftest import assert_all_blocks_free, make_engine
from tests.overlap_helpers import count_launches


@pytest.fixture(autouse=True)
def _one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _requests(vocab: int) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(3)
    reqs = []
    for i in range(12):
        length = int(torch.randint(3, 40, (1,), generator=g))
        prompt = torch.randint(3, vocab, (length,), generator=g).tolist()
        r: dict[str, Any] = {"prompt_token_ids": prompt, "max_tokens": 4 + 3 * i, "request_id": f"r{i}"}
        if i % 3 == 1:  # sampled, seeded: its tokens are a function of (seed, position) only
            r.update(temperature=0.9, top_p=0.9, top_k=40, min_p=0.01, seed=100 + i)
        else:
            r.update(temperature=0)
        if i % 4 == 0:
            r["stop_token_ids"] = [prompt[0], prompt[-1]]  # tokens the model may well produce
        if i == 5:
            r["repetition_penalty"] = 1.3  # its steps sample on the host's schedule
        if i == 7:
            r["logprobs"] = 2
        reqs.append(r)
    return reqs


def _run(engine, requests: list[dict[str, Any]], abort_at: dict[str, int] | None = None) -> dict[str, tuple]:
    """Final (token ids, finish reason) by request; `abort_at`: request -> step to abort it at."""
    for r in requests:
        engine.add_request(prompt_token_ids=r["prompt_token_ids"], params=SamplingParams.from_dict(r),
                           request_id=r["request_id"])  # fmt: skip
    final, steps = {}, 0
    while engine.has_unfinished():
        for rid, at in (abort_at or {}).items():
            if at == steps:
                engine.abort(rid)
        for out in engine.step():
            if out.finished:
                final[out.request_id] = (out.token_ids, out.finish_reason)
        steps += 1
    assert_all_blocks_free(engine)
    return final


@pytest.mark.parametrize("chunk", [2048, 16])
def test_async_scheduling_gives_the_synchronous_tokens(tiny_llama, monkeypatch, chunk):
    reqs = _requests(tiny_llama.config.vocab_size)
    config = {"max_num_batched_tokens": chunk, "max_loras": 0}
    expected = _run(make_engine(tiny_llama, async_scheduling="off", **config), reqs)
    launches = count_launches(monkeypatch)
    engine = make_engine(tiny_llama, async_scheduling="on", **config)
    assert engine.overlap
    assert _run(engine, reqs) == expected
    assert len(launches) > 10, "no step overlapped"


def test_async_scheduling_through_preemption_and_aborts(tiny_llama, monkeypatch):
    reqs = [{**r, "max_tokens": 30, "stop_token_ids": []} for r in _requests(tiny_llama.config.vocab_size)]
    config = {"num_kv_blocks": 40, "block_size": 4, "max_num_batched_tokens": 64, "max_loras": 0}
    aborts = {"r2": 3, "r9": 11}
    sync = make_engine(tiny_llama, async_scheduling="off", **config)
    expected = _run(sync, reqs, aborts)
    assert sync.scheduler.num_preemptions > 0, "the KV budget should force preemption"
    launches = count_launches(monkeypatch)
    engine = make_engine(tiny_llama, async_scheduling="on", **config)
    got = _run(engine, reqs, aborts)
    # An abort lands one step later in output terms (the token in flight is dropped), so aborted
    # requests may end a token shorter; every other request is exactly the synchronous one.
    for rid in aborts:
        tokens, reason = got.pop(rid)
        assert reason == "abort" and tokens == expected.pop(rid)[0][: len(tokens)]
    assert got == expected
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
    expected = _run(make_engine(smollm2, async_scheduling="off"), reqs)
    assert expected["eos"][1] == "stop" and expected["stop"][1] == "stop"
    launches = count_launches(monkeypatch)
    assert _run(make_engine(smollm2, async_scheduling="on"), reqs) == expected
    assert launches


def test_async_scheduling_is_off_on_the_cpu_by_default_and_with_speculation(tiny_llama):
    assert not make_engine(tiny_llama, max_loras=0).overlap
    spec = '{"method": "ngram", "num_speculative_tokens": 2}'
    assert not make_engine(tiny_llama, max_loras=0, async_scheduling="on", speculative_config=spec).overlap
