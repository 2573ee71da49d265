"""Tensor parallelism on two GPUs: NCCL, CUDA graphs on every rank, LoRA kernels, async scheduling
on (the default) and off; greedy and seeded sampled tokens equal one synchronous GPU's (float32).
Skipped without two GPUs; run it with `pytest -m gpu`."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_service.models.loader import LoadedModel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]


def tiny_cuda_model() -> LoadedModel:
    """A seeded random model on the current CUDA device: every rank builds the same one (a GPU
    test's `source`; wide weights, so greedy ties are vanishingly rare)."""
    from tests.random_models import random_llama

    cfg, module = random_llama(num_heads=8, num_kv_heads=4)
    return LoadedModel("tiny-random", cfg, module.to("cuda").eval(), None)


@pytest.mark.parametrize("async_scheduling, piecewise", [("on", False), ("off", False), ("on", True)])
def test_two_gpus_with_nccl_graphs_and_adapters_equal_one(tmp_path, monkeypatch, async_scheduling, piecewise):
    """With `piecewise`, prefill steps without LoRA rows (the second wave: base-model requests
    alone) replay graphs split at attention, each rank's pieces with the all-reduces of its
    projections recorded in them."""
    from bench.lora import write_adapter
    from model_service.engine.config import EngineConfig
    from model_service.engine.engine import Engine
    from model_service.engine.piecewise_graphs import PiecewiseGraphs
    from tests.overlap_helpers import count_launches

    replayed: list[int] = []  # rank 0's: its executor runs in this process
    run = PiecewiseGraphs.run
    monkeypatch.setattr(PiecewiseGraphs, "run", lambda self, batch: replayed.append(1) or run(self, batch))

    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = tiny_cuda_model().config
    adapters = {f"a{i}": str(write_adapter(tmp_path / f"a{i}", cfg, rank=8, seed=i)) for i in range(2)}
    for path in adapters.values():  # large enough deltas that a missing one changes tokens
        weights = f"{path}/adapter_model.safetensors"
        save_file({k: v * 30 for k, v in load_file(weights).items()}, weights)
    requests = [
        {"prompt_token_ids": [(7 * i + j) % 500 + 3 for j in range(5 + i)], "max_tokens": 12,
         "temperature": 0, "ignore_eos": True, "adapter": [None, "a0", "a1"][i % 3]}
        for i in range(6)
    ]  # fmt: skip
    requests += [{**r, "temperature": 0.8, "top_p": 0.9, "seed": 7 + i} for i, r in enumerate(requests[:3])]
    # A fixed K/V budget: by default the one-GPU engine would take most of GPU 0 for its cache.
    config = {"device": "cuda", "dtype": "float32", "max_loras": 2, "lora_modules": adapters,
              "kv_cache_memory_bytes": 64 << 20}  # fmt: skip
    one = Engine(EngineConfig(**config, async_scheduling="off"), loaded=tiny_cuda_model())
    expected = [o.token_ids for o in one.generate(requests)]
    loaded = dataclasses.replace(tiny_cuda_model(), source=tiny_cuda_model)
    tp_config = EngineConfig(
        **config, tensor_parallel_size=2, async_scheduling=async_scheduling, piecewise_graphs=piecewise
    )
    tp = Engine(tp_config, loaded=loaded)
    tp.warm_up()
    launches = count_launches(monkeypatch)
    try:
        assert [o.token_ids for o in tp.generate(requests)] == expected
        base = [i for i, r in enumerate(requests) if r["adapter"] is None]
        assert [o.token_ids for o in tp.generate([requests[i] for i in base])] == [expected[i] for i in base]
        assert bool(replayed) == piecewise
        assert tp.overlap.enabled == bool(launches) == (async_scheduling == "on")
        # No reference to the graphs may outlive this check: teardown must free them before it
        # destroys the NCCL group, which hangs under a live graph that recorded its collectives.
        assert tp.executor.rank.executor.graphs.graphs, "decode steps did not replay CUDA graphs"
    finally:
        tp.executor.teardown()


def test_two_gpus_moe_experts_split_both_ways_equal_one(tmp_path):
    """A tiny Qwen3-MoE (a dense layer among sparse ones): float32 (the expert reference, eager)
    with the experts tensor-parallel and expert-parallel gives one GPU's tokens; bf16 expert-
    parallel decode replayed from CUDA graphs (grouped experts over each rank's own run of
    experts, the all-reduce captured) gives the eager bf16 steps' tokens."""
    from model_service.engine.config import EngineConfig
    from model_service.engine.engine import Engine
    from tests.test_moe import VARIANTS
    from tests.test_tiny_models import PROMPTS, request, save_checkpoint

    torch.backends.cuda.matmul.allow_tf32 = False
    path = str(save_checkpoint(VARIANTS["qwen3-moe"], tmp_path))
    base = {"model": path, "device": "cuda", "max_loras": 0, "kv_cache_memory_bytes": 64 << 20}
    reqs = [request(ids) for ids in PROMPTS]

    def tokens(one_at_a_time: bool = False, **config) -> list[list[int]]:
        engine = Engine(EngineConfig(**base, **config))
        try:
            if config.get("dtype") == "bfloat16" and not config.get("enforce_eager"):
                assert engine.executor.rank.executor.graphs is not None
            if one_at_a_time:  # the graph's batch is then unpadded: every GEMM the same shape
                return [engine.generate([r])[0].token_ids for r in reqs]
            return [o.token_ids for o in engine.generate(reqs)]
        finally:
            if config.get("tensor_parallel_size"):
                engine.executor.teardown()

    expected = tokens(dtype="float32")
    for ep in (False, True):
        assert tokens(dtype="float32", tensor_parallel_size=2, enable_expert_parallel=ep) == expected
    bf16 = {"dtype": "bfloat16", "tensor_parallel_size": 2, "enable_expert_parallel": True}
    assert tokens(True, **bf16) == tokens(True, **bf16, enforce_eager=True)
