"""Paged KV block accounting: which physical blocks are free, which a sequence holds.

Pure bookkeeping over block ids; the tensors live in `KVCache`. The invariant every test
checks: once all requests are finished or aborted, `num_free == num_blocks`.
"""

from __future__ import annotations

from collections import deque

from model_service.models.protocol import SequenceState


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block; raise the KV cache memory budget")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_reserve(self, state: SequenceState, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(state.block_table) <= len(self._free)

    def reserve(self, state: SequenceState, num_tokens: int) -> bool:
        """Grow `state`'s block table to hold `num_tokens`; all or nothing."""
        need = self.blocks_for(num_tokens) - len(state.block_table)
        if need > len(self._free):
            return False
        for _ in range(need):
            block = self._free.popleft()
            self._ref_counts[block] = 1
            state.block_table.append(block)
        return True

    def release(self, state: SequenceState) -> None:
        for block in reversed(state.block_table):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] < 0:
                raise RuntimeError(f"KV block {block} released more times than it was taken")
            if self._ref_counts[block] == 0:
                self._free.append(block)
        state.block_table.clear()
