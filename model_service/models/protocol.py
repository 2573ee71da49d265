"""The contracts between the scheduler, a model and its layers.

Translated from the production engine's `Model` and `TransformerLayer` traits: the scheduler
talks only to `Model`; a `Model` owns its layers, the paged KV pool and per-sequence state.
Only operations this engine implements are declared here; a capability appears in the
protocol when it exists, never as a method that raises "not implemented".

Invariants (each has a test):
- `alloc_sequence` returns state that `free_sequence` releases exactly once; a second free is
  an error, because it would hand the same KV blocks to two sequences.
- `release_state` on a layer is idempotent (teardown and abort paths may both reach it).
- In a mixed batch, each request's logits come back in its own row: the caller never indexes
  a shared buffer by a position another request could also occupy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch


@dataclass
class LayerState:
    """Per-sequence state a layer keeps outside the paged KV pool (none for attention layers;
    recurrent layers keep their conv/SSM state here)."""

    released: bool = False


@dataclass
class SequenceState:
    """What the model holds for one sequence: its KV block table and per-layer state."""

    seq_id: int
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_hashed_blocks: int = 0  # leading blocks already published to the prefix cache
    last_block_key: int | None = None  # prefix-cache key of the last published block
    lora_slot: int = -1  # RESOLVED LoRA slot this sequence holds a reference on (-1 = base model)
    layer_states: list[LayerState] = field(default_factory=list)
    freed: bool = False


@dataclass
class PrefillChunk:
    """`tokens` continue `state` at position `state.num_computed`; logits wanted when `is_last`."""

    state: SequenceState
    tokens: list[int]
    is_last: bool


@runtime_checkable
class TransformerLayer(Protocol):
    def prefill(self, x: torch.Tensor, *args: object) -> torch.Tensor:
        """Run prefill chunks (one flat batch, any number of sequences)."""

    def decode(self, x: torch.Tensor, *args: object) -> torch.Tensor:
        """Run one decode token for each of many sequences."""

    def alloc_state(self) -> LayerState:
        """Per-sequence state outside the KV pool."""

    def release_state(self, state: LayerState) -> None:
        """Release `state`; idempotent."""


@runtime_checkable
class Model(Protocol):
    @property
    def vocab_size(self) -> int: ...

    def alloc_sequence(self) -> SequenceState:
        """New, empty per-sequence state (KV blocks are reserved as tokens arrive)."""

    def free_sequence(self, state: SequenceState) -> None:
        """Return every block and layer state of `state`; exactly once."""

    def prefill_chunk(self, state: SequenceState, tokens: list[int], is_last: bool) -> torch.Tensor | None:
        """Process `tokens` at `state.num_computed`; last-token logits [vocab] when `is_last`."""

    def decode_batch(self, states: list[SequenceState], tokens: list[int]) -> torch.Tensor:
        """One token per sequence; logits [len(states), vocab] in input order."""

    def mixed_forward_batch(
        self, decode_states: list[SequenceState], decode_tokens: list[int], chunks: list[PrefillChunk]
    ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """Decode rows and prefill chunks in ONE forward pass: (decode logits [M, vocab],
        per-chunk last-token logits or None)."""

    def num_free_blocks(self) -> int: ...

    def adapter_id_for(self, slot: int) -> int:
        """Prefix-cache identity of the weights `slot` selects (-1 = active adapter); 0 = base model."""

    def acquire_adapter_slot(self, state: SequenceState, slot: int) -> int:
        """Take a reference on `slot` (-1 resolves to the active adapter) for `state`; returns the
        RESOLVED index, which `free_sequence` releases exactly once."""

    def set_active_lora(self, name: str | None) -> int:
        """Rotate the active adapter (quiescent points only); running sequences keep their slot."""

    def promote_lora_from_disk(self, name: str) -> tuple[int, str | None]:
        """Make a registered adapter resident in the LRU idle slot: (slot, evicted adapter name)."""

    def num_total_blocks(self) -> int: ...

    def teardown(self) -> None:
        """Release device memory; the model is unusable afterwards."""
