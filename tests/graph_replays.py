"""The CUDA-graph check shared by the tests of the proposers that read the target's hidden states
(MTP's layer, EAGLE-3's head): one mechanism replays both (engine/cuda_graphs.py), so one check
covers both, on a GPU and, through stand-ins for a graph and a capturable backend, on the CPU
(`on_the_cpu`: the runner's wiring: static inputs, token rows, outputs at the logits rows, kept
states as views that the next replay overwrites). No conftest imports: GPU tests run with
`--noconftest`."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from model_service.attention.reference import TorchReferenceBackend
from model_service.engine.config import EngineConfig
from model_service.engine.cuda_graphs import DecodeGraphs, Outputs
from model_service.engine.engine import Engine
from model_service.engine.executor import ModelExecutor
from model_service.kernels.paged_attention import HeadNorms
from model_service.models.context import ForwardContext
from model_service.models.step import StaticRows, StepBatch

Rope = tuple[torch.Tensor, torch.Tensor] | None

Replay = tuple[bool, bool, bool]  # (a head's graph, several rows a sequence, every row a logits row)
TARGET_VERIFY: Replay = (False, True, True)
HEAD_FEED: Replay = (True, True, False)  # verified runs fed back, the last row's logits wanted
HEAD_ROWS: Replay = (True, False, True)  # a row a sequence: chained, or fed after a prefill or a rejection


def assert_graphs_equal_eager(
    make: Callable[[bool], Engine],
    requests: list[dict],
    expected: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Speculation with graphs (or `on_the_cpu`'s stand-ins) and eagerly (`make(eager)`): the
    greedy tokens are `expected` (plain decoding's) both ways, as are the counts of proposed and
    accepted tokens (the head's graphs propose what its eager steps do), and the graphs ran the
    target's verify steps and the head's feeds of verified runs and steps of a row a sequence."""
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
    assert {TARGET_VERIFY, HEAD_FEED, HEAD_ROWS} <= set(replays)


def on_the_cpu(monkeypatch: pytest.MonkeyPatch, make: Callable[[bool], Engine]) -> Callable[[bool], Engine]:
    """`make` whose engines, unless eager, replay CPU stand-ins of decode graphs (`FakeGraph`
    over `ReplayedReference`) where CUDA would replay graphs."""
    monkeypatch.setattr(DecodeGraphs, "_capture", _fake_capture)

    def made(eager: bool) -> Engine:
        if eager:
            return make(True)
        with monkeypatch.context() as m:
            m.setattr(ModelExecutor, "_attention", _replayed_attention)
            return make(False)

    return made


class FakeGraph:
    """A CUDA graph's stand-in: a replay makes the captured call again and writes what it returns
    into the captured outputs, in place, so views of them see each replay as a real graph's do."""

    def __init__(self, call: Callable[[], Outputs], outputs: Outputs) -> None:
        self.call, self.outputs = call, outputs

    def replay(self) -> None:
        for out, new in zip(self.outputs, self.call(), strict=True):
            out.copy_(new)


class ReplayedReference(TorchReferenceBackend):
    """The reference backend as a graph runner's: attention over the step's own rows, zeros for a
    padded batch's other rows (and for all of them while a graph is captured)."""

    rows = 0

    def init_graph_capture(self, rows: StaticRows, max_seq_len: int) -> None:
        pass

    def prepare_for_capture(self, num_seqs: int) -> None:
        self.rows = 0

    def prepare_for_replay(self, batch: StepBatch) -> None:
        self.prepare(batch)

    def prepare(self, batch: StepBatch) -> None:
        super().prepare(batch)
        self.rows = batch.num_tokens

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: Rope = None,
        norms: HeadNorms | None = None,
    ) -> torch.Tensor:
        n, out = self.rows, q.new_zeros(q.shape)
        if n:
            cut = None if rope is None else (rope[0][:n], rope[1][:n])
            out[:n] = super().forward(layer, q[:n], k[:n], v[:n], cut, norms)
        return out

    def forward_latent(
        self, layer: int, q_nope: torch.Tensor, q_rope: torch.Tensor, row: torch.Tensor, kv_up: torch.Tensor
    ) -> torch.Tensor:
        n, out = self.rows, q_nope.new_zeros(*q_nope.shape[:2], kv_up.shape[1] - q_nope.shape[2])
        if n:
            out[:n] = super().forward_latent(layer, q_nope[:n], q_rope[:n], row[:n], kv_up)
        return out


def _fake_capture(self: DecodeGraphs, size: int, kinds: int) -> tuple[FakeGraph, Outputs]:
    """`DecodeGraphs._capture` for `FakeGraph`s: the same static inputs, no CUDA."""
    self.backend.prepare_for_capture(size)
    ctx = ForwardContext(attention=self.backend, logits_rows=self.rows[:size])
    ids, positions = self.static.input_ids[:size], self.static.positions[:size]
    args = (ids, positions, *(t[:size] for t in self.inputs), ctx)

    def call() -> Outputs:
        out = self.forward(*args)
        return out if isinstance(out, tuple) else (out,)

    outputs = call()
    return FakeGraph(call, outputs), outputs


def _replayed_attention(
    self: ModelExecutor, config: EngineConfig
) -> tuple[ReplayedReference, DecodeGraphs, None]:
    """`ModelExecutor._attention` with decode graphs over `ReplayedReference`, on any device."""
    cfg = self.config
    scale = cfg.softmax_scale if cfg.latent_attention is not None else None
    backend = ReplayedReference(self.kv_cache, cfg.sliding_windows, cfg.head_dim, scale)
    return backend, self._decode_graphs(config, backend), None  # type: ignore[arg-type]
