"""Tensor parallelism on the CPU: the same code as on GPUs, over gloo, two processes.

The oracle is the single-process engine over the same weights (itself checked against HF and
PEFT in test_engine.py and test_lora.py): greedy tokens identical in float32, logits within
float32 summation-order noise. SmolLM2's 3 KV heads split 2 + 1 over two ranks, so the uneven
partition is what runs here. The last test kills rank 1 under a live pod.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import time
import types
import typing

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from safetensors.torch import load_file, save_file

from model_service.distributed.link import CommandFailedError
from model_service.distributed.sharding import Partition, runs
from model_service.engine.batch_builder import StepItem
from model_service.errors import ModelLoadError
from model_service.models.loader import LoadedModel
from spindle.v1 import generation_pb2_grpc
from tests.conftest import make_engine, new_sequence, prefill_logits
from tests.service_helpers import token_request


@pytest.fixture(scope="module")
def reference(smollm2, tp_adapters):
    return make_engine(smollm2, max_loras=2, lora_modules=tp_adapters)


@pytest.fixture(scope="module")
def tp(tp_weights, tp_adapters):
    engine = make_engine(tp_weights, max_loras=2, lora_modules=tp_adapters, tensor_parallel_size=2)
    yield engine
    engine.executor.teardown()


def test_partition_splits_kv_groups_unevenly_and_refuses_more_ranks_than_kv_heads(smollm2):
    cfg = smollm2.config  # 9 query heads, 3 KV heads, 1536 intermediate, 49152 vocab
    parts = [Partition.of(cfg, r, 2) for r in range(2)]
    assert [p.kv_heads for p in parts] == [range(0, 2), range(2, 3)]
    assert [p.q_heads for p in parts] == [range(0, 6), range(6, 9)]
    assert [p.inter for p in parts] == [range(0, 768), range(768, 1536)]
    assert [p.vocab for p in parts] == [range(0, 24576), range(24576, 49152)]
    assert runs(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    with pytest.raises(ModelLoadError, match="KV heads"):
        Partition.of(cfg, 0, 4)


@pytest.fixture(scope="module")
def biased(tmp_path_factory) -> LoadedModel:
    """A tiny Llama with every bias (column-parallel q/k/v and gate/up, row-parallel o and down:
    added once, after the all-reduce), 3 KV heads (2 + 1), an odd intermediate size (50 + 49)
    and an odd vocabulary (161 + 160, the last run zero-padded)."""
    from model_service.models.loader import load_model
    from tests.conftest import make_tiny_checkpoint

    path = make_tiny_checkpoint(
        "llama", tmp_path_factory.mktemp("tp_biased"), seed=5, vocab_size=321, hidden_size=96,
        intermediate_size=99, num_attention_heads=6, num_key_value_heads=3,
        attention_bias=True, mlp_bias=True,
    )  # fmt: skip
    weights = path / "model.safetensors"
    tensors = load_file(str(weights))
    g = torch.Generator().manual_seed(5)  # HF initializes biases to zero: make them count
    save_file({k: torch.randn(v.shape, generator=g) if k.endswith("bias") else v for k, v in tensors.items()},
              str(weights))  # fmt: skip
    assert sum(k.endswith("bias") for k in tensors) == 7 * 2  # q, k, v, o, gate, up, down; 2 layers
    return load_model(str(path), torch.float32, torch.device("cpu"))


def test_biases_and_uneven_splits_then_a_killed_rank_turns_the_pod_not_serving(biased):
    """One engine for both: a worker process costs seconds to start. It runs before the module's
    SmolLM2 engine starts (one tensor-parallel engine per process)."""
    requests = [
        {"prompt_token_ids": [(5 * i + j) % 300 + 3 for j in range(4 + i)], "max_tokens": 8,
         "temperature": 0, "ignore_eos": True}
        for i in range(3)
    ]  # fmt: skip
    expected = [o.token_ids for o in make_engine(biased).generate(requests)]
    engine = make_engine(biased, tensor_parallel_size=2)
    try:
        assert [o.token_ids for o in engine.generate(requests)] == expected
        asyncio.run(_kill_rank_scenario(engine))
    finally:
        engine.executor.teardown()


def test_greedy_tokens_equal_one_process_with_and_without_adapters(smollm2, reference, tp):
    prompts = [
        smollm2.tokenizer.apply_chat_template([{"role": "user", "content": q}])
        for q in ("What is the capital of France?", "Write one word about rain.")
    ]
    requests = [
        {"prompt_token_ids": ids, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "adapter": a}
        for ids in prompts
        for a in (None, "pirate", "all")
    ]
    expected = [o.token_ids for o in reference.generate(requests)]
    got = [o.token_ids for o in tp.generate(requests)]  # one mixed batch: base and both adapters
    assert got == expected
    for i in range(0, len(expected), 3):  # else a dropped delta could not be told from a correct one
        assert expected[i] != expected[i + 1] and expected[i] != expected[i + 2]


def test_both_executors_offer_every_member_of_the_executor_protocol(reference, tp):
    """`ModelExecutor` and `TensorParallelExecutor` both implement `Executor`: every method with
    the protocol's parameters, every attribute of its type. Both engines run steps through them
    (the test above: the same greedy tokens)."""
    from model_service.distributed.executor import TensorParallelExecutor
    from model_service.engine.executor import ModelExecutor
    from model_service.engine.executors import Executor

    hints = typing.get_type_hints(Executor)
    methods = {n for n, v in vars(Executor).items() if callable(v) and not n.startswith("_")}
    methods |= {"copy_blocks", "save_blocks", "load_blocks", "copy_state", "save_state", "load_state"}
    methods |= {"load_slot", "clear_slot", "move_slot"}  # KVMover's and SlotWriter's
    assert {"execute", "capture_graphs", "on_lost", "teardown"} <= methods
    for engine, cls in ((reference, ModelExecutor), (tp, TensorParallelExecutor)):
        assert type(engine.executor) is cls
        for name in methods:
            want = inspect.signature(getattr(Executor, name)).parameters
            got = inspect.signature(getattr(cls, name)).parameters
            assert list(got) == list(want), (cls.__name__, name)
            assert [p.kind for p in got.values()] == [p.kind for p in want.values()], (cls.__name__, name)
        for name, kind in hints.items():
            origin = typing.get_origin(kind)  # list[int] -> list; an `X | None` checks as itself
            expected = kind if origin is None or origin is types.UnionType else origin
            assert isinstance(getattr(engine.executor, name), expected), (cls.__name__, name)


def test_logits_and_swapped_kv_match_one_process(reference, tp):
    ids = [1, 504, 3575, 282, 4649, 314, 7042, 30, 2, 17, 99, 5]
    expected = prefill_logits(reference, ids)
    torch.testing.assert_close(prefill_logits(tp, ids, chunk=5), expected, atol=2e-4, rtol=0)
    pairs = [(engine, new_sequence(engine, len(ids))) for engine in (reference, tp)]
    saved = []
    for engine, state in pairs:
        engine.executor.execute(engine.builder.build([StepItem(state, ids, 1)]))
        saved.append(engine.executor.save_blocks(state.block_table, len(ids)))
    torch.testing.assert_close(saved[1], saved[0], atol=1e-4, rtol=0)  # gathered heads in one layout
    other = new_sequence(tp, len(ids))  # swap in elsewhere: every rank writes its own heads back
    tp.executor.load_blocks(saved[1], other.block_table)
    assert torch.equal(tp.executor.save_blocks(other.block_table, len(ids)), saved[1])
    for engine, state in [*pairs, (tp, other)]:
        engine.cache.free(state)


def test_a_command_that_fails_on_every_rank_is_an_error_and_the_workers_stay_up(reference, tp):
    state = new_sequence(tp, 4)
    wrong = torch.zeros(1, 2, 3, 4, 5)
    with pytest.raises(CommandFailedError, match="rank 1"):
        tp.executor.load_blocks(wrong, state.block_table)
    tp.cache.free(state)
    request = {"prompt_token_ids": [5, 6, 7, 8], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    assert tp.generate([request])[0].token_ids == reference.generate([request])[0].token_ids


async def _kill_rank_scenario(engine) -> None:
    from model_service.pod.server import start
    from model_service.pod.state import ModelPod

    pod = ModelPod("smollm2", drain_timeout=1.0)
    servers = await start(pod, "127.0.0.1", 0, 0)
    await pod.load(lambda: engine)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{servers.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        serving = health_pb2.HealthCheckResponse.SERVING
        assert (await health.Check(health_pb2.HealthCheckRequest())).status == serving
        generation = generation_pb2_grpc.GenerationStub(channel)
        stream = generation.Generate(token_request([5, 6, 7], 4000, temperature=0.0))
        await stream.read()  # the first chunk: the request is running on both ranks
        os.kill(engine.executor.workers.processes[0].pid, signal.SIGKILL)
        killed = time.monotonic()
        while (await health.Check(health_pb2.HealthCheckRequest())).status == serving:
            assert time.monotonic() - killed < 5.0, "still SERVING 5 s after a rank died"
            await asyncio.sleep(0.02)
        with pytest.raises(grpc.aio.AioRpcError) as running:
            while await stream.read() is not grpc.aio.EOF:
                pass
        assert running.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.aio.AioRpcError) as new:
            await generation.Generate(token_request([5, 6], 2)).read()
        assert new.value.code() == grpc.StatusCode.UNAVAILABLE
    assert pod.exit_requested.is_set() and pod.exit_code == 1
    await servers.stop(None)
    pod.close()
