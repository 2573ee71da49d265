"""PEFT LoRA rules shared by the engine, which loads adapters, and the adapter service, which
validates uploads without torch: the projections a LoRA may target, their shapes on a base
model, and the `adapter_config.json` features Spindle does not run."""

from __future__ import annotations

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
