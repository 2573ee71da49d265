"""Programmatic dependent launch (kernels/pdl.py): off where it cannot run, and on a GPU a chain of
dependent kernels replayed in a CUDA graph gives the bits it gives without it."""

from __future__ import annotations

import pytest
import torch

from model_service.kernels import pdl
from model_service.kernels.fused import rms_norm, silu_and_mul
from model_service.kernels.skinny_gemm import skinny_linear
from tests.test_skinny_gemm import transposed_weight


def test_pdl_is_off_on_the_cpu_and_when_turned_off(monkeypatch):
    assert pdl.pdl_args(torch.device("cpu")) == {"PDL": 0}
    for flag in ("0", "yes", ""):  # off, and a value that is no mode
        monkeypatch.setenv("SPINDLE_PDL", flag)
        assert pdl.pdl_args(torch.device("cuda", 0)) == {"PDL": 0}
    monkeypatch.setenv("SPINDLE_PDL", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter has no dependent launches
    assert pdl.pdl_args(torch.device("cuda", 0)) == {"PDL": 0}


def _layer_chain(x: torch.Tensor, weights: list[torch.Tensor], norm: torch.Tensor, arrivals: torch.Tensor):
    """A decode layer's dependent launches: norm, gate_up, SiLU-mul, down, norm with the residual;
    each reads what the one before wrote."""
    h = x
    for gate_up, down in zip(weights[::2], weights[1::2], strict=True):
        normed, residual = rms_norm(h, norm, 1e-6)
        act = silu_and_mul(skinny_linear(normed, gate_up, None, arrivals))
        h, _ = rms_norm(skinny_linear(act, down, None, arrivals), norm, 1e-6, residual=residual)
    return h


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 7])
def test_a_graph_of_dependent_kernels_gives_the_same_bits_with_and_without_pdl(monkeypatch, rows):
    torch.manual_seed(0)
    hidden, inter, layers = 1024, 2816, 6
    shapes = [(2 * inter, hidden), (hidden, inter)] * layers
    weights = [transposed_weight(n, k, torch.bfloat16, "cuda") for n, k in shapes]
    norm = torch.rand(hidden, device="cuda", dtype=torch.bfloat16) + 0.5
    arrivals = torch.zeros(4096, dtype=torch.int32, device="cuda")
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    outputs = {}
    for flag in ("0", "1", "2"):  # off, dependents admitted at the top, after the main loops
        monkeypatch.setenv("SPINDLE_PDL", flag)
        static = x.clone()
        _layer_chain(static, weights, norm, arrivals)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _layer_chain(static, weights, norm, arrivals)
        results = []
        for scale in (1.0, -0.5, 2.0):  # new inputs each replay
            static.copy_(x * scale)
            graph.replay()
            results.append(out.clone())
        torch.cuda.synchronize()
        outputs[flag] = torch.stack(results)
    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert pdl.pdl_args(torch.device("cuda"))["PDL"] == (2 if hopper else 0)
    torch.testing.assert_close(outputs["1"], outputs["0"], rtol=0, atol=0)
    torch.testing.assert_close(outputs["2"], outputs["0"], rtol=0, atol=0)
