"""Building blocks shared by model architectures."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model_service.kernels.fp8_gemm import ActivationQuant, QuantizedRows, plain, quantized_rows
from model_service.kernels.fused import rms_norm, silu_and_mul
from model_service.kernels.skinny_gemm import skinny_applies, skinny_linear
from model_service.models.config import ModelConfig


class RMSNorm(nn.Module):
    """Normalized in float32 as the reference implementations do (bf16 variance drifts); one
    kernel on CUDA, which also adds the residual stream when given one. A subclass that sets
    `zero_centered` scales by 1 + weight instead (`fused.rms_norm_reference`)."""

    zero_centered = False

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if self.zero_centered else torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        return rms_norm(flat, self.weight, self.eps, zero_centered=self.zero_centered)[0].view(x.shape)

    def with_residual(
        self, x: torch.Tensor, residual: torch.Tensor | None, quant: ActivationQuant | None = None
    ) -> tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
        """(RMSNorm(x + residual), x + residual): the pre-norm decoder's add and norm in one (no
        add without a residual). With `quant` (an FP8 consumer's `input_quant`) the norm also
        quantizes its rows for that consumer, in the same launch on CUDA."""
        return rms_norm(x, self.weight, self.eps, residual, quant, self.zero_centered)


class ZeroCenteredRMSNorm(RMSNorm):
    """x / rms(x) * (1 + weight), in float32, rounded once: a zero weight is the identity scale
    (how Qwen3-Next and Gemma store it). One kernel on CUDA, the residual add included
    (`fused.rms_norm`)."""

    zero_centered = True


class PackedLinear(nn.Linear):
    """Projections of one input fused into one matmul: q/k/v, or gate/up, or a single one.

    `parts` are the checkpoint (and PEFT) names of the fused projections, `output_sizes` their
    widths in output order: the loader concatenates checkpoint tensors by them, and the LoRA
    layers apply each part's adapter to its own output columns.
    """

    ROW_TENSORS = ("weight", "bias")  # tensors whose rows are the output's: concatenated by part

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.parts, self.output_sizes = tuple(parts), tuple(parts.values())
        self.arrivals: torch.Tensor | None = None  # the few-row kernel's counters, made on first use

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Decode steps of a few rows take the few-row kernel (`kernels/skinny_gemm.py`: +4%
        tok/s at batch 1, +7% at 4 on an 8B model)."""
        if skinny_applies(x, self.weight) and (arrivals := self.skinny_arrivals(x)) is not None:
            return skinny_linear(x, self.weight, self.bias, arrivals)
        return super().forward(x)

    def skinny_arrivals(self, x: torch.Tensor) -> torch.Tensor | None:
        """The few-row kernel's counters on x's device, made on the first call, which is eager:
        the warm-up before every graph capture. None when a capture comes first (allocated inside
        it, they would hold garbage until a replay zeroed them): the layer keeps its other path."""
        if self.arrivals is None and not torch.cuda.is_current_stream_capturing():
            self.arrivals = torch.zeros(self.out_features // 64, dtype=torch.int32, device=x.device)
        return self.arrivals if self.arrivals is not None and self.arrivals.device == x.device else None

    def input_quant(self, x: torch.Tensor) -> ActivationQuant | None:
        """How the kernel producing this layer's input x should quantize it: not at all in the
        compute dtype (`Fp8Linear` answers for FP8 weights)."""
        return None

    def forward_silu_mul(
        self, x: torch.Tensor | QuantizedRows, quant: ActivationQuant | None = None
    ) -> torch.Tensor | QuantizedRows:
        """silu(gate) * up of a gate_up projection: SwiGLU's consumer asks for both at once, so a
        LoRA wrapper (`lora.layers.LoraLinear`) can add its delta inside the activation. With
        `quant` (the down projection's `input_quant`) the product is also quantized for it."""
        return silu_and_mul(self(x), quant)


# The gated MLPs' activations other than SiLU (`ModelConfig.hidden_act`), as HF's ACT2FN computes them.
GELUS = {"gelu": "none", "gelu_pytorch_tanh": "tanh"}  # name -> F.gelu's `approximate`


class MLP(nn.Module):
    """The gated MLP, act(gate) * up (SwiGLU, or Gemma's GELU): a dense layer's, or an MoE layer's
    shared expert (its own width)."""

    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        self.gelu = GELUS.get(cfg.hidden_act)  # None: SiLU
        inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = PackedLinear(
            cfg.hidden_size, {"gate_proj": inter, "up_proj": inter}, cfg.mlp_bias
        )
        self.down_proj = PackedLinear(inter, {"down_proj": cfg.hidden_size}, cfg.mlp_bias)

    def input_quant(self, x: torch.Tensor) -> ActivationQuant | None:
        """The gate_up projection's (`PackedLinear.input_quant`): it alone reads the input."""
        return self.gate_up_proj.input_quant(x)

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        """down(act(gate) * up); an FP8 down projection gets its input quantized by SiLU-mul (after
        a GELU, which has no fused kernel, by the reference quantizer)."""
        quant = input_quant(self.down_proj, plain(x))
        if self.gelu is None:
            return self.down_proj(self.gate_up_proj.forward_silu_mul(x, quant))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        h = F.gelu(gate, approximate=self.gelu) * up
        return self.down_proj(h if quant is None else quantized_rows(h, quant))


def input_quant(consumer: nn.Module | None, x: torch.Tensor) -> ActivationQuant | None:
    """How the kernel producing x should quantize it for `consumer` (a projection, or a block whose
    only reader of x is one: `MLP`, `llama.Attention`), None if not, or if `consumer` cannot say
    (an MoE block, a tensor-parallel row shard: they quantize for themselves, unfused)."""
    ask = getattr(consumer, "input_quant", None)
    return ask(x) if ask is not None else None


def checkpoint_layout(module: nn.Module) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """Each parameter of `module` -> the checkpoint tensors (name, shape) it is made of, in order.

    A `PackedLinear`'s row tensors (`ROW_TENSORS`) are the concatenation of its parts' tensors
    along dim 0; every other parameter or buffer is one checkpoint tensor of its own name.
    """
    layout = {name: [(name, tuple(t.shape))] for name, t in module.state_dict().items()}
    for prefix, sub in module.named_modules():
        if not isinstance(sub, PackedLinear):
            continue
        owner = prefix.rpartition(".")[0]
        for pname in sub.ROW_TENSORS:
            param = getattr(sub, pname)
            if param is None:
                continue
            rest = tuple(param.shape[1:])
            layout[f"{prefix}.{pname}"] = [
                (f"{owner}.{part}.{pname}", (size, *rest))
                for part, size in zip(sub.parts, sub.output_sizes, strict=True)
            ]
    return layout


def checkpoint_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """`module`'s weights under checkpoint names: fused projections split back into their parts,
    and whatever a module stores otherwise than its checkpoint names it (its `checkpoint_split`:
    an MoE block's shared expert kept among its experts)."""
    state = module.state_dict()
    out: dict[str, torch.Tensor] = {}
    for name, parts in checkpoint_layout(module).items():
        pieces = state[name].split([shape[0] for _, shape in parts])
        out.update({part: piece for (part, _), piece in zip(parts, pieces, strict=True)})
    for prefix, sub in module.named_modules():
        if (split := getattr(sub, "checkpoint_split", None)) is not None:
            split(f"{prefix}." if prefix else "", out)
    return out


def store_weights_transposed(module: nn.Module) -> None:
    """Keep every linear layer's weight [out, in] as the view of its contiguous transpose.

    `F.linear(x, W)` is `x @ W.T`: with W.T contiguous cuBLAS runs its x @ B kernels, which on an
    H200 stream an 8B model's decode GEMMs ~4% faster at 64 rows and ~2% at one (the LM head's
    128k x 4,096 at 64 rows: 283 -> 253 us; docs/performance-notes.md, session g). Same math, same
    parameters and shapes (results may differ in the last bit: another kernel sums in another
    order); only the strides change, so loaders, LoRA and state dicts see nothing.
    A weight an embedding shares (tied LM head) keeps its rows contiguous for the lookups, and an
    FP8 weight keeps them too: `torch._scaled_mm` takes its transpose as the column-major operand.
    An FP8 weight's scales per 128 columns ([out, in / 128], `fp8-g128` and block checkpoints)
    are stored column-major, as cuBLASLt's block scaling takes them (else a copy every call)."""
    embedded = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    for sub in module.modules():
        scale = sub._buffers.get("weight_scale")
        if scale is not None and scale.dim() == 2 and scale.shape[1] > 1 and scale.is_contiguous():
            sub.weight_scale = scale.t().contiguous().t()
        if (
            isinstance(sub, nn.Linear)
            and id(sub.weight) not in embedded
            and sub.weight.is_contiguous()
            and sub.weight.dtype != torch.float8_e4m3fn
        ):
            sub.weight.data = sub.weight.data.t().contiguous().t()
