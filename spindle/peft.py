"""PEFT LoRA rules shared by the engine, which loads adapters, and the adapter service, which
validates uploads without torch: the projections a LoRA may target, their shapes on a base
model, and the `adapter_config.json` features Spindle does not run."""

from __future__ import annotations

import math
import re
from typing import Any

LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def projection_shapes(
    hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int
) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection a LoRA may target."""
    q, kv = heads * head_dim, kv_heads * head_dim
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, intermediate),
        "up_proj": (hidden, intermediate),
        "down_proj": (intermediate, hidden),
    }


def unsupported_feature(config: dict[str, Any]) -> str | None:
    """The first feature of a PEFT config that Spindle cannot serve, named for the adapter's
    author ("DoRA (use_dora=true)"), or None."""
    if config.get("peft_type", "LORA") != "LORA":
        return f"peft_type {config.get('peft_type')!r} (only LORA)"
    if config.get("use_dora"):
        return "DoRA (use_dora=true)"
    if config.get("modules_to_save"):
        return f"modules_to_save {config['modules_to_save']} (full-weight modules)"
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        return f"bias={config.get('bias')!r} (LoRA bias terms)"
    if config.get("fan_in_fan_out"):
        return "fan_in_fan_out=true (Conv1D-style weights)"
    return None


def module_path(layer: int, module: str) -> str:
    """The HF module path PEFT's rank_pattern / alpha_pattern keys are matched against."""
    return f"model.layers.{layer}.{'self_attn' if module[0] in 'qkvo' else 'mlp'}.{module}"


def pattern_value(patterns: dict[str, Any], key: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup: a pattern matches the end of the module path.
    Raises ValueError for a pattern that is not a regular expression."""
    for pattern, value in patterns.items():
        try:
            if re.match(rf"(.*\.)?({pattern})$", key):
                return value
        except re.error as e:
            raise ValueError(f"pattern {pattern!r} is not a regular expression: {e}") from e
    return default


def declared_mismatch(config: dict[str, Any], layer: int, module: str, rank: int) -> str | None:
    """How `adapter_config.json` misdescribes one module's tensors of rank `rank` (PEFT scales by the
    config's r and lora_alpha, so a config that lies changes the adapter's output), or None."""
    path = module_path(layer, module)
    try:
        r = pattern_value(config.get("rank_pattern") or {}, path, config.get("r", rank))
        alpha = pattern_value(config.get("alpha_pattern") or {}, path, config.get("lora_alpha", 8))
    except (ValueError, AttributeError) as e:
        return f"rank_pattern / alpha_pattern: {e}"
    if rank < 1:
        return f"{path} has rank {rank}; a LoRA needs rank >= 1"
    if r != rank or isinstance(r, bool):
        return f"{path} has rank {rank} but the config says r={r!r}: the config lies about the weights"
    if (
        isinstance(alpha, bool)
        or not isinstance(alpha, (int, float))
        or not math.isfinite(alpha)
        or alpha <= 0
    ):
        return f"lora_alpha {alpha!r} for {path} must be a finite number > 0"
    targets = config.get("target_modules")
    if isinstance(targets, list) and module not in targets:
        return f"{path} has weights but target_modules {targets} does not name {module!r}"
    return None
