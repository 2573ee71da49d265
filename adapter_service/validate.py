"""Checking an uploaded adapter before it is acknowledged, without torch or a GPU.

The safetensors header (8-byte little-endian length, then JSON) is parsed here and every tensor's
byte range is checked against the file, so a header that lies about offsets is refused instead of
failing later on a pod. Shapes, layers and rank are compared with the base model's projection
shapes (adapter_service/base_model.py). Each refusal names the field or tensor, because the reader
is the person who trained the adapter.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from adapter_service.base_model import BaseModel
from spindle.peft import LORA_MODULES, declared_mismatch, unsupported_feature

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$"
)
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1}
_MAX_HEADER = 16 << 20
# pickle protocol 2+ starts with 0x80; torch.save writes a zip archive of pickles.
_PICKLE_MAGIC = (b"\x80", b"PK\x03\x04")


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


def read_header(f: BinaryIO, size: int) -> dict[str, Any]:
    """The tensors of a safetensors file, each range checked to lie inside the file."""
    f.seek(0)
    head = f.read(8)
    if head[:1] in _PICKLE_MAGIC[:1] or head[:4] == _PICKLE_MAGIC[1]:
        raise ValidationError(
            "adapter_model.safetensors is a pickle (.bin/.pt) file; pickles can run code and are "
            "refused: save the adapter with safe_serialization=True"
        )
    if len(head) < 8:
        raise ValidationError(f"adapter_model.safetensors is {size} bytes: too short to be safetensors")
    (n,) = struct.unpack("<Q", head)
    if n > min(_MAX_HEADER, size - 8):
        raise ValidationError(
            f"adapter_model.safetensors claims a {n}-byte header in a {size}-byte file: not safetensors"
        )
    try:
        header = json.loads(f.read(n))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValidationError(f"adapter_model.safetensors header is not JSON: {e}") from e
    if not isinstance(header, dict):
        raise ValidationError("adapter_model.safetensors header is not a JSON object")
    data_size = size - 8 - n
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    for key, t in tensors.items():
        try:
            dtype, shape, (begin, end) = t["dtype"], [_whole(d) for d in t["shape"]], t["data_offsets"]
            begin, end = _whole(begin), _whole(end)
        except (KeyError, TypeError, ValueError) as e:
            raise ValidationError(f"tensor {key!r}: malformed header entry {str(t)[:200]}") from e
        if any(d < 0 for d in shape):
            raise ValidationError(f"tensor {key!r}: negative dimension in shape {shape}")
        if dtype not in _DTYPE_BYTES:
            raise ValidationError(f"tensor {key!r}: dtype {dtype} is not a float type a LoRA uses")
        want = math.prod(shape) * _DTYPE_BYTES[dtype]
        if not (0 <= begin <= end <= data_size) or end - begin != want:
            raise ValidationError(
                f"tensor {key!r}: header says bytes [{begin}, {end}) of {data_size} for shape {shape} "
                f"{dtype} ({want} bytes): the header lies about the file"
            )
    _check_tiling(
        sorted((t["data_offsets"][0], t["data_offsets"][1], k) for k, t in tensors.items()), data_size
    )
    return tensors


def _check_tiling(ranges: list[tuple[int, int, str]], data_size: int) -> None:
    """safetensors (and so every pod) refuses tensors that overlap or leave gaps: so do we, before storing."""
    at = 0
    for begin, end, key in ranges:
        if begin != at:
            raise ValidationError(
                f"tensor {key!r} starts at byte {begin}, not {at}: tensors overlap or leave a gap; "
                "the header lies about the file"
            )
        at = end
    if at != data_size:
        raise ValidationError(f"the tensors end at byte {at} of {data_size}: the header lies about the file")


def _whole(x: Any) -> int:
    """A header integer: JSON floats, strings and booleans are refused, not truncated."""
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{x!r} is not an integer")
    return x


def parse_config(config_bytes: bytes) -> dict[str, Any]:
    try:
        config = json.loads(config_bytes)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValidationError(f"adapter_config.json is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise ValidationError("adapter_config.json is not a JSON object")

    def refuse(what: str) -> None:
        raise ValidationError(f"adapter_config.json: {what} is not supported")

    feature = unsupported_feature(config)
    if feature is not None:
        refuse(feature)
    targets = config.get("target_modules") or []
    for t in [targets] if isinstance(targets, str) else targets:
        if isinstance(targets, list) and t not in LORA_MODULES:
            refuse(f"target module {t!r} (LoRA targets: {', '.join(LORA_MODULES)})")
    return config


def validate(config_bytes: bytes, weights: Path, base: BaseModel, max_rank: int) -> Summary:
    """Everything a pod would check, done before a byte is stored."""
    config = parse_config(config_bytes)
    size = weights.stat().st_size
    with open(weights, "rb") as f:
        tensors = read_header(f, size)
    shapes = base.projection_shapes()
    pairs: dict[tuple[int, str], dict[str, list[int]]] = {}
    for key, t in tensors.items():
        m = _KEY.fullmatch(key)
        if m is None:
            raise ValidationError(f"tensor {key!r} is not a LoRA A/B weight of a decoder layer projection")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in shapes:
            raise ValidationError(
                f"tensor {key!r} targets {module!r}; LoRA targets: {', '.join(LORA_MODULES)}"
            )
        if layer >= base.num_layers:
            raise ValidationError(f"tensor {key!r} names layer {layer}; {base.name} has {base.num_layers}")
        pairs.setdefault((layer, module), {})[ab] = [int(d) for d in t["shape"]]
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
                f"[r, {in_f}] and [{out_f}, r]: made for another base model?"
            )
        if r > max_rank:
            raise ValidationError(f"layer {layer} {module}: rank {r} is above the limit {max_rank}")
        wrong = declared_mismatch(config, layer, module, r)
        if wrong is not None:
            raise ValidationError(f"adapter_config.json: {wrong}")
        rank = max(rank, r)
    return Summary(rank, sorted({module for _, module in pairs}))
