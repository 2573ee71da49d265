"""MoE checkpoint tensors -> the stacked expert tensors the model holds.

Two layouts exist for the same weights. Hub checkpoints (and transformers 5.x `save_pretrained`,
which converts back by default) keep one tensor per expert and projection:
`mlp.experts.{e}.{gate,up,down}_proj.weight` (Qwen) or `block_sparse_moe.experts.{e}.{w1,w3,w2}.weight`
(Mixtral: w1 gate, w3 up, w2 down; `block_sparse_moe.gate` the router). transformers 5.x in
memory, and `save_pretrained(save_original_format=False)`, has `mlp.experts.gate_up_proj`
[E, 2I, H] (each expert's gate rows, then its up rows) and `mlp.experts.down_proj` [E, H, I]:
the per-expert [out, in] matrices stacked on a new first dimension, not transposed. The model
uses the second; this turns the first into it so the loader's name and shape checks see one form.
"""

from __future__ import annotations

import re

import torch

from model_service.errors import ModelLoadError
from model_service.models.config import ModelConfig
from model_service.models.moe import shared_expert_slots

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # an expert's tensors, by their hub names
_MIXTRAL_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_MIXTRAL_EXPERT = re.compile(r"\.experts\.(\d+)\.(w[123])\.(weight|weight_scale)$")


def stack_expert_tensors(tensors: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """`tensors` with each MoE layer's per-expert tensors replaced by the stacked pair (a layer
    already stacked is left alone). A missing expert tensor, or a layer in both layouts, is an error."""
    out = {hf_expert_name(k): v for k, v in tensors.items()}
    slots = shared_expert_slots(config)
    shared_name = "shared_expert" if config.shared_expert_gated else "shared_experts"
    for layer, kind in enumerate(config.layer_kinds):
        if kind.moe:
            mlp = f"model.layers.{layer}.mlp"
            shared = _shared_slots(out, f"{mlp}.{shared_name}", slots, config) if slots else ((), (), ())
            _stack_layer(out, f"{mlp}.experts", config.num_experts, shared)
    return out


Slots = tuple[tuple[torch.Tensor, ...], ...]  # (gates, ups, downs): an expert's tensors each


def _shared_slots(tensors: dict[str, torch.Tensor], prefix: str, slots: int, config: ModelConfig) -> Slots:
    """The shared expert's checkpoint tensors (`prefix`.{gate,up,down}_proj.weight) taken out of
    `tensors` as `slots` experts' (gates, ups, downs), each a run of its width / slots intermediate
    columns: its MLP down(SiLU(gate x) * up x) is the sum of those experts' outputs
    (`models.moe.shared_expert_slots`). Views: the stacking copies them once, with the experts.
    Their shapes are checked against the config first, as the loader checks every tensor: cut
    into slots, a wrong width would show only as experts of unequal shapes."""
    width, hidden = config.shared_expert_intermediate_size, config.hidden_size
    expected = {"gate_proj": (width, hidden), "up_proj": (width, hidden), "down_proj": (hidden, width)}
    names = [f"{prefix}.{p}.weight" for p in EXPERT_PROJECTIONS]
    for name, proj in zip(names, EXPERT_PROJECTIONS, strict=True):
        shape = expected[proj]
        if name not in tensors:
            raise ModelLoadError(f"checkpoint is missing tensor {name!r} (the MoE layer's shared expert)")
        if tuple(tensors[name].shape) != shape:
            raise ModelLoadError(
                f"tensor {name!r} has shape {tuple(tensors[name].shape)}, expected {shape} from config"
            )
    gate, up, down = (tensors.pop(name) for name in names)
    return gate.chunk(slots), up.chunk(slots), down.chunk(slots, dim=1)


def hf_expert_name(name: str) -> str:
    """Mixtral's hub names as Qwen's (and transformers 5.x's) for the same tensors."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    return _MIXTRAL_EXPERT.sub(
        lambda m: f".experts.{m.group(1)}.{_MIXTRAL_NAMES[m.group(2)]}.{m.group(3)}", name
    )


def _append_slots(tensors: dict[str, torch.Tensor], prefix: str, shared: Slots) -> None:
    """An already stacked layer's experts (transformers 5's layout) with the shared expert's slots
    appended. Experts of another width than the config's (the slots' width) are refused by name
    here: the concatenation would fail as torch's RuntimeError."""
    gates, ups, downs = shared
    stacks = {"gate_up_proj": torch.cat([torch.stack(gates), torch.stack(ups)], dim=1)}
    stacks["down_proj"] = torch.stack(downs)
    for proj, slots in stacks.items():
        name, expert = f"{prefix}.{proj}", tuple(slots.shape[1:])
        if tuple(tensors[name].shape[1:]) != expert:
            raise ModelLoadError(
                f"tensor {name!r} has shape {tuple(tensors[name].shape)}: experts of {expert} were "
                "expected from config (moe_intermediate_size, hidden_size)"
            )
        tensors[name] = torch.cat([tensors[name], slots])


def _stack_layer(
    tensors: dict[str, torch.Tensor],
    prefix: str,
    num_experts: int,
    shared: Slots = ((), (), ()),
) -> None:
    """The layer's per-expert tensors stacked, then `shared` (the shared expert's slots) after them."""
    per_expert = [k for k in tensors if k.startswith(f"{prefix}.") and k[len(prefix) + 1 :][:1].isdigit()]
    if f"{prefix}.gate_up_proj" in tensors or f"{prefix}.down_proj" in tensors:
        if per_expert:
            raise ModelLoadError(
                f"checkpoint has both stacked ({prefix}.gate_up_proj/down_proj) and per-expert tensors "
                f"({per_expert[0]!r}, ...) for the same layer; keep one layout"
            )
        if shared[0] and f"{prefix}.gate_up_proj" in tensors and f"{prefix}.down_proj" in tensors:
            _append_slots(tensors, prefix, shared)
        return
    if not per_expert:
        return  # nothing of this layer's experts: the loader reports the missing stacked tensors

    def take(e: int, proj: str, suffix: str) -> torch.Tensor:
        name = f"{prefix}.{e}.{proj}.{suffix}"
        if name not in tensors:
            raise ModelLoadError(
                f"checkpoint is missing tensor {name!r} (expert {e} of the {num_experts} the config declares)"
            )
        return tensors.pop(name)

    def stack(suffix: str, gate_up: str, down: str) -> None:
        gates, ups, downs = zip(
            *(tuple(take(e, proj, suffix) for proj in EXPERT_PROJECTIONS) for e in range(num_experts)),
            strict=True,
        )
        if suffix == "weight":  # the shared expert's slots after the routed experts (no FP8 scales then)
            gates, ups, downs = (a + b for a, b in zip((gates, ups, downs), shared, strict=True))
        try:
            tensors[f"{prefix}.{gate_up}"] = torch.cat([torch.stack(gates), torch.stack(ups)], dim=1)
            tensors[f"{prefix}.{down}"] = torch.stack(downs)
        except RuntimeError as e:
            raise ModelLoadError(f"the experts of {prefix} do not all have the same shapes: {e}") from e

    stack("weight", "gate_up_proj", "down_proj")
    if f"{prefix}.0.gate_proj.weight_scale" in tensors:  # FP8 experts (fp8_weights): their row scales
        stack("weight_scale", "gate_up_scale", "down_scale")
