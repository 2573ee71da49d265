"""What the cache manager holds for one sequence: its blocks, its state slot, its LoRA slot."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SequenceState:
    seq_id: int
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V (and recurrent state) are in the cache
    block_keys: list[int] = field(default_factory=list)  # prefix-cache keys of its leading full blocks
    lora_slot: int = -1  # RESOLVED LoRA slot this sequence holds a reference on (-1 = base model)
    state_slot: int = -1  # recurrent-state slot (-1: the model has no recurrent layers)
    snapshots: dict[int, int] = field(default_factory=dict)  # position -> state slot holding a copy
    freed: bool = False
