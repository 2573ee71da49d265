"""Tensor parallelism on two GPUs: NCCL, CUDA graphs on every rank, LoRA kernels; greedy tokens
equal one GPU's (float32). Skipped without two GPUs; run it with `pytest -m gpu`."""

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
    from model_service.models.config import ModelConfig
    from model_service.models.llama import DecoderModel

    cfg = ModelConfig(
        family="llama", vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=3,
        num_heads=8, num_kv_heads=4, head_dim=32, rms_norm_eps=1e-5, max_position_embeddings=1024,
    )  # fmt: skip
    torch.manual_seed(0)
    module = DecoderModel(cfg)
    for p in module.parameters():
        torch.nn.init.normal_(p, 0, 0.2)
    return LoadedModel("tiny-random", cfg, module.to("cuda").eval(), None)


def test_two_gpus_with_nccl_graphs_and_adapters_equal_one(tmp_path):
    from bench.lora import write_adapter
    from model_service.engine.config import EngineConfig
    from model_service.engine.engine import Engine

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
    # A fixed K/V budget: by default the one-GPU engine would take most of GPU 0 for its cache.
    config = {"device": "cuda", "dtype": "float32", "max_loras": 2, "lora_modules": adapters,
              "kv_cache_memory_bytes": 64 << 20}  # fmt: skip
    one = Engine(EngineConfig(**config), loaded=tiny_cuda_model())
    expected = [o.token_ids for o in one.generate(requests)]
    loaded = dataclasses.replace(tiny_cuda_model(), source=tiny_cuda_model)
    tp = Engine(EngineConfig(**config, tensor_parallel_size=2), loaded=loaded)
    try:
        assert [o.token_ids for o in tp.generate(requests)] == expected
        graphs = tp.executor.rank.executor.graphs
        assert graphs is not None and graphs.graphs, "decode steps did not replay CUDA graphs"
    finally:
        tp.executor.teardown()
