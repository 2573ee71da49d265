"""The Qwen3-Next decode glue kernels against the torch references they replace: the zero-centered
RMSNorm (with and without the residual add) of `fused.rms_norm`, and the gated full attention's
head preparation (q/k norms, partial RoPE, the q/k/v copies) and output gate
(kernels/gated_attention.py), over the strided views the layer passes them.

On CUDA (`pytest --noconftest -m gpu tests/test_gated_attention_kernels.py`); on the CPU under
Triton's interpreter too, when it is installed:
`TRITON_INTERPRET=1 pytest tests/test_gated_attention_kernels.py`.
"""

from __future__ import annotations

import os

import pytest
import torch

from model_service.kernels.fused import rms_norm_reference, rms_norm_triton
from model_service.kernels.gated_attention import (
    gated_heads_reference,
    gated_heads_triton,
    sigmoid_gate_reference,
    sigmoid_gate_triton,
    triton,
)

HEADS, KV_HEADS, DIM = 4, 2, 16


def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """float32 to rounding (sums in another order), bf16 to a unit in the last place."""
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def _check_zero_centered_norm(device: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x, residual = (_randn(gen, 5, 48).to(device, dtype) for _ in range(2))
    weight = (0.3 * _randn(gen, 48)).to(device, dtype)
    out, summed = rms_norm_triton(x, weight, 1e-6, residual, zero_centered=True)
    assert torch.equal(summed, x + residual)
    _close(out, rms_norm_reference(x + residual, weight, 1e-6, zero_centered=True), dtype)
    alone = rms_norm_triton(x, weight, 1e-6, zero_centered=True)[0]
    _close(alone, rms_norm_reference(x, weight, 1e-6, zero_centered=True), dtype)


def _check_gated_heads(device: str, dtype: torch.dtype) -> None:
    """Partial rotary (Qwen3-Next's quarter of DIM) and full; gate left where qkv has it."""
    for rotary_dim in (4, DIM):
        gen = torch.Generator().manual_seed(1)
        qkv = _randn(gen, 5, 2 * HEADS * DIM + 2 * KV_HEADS * DIM).to(device, dtype)
        norms = tuple((0.3 * _randn(gen, DIM)).to(device, dtype) for _ in range(2))
        angles = _randn(gen, 5, rotary_dim // 2).repeat(1, 2)
        rope = (angles.cos().to(device, dtype), angles.sin().to(device, dtype))
        shape = (HEADS, KV_HEADS, DIM)
        got = gated_heads_triton(qkv, norms, 1e-6, rope, shape)
        want = gated_heads_reference(qkv, norms, 1e-6, rope, shape)
        for g, w in zip(got, want, strict=True):
            _close(g, w, dtype)
        assert all(t.is_contiguous() for t in got[:3])
        assert got[3].untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()


def _check_sigmoid_gate(device: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    x = _randn(gen, 5, HEADS, DIM).to(device, dtype)
    q_gate = _randn(gen, 5, HEADS, 2 * DIM).to(device, dtype)
    gate = q_gate[..., DIM:]  # the strided view gated_heads returns
    _close(sigmoid_gate_triton(x, gate), sigmoid_gate_reference(x, gate), dtype)


# One test each, so that a failure (or, in scripts/compile_kernels.sh, a kernel that was only
# compiled and left its outputs unwritten) stops no other kernel's check.
CHECKS = {
    "zero_centered_norm": _check_zero_centered_norm,
    "gated_heads": _check_gated_heads,
    "sigmoid_gate": _check_sigmoid_gate,
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or triton is None, reason="needs CUDA and Triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_gated_attention_glue_matches_the_torch_references_on_cuda(check: str, dtype: torch.dtype):
    CHECKS[check]("cuda", dtype)


@pytest.mark.skipif(
    triton is None or os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter"
)
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_gated_attention_glue_matches_the_torch_references_under_the_interpreter(check: str):
    CHECKS[check]("cpu", torch.float32)
