"""Async scheduling (engine/overlap.py) test helpers, for the CPU, tensor-parallel and GPU tests
alike: counting the steps that overlapped, a request mix that exercises every kind of step, and
running requests step by step to their final outputs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

import model_service.engine.overlap as overlap_module
from tests.conftest import assert_all_blocks_free


def count_launches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The engine's device-side sampling launches from here on: one entry (its rows) per step
    that went on without reading its tokens."""
    launches: list[int] = []
    original = overlap_module.launch

    def counted(seqs, logits):
        launches.append(len(seqs))
        return original(seqs, logits)

    monkeypatch.setattr(overlap_module, "launch", counted)
    return launches


def mixed_requests(vocab: int, adapters: Sequence[str | None] = (None,)) -> list[dict[str, Any]]:
    """Twelve requests: greedy and seeded sampled, some with stop tokens, one with a penalty and
    one with logprobs (their steps sample on the host's schedule), on `adapters` in turn."""
    g = torch.Generator().manual_seed(3)
    reqs = []
    for i in range(12):
        length = int(torch.randint(3, 40, (1,), generator=g))
        prompt = torch.randint(3, vocab, (length,), generator=g).tolist()
        r: dict[str, Any] = {"prompt_token_ids": prompt, "max_tokens": 4 + 3 * i, "request_id": f"r{i}",
                             "adapter": adapters[i % len(adapters)]}  # fmt: skip
        if i % 3 == 1:  # sampled, seeded: its tokens are a function of (seed, position) only
            r.update(temperature=0.9, top_p=0.9, top_k=40, min_p=0.01, seed=100 + i)
        else:
            r.update(temperature=0)
        if i % 4 == 0:
            r["stop_token_ids"] = [prompt[0], prompt[-1]]  # tokens the model may well produce
        if i == 5:
            r["repetition_penalty"] = 1.3
        if i == 7:
            r["logprobs"] = 2
        reqs.append(r)
    return reqs


# A K/V budget tight enough that `long_requests` preempt, and the steps two of them are aborted at.
PREEMPTING = {"num_kv_blocks": 40, "block_size": 4, "max_num_batched_tokens": 64}
ABORTS = {"r2": 3, "r9": 11}


def long_requests(vocab: int, adapters: Sequence[str | None] = (None,), n: int = 30) -> list[dict[str, Any]]:
    """`mixed_requests` with `n` tokens each and no stop tokens: under `PREEMPTING` they preempt."""
    return [{**r, "max_tokens": n, "stop_token_ids": []} for r in mixed_requests(vocab, adapters)]


def assert_same_but_aborts(got: dict[str, tuple], expected: dict[str, tuple], aborts: dict[str, int]) -> None:
    """An abort lands one step later in output terms (the token in flight is dropped), so aborted
    requests may end a token shorter; every other request is exactly the synchronous one."""
    got, expected = dict(got), dict(expected)
    for rid in aborts:
        (tokens, reason), synchronous = got.pop(rid), expected.pop(rid)[0]
        assert reason == "abort" and tokens == synchronous[: len(tokens)], (rid, tokens, synchronous)
    assert got == expected


def run_steps(
    engine, requests: list[dict[str, Any]], abort_at: dict[str, int] | None = None
) -> dict[str, tuple]:
    """Final (token ids, finish reason) by request; `abort_at`: request -> step to abort it at."""
    for r in requests:
        engine.add_request_dict(r)
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
