"""`bench/fp8_gemm.py` on the CPU: the layers it times are the engine's (so 1-16 rows take the
few-row kernels there, as decode does), and its GEMV sweep starts from the engine's tiling and
offers only tilings the kernel can run on each shape."""

from __future__ import annotations

import torch

from bench import fp8_gemm
from model_service.kernels.fp8_gemm import dequantize_groups
from model_service.kernels.skinny_gemm import gemv_config
from model_service.models.fp8_linear import Fp8Linear
from model_service.models.layers import PackedLinear


def test_the_layers_are_held_as_the_engine_holds_them():
    w = torch.randn(256, 512, dtype=torch.bfloat16)
    bf16, fp8, g128 = (fp8_gemm.layer(w, fmt) for fmt in fp8_gemm.FORMATS)
    assert type(bf16) is PackedLinear and bf16.weight.t().is_contiguous()  # the few-row kernel's layout
    assert torch.equal(bf16.weight, w)
    assert isinstance(fp8, Fp8Linear) and fp8.weight.is_contiguous() and fp8.weight_scale.shape == (256, 1)
    # fp8-g128: a scale per row and 128 columns, column-major as cuBLASLt's block scaling takes them
    assert g128.weight_scale.shape == (256, 4) and g128.weight_scale.stride() == (1, 256)
    for layer in (fp8, g128):  # quantized from w: each row's groups dequantize to within e4m3's step
        dequantized = dequantize_groups(layer.weight, layer.weight_scale, layer.group)
        torch.testing.assert_close(dequantized, w.float(), atol=w.abs().max().item() / 16, rtol=0.07)


def test_the_gemv_sweep_starts_from_the_engines_tiling_and_fits_each_shape():
    for k, n in fp8_gemm.SHAPES.values():
        grid = fp8_gemm.gemv_grid(k, n)
        assert grid[0] == gemv_config(k) and len(set(grid)) == len(grid) >= 40
        for cfg in grid:
            assert n % cfg.block_n == 0 and k % (cfg.split * cfg.block_k) == 0
            assert cfg.block_k % 128 == 0  # whole scale groups a K tile (fp8-g128)
            assert cfg.split == 1 or 64 % cfg.block_n == 0  # a split's counters: whole 64-column groups
