"""Async scheduling under tensor parallelism on the CPU: two processes over gloo, the same code as
on GPUs over NCCL. Rank 0 launches step N + 1 before it reads step N's tokens and broadcasts the
in-flight ones to rank 1 over the device group (distributed/rank.py), and no rank waits for its
device per step. The oracle is the single-process synchronous engine over the same weights:
greedy and seeded sampled tokens identical, on a batch mixing the base model and two adapters,
stop tokens, steps that sample on the host's schedule (a penalty, logprobs), chunked prefill,
preemption and aborts. The model is a tiny random Llama (4 heads, 2 KV heads: each rank holds
half): what is tested is the ranks' protocol, which a model's size does not change, and SmolLM2's
steps made these two tests ~40 s of the suite's CPU (tests/test_tensor_parallel.py runs it on
SmolLM2 with the shipped adapter)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_service.engine.batch_builder import BatchBuilder, StepItem
from model_service.engine.config import EngineConfig
from model_service.engine.overlap import Overlap
from tests import overlap_helpers as overlap
from tests.conftest import make_engine, new_sequence

ADAPTERS = (None, "qv", "all")


@pytest.fixture(scope="module")
def config(tiny_llama, tmp_path_factory) -> dict:
    """Two random adapters, on q/v and on all seven projections, scaled until their deltas change
    greedy tokens (a missing or mis-sliced one would show)."""
    from bench.lora import write_adapter

    adapters = {}
    for name, targets in (("qv", ["q_proj", "v_proj"]), ("all", None)):
        path = write_adapter(tmp_path_factory.mktemp("tp_async") / name, tiny_llama.config, 8, 3, targets)
        weights = Path(path) / "adapter_model.safetensors"
        save_file({k: v * 30 for k, v in load_file(str(weights)).items()}, str(weights))
        adapters[name] = str(path)
    return {"max_loras": 2, "lora_modules": adapters, **overlap.PREEMPTING}


@pytest.fixture(scope="module")
def sync(tiny_llama, config):
    """The oracle, run on the same requests in the same order as `tp_async`, so that their
    prefix caches (and with them the steps an abort lands in) stay the same."""
    return make_engine(tiny_llama, async_scheduling="off", **config)


@pytest.fixture(scope="module")
def tp_async(tiny_llama, config):
    engine = make_engine(tiny_llama, tensor_parallel_size=2, async_scheduling="on", **config)
    engine.warm_up()  # as a pod does: every rank gets the command (no graphs to capture on a CPU)
    yield engine
    engine.executor.teardown()


def test_async_scheduling_is_on_by_default_on_gpus_and_on_request_on_the_cpu():
    def on(mode: str, device: str, tp: int = 2) -> bool:
        cfg = EngineConfig(model="smollm2", tensor_parallel_size=tp, async_scheduling=mode)
        return Overlap.wanted(cfg, torch.device(device), with_speculation=False)

    assert on("auto", "cuda", tp=1) and on("auto", "cuda") and on("on", "cuda") and on("on", "cpu")
    assert not on("off", "cuda") and not on("auto", "cpu") and not on("auto", "cpu", tp=1)


def test_the_feed_index_travels_in_the_packed_batch_and_the_executor_writes_the_in_flight_tokens(tiny_llama):
    """What rank 0 packs is what a worker rebuilds from the same host words (its header shape
    included); the executor writes step N's tokens (`fed`) into the placeholder rows."""
    engine = make_engine(tiny_llama, max_loras=0)
    states = [new_sequence(engine, 4) for _ in range(3)]
    tokens, fed_from = ([0], [5, 6, 7], [0]), (2, -1, 0)  # rows 0 and 4: step N's third and first
    items = [StepItem(st, ids, 1, f) for st, ids, f in zip(states, tokens, fed_from, strict=True)]
    batch = engine.builder.build(items)
    worker = BatchBuilder(engine.config.block_size, torch.device("cpu"))
    worker.host_region(batch.packed_shape)[:] = batch.packed
    rebuilt = worker.from_host(batch.packed_shape)
    assert batch.feed_index.tolist() == rebuilt.feed_index.tolist() == [[0, 4], [2, 0]]
    engine.executor.execute(batch, torch.tensor([10, 11, 12]))
    assert batch.input_ids.tolist() == [12, 5, 6, 7, 10]
    assert rebuilt.input_ids.tolist() == [0, 5, 6, 7, 0]  # a worker's: `_share_fed` writes them
    for state in states:
        engine.cache.free(state)


def _stopping_midway(loaded, config: dict, reqs: list[dict]) -> list[dict]:
    """`reqs` whose stop tokens are each one a token from the middle of the request's own output
    (a fresh engine's run without them): a random model rarely writes a prompt's tokens, which
    `mixed_requests` stops at for SmolLM2."""
    free = overlap.run_steps(make_engine(loaded, async_scheduling="off", **config),
                             [{**r, "stop_token_ids": []} for r in reqs])  # fmt: skip
    return [
        {**r, "stop_token_ids": [free[r["request_id"]][0][len(free[r["request_id"]][0]) // 2]]}
        if r.get("stop_token_ids") else r
        for r in reqs
    ]  # fmt: skip


def test_two_ranks_overlapping_give_the_synchronous_tokens(tiny_llama, config, sync, tp_async, monkeypatch):
    mixed = overlap.mixed_requests(tiny_llama.config.vocab_size, ADAPTERS)
    reqs = _stopping_midway(tiny_llama, config, mixed)
    expected = overlap.run_steps(sync, reqs)
    assert sum(reason == "stop" for _, reason in expected.values()) >= 1, "no stop token hit"
    launches = overlap.count_launches(monkeypatch)
    assert tp_async.overlap.enabled
    assert overlap.run_steps(tp_async, reqs) == expected
    assert len(launches) > 10, "no step overlapped"


def test_two_ranks_overlapping_through_preemption_and_aborts(tiny_llama, sync, tp_async, monkeypatch):
    reqs = overlap.long_requests(tiny_llama.config.vocab_size, ADAPTERS)
    preempted = sync.scheduler.num_preemptions
    expected = overlap.run_steps(sync, reqs, overlap.ABORTS)
    assert sync.scheduler.num_preemptions > preempted, "the KV budget should force preemption"
    launches = overlap.count_launches(monkeypatch)
    preempted = tp_async.scheduler.num_preemptions
    got = overlap.run_steps(tp_async, reqs, overlap.ABORTS)
    overlap.assert_same_but_aborts(got, expected, overlap.ABORTS)
    assert tp_async.scheduler.num_preemptions > preempted and launches
