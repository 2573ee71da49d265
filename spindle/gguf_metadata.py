"""A GGUF file's model metadata, read and checked without torch (numpy-only `gguf`).

The pods load a GGUF file (model_service/models/gguf_weights.py) and the adapter service checks
uploads against one as its base model (adapter_service/base_model.py); both read its config here,
by one set of rules, so an adapter is accepted at upload exactly for a base the pods serve. The
rules: the architectures the engine runs, head counts and FFN widths as llama.cpp reads them
(a per-layer array whose layers all agree is that value), and refusal by name of what the engine
would otherwise drop and run without (RoPE scaling, partial RoPE, layers that differ, tensors
without an HF name, a split model's shard).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

# GGUF `general.architecture` -> the engine's family (model_service/models/config.py). Gemma's
# are left out (refused, not served wrong): llama.cpp's converter stores their norms' weights plus
# one, and spells soft-caps, sliding layers and RoPE bases in its own metadata, none read here.
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
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


class GgufError(ValueError):
    """A GGUF file the engine cannot serve, or cannot read; the message names why."""


def open_reader(path: Path) -> Any:
    """The file's `gguf.GGUFReader` (its metadata and tensor table; tensor data stays on disk)."""
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:
        raise GgufError(f"cannot read GGUF file {path}: {e}") from e


def model_config(reader: Any, path: Path) -> dict[str, Any]:
    """`ModelConfig`'s fields from the file's metadata (plain values, so a cache can keep them as
    JSON), after every refusal: a file this returns for is one the pods load."""
    fields = _config_fields(reader, path)
    _refuse_unknown_tensors(reader, fields["family"])
    return fields


def hf_name(name: str) -> str | None:
    """An HF checkpoint's name for a GGUF tensor's, or None for one the engine does not know."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _required(reader: Any, key: str) -> Any:
    value = _field(reader, key)
    if value is None:
        raise GgufError(f"GGUF file lacks required metadata key {key!r}")
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
        raise GgufError(f"GGUF metadata {key!r} differs between layers ({value}), which is not supported")
    return value[0]


def _config_fields(reader: Any, path: Path) -> dict[str, Any]:
    _refuse_split(reader, path)
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GgufError(f"GGUF architecture {arch!r} is not supported; supported: {sorted(ARCHITECTURES)}")

    def number(key: str, default: Any = None) -> Any:
        return _layer_value(reader, f"{arch}.{key}", default)

    heads, hidden = int(number("attention.head_count")), int(number("embedding_length"))
    names = {t.name for t in reader.tensors}
    token_embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if token_embd is None:
        raise GgufError(f"GGUF file {path.name} has no 'token_embd.weight' tensor")
    head_dim = int(number("attention.key_length", hidden // heads))
    _refuse_rope_variants(reader, arch, names, path, head_dim)
    return {
        "family": ARCHITECTURES[arch],
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
        raise GgufError(
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
        raise GgufError(
            f"GGUF file {path.name} uses RoPE scaling ({what}), "
            "which the GGUF loader does not support; load the HF checkpoint directory instead"
        )
    rotary = int(_layer_value(reader, f"{arch}.rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise GgufError(
            f"GGUF file {path.name} rotates {rotary} of each head's {head_dim} dims "
            f"({arch}.rope.dimension_count: partial RoPE), which the GGUF loader does not support"
        )


def _refuse_unknown_tensors(reader: Any, family: str) -> None:
    """A tensor without an HF name would be left out, and the model run without it: a Mixtral's
    experts (`ffn_gate_exps`), a norm's bias. As the HF loader refuses tensors its config does not
    use, so does this one, naming them."""
    unknown = sorted(t.name for t in reader.tensors if hf_name(t.name) is None)
    if unknown:
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise GgufError(
            f"GGUF file has tensors the {family} loader does not know: {unknown[:5]}{more}; "
            "a model run without them would answer wrongly"
        )
