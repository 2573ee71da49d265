"""Where a serving run's steps go: host and device milliseconds by kind of step.

`StepTimes(executor)` wraps one single-GPU engine's `ModelExecutor.execute` while it is entered:
each call's host time (what the engine thread spends launching the step) and the device time
between CUDA events recorded before and after it (the step's kernels, plus any wait for the host
when the host is the slower side). Steps are classed after the call by what ran them (a decode
graph, piecewise graphs, eager), what they held (decode rows only, a prefill chunk with or
without leading decode rows) and their token count. `bench/serving.py --step-times` prints the
classes of every measured run; they told session k that eager mixed steps with LoRA rows were
host-bound (docs/performance-notes.md, session k).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from types import TracebackType

import torch

from model_service.engine.executor import ModelExecutor
from model_service.models.step import StepBatch

Record = tuple[tuple[str, str, str], float, torch.cuda.Event, torch.cuda.Event]


def step_class(executor: ModelExecutor, batch: StepBatch) -> tuple[str, str, str]:
    """(what ran it, what it held, its size) of a step `executor` has just run."""
    if executor.graphs is not None and executor.graphs.can_run(batch):
        path = "graph"
    elif executor.pieces is not None and executor.pieces.can_run(batch):
        path = "pieces"
    else:
        path = "eager"
    kind = "decode" if batch.max_query_len == 1 else "mixed" if batch.num_leading_decodes else "prefill"
    n = batch.num_tokens
    return path, kind, "<=512" if n <= 512 else "<=1024" if n <= 1024 else ">1024"


class StepTimes:
    def __init__(self, executor: ModelExecutor) -> None:
        self.executor = executor
        self.records: list[Record] = []

    def __enter__(self) -> StepTimes:
        run = self.executor.execute
        self.executor.execute = lambda batch, fed=None: self._timed(run, batch, fed)  # shadows the class's
        return self

    def __exit__(self, kind: type | None, error: BaseException | None, tb: TracebackType | None) -> None:
        del self.executor.execute

    def _timed(
        self, run: Callable[..., torch.Tensor], batch: StepBatch, fed: torch.Tensor | None
    ) -> torch.Tensor:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        began = time.perf_counter()
        logits = run(batch, fed)
        host = time.perf_counter() - began
        end.record()
        self.records.append((step_class(self.executor, batch), host, start, end))
        return logits

    def classes(self) -> list[dict[str, object]]:
        """Per class: steps, mean host and device ms, and their sums in seconds (synchronizes)."""
        torch.cuda.synchronize()
        groups: dict[tuple[str, str, str], list[tuple[float, float]]] = collections.defaultdict(list)
        for key, host, start, end in self.records:
            groups[key].append((host * 1e3, start.elapsed_time(end)))
        rows = []
        for (path, kind, tokens), times in sorted(groups.items()):
            host_ms, device_ms = (sum(t[i] for t in times) for i in (0, 1))
            n = len(times)
            rows.append({
                "path": path, "kind": kind, "tokens": tokens, "steps": n, "host_ms": round(host_ms / n, 2),
                "device_ms": round(device_ms / n, 2), "host_s": round(host_ms / 1e3, 2),
                "device_s": round(device_ms / 1e3, 2),
            })  # fmt: skip
        return rows
