"""FP8 products on CUDA (issue 33) against the reference of `kernels/fp8_gemm.py`, and the FP8
engine with CUDA graphs and adapters. Apart from tests/test_fp8.py and needing no fixture of
tests/conftest.py: the GPU suite runs with `pytest --noconftest -m gpu`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model_service.engine.config import EngineConfig
from model_service.engine.engine import Engine
from model_service.kernels.fp8_gemm import (
    ActivationQuant,
    fp8_linear,
    fp8_linear_reference,
    quantize_groups,
    quantize_rows,
    quantize_static,
    scaled_mm_applies,
)
from model_service.models.loader import load_model
from tests.test_fp8 import FORMATS, MAX_NEW, PROMPTS, W8A8_GREEDY_AGREEMENT, Case, greedy_agreement

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("rows", [2, 7, 300])
@pytest.mark.parametrize("k", [4096, 14336, 192])
@pytest.mark.parametrize(("mode", "scale_ub"), [("dynamic", None), ("dynamic", 2.0), ("static", None)])
def test_the_quantization_kernel_is_the_reference_bit_for_bit(
    rows: int, k: int, mode: str, scale_ub: float | None
):
    """One Triton launch against `quantize_groups` / `quantize_static` (torch ops, the reference)
    on the same CUDA input: the same e4m3 bytes and float32 scales; row 0 is a CUDA graph's
    all-zero padding row, rows grow from 1e-3 to 1e3 in scale (some capped by `scale_ub`)."""
    torch.manual_seed(rows + k)
    x = (torch.randn(rows, k, device="cuda") * torch.logspace(-3, 3, rows, device="cuda")[:, None]).bfloat16()
    x[0] = 0
    static = torch.tensor([0.0123], device="cuda")
    acts = ActivationQuant(mode, k, static if mode == "static" else None, scale_ub)
    q, scale = quantize_rows(x, acts)
    if mode == "dynamic":
        want_q, want_scale = quantize_groups(x, k, scale_ub)
    else:
        want_q, want_scale = quantize_static(x, static), static.expand(rows, 1)
    assert q.dtype == want_q.dtype and scale.shape == (rows, 1)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scale, want_scale)


@pytest.mark.parametrize("rows", [1, 5, 16, 64, 300])
@pytest.mark.parametrize(("k", "n"), [(4096, 6144), (4096, 4096), (14336, 4096), (192, 320)])
@pytest.mark.parametrize("mode", ["dynamic", "static"])
def test_scaled_mm_matches_the_reference(rows: int, k: int, n: int, mode: str):
    """`torch._scaled_mm` (row-wise scales) against the float32 reference on the same e4m3
    operands: the activations are quantized by the same ops, so only the GEMM's summation order
    and its bfloat16 output differ."""
    torch.manual_seed(rows + k + n)
    weight, scale = quantize_groups(torch.randn(n, k, device="cuda") * k**-0.5, k)
    x = torch.randn(rows, k, device="cuda").bfloat16()
    bias = torch.randn(n, device="cuda").bfloat16()
    static = torch.tensor([x.float().abs().max().item() / 300], device="cuda")
    acts = ActivationQuant(mode, k, static if mode == "static" else None)
    assert scaled_mm_applies(x, weight, scale, acts)
    got = fp8_linear(x, weight, scale, k, bias, acts)
    want = fp8_linear_reference(x.float(), weight, scale, k, bias, acts)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1e-2)  # bfloat16 output rounding


def test_scaled_mm_replays_in_a_cuda_graph_over_new_inputs():
    weight, scale = quantize_groups(torch.randn(4096, 4096, device="cuda") * 0.02, 4096)
    acts = ActivationQuant("dynamic", 4096)
    x = torch.randn(8, 4096, device="cuda").bfloat16()
    fp8_linear(x, weight, scale, 4096, None, acts)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fp8_linear(x, weight, scale, 4096, None, acts)
    for seed in range(3):
        torch.manual_seed(seed)
        x.copy_(torch.randn(8, 4096, device="cuda").bfloat16())
        graph.replay()
        torch.testing.assert_close(y, fp8_linear(x, weight, scale, 4096, None, acts), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["ct-channel-dynamic", "ct-tensor-static", "fp8-block", "ct-channel-w8a16"])
def test_cuda_fp8_engine_with_graphs_and_adapters(name: str, tmp_path: Path):
    """On CUDA in bfloat16 (`_scaled_mm` for the per-channel and static schemes, the reference for
    block-wise and weight-only): decode CUDA graphs give the eager engine's tokens, with and without
    adapters, and the tokens mostly agree with HF's float32 oracle (as on CPU, `W8A8_GREEDY_AGREEMENT`)."""
    from tests.test_lora import ALL, make_adapter

    case = Case(FORMATS[name], tmp_path)
    oracle = case.hf_w8a8 or case.hf
    adapter = make_adapter(oracle, tmp_path / "all", seed=3, scale=0.3, r=8, lora_alpha=8, target_modules=ALL)
    loaded = load_model(str(case.fp8_path), torch.bfloat16, torch.device("cuda"))
    request = {"max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    reqs = [{"prompt_token_ids": p, "adapter": a, **request} for p in PROMPTS for a in (None, "all")]
    runs = {}
    for eager in (True, False):
        cfg = EngineConfig(
            model=loaded.name, device="cuda", dtype="bfloat16", enforce_eager=eager, max_loras=1,
            lora_modules={"all": str(adapter)}, num_kv_blocks=256,
        )  # fmt: skip
        runs[eager] = [o.token_ids for o in Engine(cfg, loaded=loaded).generate(reqs)]
    assert runs[False] == runs[True]
    base = runs[True][::2]
    assert greedy_agreement(oracle, PROMPTS, base) >= W8A8_GREEDY_AGREEMENT
