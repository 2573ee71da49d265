"""The safetensors header, parsed and checked without torch: shared by the adapter service, which
validates uploads, and the engine, which converts each tensor straight from the file's bytes into
its place in an adapter's host buffer (model_service/lora/reading.py).

A file is an 8-byte little-endian header length, the header (JSON: name -> dtype, shape and byte
range in the data that follows; `__metadata__` aside), then the data. Every range is checked to
lie inside the file, to hold exactly its shape's bytes, and the ranges to tile the data without
overlap or gap (as the safetensors library requires), so a header that lies about the file is
refused here instead of reading outside a tensor's bytes.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Any

# The float types a LoRA's weights come in, and their bytes per element.
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1}
MAX_HEADER = 16 << 20
# pickle protocol 2+ starts with 0x80; torch.save writes a zip archive of pickles.
_PICKLE_MAGIC = (b"\x80", b"PK\x03\x04")


class HeaderError(ValueError):
    """A file that is not safetensors, or whose header lies about it; the message names why."""


@dataclass(frozen=True)
class TensorEntry:
    dtype: str  # a key of DTYPE_BYTES
    shape: tuple[int, ...]
    begin: int  # byte range in the data, which follows the header
    end: int


def header_length(head: bytes, size: int) -> int:
    """The header's length from a file's first 8 bytes (`size`: the file's). A length whose low
    byte is 0x80 (a header of 384, 640, ... bytes) starts as a pickle does, so the pickle
    message is only for a file whose first 8 bytes are no length that fits it."""
    n = struct.unpack("<Q", head[:8])[0] if len(head) >= 8 else None
    if n is not None and n <= min(MAX_HEADER, size - 8):
        return n
    if head[:1] == _PICKLE_MAGIC[0] or head[:4] == _PICKLE_MAGIC[1]:
        raise HeaderError(
            "adapter_model.safetensors is a pickle (.bin/.pt) file; pickles can run code and are "
            "refused: save the adapter with safe_serialization=True"
        )
    if n is None:
        raise HeaderError(f"adapter_model.safetensors is {size} bytes: too short to be safetensors")
    raise HeaderError(
        f"adapter_model.safetensors claims a {n}-byte header in a {size}-byte file: not safetensors"
    )


def parse_header(text: bytes, size: int) -> dict[str, TensorEntry]:
    """The tensors that the header `text` (the `header_length` bytes after the first 8) of a file
    of `size` bytes describes, in the header's order."""
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HeaderError(f"adapter_model.safetensors header is not JSON: {e}") from e
    if not isinstance(header, dict):
        raise HeaderError("adapter_model.safetensors header is not a JSON object")
    data_size = size - 8 - len(text)
    tensors = {k: _entry(k, t, data_size) for k, t in header.items() if k != "__metadata__"}
    _check_tiling(sorted((t.begin, t.end, k) for k, t in tensors.items()), data_size)
    return tensors


def _entry(key: str, t: Any, data_size: int) -> TensorEntry:
    try:
        dtype, shape, (begin, end) = t["dtype"], tuple(_whole(d) for d in t["shape"]), t["data_offsets"]
        begin, end = _whole(begin), _whole(end)
    except (KeyError, TypeError, ValueError) as e:
        raise HeaderError(f"tensor {key!r}: malformed header entry {str(t)[:200]}") from e
    if any(d < 0 for d in shape):
        raise HeaderError(f"tensor {key!r}: negative dimension in shape {list(shape)}")
    if dtype not in DTYPE_BYTES:
        raise HeaderError(f"tensor {key!r}: dtype {dtype} is not a float type a LoRA uses")
    want = math.prod(shape) * DTYPE_BYTES[dtype]
    if not (0 <= begin <= end <= data_size) or end - begin != want:
        raise HeaderError(
            f"tensor {key!r}: header says bytes [{begin}, {end}) of {data_size} for shape {list(shape)} "
            f"{dtype} ({want} bytes): the header lies about the file"
        )
    return TensorEntry(dtype, shape, begin, end)


def _check_tiling(ranges: list[tuple[int, int, str]], data_size: int) -> None:
    """safetensors (and so every pod) refuses tensors that overlap or leave gaps: so do we."""
    at = 0
    for begin, end, key in ranges:
        if begin != at:
            raise HeaderError(
                f"tensor {key!r} starts at byte {begin}, not {at}: tensors overlap or leave a gap; "
                "the header lies about the file"
            )
        at = end
    if at != data_size:
        raise HeaderError(f"the tensors end at byte {at} of {data_size}: the header lies about the file")


def _whole(x: Any) -> int:
    """A header integer: JSON floats, strings and booleans are refused, not truncated."""
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{x!r} is not an integer")
    return x
