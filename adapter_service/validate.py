"""Checking an uploaded adapter before it is acknowledged, without torch or a GPU.

The safetensors header (8-byte little-endian length, then JSON) is parsed and every tensor's byte
range is checked against the file (spindle/safetensors_header.py, which the pods use too), so a
header that lies about offsets is refused instead of failing later on a pod. Shapes, layers and
rank are compared with the base model's projection shapes (adapter_service/base_model.py), which
come from the rules the pods load adapters by: for a DeepSeek (MLA) base the targets are its query,
latent and output projections, never `kv_b_proj`, and gate/up/down only on dense layers. Each
refusal names the field or tensor, and lists what this base accepts, because the reader is the
person who trained the adapter.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from adapter_service.base_model import BaseModel
from spindle.peft import (
    EXPERTS_KEY,
    LINEAR_ATTENTION_KEY,
    MLP_MODULES,
    bias_refusal,
    declared_base,
    declared_mismatch,
    linear_attention_refusal,
    target_refusal,
    unsupported_feature,
    untargetable,
)
from spindle.safetensors_header import HeaderError, TensorEntry, header_length, parse_header

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$"
)


class ValidationError(ValueError):
    """An adapter the cluster will not serve (INVALID_ARGUMENT), with the reason."""


@dataclass
class Summary:
    rank: int
    target_modules: list[str]


def check_name(name: str) -> str:
    """Names become S3 keys, Redis keys and pod cache directories: no path tricks, nothing odd."""
    if not NAME.fullmatch(name or "") or ".." in name:  # (match: "$" accepts a trailing newline)
        raise ValidationError(
            f"adapter name {name!r} is not allowed: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit, without '..'"
        )
    return name


def read_header(f: BinaryIO, size: int) -> dict[str, TensorEntry]:
    """The tensors of a safetensors file, each range checked to lie inside the file."""
    f.seek(0)
    try:
        n = header_length(f.read(8), size)
        return parse_header(f.read(n), size)
    except HeaderError as e:
        raise ValidationError(str(e)) from e


def parse_config(config_bytes: bytes, base: BaseModel) -> dict[str, Any]:
    try:
        config = json.loads(config_bytes)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValidationError(f"adapter_config.json is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise ValidationError("adapter_config.json is not a JSON object")

    def refuse(what: str) -> None:
        raise ValidationError(f"adapter_config.json: {what} is not supported")

    feature = unsupported_feature(config) or target_refusal(config, base.projection_shapes())
    if feature is not None:
        refuse(feature)
    return config


def validate(config_bytes: bytes, weights: Path, base: BaseModel, max_rank: int) -> Summary:
    """Everything a pod would check, done before a byte is stored."""
    config = parse_config(config_bytes, base)
    size = weights.stat().st_size
    with open(weights, "rb") as f:
        tensors = read_header(f, size)
    shapes = base.projection_shapes()
    pairs: dict[tuple[int, str], dict[str, list[int]]] = {}
    for key, t in tensors.items():
        bias = bias_refusal(key, config)
        if bias is not None:
            raise ValidationError(bias)
        if EXPERTS_KEY.search(key):
            raise ValidationError(
                f"tensor {key!r} adapts mixture-of-experts experts, which no pod serves: target "
                f"{_attention(shapes)} there ({_dense_layers(base)})"
            )
        linear = LINEAR_ATTENTION_KEY.search(key)
        if linear is not None:
            raise ValidationError(f"tensor {key!r}: {linear_attention_refusal(int(linear.group(1)), shapes)}")
        m = _KEY.fullmatch(key)
        if m is None:
            raise ValidationError(f"tensor {key!r} is not a LoRA A/B weight of a decoder layer projection")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in shapes:
            raise ValidationError(f"tensor {key!r} targets {module!r}: {untargetable(module, shapes)}")
        if layer >= base.num_layers:
            raise ValidationError(f"tensor {key!r} names layer {layer}; {base.name} has {base.num_layers}")
        if module not in MLP_MODULES and layer in base.linear_layers:
            raise ValidationError(f"tensor {key!r}: {linear_attention_refusal(layer, shapes)}")
        if module in MLP_MODULES and layer in base.moe_layers:
            raise ValidationError(
                f"tensor {key!r} targets {module!r} of layer {layer}, a mixture-of-experts layer, whose "
                f"experts carry no LoRA: target {_attention(shapes)} there ({_dense_layers(base)})"
            )
        pairs.setdefault((layer, module), {})[ab] = list(t.shape)
    if not pairs:
        raise ValidationError("adapter_model.safetensors holds no LoRA weights")
    rank = 0
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ValidationError(f"layer {layer} {module}: has lora_{''.join(ab)} but not both A and B")
        a, b = ab["A"], ab["B"]
        in_f, out_f = shapes[module]
        r = a[0] if len(a) == 2 else -1
        if a != [r, in_f] or b != [out_f, r]:
            raise ValidationError(
                f"layer {layer} {module}: lora_A {a} and lora_B {b}; {base.name} needs "
                f"[r, {in_f}] and [{out_f}, r]: made for another base model?{declared_base(config)}"
            )
        if r > max_rank:
            raise ValidationError(
                f"layer {layer} {module}: rank {r} is above the limit {max_rank} (--max-lora-rank)"
            )
        wrong = declared_mismatch(config, layer, module, r)
        if wrong is not None:
            raise ValidationError(f"adapter_config.json: {wrong}")
        rank = max(rank, r)
    return Summary(rank, sorted({module for _, module in pairs}))


def _attention(shapes: dict[str, tuple[int, int]]) -> str:
    """The base's attention targets, the ones an MoE layer can carry."""
    return ", ".join(m for m in shapes if m not in MLP_MODULES)


def _dense_layers(base: BaseModel) -> str:
    """Where gate/up/down may go, for an author restricting them (PEFT's `layers_to_transform`)."""
    dense = [i for i in range(base.num_layers) if i not in base.moe_layers]
    if not dense:
        return "every layer is mixture-of-experts: no gate/up/down targets"
    shown = ", ".join(map(str, dense[:16])) + (", ..." if len(dense) > 16 else "")
    return f"gate/up/down only on the dense layers: {shown}"
