"""MXFP4 expert weights (gpt-oss's hub checkpoints) -> the compute dtype, at load.

OCP microscaling FP4: each run of 32 weights along a row's input dimension is 16 bytes of e2m1
codes (`*_blocks` [..., G, 16], uint8: two codes a byte, the low nibble first) and one shared
power-of-two exponent (`*_scales` [..., G], uint8, biased by 127). A weight is
FP4_VALUES[code] * 2 ** (scale - 127): exact in bf16 and float32 (a power of two times a
3-bit value), so dequantizing once at load gives the weights transformers' `dequantize` path
(integrations/mxfp4.py) computes with. The engine has no MXFP4 kernel; the weights take the
compute dtype's bytes (4x MXFP4's in bf16).
"""

from __future__ import annotations

import torch

from model_service.errors import ModelLoadError

# e2m1: sign, two exponent bits, one mantissa bit; code i is FP4_VALUES[i]
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
PROJECTIONS = ("gate_up_proj", "down_proj")


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[E, R, G, 16] uint8 codes and [E, R, G] uint8 exponents -> [E, R, G * 32] weights in
    `dtype`, one expert at a time (the float32 intermediate stays one expert's size)."""
    if blocks.dim() != 4 or blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ModelLoadError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match: "
            "expected [experts, rows, G, 16] and [experts, rows, G]"
        )
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    experts, rows, groups, _ = blocks.shape
    out = torch.empty(experts, rows, groups * 32, dtype=dtype)
    for e in range(experts):
        codes = blocks[e].to(torch.uint8)
        pairs = torch.stack((lut[(codes & 0x0F).long()], lut[(codes >> 4).long()]), dim=-1)  # [R, G, 16, 2]
        exponents = scales[e].to(torch.int32) - 127
        out[e] = torch.ldexp(pairs.flatten(-2), exponents[..., None]).flatten(-2).to(dtype)
    return out


def dequantize_experts(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`tensors` with each `*.experts.{gate_up,down}_proj_{blocks,scales}` pair replaced by the
    dequantized weight under HF's parameter name and layout: blocks hold each expert's [out, in]
    rows, HF's experts multiply by [in, out] (gate_up [E, H, 2I], down [E, I, H]), as
    transformers' `convert_moe_packed_tensors` transposes them."""
    out = dict(tensors)
    for name in [k for k in tensors if k.endswith("_blocks")]:
        weight = name.removesuffix("_blocks")
        if not weight.endswith(PROJECTIONS) or f"{weight}_scales" not in out:
            raise ModelLoadError(f"MXFP4 tensor {name!r} is not an expert projection with its _scales")
        blocks, scales = out.pop(name), out.pop(f"{weight}_scales")
        out[weight] = dequantize(blocks, scales, dtype).transpose(-1, -2).contiguous()
    return out
