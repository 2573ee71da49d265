"""What the cache manager holds for one sequence: its blocks, its state slot, its LoRA slot."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np


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
    # The batch builder's int64 copy of `block_table`, current while it is as long as the table:
    # tables only grow during decode, so a step copies only the tables that grew. Whoever rewrites
    # an entry in place (copy-on-write, truncation) sets it to None.
    table_array: np.ndarray | None = field(default=None, compare=False, repr=False)
