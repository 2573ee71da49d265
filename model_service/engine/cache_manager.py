"""Everything the scheduler knows about device memory, and nothing about the model.

The cache manager owns each sequence's block table (through `BlockManager`: paged blocks, the
prefix cache, copy-on-write), its recurrent-state slot for models with linear-attention layers,
swap to host memory, forks for beam search, and `truncate` for speculative rollback. It moves
bytes only through `KVMover`, which the executor implements; so the scheduler and this class run
unchanged over a CPU reference, a GPU, or N tensor-parallel executors behind one mover.

Recurrent state cannot be cut back like K/V: a state slot holds the whole history. A sequence
keeps copies of it at given lengths in `SequenceState.snapshots` (length -> spare slot): `snapshot`
copies it at the current length; `plan_checkpoints` reserves slots for lengths the next step will
pass, which the model fills as its recurrence passes them. `truncate` to a kept length restores it.

Speculative verify checkpoints after each of its tokens but the last (what the production engine
does with its per-position "SSM intermediates"): any rejection point then restores with one copy,
where snapshot-before-verify would have to run the accepted tokens through the model again.

Prefix caching (Marconi-style): a step checkpoints at the last block boundary it reaches, and
`register_full_blocks` publishes that state under the block's prefix key, in an LRU map whose
entries give their slots back when a slot is needed. A new request resumes from the longest cached
prefix that ends at a published state, so a warm multi-turn request computes only its new tokens.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

import torch

from model_service.engine.block_manager import BlockManager
from model_service.engine.seq_state import SequenceState


class KVMover(Protocol):
    """The data movement the cache manager asks of the executor; ids are block or state slots."""

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy each (src, dst) block's K/V in every layer."""

    def save_blocks(self, blocks: list[int], num_tokens: int) -> torch.Tensor:
        """The first `num_tokens` tokens' K/V held in `blocks`, in host memory."""

    def load_blocks(self, saved: torch.Tensor, blocks: list[int]) -> None:
        """Write K/V saved by `save_blocks` into `blocks`."""

    def copy_state(self, src: int, dst: int) -> None:
        """Copy recurrent-state slot `src` into `dst`."""

    def save_state(self, slot: int) -> torch.Tensor:
        """State slot `slot` in host memory (empty for a model without recurrent layers)."""

    def load_state(self, saved: torch.Tensor, slot: int) -> None:
        """Write a state saved by `save_state` into `slot`."""


@dataclass
class SwappedState:
    """A preempted sequence's K/V (and recurrent state) in host memory."""

    kv: torch.Tensor
    state: torch.Tensor | None
    num_tokens: int

    @property
    def nbytes(self) -> int:
        extra = self.state.numel() * self.state.element_size() if self.state is not None else 0
        return self.kv.numel() * self.kv.element_size() + extra


class CacheManager:
    def __init__(
        self,
        blocks: BlockManager,
        mover: KVMover,
        kv_bytes_per_token: int,
        num_state_slots: int = 0,
        state_bytes: int = 0,
    ) -> None:
        """`state_bytes`: host bytes of one sequence's saved recurrent state (what a swap stores
        beside its K/V)."""
        self.blocks, self.mover = blocks, mover
        self.block_size = blocks.block_size
        self.kv_bytes_per_token = kv_bytes_per_token
        self.state_bytes = state_bytes
        self.has_state = num_state_slots > 0
        # Recurrent states are kept at block boundaries, for the prefix cache (`plan_boundary_checkpoint`).
        self.keeps_boundaries = self.has_state and blocks.enable_prefix_caching
        self.num_state_slots = num_state_slots
        self._free_state_slots = dict.fromkeys(range(num_state_slots))  # an ordered set, taken LIFO
        self._cached_states: OrderedDict[int, int] = OrderedDict()  # block key -> state slot, LRU first
        self._seq_ids = itertools.count()

    # --- capacity -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.blocks.num_free

    @property
    def num_total_blocks(self) -> int:
        return self.blocks.num_blocks

    @property
    def num_free_state_slots(self) -> int:
        return len(self._free_state_slots)

    @property
    def num_cached_states(self) -> int:
        """State slots holding prefix-cache snapshots (given back when a slot is needed)."""
        return len(self._cached_states)

    @property
    def num_spare_state_slots(self) -> int:
        """State slots a new sequence may take: the free ones and the prefix-cache snapshots'."""
        return self._spare_state_slots()

    def can_allocate(self, num_sequences: int = 1) -> bool:
        return not self.has_state or self._spare_state_slots() >= num_sequences

    # --- life of a sequence ---------------------------------------------------------------

    def allocate(self) -> SequenceState:
        """New, empty state; a state slot too when the model has recurrent layers."""
        state = SequenceState(seq_id=next(self._seq_ids))
        if self.has_state:
            state.state_slot = self._take_state_slot()
        return state

    def free(self, state: SequenceState) -> None:
        """Return every block and state slot of `state`; exactly once."""
        if state.freed:
            raise RuntimeError(f"sequence {state.seq_id} freed twice: its blocks could go to two owners")
        self.blocks.release(state)
        for slot in [state.state_slot, *state.snapshots.values()]:
            if slot >= 0:
                self._release_state_slot(slot)
        state.state_slot, state.snapshots = -1, {}
        state.num_computed = 0
        state.freed = True

    def commit(self, state: SequenceState, num_tokens: int) -> None:
        """Count `state`'s next `num_tokens` tokens as in the cache: a step that writes their K/V
        (and recurrent state) was launched. The one place a forward pass moves `num_computed`
        (`truncate` takes it back), so that it is always the tokens the cache holds; the batch
        builder has checked that the reserved blocks cover them."""
        state.num_computed += num_tokens

    def reserve(self, state: SequenceState, num_tokens: int) -> bool:
        """Make `state`'s block table cover `num_tokens` tokens; False (and no change) if blocks run out."""
        return self.blocks.reserve(state, num_tokens)

    def take_cached_prefix(self, state: SequenceState, token_ids: list[int], adapter_id: int) -> int:
        """Attach the longest cached prefix of `token_ids`; returns the tokens reused. A model with
        recurrent layers reuses a prefix only up to a block whose state snapshot is cached, and
        starts from a copy of that state."""
        if not self.has_state:
            return self.blocks.take_cached_prefix(state, token_ids, adapter_id)
        has_state = self._cached_states.__contains__
        reused = self.blocks.take_cached_prefix(state, token_ids, adapter_id, has_state)
        if reused:
            key = state.block_keys[-1]
            self._cached_states.move_to_end(key)
            self.mover.copy_state(self._cached_states[key], state.state_slot)
        return reused

    def register_full_blocks(self, state: SequenceState, token_ids: list[int], adapter_id: int) -> None:
        """Publish `state`'s newly full blocks to the prefix cache; with recurrent layers, also the
        snapshots taken at their boundaries. Other snapshots up to the current length are released."""
        if len(state.block_keys) < state.num_computed // self.block_size:  # a block just filled
            self.blocks.register_full_blocks(state, token_ids, adapter_id)
        if not state.snapshots:
            return
        for length in [n for n in state.snapshots if n <= state.num_computed]:
            slot = state.snapshots.pop(length)
            key = self._key_ending_at(state, length)
            if key is None or key in self._cached_states:
                self._release_state_slot(slot)
            else:
                self._cached_states[key] = slot

    def forget_unused_prefixes(self) -> None:
        """Drop the prefix-cache entries no sequence holds: their blocks' keys and, with
        recurrent layers, the snapshots' state slots, back to the free pool."""
        self.blocks.forget_unused_prefixes()
        while self._cached_states:
            self._release_state_slot(self._cached_states.popitem()[1])

    def _key_ending_at(self, state: SequenceState, length: int) -> int | None:
        """The prefix-cache key of `state`'s block that ends at `length`, once that block is registered."""
        index = length // self.block_size - 1
        if length % self.block_size or not 0 <= index < len(state.block_keys):
            return None
        return state.block_keys[index]

    def plan_checkpoints(self, state: SequenceState, lengths: list[int]) -> bool:
        """Reserve a slot for `state`'s recurrent state at each of `lengths` (past its current
        length); the model writes them as the next step passes those lengths. All or nothing;
        True at once for a model without recurrent layers."""
        if not self.has_state:
            return True
        if self._spare_state_slots() < len(lengths):
            return False
        for length in lengths:
            state.snapshots[length] = self._take_state_slot()
        return True

    def plan_boundary_checkpoint(self, state: SequenceState, num_tokens: int) -> None:
        """Prefix caching with recurrent layers: keep the state at the last block boundary that the
        next `num_tokens` tokens reach, to publish with that block (best effort)."""
        if not self.keeps_boundaries:
            return
        boundary = (state.num_computed + num_tokens) // self.block_size * self.block_size
        if boundary > state.num_computed and boundary not in state.snapshots:
            self.plan_checkpoints(state, [boundary])

    def has_room(self, state: SequenceState, num_tokens: int) -> bool:
        """Whether `state`'s next `num_tokens` tokens fit with nothing to do: its blocks cover them
        and the first lands in a fresh block or a private partial one (`make_writable` and
        `reserve` would change nothing). The common decode row; checked first, for speed."""
        computed, table, bs = state.num_computed, state.block_table, self.block_size
        if computed + num_tokens > len(table) * bs:
            return False
        return computed % bs == 0 or self.blocks.ref_count(table[computed // bs]) == 1

    def make_writable(self, state: SequenceState) -> bool:
        """Copy-on-write: before appending into a partial last block shared with another sequence,
        give `state` its own copy of it. False if no block is free."""
        index = state.num_computed // self.block_size
        if state.num_computed % self.block_size == 0 or index >= len(state.block_table):
            return True  # the next token starts a fresh block
        old = state.block_table[index]
        if self.blocks.ref_count(old) == 1:
            return True
        new = self.blocks.replace_block(state, index)
        if new is None:
            return False
        self.mover.copy_blocks([(old, new)])
        return True

    def fork(self, parent: SequenceState) -> SequenceState:
        """A new sequence sharing `parent`'s blocks (beam search); its state slot is a copy."""
        child = self.allocate()
        self.blocks.fork(parent, child)
        if self.has_state:
            self.mover.copy_state(parent.state_slot, child.state_slot)
        return child

    # --- swap -----------------------------------------------------------------------------

    def swap_bytes(self, state: SequenceState) -> int:
        """Host bytes `swap_out` would store for `state`: its K/V and its recurrent state."""
        return self.kv_bytes_per_token * state.num_computed + (self.state_bytes if self.has_state else 0)

    def swap_out(self, state: SequenceState) -> SwappedState:
        """Copy `state`'s computed K/V (and state) to host memory and free it on the device."""
        kv = self.mover.save_blocks(state.block_table, state.num_computed)
        recurrent = self.mover.save_state(state.state_slot) if self.has_state else None
        saved = SwappedState(kv, recurrent, state.num_computed)
        self.free(state)
        return saved

    def swap_in(self, saved: SwappedState) -> SequenceState | None:
        """A new state holding the saved K/V, or None (nothing changed) if blocks or slots run out."""
        if not self.can_allocate():
            return None
        state = self.allocate()
        if not self.reserve(state, saved.num_tokens):
            self.free(state)
            return None
        self.mover.load_blocks(saved.kv, state.block_table)
        if saved.state is not None:
            self.mover.load_state(saved.state, state.state_slot)
        state.num_computed = saved.num_tokens
        return state

    # --- speculative rollback -------------------------------------------------------------

    def snapshot(self, state: SequenceState) -> bool:
        """Keep a copy of `state`'s recurrent state at its current length; False if no slot is
        free. Nothing to keep for a model without recurrent layers."""
        if not self.has_state:
            return True
        if not self._spare_state_slots():
            return False
        slot = self._take_state_slot()
        self.mover.copy_state(state.state_slot, slot)
        state.snapshots[state.num_computed] = slot
        return True

    def truncate(self, state: SequenceState, num_tokens: int) -> None:
        """Roll `state` back to its first `num_tokens` tokens. With recurrent layers, only to a
        length `snapshot` was taken at; snapshots past it are released."""
        if not 0 <= num_tokens <= state.num_computed:
            raise ValueError(f"cannot truncate {state.num_computed} computed tokens to {num_tokens}")
        if self.has_state and num_tokens != state.num_computed:
            if num_tokens not in state.snapshots:
                raise ValueError(f"no recurrent-state snapshot at length {num_tokens} to roll back to")
            self.mover.copy_state(state.snapshots[num_tokens], state.state_slot)
        for length in [n for n in state.snapshots if n >= num_tokens]:
            self._release_state_slot(state.snapshots.pop(length))
        self.blocks.truncate(state, num_tokens)
        state.num_computed = num_tokens

    def _spare_state_slots(self) -> int:
        return len(self._free_state_slots) + len(self._cached_states)

    def _take_state_slot(self) -> int:
        """A free slot, else the least recently used prefix-cache snapshot's."""
        if self._free_state_slots:
            return self._free_state_slots.popitem()[0]
        if self._cached_states:
            return self._cached_states.popitem(last=False)[1]
        raise RuntimeError("no recurrent-state slot is free; check can_allocate() first")

    def _release_state_slot(self, slot: int) -> None:
        """Back to the free pool, exactly once: a slot freed twice would go to two sequences, whose
        recurrent states would overwrite each other, and the free count cannot show it (a double
        free beside a leak adds up)."""
        if slot in self._free_state_slots:
            raise RuntimeError(f"recurrent-state slot {slot} freed twice: it could go to two sequences")
        self._free_state_slots[slot] = None
