"""Read a GGUF file into a `ModelConfig` and HF-named float32 tensors.

Quantized tensors are dequantized once at load (the compute dtype is float32 on CPU and
bfloat16 on GPU), and the float32 result kept for the next load of the same file
(`gguf_cache`: seconds of numpy a load otherwise). llama.cpp's converter permutes the rows of
Llama q/k projections for its interleaved RoPE; we undo that so the weights match the HF
half-rotation layout.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from model_service.errors import ModelLoadError
from model_service.models import gguf_cache
from model_service.models.config import ModelConfig

# What the cached tensors depend on besides the file: this module's code (names, layouts).
_CONVERSION = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()

_FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _required(reader: Any, key: str) -> Any:
    value = _field(reader, key)
    if value is None:
        raise ModelLoadError(f"GGUF file lacks required metadata key {key!r}")
    return value


def _layer_value(reader: Any, key: str, default: Any = None) -> Any:
    """A value every layer shares (required where `default` is None). llama.cpp accepts a
    per-layer array for head counts and FFN widths (`get_key_or_arr`); one whose layers all agree
    is that value, and layers that differ are refused by name (the model is built with one shape
    for every layer)."""
    value = _field(reader, key, default) if default is not None else _required(reader, key)
    if not isinstance(value, list):
        return value
    if not value or any(v != value[0] for v in value):
        raise ModelLoadError(
            f"GGUF metadata {key!r} differs between layers ({value}), which is not supported"
        )
    return value[0]


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
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e
    fields = _config_fields(reader, path)
    tensors = _tensors(reader, fields["family"], fields["num_heads"], fields["num_kv_heads"])

    def write(entry: Path) -> None:
        (entry / "config.json").write_text(json.dumps(fields))
        save_file(tensors, entry / "model.safetensors")

    gguf_cache.store(path, "weights", write, _CONVERSION)
    return ModelConfig(**fields), tensors


def _config_fields(reader: Any, path: Path) -> dict[str, Any]:
    """`ModelConfig`'s fields from the file's metadata (plain values: the cache keeps them as JSON)."""
    _refuse_split(reader, path)
    arch = _field(reader, "general.architecture")
    if arch not in _FAMILIES:
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported; supported: {sorted(_FAMILIES)}")

    def number(key: str, default: Any = None) -> Any:
        return _layer_value(reader, f"{arch}.{key}", default)

    heads, hidden = int(number("attention.head_count")), int(number("embedding_length"))
    names = {t.name for t in reader.tensors}
    token_embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if token_embd is None:
        raise ModelLoadError(f"GGUF file {path.name} has no 'token_embd.weight' tensor")
    head_dim = int(number("attention.key_length", hidden // heads))
    _refuse_rope_variants(reader, arch, names, path, head_dim)
    return {
        "family": _FAMILIES[arch],
        "vocab_size": int(number("vocab_size", token_embd.shape[-1])),
        "hidden_size": hidden,
        "intermediate_size": int(number("feed_forward_length")),
        "num_layers": int(number("block_count")),
        "num_heads": heads,
        "num_kv_heads": int(number("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(number("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(number("context_length", 2048)),
        "rope_theta": float(number("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "qkv_bias": "blk.0.attn_q.bias" in names,
        "o_proj_bias": "blk.0.attn_output.bias" in names,
        "mlp_bias": "blk.0.ffn_up.bias" in names,
        "qk_norm": "blk.0.attn_q_norm.weight" in names,
        "eos_token_ids": _end_of_generation_ids(reader),
        "bos_token_id": _optional_int(_field(reader, "tokenizer.ggml.bos_token_id")),
    }


def _refuse_split(reader: Any, path: Path) -> None:
    """A shard of a split model (`llama-gguf-split`) holds only its own tensors: read alone, the
    others would be reported "missing" without a word of the split."""
    shards = int(_field(reader, "split.count", 1))
    if shards > 1:
        raise ModelLoadError(
            f"GGUF file {path.name} is shard {int(_field(reader, 'split.no', 0)) + 1} of {shards} of a "
            "split model, which the GGUF loader does not read; merge the shards into one file "
            "first (`llama-gguf-split --merge`)"
        )


def _end_of_generation_ids(reader: Any) -> list[int]:
    """The tokens that end a generation: llama.cpp stops on the end-of-turn and end-of-message
    tokens as on EOS (its `special_eog_ids`); a chat model whose EOS is its end-of-text token
    (Llama-3-Instruct: `<|eot_id|>` is its EOT) would otherwise run on past its turn."""
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    ids = [int(v) for v in (_field(reader, k) for k in keys) if v is not None]
    return list(dict.fromkeys(ids))


def _optional_int(value: Any) -> int | None:
    return int(value) if value is not None else None


def _refuse_rope_variants(reader: Any, arch: str, names: set[str], path: Path, head_dim: int) -> None:
    """RoPE the loader cannot apply: loading it as plain RoPE would run, and answer wrongly. A
    scaling factor without a type is linear scaling (llama.cpp's default type; older files spell
    it `rope.scale_linear`), and a rotary dimension below the head's is partial RoPE."""
    factor = _field(reader, f"{arch}.rope.scaling.factor", _field(reader, f"{arch}.rope.scale_linear", 0.0))
    scaling = _field(
        reader, f"{arch}.rope.scaling.type", "linear" if float(factor) not in (0.0, 1.0) else "none"
    )
    if scaling != "none" or "rope_freqs.weight" in names:
        what = scaling if scaling != "none" else "rope_freqs.weight"
        raise ModelLoadError(
            f"GGUF file {path.name} uses RoPE scaling ({what}), "
            "which the GGUF loader does not support; load the HF checkpoint directory instead"
        )
    rotary = int(_layer_value(reader, f"{arch}.rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise ModelLoadError(
            f"GGUF file {path.name} rotates {rotary} of each head's {head_dim} dims "
            f"({arch}.rope.dimension_count: partial RoPE), which the GGUF loader does not support"
        )


def _tensors(reader: Any, family: str, heads: int, kv_heads: int) -> dict[str, torch.Tensor]:
    """Every tensor the model uses, dequantized to float32, under its HF name and layout."""
    import gguf

    _refuse_unknown_tensors(reader, family)
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        hf_name = _hf_name(t.name)
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


def _refuse_unknown_tensors(reader: Any, family: str) -> None:
    """A tensor without an HF name would be left out, and the model run without it: a Mixtral's
    experts (`ffn_gate_exps`), a norm's bias. As the HF loader refuses tensors its config does not
    use, so does this one, naming them."""
    unknown = sorted(t.name for t in reader.tensors if _hf_name(t.name) is None)
    if unknown:
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise ModelLoadError(
            f"GGUF file has tensors the {family} loader does not know: {unknown[:5]}{more}; "
            "a model run without them would answer wrongly"
        )


def _hf_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None
