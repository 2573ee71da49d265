"""Activation quantization fused into the kernels that produce the activations (issue 33), and
the one-row e4m3 GEMV's split of K, on the CPU.

An FP8 projection on `_scaled_mm` wants its input as e4m3 rows and per-row scales. RMSNorm (with
or without the residual add) and SiLU-mul make them in their own launch when their consumer asks
(`input_quant`), as `QuantizedRows`; the unfused path (the bf16 output, then `quantize_rows`)
is the reference, and they must give its bytes and scales exactly, or greedy tokens would move.

Under Triton's interpreter (`TRITON_INTERPRET=1`, triton importable) the kernels run on the CPU
in float32 (the interpreter's bf16 casts truncate) with torch's round-to-nearest-even e4m3 cast
patched into the interpreter (its own rounds half up without a carry: 124 -> 64): the fused
kernels against the unfused kernel run on their own output, bit for bit, and against the torch
reference to a last-bit tolerance (the CPU divides by 448 where CUDA multiplies by 1 / 448).
Without the interpreter, the model-level test runs everywhere: with `_scaled_mm` forced on (the
CPU runs it too) the fused route gives the unfused route's logits exactly. The CUDA checks (bf16,
bit for bit) are in tests/test_fp8_gpu.py.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import torch

from model_service.kernels import fp8_gemm
from model_service.kernels import skinny_gemm as skinny_module
from model_service.kernels.fp8_gemm import (
    ActivationQuant,
    QuantizedRows,
    dequantize_groups,
    quantize_groups,
    quantize_rows,
)
from model_service.kernels.fused import rms_norm, silu_and_mul
from model_service.kernels.paged_attention import triton
from model_service.models import fp8_linear as fp8_linear_module
from model_service.models.fp8_linear import Fp8Linear
from model_service.models.loader import LoadedModel
from tests.conftest import make_engine

interpreter = pytest.mark.skipif(
    triton is None or os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter"
)
SCHEMES = {
    "dynamic": lambda k: ActivationQuant("dynamic", k),
    "capped": lambda k: ActivationQuant("dynamic", k, scale_ub=1.5),
    "static": lambda k: ActivationQuant("static", k, torch.tensor([0.0123])),
}


@pytest.fixture
def torch_e4m3_cast(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter's float32 -> e4m3 conversion done by torch (round to nearest even)."""
    import triton.language as tl
    from triton.runtime import interpreter as triton_interpreter

    convert = triton_interpreter._convert_float

    def torch_cast(data: np.ndarray, src: Any, dst: Any, rounding: Any) -> np.ndarray:
        if not (src == tl.float32 and dst == tl.float8e4nv):
            return convert(data, src, dst, rounding)
        values = torch.from_numpy(np.ascontiguousarray(data).view(np.float32).copy())
        return values.to(fp8_gemm.E4M3).view(torch.uint8).numpy().reshape(data.shape)

    monkeypatch.setattr(triton_interpreter, "_convert_float", torch_cast)


def rows_of_every_scale(rows: int, k: int, seed: int) -> torch.Tensor:
    """float32 rows from 1e-2 to 1e2 in magnitude; row 0 all zeros (a CUDA graph's padding row)."""
    torch.manual_seed(seed)
    x = torch.randn(rows, k) * torch.logspace(-2, 2, rows)[:, None]
    x[0] = 0
    return x


def assert_as_unfused(got: QuantizedRows, acts: ActivationQuant, reference: torch.Tensor) -> None:
    """`got` holds the unfused kernel's quantization of its own rows, bit for bit; its rows are the
    reference's to float32's last bits, and so is their quantization (scales to one rounding)."""
    q, scale = fp8_gemm.quantize_rows_triton(got.x, acts)
    assert torch.equal(got.q.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(got.scale, scale)
    torch.testing.assert_close(got.x, reference, atol=1e-5, rtol=1e-5)
    want = fp8_gemm.quantized_rows(reference, acts)  # torch ops
    torch.testing.assert_close(got.scale, want.scale, atol=0, rtol=3e-7)
    dequantized = got.q.float() * got.scale
    torch.testing.assert_close(dequantized, want.q.float() * want.scale, atol=1e-6, rtol=2**-3)


@interpreter
@pytest.mark.usefixtures("torch_e4m3_cast")
@pytest.mark.parametrize("scheme", sorted(SCHEMES))
@pytest.mark.parametrize(("rows", "dim", "residual"), [(5, 256, True), (3, 200, False), (1, 192, True)])
def test_fused_rms_norm_quantizes_as_the_unfused_kernel(scheme: str, rows: int, dim: int, residual: bool):
    from model_service.kernels.fused import rms_norm_triton

    x, weight = rows_of_every_scale(rows, dim, dim), torch.rand(dim) + 0.5
    res = torch.randn(rows, dim) if residual else None
    if res is not None:
        res[0] = -x[0]  # the padding row's sum stays zero
    acts = SCHEMES[scheme](dim)
    got, summed = rms_norm_triton(x, weight, 1e-5, res, acts)
    plain_out, plain_summed = rms_norm_triton(x, weight, 1e-5, res)
    assert isinstance(got, QuantizedRows) and got.q.shape == (rows, dim) and got.scale.shape == (rows, 1)
    assert torch.equal(got.x, plain_out) and torch.equal(summed, plain_summed)
    reference, _ = rms_norm(x, weight, 1e-5, res)
    assert_as_unfused(got, acts, reference)


@interpreter
@pytest.mark.usefixtures("torch_e4m3_cast")
@pytest.mark.parametrize("scheme", sorted(SCHEMES))
@pytest.mark.parametrize(("rows", "inter"), [(4, 320), (2, 5000), (1, 2048)])
def test_fused_silu_mul_quantizes_as_the_unfused_kernel(scheme: str, rows: int, inter: int):
    """Columns in several blocks of 2,048 (5,000: a masked tail), or one."""
    from model_service.kernels.fused import silu_and_mul_triton

    gate_up = rows_of_every_scale(rows, 2 * inter, inter)
    acts = SCHEMES[scheme](inter)
    got = silu_and_mul_triton(gate_up, acts)
    assert isinstance(got, QuantizedRows)
    assert torch.equal(got.x, silu_and_mul_triton(gate_up))
    assert_as_unfused(got, acts, silu_and_mul(gate_up))


@interpreter
@pytest.mark.usefixtures("torch_e4m3_cast")
@pytest.mark.parametrize(("rows", "dim", "inter"), [(5, 256, 2176), (1, 384, 384)])
def test_fused_producers_quantize_column_groups_as_the_group_kernel(rows: int, dim: int, inter: int):
    """`fp8-g128`'s inputs (a scale per token and 128 columns): RMSNorm (with a residual) and
    SiLU-mul (2,176 columns: a block of 2,048 and one group) quantize from registers exactly as
    `quantize_column_groups_triton` quantizes their stored rows, scales column-major."""
    from model_service.kernels.fused import rms_norm_triton, silu_and_mul_triton

    acts = ActivationQuant("dynamic", 128)
    x = rows_of_every_scale(rows, dim, dim) * torch.logspace(-1, 1, dim)
    normed, _ = rms_norm_triton(x, torch.rand(dim) + 0.5, 1e-5, torch.randn(rows, dim), acts)
    product = silu_and_mul_triton(rows_of_every_scale(rows, 2 * inter, inter) * 3, acts)
    for got in (normed, product):
        assert isinstance(got, QuantizedRows)
        q, scale = fp8_gemm.quantize_column_groups_triton(got.x, 128)
        assert got.scale.shape == scale.shape and got.scale.stride() == (1, rows)
        assert torch.equal(got.scale, scale)
        assert torch.equal(got.q.view(torch.uint8), q.view(torch.uint8))


def test_without_cuda_the_producers_give_the_unfused_reference():
    """The torch path (CPU, the oracle): the product, then `quantize_rows` of it, or the plain
    product when no consumer asked."""
    x, weight, acts = (
        torch.randn(3, 64).bfloat16(),
        torch.randn(64).bfloat16(),
        ActivationQuant("dynamic", 64),
    )
    got, summed = rms_norm(x, weight, 1e-6, x, acts)
    out, _ = rms_norm(x, weight, 1e-6, x)
    assert torch.equal(got.x, out) and torch.equal(summed, x + x)
    q, scale = quantize_rows(out, acts)
    assert torch.equal(got.q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(got.scale, scale)
    assert isinstance(silu_and_mul(x, acts), QuantizedRows) and not isinstance(silu_and_mul(x), QuantizedRows)


@interpreter
@pytest.mark.parametrize(
    ("n", "k", "config"),
    [
        (128, 4096, None),  # the engine's tiling: [4, 2048]
        (96, 1000, None),  # K masked in one 1,024-wide tile
        (128, 4096, skinny_module.GemvConfig(8, 1024, 2, 4, 2)),  # two K slices (the sweep's)
        (64, 2048, skinny_module.GemvConfig(8, 1024, 2, 4, 2)),
    ],
)
def test_the_one_row_gemv_in_the_engines_tiling_and_split_in_k(
    monkeypatch: pytest.MonkeyPatch, n: int, k: int, config: skinny_module.GemvConfig | None
):
    """The engine's tiling (K masked where it is not whole tiles) and two K slices (whole K
    tiles, whole 64-column groups) summed by the last of each group to arrive: the weight-only
    reference to float32's summation error, the counters left zeroed, the same bits on a second
    call."""
    monkeypatch.setattr(skinny_module, "_device_limits", lambda device: (132, 232_448))
    torch.manual_seed(n + k)
    weight, scale = quantize_groups(torch.randn(n, k), k)
    x, bias = torch.randn(1, k), torch.randn(n)
    arrivals = torch.zeros(max(1, n // 64), dtype=torch.int32)
    got = skinny_module.fp8_gemv(x, weight, bias, scale, arrivals, config)
    torch.testing.assert_close(got, x @ (weight.float() * scale).T + bias, atol=1e-4, rtol=1e-5)
    assert int(arrivals.abs().sum()) == 0
    assert torch.equal(skinny_module.fp8_gemv(x, weight, bias, scale, arrivals, config), got)


@interpreter
@pytest.mark.usefixtures("torch_e4m3_cast")
@pytest.mark.parametrize(("rows", "k"), [(5, 256), (1, 1024), (3, 128)])
def test_the_group_quantization_kernel_is_the_reference(rows: int, k: int):
    """Activations per token and 128 columns (`fp8-g128`'s GEMM input): the Triton kernel's
    scales are `quantize_groups`' to the last bit (CUDA multiplies by 1 / 448 where the CPU
    divides), stored column-major as cuBLASLt's block scaling wants them, and its e4m3 bytes are
    torch's rounding of x by those scales, bit for bit."""
    x = rows_of_every_scale(rows, k, k) * torch.logspace(-1, 1, k)
    q, scale = fp8_gemm.quantize_column_groups_triton(x, 128)
    _, want_scale = quantize_groups(x, 128)
    assert scale.shape == (rows, k // 128) and scale.stride() == (1, rows)
    torch.testing.assert_close(scale, want_scale, atol=0, rtol=3e-7)
    want_q = (x / scale.repeat_interleave(128, dim=1)).clamp(-448, 448).to(fp8_gemm.E4M3)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@interpreter
@pytest.mark.usefixtures("torch_e4m3_cast")
@pytest.mark.parametrize("scheme", sorted(SCHEMES))
@pytest.mark.parametrize(("rows", "k"), [(5, 256), (2, 2500)])  # 2,500: blocks of 1,024, the last ragged
def test_the_row_quantization_kernel_is_the_reference(scheme: str, rows: int, k: int):
    """Activations per token, dynamic (capped or not) or static (`_scaled_mm`'s row-wise input):
    the Triton kernel's scales are `quantize_rows`' torch ops' to the last bit (CUDA multiplies
    by 1 / 448 where the CPU divides; a static scale is the checkpoint's), and its e4m3 bytes
    are torch's rounding of x by those scales, saturated at +-448, bit for bit."""
    x, acts = rows_of_every_scale(rows, k, k), SCHEMES[scheme](k)
    q, scale = fp8_gemm.quantize_rows_triton(x, acts)
    _, want_scale = quantize_rows(x, acts)
    assert scale.shape == (rows, 1)
    torch.testing.assert_close(scale, want_scale, atol=0, rtol=3e-7)
    want_q = (x / scale).clamp(-448, 448).to(fp8_gemm.E4M3)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@interpreter
@pytest.mark.parametrize("column_major", [False, True])
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 128, 4096), (1, 192, 1024), (1, 64, 2048), (3, 128, 1024)])
def test_the_few_row_kernels_scale_each_128_columns_of_a_row(
    monkeypatch: pytest.MonkeyPatch, rows: int, n: int, k: int, column_major: bool
):
    """Weights with a scale per row and 128 columns (`--quantization fp8-g128`), their scales
    spread over three decades along K so a partial sum scaled by its neighbour's scale shows: the
    GEMV (one row; its 256- and 1,024-wide tiles summed in groups of 128, K split in two at
    4,096 and 2,048) and the `tl.dot` kernel (K tiles of 128, split four ways) give the weight-only
    reference on the dequantized weight, the counters left zeroed; with the scales row-major (as
    loaded) or column-major (as `store_weights_transposed` keeps them on CUDA)."""
    monkeypatch.setattr(skinny_module, "_device_limits", lambda device: (132, 232_448))
    torch.manual_seed(rows + n + k)
    w = torch.randn(n, k) * torch.logspace(-2, 1, k)
    weight, scale = quantize_groups(w, 128)
    assert scale.shape == (n, k // 128)
    scale = scale.t().contiguous().t() if column_major else scale
    x, bias = torch.randn(rows, k), torch.randn(n)
    arrivals = torch.zeros(max(1, n // 32), dtype=torch.int32)
    got = skinny_module.skinny_linear(x, weight, bias, arrivals, scale)
    want = x @ dequantize_groups(weight, scale, 128).T + bias
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-5)
    assert int(arrivals.abs().sum()) == 0


def test_fused_and_unfused_routes_give_the_same_logits(monkeypatch: pytest.MonkeyPatch):
    """A bf16 model quantized online, `_scaled_mm` forced on (the CPU runs it): with the producers
    quantizing for their consumers (qkv, gate_up, down; o quantizes its own input), a prefill's
    logits and the greedy tokens are the unfused route's exactly."""
    from bench.gpu import quantized, random_model

    shape = {"vocab_size": 320, "hidden_size": 128, "intermediate_size": 256, "num_layers": 2,
             "num_heads": 4, "num_kv_heads": 2, "head_dim": 32}  # fmt: skip
    fp8 = quantized(random_model(shape, device="cpu", dtype=torch.bfloat16))
    monkeypatch.setattr(fp8_gemm, "scaled_mm_applies", lambda *args: True)
    monkeypatch.setattr(fp8_linear_module, "scaled_mm_applies", lambda *args: True)
    fused = run(fp8)
    assert fused[2] == {"q_proj": 2, "gate_proj": 2, "down_proj": 2}, "o_proj quantizes its own input"
    monkeypatch.setattr(Fp8Linear, "input_quant", lambda self, x: None)
    unfused = run(fp8)
    assert not unfused[2]
    assert torch.equal(fused[0], unfused[0]) and fused[1] == unfused[1]


def emulated_block_scaled_mm(real: Any) -> Any:
    """`torch._scaled_mm` with cuBLASLt's 1x128 x 1x128 block scaling emulated (it runs on sm90
    only): the CUDA op's layout checks (`is_blockwise_1x128_scaling` on `a, scale_a` and on
    `b.t(), scale_b.t()`), then both operands dequantized and multiplied in float32. Row-wise
    calls go to `real`."""

    def scaled_mm(a: torch.Tensor, b: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        scale_a, scale_b = kwargs["scale_a"], kwargs["scale_b"]
        if scale_a.shape[1] == 1:
            return real(a, b, **kwargs)
        (m, k), n = a.shape, b.shape[1]
        assert m % 4 == 0, "cuBLASLt refuses block-scaled rows that are not a multiple of 4"
        assert scale_a.shape == (m, k // 128) and scale_a.stride() == (1, m)
        assert scale_b.t().shape == (n, k // 128) and scale_b.t().stride() == (1, n)
        x, w = dequantize_groups(a, scale_a, 128), dequantize_groups(b.t(), scale_b.t(), 128)
        return (x @ w.T).to(kwargs["out_dtype"])

    return scaled_mm


def test_the_group_scheme_takes_the_block_scaled_gemm_fused_or_not(monkeypatch: pytest.MonkeyPatch):
    """`fp8-g128` as it runs on sm90, the block-scaled `_scaled_mm` emulated with the CUDA op's
    layout checks: the producers hand qkv, gate_up and down `QuantizedRows` with a scale per token
    and 128 columns (o quantizes its own), the logits and tokens equal the unfused route's, and
    both stay within bf16 rounding of the reference path the CPU runs."""
    from bench.gpu import quantized, random_model

    # every projection's K is 2 or 3 groups of 128
    shape = {"vocab_size": 320, "hidden_size": 256, "intermediate_size": 384, "num_layers": 2,
             "num_heads": 4, "num_kv_heads": 2, "head_dim": 64}  # fmt: skip
    fp8 = quantized(random_model(shape, device="cpu", dtype=torch.bfloat16), "fp8-g128")
    reference = run(fp8)
    monkeypatch.setattr(torch, "_scaled_mm", emulated_block_scaled_mm(torch._scaled_mm))
    monkeypatch.setattr(fp8_gemm, "scaled_mm_applies", lambda *args: True)
    monkeypatch.setattr(fp8_linear_module, "scaled_mm_applies", lambda *args: True)
    fused = run(fp8)
    assert fused[2] == {"q_proj": 2, "gate_proj": 2, "down_proj": 2}, "o_proj quantizes its own input"
    assert all(r.scale.shape[1] > 1 for r in fused[3])
    monkeypatch.setattr(Fp8Linear, "input_quant", lambda self, x: None)
    unfused = run(fp8)
    assert torch.equal(fused[0], unfused[0]) and fused[1] == unfused[1]
    torch.testing.assert_close(fused[0].float(), reference[0].float(), atol=0.05, rtol=0.05)


def run(loaded: LoadedModel) -> tuple[torch.Tensor, list[list[int]], dict[str, int], list[QuantizedRows]]:
    """(a prefill's logits, greedy tokens of two prompts, how many layers' projections got
    `QuantizedRows` in that prefill, by their first part, and those rows), in bf16 on the CPU."""
    from tests.test_fp8 import all_logits

    counted: dict[str, int] = {}
    handed: list[QuantizedRows] = []
    original = Fp8Linear.forward

    def counting(self: Fp8Linear, x: Any) -> torch.Tensor:
        if isinstance(x, QuantizedRows):
            counted[self.parts[0]] = counted.get(self.parts[0], 0) + 1
            handed.append(x)
        return original(self, x)

    prompts = [[(7 * i + 3) % 300 + 5 for i in range(n)] for n in (9, 17)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Fp8Linear, "forward", counting)
        logits = all_logits(loaded, prompts[1], dtype="bfloat16")
    requests = [
        {"prompt_token_ids": p, "max_tokens": 4, "temperature": 0, "ignore_eos": True} for p in prompts
    ]
    outputs = make_engine(loaded, dtype="bfloat16").generate(requests)
    return logits, [o.token_ids for o in outputs], counted, handed
