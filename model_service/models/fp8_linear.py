"""`Fp8Linear`: a fused projection whose weight is e4m3 with float32 scales (issue 33).

It is a `PackedLinear` (same parts, widths, names and forward signature), so everything that
finds or wraps projections by that type keeps working on an FP8 model: the loader's checkpoint
layout, the LoRA wrapper (its base output comes from the FP8 GEMM, its bf16 delta is added on
top), the SwiGLU consumer and tensor-parallel sharding (weight rows and their scales are sliced
together). What it changes: `weight` is e4m3 [out, in] with rows contiguous (the layout
`torch._scaled_mm` wants, so `store_weights_transposed` leaves it), `weight_scale` is float32
[out, groups], and `input_scale` the static activation scale where the scheme has one.
"""

from __future__ import annotations

import torch
from torch import nn

from model_service.kernels.fp8_gemm import (
    E4M3,
    ActivationQuant,
    QuantizedRows,
    fp8_linear,
    quantize_groups,
    scaled_mm_applies,
    scaled_mm_rows,
)
from model_service.kernels.skinny_gemm import skinny_applies, skinny_linear
from model_service.models.layers import PackedLinear
from model_service.models.moe import StackedExperts
from model_service.models.quantization import ONLINE, Fp8Scheme


class Fp8Linear(PackedLinear):
    """See the module docstring; `weight_scale` is concatenated by part with the weight's rows."""

    ROW_TENSORS = ("weight", "bias", "weight_scale")

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool, scheme: Fp8Scheme) -> None:
        """Made on the meta device (a loader assigns the tensors): quantized models are big."""
        with torch.device("meta"):
            super().__init__(in_features, parts, bias)
            self.weight = nn.Parameter(torch.empty(self.out_features, in_features, dtype=E4M3), False)
            self.group = scheme.block or in_features  # input columns one weight scale covers
            groups = -(-in_features // self.group)
            self.register_buffer("weight_scale", torch.empty(self.out_features, groups))
            static = scheme.activations == "static"
            self.register_buffer("input_scale", torch.empty(1) if static else None)
        self.scheme = scheme

    @classmethod
    def like(cls, linear: PackedLinear, scheme: Fp8Scheme) -> Fp8Linear:
        """An empty (meta) FP8 layer of `linear`'s shape."""
        parts = dict(zip(linear.parts, linear.output_sizes, strict=True))
        return cls(linear.in_features, parts, linear.bias is not None, scheme)

    @classmethod
    def quantized(cls, linear: PackedLinear, scheme: Fp8Scheme = ONLINE) -> Fp8Linear:
        """`linear` quantized online: e4m3 rows, each scaled by its own maximum (per channel), or
        each 128 columns of a row by theirs (`ONLINE_G128`).
        The rows are made contiguous whatever `linear.weight`'s strides: a bf16 weight an executor
        stored transposed would otherwise give a transposed e4m3 one, which `_scaled_mm` cannot
        take, and every product would silently fall back to the dequantizing reference (what made
        `bench/serving.py --compare`'s FP8 run 8x slower than bf16, 2026-12-02 w)."""
        layer = cls.like(linear, scheme)
        weight, scale = quantize_groups(linear.weight.detach(), layer.group)
        layer.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        layer.weight_scale = scale
        layer.bias = linear.bias
        return layer

    def activations(self) -> ActivationQuant:
        scheme = self.scheme
        return ActivationQuant(scheme.activations, self.group, self.input_scale, scheme.activation_scale_ub)

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        """Decode steps of a few rows with one scale a weight row (per-channel and per-tensor
        schemes), or one a row and 128 columns (`fp8-g128`, block checkpoints), take the few-row
        kernel in W8A16 (`skinny_linear`: one byte a weight, where
        `_scaled_mm` is slow at so few rows), as `PackedLinear.forward` takes it in bf16. Rows
        their producer quantized (it asked `input_quant`) go straight to `_scaled_mm`."""
        if isinstance(x, QuantizedRows):
            return scaled_mm_rows(x, self.weight, self.weight_scale, self.bias)
        if (arrivals := self._few_rows(x)) is not None:
            return skinny_linear(x, self.weight, self.bias, arrivals, self.weight_scale)
        return fp8_linear(x, self.weight, self.weight_scale, self.group, self.bias, self.activations())

    def input_quant(self, x: torch.Tensor) -> ActivationQuant | None:
        """How the kernel producing x (or a tensor of its rows, dtype and device) should quantize
        it for this layer, None if it should not: only where `forward` would run `_scaled_mm`,
        which would otherwise launch that quantization itself (`fp8_gemm.quantize_rows`; per
        token, or per token and 128 columns for `fp8-g128`)."""
        acts = self.activations()
        if self._few_rows(x) is not None or not scaled_mm_applies(x, self.weight, self.weight_scale, acts):
            return None
        return acts

    def _few_rows(self, x: torch.Tensor) -> torch.Tensor | None:
        """The few-row kernel's counters when x takes that kernel, else None."""
        return self.skinny_arrivals(x) if skinny_applies(x, self.weight, self.weight_scale) else None


def quantize_online(module: nn.Module, scheme: Fp8Scheme = ONLINE) -> None:
    """Replace every `PackedLinear` of `module` by its FP8 quantization in `scheme` (an online
    one: per channel, or per 128-column group) and store MoE experts in e4m3 the same way
    (`quantize_experts`) (`--quantization`); the embeddings, the MoE router and the LM head stay
    in the compute dtype, as vLLM leaves them."""
    for name, sub in list(module.named_modules()):
        if type(sub) is PackedLinear:
            owner, _, attr = name.rpartition(".")
            setattr(module.get_submodule(owner), attr, Fp8Linear.quantized(sub, scheme))
        elif isinstance(sub, StackedExperts):
            quantize_experts(sub, scheme.block or 0)


def quantize_experts(experts: StackedExperts, group: int = 0) -> None:
    """`experts`' weights in e4m3, in place, each expert's output rows scaled by their own
    maximum over `group` columns (0: per channel, as `Fp8Linear.quantized`): the fused MoE
    kernels read one byte a weight and scale their sums (W8A16)."""
    for name in ("gate_up_proj", "down_proj"):
        q, scale = quantize_stack(getattr(experts, name).detach(), group)
        setattr(experts, name, nn.Parameter(q, requires_grad=False))
        setattr(experts, name.replace("_proj", "_scale"), scale)
    experts.scale_group = group


def quantize_stack(w: torch.Tensor, group: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [E, N, K], float32 scales [E, N, G]) of a stack of expert weights [E, N, K], each
    row scaled by its own maximum over `group` columns (0: the whole row). One expert at a time,
    so the float32 copy the quantization makes stays one expert's."""
    num, rows, cols = w.shape
    group = group or cols
    q = torch.empty(w.shape, dtype=E4M3, device=w.device)
    scale = torch.empty(num, rows, -(-cols // group), dtype=torch.float32, device=w.device)
    for e in range(num):
        q[e], scale[e] = quantize_groups(w[e], group)
    return q, scale


def make_fp8_experts(experts: StackedExperts, group: int) -> None:
    """Make (meta) `experts` e4m3 with scale buffers for a loader to fill: one scale per expert,
    output row and `group` input columns (0: one a row)."""
    num, rows, hidden = experts.gate_up_proj.shape
    inter = experts.down_proj.shape[2]

    def groups(cols: int) -> int:
        return -(-cols // group) if group else 1

    with torch.device("meta"):
        experts.gate_up_proj = nn.Parameter(torch.empty(num, rows, hidden, dtype=E4M3), requires_grad=False)
        experts.down_proj = nn.Parameter(torch.empty(num, hidden, inter, dtype=E4M3), requires_grad=False)
        experts.gate_up_scale = torch.empty(num, rows, groups(hidden))
        experts.down_scale = torch.empty(num, hidden, groups(inter))
    experts.scale_group = group


def fp8_dtypes(module: nn.Module) -> dict[str, torch.dtype]:
    """State-dict names of `module`'s FP8 tensors -> the dtype they keep whatever the compute
    dtype: e4m3 weights (of projections and expert stacks), float32 scales."""
    return {
        f"{prefix}.{name}": t.dtype
        for prefix, sub in module.named_modules()
        if isinstance(sub, Fp8Linear) or (isinstance(sub, StackedExperts) and sub.gate_up_scale is not None)
        for name, t in (*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False))
        if name != "bias"
    }
