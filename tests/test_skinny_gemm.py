"""The few-row product kernel (decode steps of small batches) against F.linear, its reference."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from model_service.engine.config import EngineConfig
from model_service.engine.engine import Engine
from model_service.kernels.skinny_gemm import (
    MAX_ROWS,
    SkinnyConfig,
    skinny_applies,
    skinny_config,
    skinny_linear,
)
from model_service.models import layers
from model_service.models.layers import PackedLinear, store_weights_transposed
from model_service.models.llama import DecoderModel
from model_service.models.loader import LoadedModel
from tests.random_models import random_llama

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def transposed_weight(n: int, k: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """[n, k] stored as its contiguous transpose, as the engine keeps linear weights."""
    return (torch.randn(n, k, device=device) * k**-0.5).to(dtype).t().contiguous().t()


def test_wide_outputs_take_one_program_per_column_block_and_narrow_ones_split_k():
    assert skinny_config(4096, 6144).split_k == 1  # 8B qkv
    assert skinny_config(4096, 28672).block_n == 256  # 8B gate_up
    assert skinny_config(4096, 4096).split_k == 4  # 8B o
    assert skinny_config(14336, 4096).split_k == 4  # 8B down
    assert skinny_config(4096, 4096).num_stages == 4  # 8B o: 256 programs, two waves
    assert skinny_config(2048, 12288) == SkinnyConfig(128, 128, 1, 4)  # Qwen3-Next in_proj_qkvz: short K
    assert skinny_config(4096, 2048) == SkinnyConfig(64, 64, 4, 6)  # Qwen3-Next o: under one wave
    assert skinny_config(576, 576) is None  # SmolLM2's o: K is no multiple of 4 x 64
    assert skinny_config(4096, 4100) is None
    assert skinny_config(4096, 6144).num_stages == 6  # an H200's 227 KiB a program: the measured tiling
    assert skinny_config(4096, 6144, smem=101_376).num_stages == 4  # 99 KiB (sm86 / sm89): fewer stages
    assert skinny_config(4096, 6144, smem=32_768) is None  # not two stages


def test_e4m3_weights_take_longer_k_tiles_and_narrower_column_blocks():
    """The tilings an H200 sweep chose for one-byte weights read along K (8B shapes)."""
    fp8 = functools.partial(skinny_config, weight_bytes=1)
    assert fp8(4096, 28672) == SkinnyConfig(32, 256, 1, 3)  # gate_up: 896 column blocks, no split
    assert fp8(4096, 6144) == SkinnyConfig(64, 128, 4, 3)  # qkv
    assert fp8(4096, 4096) == SkinnyConfig(64, 128, 4, 3)  # o
    assert fp8(14336, 4096) == SkinnyConfig(64, 128, 4, 3)  # down
    assert fp8(768, 320) == SkinnyConfig(64, 128, 2, 3)  # a K that four splits do not divide: two
    assert fp8(576, 576) is None  # SmolLM2: K is no multiple of 128


def test_the_kernel_is_only_chosen_where_it_applies():
    w = transposed_weight(4096, 4096, torch.bfloat16, "cpu")
    assert not skinny_applies(torch.randn(1, 4096, dtype=torch.bfloat16), w)  # CPU: the reference
    layer = PackedLinear(64, {"o_proj": 64}, bias=True)
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    assert layer.arrivals is None


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 5, MAX_ROWS])
@pytest.mark.parametrize(
    "k, n",
    [(4096, 4096), (14336, 4096), (4096, 6144), (1024, 24576), (1536, 576), (2048, 12288), (4096, 2048)],
)
@pytest.mark.parametrize("dtype, bias", [(torch.bfloat16, False), (torch.float16, True)])
def test_triton_skinny_linear_matches_f_linear(rows, k, n, dtype, bias):
    torch.manual_seed(rows + k + n)
    w = transposed_weight(n, k, dtype, "cuda")
    x = torch.randn(rows, k, device="cuda").to(dtype)
    b = torch.randn(n, device="cuda").to(dtype) if bias else None
    assert skinny_applies(x, w)
    arrivals = torch.zeros(n // 64, dtype=torch.int32, device="cuda")
    got = skinny_linear(x, w, b, arrivals)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=1e-2)  # rounding of the output only
    assert int(arrivals.abs().sum()) == 0, "the last program of each column block resets its counter"
    assert torch.equal(skinny_linear(x, w, b, arrivals), got), "split-K sums in a fixed order"


@cuda
@pytest.mark.gpu
def test_skinny_linear_replays_in_a_cuda_graph_over_new_inputs():
    """The counters are reset inside the kernel, so a graph replays it with nothing re-prepared."""
    w = transposed_weight(4096, 4096, torch.bfloat16, "cuda")
    x = torch.randn(2, 4096, device="cuda", dtype=torch.bfloat16)
    arrivals = torch.zeros(64, dtype=torch.int32, device="cuda")
    skinny_linear(x, w, None, arrivals)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = skinny_linear(x, w, None, arrivals)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(y, skinny_linear(x, w, None, arrivals), atol=0, rtol=0)
    assert int(arrivals.abs().sum()) == 0


@cuda
@pytest.mark.gpu
def test_packed_linear_takes_the_kernel_for_few_rows_and_cublas_for_more():
    layer = PackedLinear(4096, {"o_proj": 4096}, bias=False).to("cuda", torch.bfloat16)
    store_weights_transposed(layer)
    few = torch.randn(MAX_ROWS, 4096, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(layer(few), F.linear(few, layer.weight), atol=2e-2, rtol=1e-2)
    assert layer.arrivals is not None
    many = torch.randn(MAX_ROWS + 1, 4096, device="cuda", dtype=torch.bfloat16)
    assert not skinny_applies(many, layer.weight)
    torch.testing.assert_close(layer(many), F.linear(many, layer.weight), atol=0, rtol=0)


@cuda
@pytest.mark.gpu
def test_a_capture_before_any_eager_call_keeps_cublas():
    """The counters are made by an eager call; a graph captured first must not allocate them
    inside the capture (they would hold garbage until a replay zeroed them)."""
    layer = PackedLinear(4096, {"o_proj": 4096}, bias=False).to("cuda", torch.bfloat16)
    store_weights_transposed(layer)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    F.linear(x, layer.weight)  # cuBLAS's own warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = layer(x)
    graph.replay()
    assert layer.arrivals is None
    torch.testing.assert_close(y, F.linear(x, layer.weight), atol=0, rtol=0)


def kernel_shaped_decode() -> tuple[Any, torch.nn.Module, list[dict]]:
    """A random model whose four projections all take the few-row kernel (K a multiple of 256),
    and three greedy requests of 10 tokens decoding through it (tests/test_fp8_gpu.py too)."""
    cfg, reference = random_llama(hidden_size=256, intermediate_size=512, num_layers=2, head_dim=64)
    requests = [
        {"prompt_token_ids": [(11 * i + j) % 500 + 3 for j in range(5 + 7 * i)], "max_tokens": 10,
         "temperature": 0, "ignore_eos": True}
        for i in range(3)
    ]  # fmt: skip
    return cfg, reference, requests


@cuda
@pytest.mark.gpu
def test_bf16_decode_through_the_kernel_gives_the_tokens_of_cublas_and_the_cpu(monkeypatch):
    """A model whose four projections all take the kernel, in bf16 on CUDA: greedy tokens from
    decode graphs and from eager steps are the same (one kernel, one order of sums), and their
    first tokens, like those with the kernel turned off (cuBLAS), are the CPU float32 engine's.
    Later tokens of the kernel and of cuBLAS may part: bf16 sums in another order round
    differently, and a random model's near-ties flip (seen on an H200 at the 6th token)."""
    cfg, reference, requests = kernel_shaped_decode()

    def run(device: str, dtype: torch.dtype, **config: object) -> tuple[Engine, list[list[int]]]:
        model = DecoderModel(cfg)
        model.load_state_dict(reference.state_dict())
        loaded = LoadedModel("random", cfg, model.to(device, dtype).eval(), None)
        name = str(dtype).removeprefix("torch.")
        engine = Engine(EngineConfig(device=device, dtype=name, num_kv_blocks=64, **config), loaded=loaded)
        return engine, [o.token_ids for o in engine.generate(requests)]

    _, cpu = run("cpu", torch.float32)
    engine, graphs = run("cuda", torch.bfloat16)
    projections = [m for m in engine.executor.module.modules() if isinstance(m, PackedLinear)]
    assert len(projections) == 4 * cfg.num_layers and all(m.arrivals is not None for m in projections)
    _, eager = run("cuda", torch.bfloat16, enforce_eager=True)
    monkeypatch.setattr(layers, "skinny_applies", lambda x, w: False)
    _, cublas = run("cuda", torch.bfloat16)
    assert graphs == eager
    assert [t[:4] for t in graphs] == [t[:4] for t in cublas] == [t[:4] for t in cpu]
