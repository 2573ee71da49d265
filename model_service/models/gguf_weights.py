"""Read a GGUF file into a `ModelConfig` and HF-named float32 tensors.

Quantized tensors are dequantized once at load (the compute dtype is float32 on CPU and
bfloat16 on GPU), and the float32 result kept for the next load of the same file
(`gguf_cache`: seconds of numpy a load otherwise). llama.cpp's converter permutes the rows of
Llama q/k projections for its interleaved RoPE; we undo that so the weights match the HF
half-rotation layout. The config, and what the loader refuses, are read by the torch-free
rules the adapter service checks a GGUF base model by (spindle/gguf_metadata.py).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from model_service.errors import ModelLoadError
from model_service.models import gguf_cache
from model_service.models.config import ModelConfig
from spindle import gguf_metadata

# What the cached config and tensors depend on besides the file: the code that reads them (this
# module's layouts, the shared module's config fields and names).
_CONVERSION = hashlib.sha256(
    Path(gguf_metadata.__file__).read_bytes() + Path(__file__).read_bytes()
).hexdigest()


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama_rows(hf_name: str, data: np.ndarray, heads: int, kv_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation. Its converter permutes `q_proj.bias` and
    `k_proj.bias` exactly as the weights (a Llama with `attention_bias`), so both are undone."""
    if ".q_proj." in hf_name:
        return _unpermute(data, heads)
    if ".k_proj." in hf_name:
        return _unpermute(data, kv_heads)
    return data


def read_gguf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The config and float32 tensors of a GGUF file: from the conversion cache when an earlier
    load left them there (no parse of the file at all: `GGUFReader` alone takes ~3 s on
    SmolLM2's 49k-token vocabulary), else converted, then cached."""
    with gguf_cache.converting(path, "weights", _CONVERSION):
        return _read_or_convert(path)


def _read_or_convert(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file, save_file

    cached = gguf_cache.lookup(path, "weights", _CONVERSION)
    if cached is not None:
        try:
            fields = json.loads((cached / "config.json").read_text())
            return ModelConfig(**fields), load_file(cached / "model.safetensors")
        except (OSError, ValueError, TypeError, SafetensorError):
            gguf_cache.discard(cached)
    try:
        reader = gguf_metadata.open_reader(path)
        fields = gguf_metadata.model_config(reader, path)
    except gguf_metadata.GgufError as e:
        raise ModelLoadError(str(e)) from e
    tensors = _tensors(reader, fields["family"], fields["num_heads"], fields["num_kv_heads"])

    def write(entry: Path) -> None:
        (entry / "config.json").write_text(json.dumps(fields))
        save_file(tensors, entry / "model.safetensors")

    gguf_cache.store(path, "weights", write, _CONVERSION)
    return ModelConfig(**fields), tensors


def _tensors(reader: Any, family: str, heads: int, kv_heads: int) -> dict[str, torch.Tensor]:
    """Every tensor the model uses, dequantized to float32, under its HF name and layout."""
    import gguf

    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        hf_name = gguf_metadata.hf_name(t.name)
        if hf_name is None:
            continue
        try:
            data = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as e:  # e.g. a quantization type this gguf version cannot dequantize
            raise ModelLoadError(f"cannot dequantize GGUF tensor {t.name!r} ({t.tensor_type!r}): {e}") from e
        data = np.array(data, dtype=np.float32).reshape(tuple(reversed([int(d) for d in t.shape])))
        if family == "llama":
            data = _llama_rows(hf_name, data, heads, kv_heads)
        tensors[hf_name] = torch.from_numpy(np.ascontiguousarray(data))
    return tensors
