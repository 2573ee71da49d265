"""Which FP8 scheme a checkpoint's `quantization_config` describes, normalized to one `Fp8Scheme`.

Three producers ship FP8 checkpoints, each spelling the same few choices its own way:
- compressed-tensors (llm-compressor, vLLM's own format): `format: float-quantized` (older files
  say `naive-quantized`), one config group whose `weights` are 8-bit floats per tensor, per
  channel, in 128x128 blocks or in groups of 128 columns of a row, and whose `input_activations`
  are dynamic per token (per 128-column group with blocks or groups), static per tensor (an
  `input_scale` tensor per projection), or absent (weight-only); `ignore` lists names or `re:`
  patterns left in high precision.
- HF `fbgemm_fp8`: per-channel weights, dynamic per-token activations whose row maximum is capped
  at `activation_scale_ub`; `modules_to_not_convert` name modules left alone (HF's patterns).
- HF `fp8` (FineGrainedFP8, DeepSeek's): 128x128 weight blocks (`weight_scale_inv`) with dynamic
  per-token-group activations; without `weight_block_size`, AutoFP8's per-tensor weights with a
  static or dynamic activation scheme. `scale_fmt: ue8m0` scales are powers of two, stored as
  floats or as their e8m0 bytes.
Anything else is refused by name: a wrong guess at a scale's meaning gives a model that runs and
talks nonsense, which is worse than no model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from model_service.errors import ModelLoadError

BLOCK = 128  # the only block and group size supported: DeepSeek's 128x128, and groups of 128 columns

SUPPORTED = (
    "compressed-tensors (float-quantized or naive-quantized, 8-bit float weights per tensor, channel, "
    "128x128 block or 128-column group; activations dynamic per token, static per tensor, or none), "
    "fbgemm_fp8, fp8 (weight_block_size [128, 128] or per-tensor)"
)


class QuantizationError(ModelLoadError, ValueError):
    """A checkpoint quantized in a scheme the engine does not run (or describes inconsistently)."""


@dataclass(frozen=True)
class Fp8Scheme:
    """One FP8 scheme as the engine runs it: e4m3 weights with float32 scales, one per output row
    (`block` None: per channel; a per-tensor scale is repeated down the rows) or one per row and
    `block` input columns (block-wise), and activations quantized `dynamic`ally (per token, or
    per token and `block` columns), `static`ally (the checkpoint's per-tensor `input_scale`) or
    not at all (`none`: weight-only)."""

    method: str  # config.json's quant_method, or "online" for --quantization fp8 / fp8-g128
    block: int | None = None
    block_rows: int = BLOCK  # rows a checkpoint's block scale covers: 128 (128x128), 1 (groups of a row)
    activations: str = "dynamic"
    activation_scale_ub: float | None = None  # fbgemm: per-token maxima are capped here
    ignore: tuple[str, ...] = ()  # modules kept in high precision
    hf_patterns: bool = False  # `ignore` is HF's modules_to_not_convert (see `_hf_skips`), not exact names
    ue8m0: bool = False  # HF fp8's scale_fmt "ue8m0": power-of-two scales, stored as float or as bytes

    @property
    def weight_scale_names(self) -> tuple[str, ...]:
        """The checkpoint's suffixes of a weight's scale, the first present read. HF fp8's spellings
        differ by producer, all multiplying: DeepSeek's blocks `weight_scale_inv` (misnamed), which
        transformers' FineGrainedFP8 also writes for a per-tensor scale, and AutoFP8's `weight_scale`."""
        if self.method != "fp8":
            return ("weight_scale",)
        return ("weight_scale_inv", "weight_scale") if self.block else ("weight_scale", "weight_scale_inv")

    @property
    def input_scale_names(self) -> tuple[str, ...]:
        """The suffixes of a static activation scale: `input_scale`, or transformers' FineGrainedFP8
        `activation_scale`."""
        return ("input_scale", "activation_scale") if self.method == "fp8" else ("input_scale",)

    def quantizes(self, name: str) -> bool:
        """Whether the linear module `name` (checkpoint spelling, `model.layers.0.mlp.up_proj`)
        holds FP8 weights."""
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], name):
                    return False
            elif _hf_skips(pattern, name) if self.hf_patterns else pattern == name:
                return False
        return True


def _hf_skips(pattern: str, name: str) -> bool:
    """Whether HF's `modules_to_not_convert` entry `pattern` names module `name`, as transformers'
    `should_convert_module` decides: a regex matching from the start of the name up to a module
    boundary ("model.layers.1" is layer 1, not layers 10-19), or a suffix ("mlp.gate" is the
    router, not `mlp.gate_proj`). A plain substring test got both wrong: a dense layer's gate_proj
    then counted as unquantized (its checkpoint refused), layers 10-19 ran dequantized."""
    try:
        at_start = re.match(rf"(?:{pattern})(?:(?<=\.)|(?=\.|$))", name)
    except re.error as e:
        raise QuantizationError(
            f"modules_to_not_convert entry {pattern!r} is not a valid pattern: {e}"
        ) from e
    return at_start is not None or name.endswith(pattern)


ONLINE = Fp8Scheme(method="online")  # --quantization fp8: per-channel weights, per-token activations
# --quantization fp8-g128: a scale per output row and 128 input columns, activations per token and
# 128 columns. Finer scales lose less: SmolLM2's perplexity +1.9% where per channel loses +4.6%
# (docs/quantization.md, "Quality"); on CUDA it needs cuBLASLt's 1x128 block scaling (sm90).
ONLINE_G128 = Fp8Scheme(method="online", block=BLOCK, block_rows=1)
ONLINE_SCHEMES = {"fp8": ONLINE, "fp8-g128": ONLINE_G128}  # --quantization's values besides none


def quantization_scheme(raw: dict[str, Any] | None) -> Fp8Scheme | None:
    """The scheme of a `quantization_config` (None: an unquantized checkpoint)."""
    if not raw:
        return None
    method = raw.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(raw)
    if method == "fbgemm_fp8":
        ub = raw.get("activation_scale_ub")
        return Fp8Scheme(
            method=method,
            activation_scale_ub=float(ub) if ub is not None else None,
            ignore=tuple(raw.get("modules_to_not_convert") or ()),
            hf_patterns=True,
        )
    if method == "fp8":
        return _hf_fp8(raw)
    raise QuantizationError(
        f"unsupported quantization scheme quant_method={method!r}; supported: {SUPPORTED}"
    )


def _hf_fp8(raw: dict[str, Any]) -> Fp8Scheme:
    if raw.get("fmt", "e4m3") != "e4m3":
        raise QuantizationError(f"unsupported fp8 format fmt={raw['fmt']!r}; supported: e4m3")
    for key, supported in (("scale_fmt", ("float", "ue8m0")), ("expert_dtype", ("fp8",))):
        if raw.get(key, supported[0]) not in supported:
            raise QuantizationError(f"unsupported fp8 {key}={raw[key]!r}; supported: {', '.join(supported)}")
    block = raw.get("weight_block_size")
    activations = raw.get("activation_scheme", "dynamic")
    if block is not None and (list(block) != [BLOCK, BLOCK] or activations != "dynamic"):
        raise QuantizationError(
            f"unsupported fp8 scheme weight_block_size={block}, activation_scheme={activations!r}; "
            f"supported: weight_block_size [{BLOCK}, {BLOCK}] with dynamic activations"
        )
    if activations not in ("dynamic", "static"):
        raise QuantizationError(
            f"unsupported fp8 activation_scheme {activations!r}; supported: dynamic, static"
        )
    return Fp8Scheme(
        method="fp8",
        block=BLOCK if block else None,
        activations=activations,
        # HF's spelling, then AutoFP8's
        ignore=tuple(raw.get("modules_to_not_convert") or raw.get("ignored_layers") or ()),
        hf_patterns=True,
        ue8m0=raw.get("scale_fmt") == "ue8m0",
    )


def _compressed_tensors(raw: dict[str, Any]) -> Fp8Scheme:
    _refuse_sparsity_and_runtime_transforms(raw)
    groups = list((raw.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise QuantizationError(
            f"compressed-tensors checkpoint with {len(groups)} config groups; supported: exactly one"
        )
    group = groups[0]
    fmt = group.get("format") or raw.get("format")
    weights, acts = group.get("weights") or {}, group.get("input_activations")
    described = f"compressed-tensors format={fmt!r} weights={weights} input_activations={acts}"
    if fmt not in FLOAT_FORMATS or not _symmetric_fp8(weights):
        raise QuantizationError(f"unsupported quantization scheme {described}; supported: {SUPPORTED}")
    strategy = weights.get("strategy")
    block = BLOCK if strategy in ("block", "group") else None
    if strategy not in ("tensor", "channel", "block", "group") or (
        (strategy == "block" and list(weights.get("block_structure") or ()) != [BLOCK, BLOCK])
        or (strategy == "group" and weights.get("group_size") != BLOCK)
    ):
        raise QuantizationError(f"unsupported weight strategy in {described}; supported: {SUPPORTED}")
    activations = _ct_activations(acts, block, described)
    rows = 1 if strategy == "group" else BLOCK
    return Fp8Scheme("compressed-tensors", block, rows, activations, ignore=tuple(raw.get("ignore") or ()))


# naive-quantized: what compressed-tensors before 0.6 called float-quantized (weights in their
# quantized dtype, e4m3 for 8-bit floats), as neuralmagic/Meta-Llama-3.1-8B-Instruct-FP8 ships
FLOAT_FORMATS = ("float-quantized", "naive-quantized")
MERGED_TRANSFORMS = ("weight_input", "weight_output")  # applied to the stored weights themselves


def _refuse_sparsity_and_runtime_transforms(raw: dict[str, Any]) -> None:
    """compressed-tensors' companions of a quantization: a sparse format stores weights as values
    and masks the loader does not read; a transform applied at run time (QuIP's and SpinQuant's
    online Hadamards on a projection's input or output, the attention's queries or K cache)
    rotates what the stored weights were rotated to expect, so without it the model runs and
    talks nonsense. Transforms merged into the weights need nothing at run time."""
    sparsity = raw.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        raise QuantizationError(
            f"unsupported compressed-tensors sparsity_config format={sparsity['format']!r}; supported: dense"
        )
    for name, transform in ((raw.get("transform_config") or {}).get("config_groups") or {}).items():
        at_run_time = [
            a.get("location")
            for a in transform.get("apply") or ()
            if a.get("location") not in MERGED_TRANSFORMS
        ]
        if at_run_time:
            raise QuantizationError(
                f"unsupported compressed-tensors transform {name!r} ({transform.get('type')}) applied at run "
                f"time at {at_run_time}; supported: transforms merged into the weights {MERGED_TRANSFORMS}"
            )


def _symmetric_fp8(args: dict[str, Any]) -> bool:
    """8-bit float without zero points (an asymmetric scheme would need them)."""
    return args.get("type", "float") == "float" and args.get("num_bits") == 8 and args.get("symmetric", True)


def _ct_activations(acts: dict[str, Any] | None, block: int | None, described: str) -> str:
    """Dynamic per-tensor activations run per token too: no calibrated value to honour, and
    finer scales lose less."""
    if acts is None:
        return "none"
    if not _symmetric_fp8(acts):
        raise QuantizationError(f"unsupported activations in {described}; supported: symmetric 8-bit float")
    strategy = (acts.get("strategy"), acts.get("group_size"))
    if acts.get("dynamic") and (
        strategy == ("group", BLOCK) if block else strategy[0] in ("token", "tensor")
    ):
        return "dynamic"
    if not acts.get("dynamic") and acts.get("strategy") == "tensor" and not block:
        return "static"
    need = "dynamic per-token-group 128" if block else "dynamic or static per-tensor, dynamic per-token"
    raise QuantizationError(f"unsupported activations in {described}; supported with these weights: {need}")
