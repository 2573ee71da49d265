"""An FP8 checkpoint's tensors in the form `Fp8Linear` holds, whatever format wrote them.

Each quantized projection part arrives as an e4m3 `weight` and a scale whose shape says its
granularity: one per tensor ([] or [1]), one per output channel ([out, 1]) or one per 128x128
block ([ceil(out/128), ceil(in/128)], DeepSeek's `weight_scale_inv`). Every one becomes float32
scales per output row, [out, 1] or [out, ceil(in/128)], so the parts of a fused projection
(q/k/v with three different per-tensor scales, say) concatenate into one layer with each row
still scaled by its own part's scale. Static activation scales of fused parts become one, their
maximum (as vLLM does): the parts share one input, so one quantization of it must cover all.

MoE experts stay in e4m3 (`_fp8_experts`): each expert weight's scale in row form, which the
stacking of the experts stacks with the weights, and the module's expert stacks made FP8 (the
fused MoE kernels run them W8A16). An FP8 tensor of a module the engine runs in high precision
(an LM head the checkpoint did quantize, MLA's `kv_b_proj`) is dequantized here, so the rest of
the loader sees ordinary weights.
"""

from __future__ import annotations

import torch
from torch import nn

from model_service.errors import ModelLoadError
from model_service.kernels.fp8_gemm import E4M3, dequantize_groups
from model_service.models.expert_weights import EXPERT_PROJECTIONS, hf_expert_name
from model_service.models.fp8_linear import Fp8Linear, make_fp8_experts
from model_service.models.layers import PackedLinear
from model_service.models.moe import StackedExperts
from model_service.models.quantization import Fp8Scheme, QuantizationError


def fp8_checkpoint(
    module: nn.Module, tensors: dict[str, torch.Tensor], scheme: Fp8Scheme
) -> dict[str, torch.Tensor]:
    """Replace the quantized projections of `module` (on the meta device) by `Fp8Linear`s and
    return `tensors` as their checkpoint layout expects them (see the module docstring)."""
    # K/V cache scales (compressed-tensors' kv_cache_scheme): the engine's K/V pool keeps the compute
    # dtype, or its own unscaled e4m3 with --kv-cache-dtype fp8, so they have nothing to scale.
    tensors = {k: t for k, t in tensors.items() if not k.endswith(_KV_SCALES)}
    taken: set[str] = set()
    for prefix, sub in list(module.named_modules()):
        if type(sub) is not PackedLinear:
            continue
        owner = prefix.rpartition(".")[0]
        names = [f"{owner}.{part}" for part in sub.parts]
        quantized = [scheme.quantizes(name) for name in names]
        if not any(quantized):
            continue
        if not all(quantized):
            raise QuantizationError(
                f"{names} are fused into one projection, but the quantization_config leaves only some of "
                "them in high precision: quantize all or none"
            )
        input_scales = [
            _part_tensors(tensors, name, rows, sub.in_features, scheme)
            for name, rows in zip(names, sub.output_sizes, strict=True)
        ]
        taken.update(names)
        if scheme.activations == "static":
            tensors[f"{prefix}.input_scale"] = torch.stack(input_scales).amax().reshape(1)
        setattr(module.get_submodule(owner), prefix.rpartition(".")[2], Fp8Linear.like(sub, scheme))
    _fp8_experts(module, tensors, scheme, taken)
    _dequantize_rest(tensors, scheme, taken)
    return tensors


def _fp8_experts(
    module: nn.Module, tensors: dict[str, torch.Tensor], scheme: Fp8Scheme, taken: set[str]
) -> None:
    """Keep the e4m3 weights of every expert stack whose per-expert tensors are all FP8, each
    with its scale in row form under `{name}.weight_scale`, and make those (meta) stacks FP8.
    Activation scales are dropped: the experts run W8A16 whatever the checkpoint calibrated."""
    names = {hf_expert_name(k): k for k in tensors if ".experts." in k}
    for prefix, sub in module.named_modules():
        if not isinstance(sub, StackedExperts):
            continue
        experts = range(sub.gate_up_proj.shape[0])
        keys = [names.get(f"{prefix}.{e}.{proj}.weight") for e in experts for proj in EXPERT_PROJECTIONS]
        fp8 = [k is not None and tensors[k].dtype == E4M3 for k in keys]
        if not any(fp8):
            continue  # float experts, or the stacked layout (the loader checks what is missing)
        if not all(fp8):
            raise QuantizationError(
                f"some experts of {prefix} are FP8 and some are not (or missing): quantize all or none"
            )
        for key in keys:
            name = key.removesuffix(".weight")
            tensors[f"{name}.weight_scale"] = _weight_only_scales(tensors, name, scheme)
            taken.add(name)
        make_fp8_experts(sub, scheme.block or 0)


# the attention's, then (older compressed-tensors, Quark) the K/V/Q projections' output scales
_KV_SCALES = (
    ".k_scale",
    ".v_scale",
    ".kv_scale",
    ".k_proj.output_scale",
    ".v_proj.output_scale",
    ".q_proj.output_scale",
)


def _part_tensors(
    tensors: dict[str, torch.Tensor], name: str, rows: int, cols: int, scheme: Fp8Scheme
) -> torch.Tensor | None:
    """Put part `name`'s weight scale in row form; return its static input scale (None if dynamic)."""
    weight = tensors.get(f"{name}.weight")
    if weight is None:
        raise ModelLoadError(f"checkpoint is missing tensor {name + '.weight'!r} (shape {(rows, cols)})")
    if weight.dtype != E4M3:
        raise QuantizationError(
            f"{name}.weight is {weight.dtype}, but the quantization_config ({scheme.method}) says {name} is "
            "float8_e4m3fn"
        )
    scale = _pop(tensors, name, scheme.weight_scale_names)
    tensors[f"{name}.weight_scale"] = _row_scales(scale, name, rows, cols, scheme)
    tensors.pop(f"{name}.input_scale_ub", None)  # fbgemm's copy of activation_scale_ub
    if scheme.activations != "static":
        for suffix in scheme.input_scale_names:  # calibrated, but the scheme quantizes dynamically
            tensors.pop(f"{name}.{suffix}", None)
        return None
    return _scale_values(_pop(tensors, name, scheme.input_scale_names), name, scheme).reshape(())


def _pop(tensors: dict[str, torch.Tensor], name: str, suffixes: tuple[str, ...]) -> torch.Tensor:
    """Pop `name`'s tensor under the first of `suffixes` the checkpoint has."""
    for suffix in suffixes:
        if f"{name}.{suffix}" in tensors:
            return tensors.pop(f"{name}.{suffix}")
    spelled = " or ".join(repr(f"{name}.{suffix}") for suffix in suffixes)
    raise ModelLoadError(f"FP8 checkpoint is missing tensor {spelled}")


def _scale_values(scale: torch.Tensor, name: str, scheme: Fp8Scheme) -> torch.Tensor:
    """A checkpoint's scale as float32. UE8M0 scales may be stored as their bytes (uint8, as MXFP8
    checkpoints do): each byte b is the exponent of 2^(b-127), never the number b that `.float()`
    would make of it. An integer scale in any other scheme has no meaning the engine could guess."""
    if scale.dtype == torch.uint8 and scheme.ue8m0:
        return scale.view(torch.float8_e8m0fnu).float()
    if not scale.dtype.is_floating_point:
        raise QuantizationError(
            f"{name}'s scale is {scale.dtype}; the quantization_config ({scheme.method}) stores float scales"
            + ("" if scheme.method != "fp8" else ' (or uint8 bytes with scale_fmt "ue8m0")')
        )
    return scale.float()


def _row_scales(scale: torch.Tensor, name: str, rows: int, cols: int, scheme: Fp8Scheme) -> torch.Tensor:
    """A checkpoint's weight scale of a [rows, cols] weight as float32 [rows, groups]."""
    s = _scale_values(scale, name, scheme)
    if scheme.block:
        b, r = scheme.block, scheme.block_rows
        expected = (-(-rows // r), -(-cols // b))
        if tuple(s.shape) != expected:
            raise ModelLoadError(
                f"block scale has shape {tuple(s.shape)}, expected {expected} for a {rows}x{cols} weight"
            )
        return s.repeat_interleave(r, dim=0)[:rows].contiguous()
    if s.numel() == 1:
        return s.reshape(1, 1).expand(rows, 1).contiguous()
    if s.numel() == rows:
        return s.reshape(rows, 1).contiguous()
    raise ModelLoadError(
        f"weight scale has shape {tuple(s.shape)}: neither per tensor nor per channel of {rows} rows"
    )


def _dequantize_rest(tensors: dict[str, torch.Tensor], scheme: Fp8Scheme, taken: set[str]) -> None:
    """Dequantize, to float32, every FP8 weight of a module not in `taken` (the `Fp8Linear` parts
    and the experts kept in FP8)."""
    for key in [k for k, t in tensors.items() if t.dtype == E4M3 and k.removesuffix(".weight") not in taken]:
        name = key.removesuffix(".weight")
        scale = _weight_only_scales(tensors, name, scheme)
        tensors[key] = dequantize_groups(tensors[key], scale, scheme.block or tensors[key].shape[1])


def _weight_only_scales(tensors: dict[str, torch.Tensor], name: str, scheme: Fp8Scheme) -> torch.Tensor:
    """Part `name`'s weight scale popped in row form, its activation scales dropped: for weights
    whose inputs are not quantized (experts run W8A16, dequantized modules in high precision)."""
    rows, cols = tensors[f"{name}.weight"].shape
    scale = _row_scales(_pop(tensors, name, scheme.weight_scale_names), name, rows, cols, scheme)
    for suffix in (*scheme.input_scale_names, "input_scale_ub"):
        tensors.pop(f"{name}.{suffix}", None)
    return scale
