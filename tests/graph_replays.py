"""The CUDA-graph check shared by the GPU tests of the proposers that read the target's hidden
states (MTP's layer, EAGLE-3's head): one mechanism replays both (engine/cuda_graphs.py), so one
check covers both. No conftest imports: GPU tests run with `--noconftest`."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from model_service.engine.cuda_graphs import DecodeGraphs, Outputs
from model_service.engine.engine import Engine
from model_service.models.step import StepBatch

Replay = tuple[bool, bool, bool]  # (a head's graph, several rows a sequence, every row a logits row)
TARGET_VERIFY: Replay = (False, True, True)
HEAD_FEED: Replay = (True, True, False)  # verified runs fed back, the last row's logits wanted
HEAD_CHAINED: Replay = (True, False, True)


def assert_graphs_equal_eager(
    make: Callable[[bool], Engine],
    requests: list[dict],
    expected: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Speculation on CUDA with graphs and eagerly (`make(eager)`): the greedy tokens are
    `expected` (plain decoding's) both ways, as are the counts of proposed and accepted tokens
    (the head's graphs propose what its eager steps do), and the graphs ran the target's verify
    steps and the head's feeds of verified runs and chained steps."""
    replays: list[Replay] = []
    run = DecodeGraphs.run

    def counting_run(self: DecodeGraphs, batch: StepBatch, *inputs: torch.Tensor) -> Outputs:
        every_row = len(batch.logits_rows) == batch.num_tokens
        replays.append((bool(inputs), batch.max_query_len > 1, every_row))
        return run(self, batch, *inputs)

    monkeypatch.setattr(DecodeGraphs, "run", counting_run)
    counts = {}
    for eager in (True, False):
        replays.clear()
        engine = make(eager)
        assert [o.token_ids for o in engine.generate(requests)] == expected
        spec = engine.speculation
        assert spec is not None and 0 < spec.accepted < spec.proposed
        counts[eager] = (spec.proposed, spec.accepted)
        head = spec.proposer.executor
        assert (engine.executor.graphs is None) == (head.graphs is None) == eager
        assert bool(replays) != eager
    assert counts[False] == counts[True]
    assert {TARGET_VERIFY, HEAD_FEED, HEAD_CHAINED} <= set(replays)
