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
    QuantizedRows,
    fp8_linear,
    fp8_linear_reference,
    has_block_scaled_mm,
    quantize_column_groups,
    quantize_groups,
    quantize_rows,
    quantize_static,
    scaled_mm_applies,
)
from model_service.kernels.fused import rms_norm, silu_and_mul
from model_service.kernels.skinny_gemm import MAX_ROWS, skinny_applies, skinny_linear
from model_service.models import fp8_linear as fp8_linear_module
from model_service.models.fp8_linear import Fp8Linear
from model_service.models.layers import PackedLinear
from model_service.models.loader import LoadedModel, load_model
from tests.test_fp8 import FORMATS, MAX_NEW, PROMPTS, W8A8_GREEDY_AGREEMENT, Case, greedy_agreement
from tests.test_skinny_gemm import kernel_shaped_decode

WEIGHT_ONLY = ActivationQuant("none", 0)  # the few-row kernel's arithmetic: x is not quantized

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


@pytest.mark.parametrize("rows", [2, 300])
@pytest.mark.parametrize("k", [4096, 14336])
def test_the_group_quantization_kernel_is_the_reference_bit_for_bit(rows: int, k: int):
    """Per token and 128 columns (`fp8-g128`): one Triton launch against `quantize_groups` on the
    same CUDA input, the same e4m3 bytes and scales, the scales column-major."""
    torch.manual_seed(rows + k)
    x = (torch.randn(rows, k, device="cuda") * torch.logspace(-3, 3, k, device="cuda")).bfloat16()
    x[0] = 0
    q, scale = quantize_column_groups(x, 128)
    want_q, want_scale = quantize_groups(x, 128)
    assert scale.stride() == (1, rows) and torch.equal(scale, want_scale)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


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


@pytest.mark.skipif(
    not torch.cuda.is_available() or not has_block_scaled_mm(torch.device("cuda")),
    reason="needs cuBLASLt's 1x128 block scaling (sm90, CUDA 12.9+)",
)
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
@pytest.mark.parametrize(("k", "n"), [(4096, 6144), (14336, 4096), (256, 320)])
def test_block_scaled_mm_matches_the_reference_and_replays_in_a_graph(rows: int, k: int, n: int):
    """Scales per row and 128 columns (`--quantization fp8-g128`, block checkpoints in row form):
    `torch._scaled_mm` with 1x128 block scaling on both operands against the float32 reference
    on the same e4m3 operands (activations quantized per token and 128 columns by the same ops),
    then captured in a CUDA graph and replayed over new inputs bit for bit."""
    torch.manual_seed(rows + k + n)
    w = torch.randn(n, k, device="cuda") * k**-0.5 * torch.logspace(-2, 1, k, device="cuda")
    weight, scale = quantize_groups(w, 128)
    x = torch.randn(rows, k, device="cuda").bfloat16()
    bias = torch.randn(n, device="cuda").bfloat16()
    acts = ActivationQuant("dynamic", 128)
    assert scaled_mm_applies(x, weight, scale, acts)
    got = fp8_linear(x, weight, scale, 128, bias, acts)
    want = fp8_linear_reference(x.float(), weight, scale, 128, bias, acts)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1e-2)  # bfloat16 output rounding
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fp8_linear(x, weight, scale, 128, bias, acts)
    x.copy_(torch.randn(rows, k, device="cuda").bfloat16())
    graph.replay()
    torch.testing.assert_close(y, fp8_linear(x, weight, scale, 128, bias, acts), rtol=0, atol=0)


@pytest.mark.parametrize(
    "name", ["ct-channel-dynamic", "ct-tensor-static", "fp8-block", "ct-group", "ct-channel-w8a16"]
)
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


def fp8_weight(n: int, k: int, per_tensor: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [n, k] with contiguous rows, float32 scales [n, 1]): per channel, rows of magnitudes
    spread over three decades; or one per-tensor scale repeated down the rows, as the loader
    stores a checkpoint's."""
    w = torch.randn(n, k, device="cuda") * k**-0.5 * torch.logspace(-2, 1, n, device="cuda")[:, None]
    if not per_tensor:
        return quantize_groups(w, k)
    q, scale = quantize_groups(w.reshape(1, -1), n * k)
    return q.view(n, k), scale.expand(n, 1).contiguous()


@pytest.mark.parametrize("rows", [1, 5, MAX_ROWS])
@pytest.mark.parametrize(("k", "n"), [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (768, 320)])
@pytest.mark.parametrize(("per_tensor", "bias"), [(False, False), (True, True)])
def test_few_row_kernel_matches_the_weight_only_reference(
    rows: int, k: int, n: int, per_tensor: bool, bias: bool
):
    """W8A16 in Triton against `fp8_linear_reference` in float32 on the same e4m3 weight with
    activations not quantized (what the kernel computes whatever the scheme): only the summation
    order and the bfloat16 output differ, so the tolerance is bf16's, as for bf16 weights."""
    torch.manual_seed(rows + k + n)
    weight, scale = fp8_weight(n, k, per_tensor)
    x = torch.randn(rows, k, device="cuda").bfloat16()
    b = torch.randn(n, device="cuda").bfloat16() if bias else None
    assert skinny_applies(x, weight, scale)
    arrivals = torch.zeros(n // 64, dtype=torch.int32, device="cuda")
    got = skinny_linear(x, weight, b, arrivals, scale)
    want = fp8_linear_reference(x.float(), weight, scale, k, b, WEIGHT_ONLY)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1e-2)  # rounding of the output only
    assert int(arrivals.abs().sum()) == 0, "the last program of each column block resets its counter"
    assert torch.equal(skinny_linear(x, weight, b, arrivals, scale), got), "split-K sums in a fixed order"


@pytest.mark.parametrize("rows", [1, 5, MAX_ROWS])
@pytest.mark.parametrize(("k", "n"), [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)])
def test_few_row_kernels_scale_each_128_columns_with_their_own(rows: int, k: int, n: int):
    """A scale per row and 128 columns (`fp8-g128`), spread over three decades along K: the GEMV
    and the `tl.dot` kernel against the weight-only reference, bf16's tolerance, counters reset,
    the same bits twice; `Fp8Linear` takes them for these rows."""
    torch.manual_seed(rows + k + n)
    w = torch.randn(n, k, device="cuda") * k**-0.5 * torch.logspace(-2, 1, k, device="cuda")
    weight, scale = quantize_groups(w, 128)
    x = torch.randn(rows, k, device="cuda").bfloat16()
    assert skinny_applies(x, weight, scale)
    arrivals = torch.zeros(n // 32, dtype=torch.int32, device="cuda")
    got = skinny_linear(x, weight, None, arrivals, scale)
    want = fp8_linear_reference(x.float(), weight, scale, 128, None, WEIGHT_ONLY)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1e-2)
    assert int(arrivals.abs().sum()) == 0
    assert torch.equal(skinny_linear(x, weight, None, arrivals, scale), got)


def test_one_row_of_any_width_takes_the_gemv():
    """SmolLM2's shapes (K of 576 or 1,536, not whole GEMV K tiles of 1,024 / 2,048; at
    576 no tiling of the few-row kernel divides the weight either, so two rows do not apply): one
    row takes the GEMV (K masked), against the weight-only reference."""
    for k, n in ((576, 576), (1536, 576), (576, 3072)):
        torch.manual_seed(k + n)
        weight, scale = fp8_weight(n, k, False)
        x = torch.randn(1, k, device="cuda").bfloat16()
        assert skinny_applies(x, weight, scale)
        assert skinny_applies(torch.randn(2, k, device="cuda").bfloat16(), weight, scale) == (k != 576)
        got = skinny_linear(x, weight, None, torch.zeros(n // 64, dtype=torch.int32, device="cuda"), scale)
        want = fp8_linear_reference(x.float(), weight, scale, k, None, WEIGHT_ONLY)
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("rows", [1, 3])
def test_few_row_kernel_replays_in_a_cuda_graph_over_new_inputs(rows: int):
    """o's shape: the GEMV at one row, the `tl.dot` kernel's four K slices at three, with its
    counters reset inside the kernel: a graph replays both as they are."""
    weight, scale = fp8_weight(4096, 4096)
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    arrivals = torch.zeros(64, dtype=torch.int32, device="cuda")
    skinny_linear(x, weight, None, arrivals, scale)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = skinny_linear(x, weight, None, arrivals, scale)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(y, skinny_linear(x, weight, None, arrivals, scale), atol=0, rtol=0)
    assert int(arrivals.abs().sum()) == 0


def fp8_layer(k: int, n: int) -> Fp8Linear:
    """A bf16 CUDA projection quantized online (per channel, dynamic per-token activations)."""
    return Fp8Linear.quantized(PackedLinear(k, {"o_proj": n}, bias=True).to("cuda", torch.bfloat16))


def test_fp8_linear_takes_the_kernel_for_few_rows_and_scaled_mm_for_more():
    layer = fp8_layer(4096, 4096)
    acts = layer.activations()
    few = torch.randn(MAX_ROWS, 4096, device="cuda", dtype=torch.bfloat16)
    want = fp8_linear_reference(few.float(), layer.weight, layer.weight_scale, 4096, layer.bias, WEIGHT_ONLY)
    torch.testing.assert_close(layer(few).float(), want, atol=2e-2, rtol=1e-2)
    assert layer.arrivals is not None
    many = torch.randn(MAX_ROWS + 1, 4096, device="cuda", dtype=torch.bfloat16)
    assert not skinny_applies(many, layer.weight, layer.weight_scale)
    want = fp8_linear(many, layer.weight, layer.weight_scale, 4096, layer.bias, acts)  # _scaled_mm
    torch.testing.assert_close(layer(many), want, atol=0, rtol=0)


def test_a_capture_before_any_eager_call_keeps_scaled_mm():
    """As in bf16 (tests/test_skinny_gemm.py): counters are made by an eager call only."""
    layer = fp8_layer(4096, 4096)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    want = fp8_linear(x, layer.weight, layer.weight_scale, 4096, layer.bias, layer.activations())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = layer(x)
    graph.replay()
    assert layer.arrivals is None
    torch.testing.assert_close(y, want, atol=0, rtol=0)


def test_fp8_decode_through_the_kernel_gives_the_same_tokens_in_graphs_and_eager(monkeypatch):
    """A model whose four projections all take the kernel, quantized online, in bf16 on CUDA:
    greedy tokens from decode graphs and from eager steps agree, every projection made its
    counters; with the kernel turned off (`_scaled_mm`, W8A8), decoding still runs."""
    from bench.gpu import quantized

    cfg, reference, requests = kernel_shaped_decode()

    def run(**config: object) -> tuple[Engine, list[list[int]]]:
        loaded = quantized(LoadedModel("random", cfg, reference.to("cuda", torch.bfloat16).eval(), None))
        engine = Engine(
            EngineConfig(device="cuda", dtype="bfloat16", num_kv_blocks=64, **config), loaded=loaded
        )
        return engine, [o.token_ids for o in engine.generate(requests)]

    engine, graphs = run()
    projections = [m for m in engine.executor.module.modules() if isinstance(m, PackedLinear)]
    assert len(projections) == 4 * cfg.num_layers
    assert all(isinstance(m, Fp8Linear) and m.arrivals is not None for m in projections)
    _, eager = run(enforce_eager=True)
    assert graphs == eager
    monkeypatch.setattr(fp8_linear_module, "skinny_applies", lambda x, w, s: False)
    _, scaled_mm = run()
    assert [len(t) for t in scaled_mm] == [10, 10, 10]


def fused_case(rows: int, k: int, mode: str, scale_ub: float | None) -> tuple[torch.Tensor, ActivationQuant]:
    """bf16 rows from 1e-3 to 1e3 in scale, row 0 zeros (a graph's padding row), and the scheme
    ("groups": dynamic per token and 128 columns, `fp8-g128`'s; K must be whole groups)."""
    if mode == "groups" and k % 128:
        pytest.skip("column groups need K a multiple of 128")
    torch.manual_seed(rows + k)
    x = (torch.randn(rows, k, device="cuda") * torch.logspace(-3, 3, rows, device="cuda")[:, None]).bfloat16()
    x[0] = 0
    static = torch.tensor([0.0123], device="cuda")
    if mode == "groups":
        return x, ActivationQuant("dynamic", 128)
    return x, ActivationQuant(mode, k, static if mode == "static" else None, scale_ub)


def assert_quantized_as_unfused(got: QuantizedRows, plain_out: torch.Tensor, acts: ActivationQuant) -> None:
    """The fused kernel's rows are the plain kernel's, and their e4m3 bytes and scales are
    `quantize_rows`' of them (the unfused route), bit for bit."""
    assert isinstance(got, QuantizedRows) and torch.equal(got.x, plain_out)
    q, scale = quantize_rows(plain_out, acts)
    assert torch.equal(got.q.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(got.scale, scale)


MODES = [("dynamic", None), ("dynamic", 2.0), ("static", None), ("groups", None)]


@pytest.mark.parametrize("rows", [1, 17, 300])
@pytest.mark.parametrize("dim", [4096, 192])
@pytest.mark.parametrize(("mode", "scale_ub"), MODES)
def test_rms_norm_quantizes_as_the_unfused_route(rows: int, dim: int, mode: str, scale_ub: float | None):
    x, acts = fused_case(rows, dim, mode, scale_ub)
    residual = torch.randn_like(x)
    residual[0] = 0
    weight = (torch.rand(dim, device="cuda") + 0.5).bfloat16()
    for res in (None, residual):
        got, summed = rms_norm(x, weight, 1e-5, res, acts)
        plain_out, plain_summed = rms_norm(x, weight, 1e-5, res)
        assert torch.equal(summed, plain_summed)
        assert_quantized_as_unfused(got, plain_out, acts)


@pytest.mark.parametrize("rows", [1, 17, 300])
@pytest.mark.parametrize("inter", [14336, 320])
@pytest.mark.parametrize(("mode", "scale_ub"), MODES)
def test_silu_mul_quantizes_as_the_unfused_route(rows: int, inter: int, mode: str, scale_ub: float | None):
    gate_up, acts = fused_case(rows, 2 * inter, mode, scale_ub)
    if mode == "groups" and inter % 128:
        pytest.skip("column groups need K a multiple of 128")
    if mode != "groups":
        acts = ActivationQuant(acts.mode, inter, acts.scale, acts.scale_ub)
    assert_quantized_as_unfused(silu_and_mul(gate_up, acts), silu_and_mul(gate_up), acts)


def test_fused_quantization_gives_the_unfused_tokens_in_graphs_and_eager(monkeypatch):
    """An online-FP8 model decoding 20 sequences (> 16 rows: `_scaled_mm`, the producers
    quantizing for qkv, gate_up and down) in decode graphs and eagerly: the tokens of the unfused
    route (each GEMM quantizing its own input), which the same engine gives with the producers
    told not to."""
    from bench.gpu import quantized

    cfg, reference, _ = kernel_shaped_decode()
    requests = [
        {"prompt_token_ids": [(13 * i + j) % 500 + 3 for j in range(3 + i)], "max_tokens": 6,
         "temperature": 0, "ignore_eos": True}
        for i in range(20)
    ]  # fmt: skip
    loaded = quantized(LoadedModel("random", cfg, reference.to("cuda", torch.bfloat16).eval(), None))
    fused = 0
    forward = Fp8Linear.forward

    def counting(self: Fp8Linear, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        nonlocal fused
        fused += isinstance(x, QuantizedRows)
        return forward(self, x)

    def run(**config: object) -> list[list[int]]:
        engine = Engine(
            EngineConfig(device="cuda", dtype="bfloat16", num_kv_blocks=64, **config), loaded=loaded
        )
        return [o.token_ids for o in engine.generate(requests)]

    monkeypatch.setattr(Fp8Linear, "forward", counting)
    graphs, eager = run(), run(enforce_eager=True)
    assert fused > 0 and graphs == eager
    monkeypatch.setattr(Fp8Linear, "input_quant", lambda self, x: None)
    fused = 0
    assert run() == graphs and run(enforce_eager=True) == graphs
    assert fused == 0
