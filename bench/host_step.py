"""Host time of a decode step outside the device's work, on the CPU: what async scheduling leaves
exposed at batch 1 on a GPU (issue 37), for A/B comparisons of the engine's bookkeeping.

Setup (printed in every line): CPU, float32, one torch thread, async scheduling on (the CUDA
default, so the loop takes the GPU's path: tokens sampled on the device and read a step later),
`bench/gpu.py`'s `start_decode` (random prompts of 16 ids, temperature 1, EOS ignored), then
`--steps` decode steps. Models: `hybrid`, the small Qwen3-Next-shaped model of `bench/hybrid.py`
(8 layers: Gated DeltaNet and gated attention, recurrent-state slots; block size 16, no prefix
cache) and `dense`, SmolLM2-135M (the engine's default model, with its tokenizer: detokenizing
is host work). Per step, process CPU time of `Engine.step()` less the time inside the executor's
forward (`executor.execute`: on a GPU a graph replay) and inside `sample_on_device` (on a GPU a
sampling kernel): the scheduler, batch building, overlap, outputs, detokenizing. The sampler's
own host side on CUDA (its temperature and seed lists) is outside the figure. `--forward stub`
(the default) answers each forward with fixed random logits of its shape instead of running the
model, and samples their argmax (`stub_sampler`): the host's figure without the CPU caches a
real forward and sampler flush (a GPU's host keeps them), in seconds, not minutes; `--forward
real` runs both. The batch builder works as on a GPU (`keep_batches=False`: one device buffer,
its views kept by layout; a tree before that flag packs as it did on either device). Median of
the steps, best of `--repeats` runs (the machine may be shared). One JSON line per (model, batch).

    PYTHONPATH=. python bench/host_step.py [--models hybrid dense] [--batches 1 64] [--steps 200]
                                           [--repeats 5] [--forward stub|real]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.gpu import start_decode
from bench.hybrid import _config, _engine
from model_service.engine import overlap
from model_service.engine.config import EngineConfig
from model_service.engine.engine import Engine
from model_service.models.step import StepBatch
from model_service.startup import configure_process


def hybrid_engine() -> Engine:
    cfg = _config(8, True, False)
    return _engine(
        cfg, "cpu", torch.float32, block_size=16, enable_prefix_caching=False, async_scheduling="on"
    )


def dense_engine() -> Engine:
    return Engine(EngineConfig(device="cpu", dtype="float32", num_kv_blocks=1024, async_scheduling="on"))


ENGINES: dict[str, Callable[[], Engine]] = {"hybrid": hybrid_engine, "dense": dense_engine}


def stub_forward(vocab: int) -> Callable[..., torch.Tensor]:
    """An `executor.execute` that returns fixed random logits, one tensor per row count."""
    logits: dict[int, torch.Tensor] = {}

    def execute(batch: StepBatch, fed: torch.Tensor | None = None) -> torch.Tensor:
        rows = len(batch.logits_rows)
        if rows not in logits:
            logits[rows] = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows))
        return logits[rows]

    return execute


def stub_sampler() -> Callable[..., torch.Tensor]:
    """A `sample_on_device` for `stub_forward`'s logits: their argmax, computed once per tensor, so
    that no step reads megabytes of logits on the host (a GPU's host never does; the argmax of
    every step flushed the CPU caches: hybrid at batch 64 read ~570 us a step, not ~370)."""
    tokens: dict[int, torch.Tensor] = {}

    def sample(logits: torch.Tensor, rows: list[Any]) -> torch.Tensor:
        key = id(logits)  # the stub's tensors live as long as the run
        if key not in tokens:
            tokens[key] = logits.argmax(dim=-1)
        return tokens[key].clone()

    return sample


class DeviceClock:
    """Process CPU seconds spent inside the wrapped callables since the last `take`."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.process_time() - start

        return timed

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def host_us(engine: Engine, clock: DeviceClock, batch: int, steps: int) -> tuple[float, float]:
    """(median host us, median device us) per decode step over `steps` steps at `batch`."""
    start_decode(engine, batch, 16, engine.vocab_size, max_tokens=steps + 8)
    host, device = [], []
    for _ in range(steps):
        clock.take()
        start = time.process_time()
        engine.step()
        total, inside = time.process_time() - start, clock.take()
        host.append(total - inside)
        device.append(inside)
    while engine.has_unfinished():
        engine.step()
    return statistics.median(host) * 1e6, statistics.median(device) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--forward", default="stub", choices=["stub", "real"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.cuda.synchronize = lambda *_: None  # start_decode's, on a machine with no GPU
    clock = DeviceClock()
    stub = args.forward == "stub"
    overlap.sample_on_device = clock.wrap(stub_sampler() if stub else overlap.sample_on_device)
    for model in args.models:
        engine = ENGINES[model]()
        forward = stub_forward(engine.vocab_size) if stub else engine.executor.execute
        engine.executor.execute = clock.wrap(forward)
        engine.builder.keep_batches = False  # as on a GPU: nothing keeps a batch past its step
        for batch in args.batches:
            host_us(engine, clock, batch, 4)  # warm-up at this batch size
            runs = [host_us(engine, clock, batch, args.steps) for _ in range(args.repeats)]
            host, device = min(runs)
            setup = {"device": "cpu", "dtype": "float32", "threads": 1, "async_scheduling": True}
            setup["forward"] = args.forward
            result = {"bench": "host_step", "model": model, "batch": batch, "steps": args.steps}
            result |= {"host_us_per_step": round(host, 1), "device_us_per_step": round(device, 1)}
            print(json.dumps({**setup, **result}), flush=True)


if __name__ == "__main__":
    configure_process()
    main()
