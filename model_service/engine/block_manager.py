"""Paged KV block accounting, with a prefix cache over full blocks.

Pure bookkeeping over block ids; the tensors live in `KVCache`.

Prefix cache: a block that is full of computed tokens gets a key chained from the previous
block's key, the block's token ids and the sequence's adapter identity, so a block is reused
only under the exact same prefix and the same weights. Blocks nobody holds stay in the cache
(in LRU order) until a new allocation needs them; a later request with the same prefix takes
them back without recomputing. Keys are sha256 digests: equal keys mean equal prefixes under
equal weights, so one tenant's prompt cannot be made to reuse another's K/V (a block's stored
token ids alone would not show that the blocks before it differ).

The invariant every test checks: once all requests are finished or aborted, `num_free == num_blocks`.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from model_service.engine.seq_state import SequenceState


@dataclass
class _Block:
    ref_count: int = 0
    key: int | None = None  # prefix-cache key once the block is full and registered
    tokens: tuple[int, ...] = ()


def block_key(prev_key: int | None, tokens: tuple[int, ...], adapter_id: int) -> int:
    """The chained key of one full block: sha256 over the previous block's key, the adapter's
    identity and the block's token ids. Python's `hash()` of the same tuple was 64 bits and
    unseeded for ints, so keys could be made to collide (adapter ids 2**61 - 1 apart hashed alike
    in every block), and a collision reused K/V computed under another prefix or adapter (vLLM
    moved its prefix keys to sha256 for the same reason)."""
    digest = hashlib.sha256((prev_key or 0).to_bytes(32, "big"))
    digest.update(adapter_id.to_bytes(8, "big", signed=True))
    digest.update(array("q", tokens).tobytes())
    return int.from_bytes(digest.digest(), "big")


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block; raise the KV cache memory budget")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [_Block() for _ in range(num_blocks)]
        # Unreferenced blocks, least recently used first; cached ones keep their key until reused.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # key -> block id

    @property
    def num_free(self) -> int:
        """Blocks no sequence holds (cached-but-unreferenced blocks count: they can be reclaimed)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def ref_count(self, block: int) -> int:
        return self._blocks[block].ref_count

    # --- allocation -----------------------------------------------------------------------

    def reserve(self, state: SequenceState, num_tokens: int) -> bool:
        """Grow `state`'s block table to hold `num_tokens`; all or nothing."""
        need = self.blocks_for(num_tokens) - len(state.block_table)
        if need > len(self._free):
            return False
        for _ in range(need):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self._blocks[block].ref_count = 1
            state.block_table.append(block)
        return True

    def release(self, state: SequenceState) -> None:
        # Tail blocks go back first, so they are evicted before the shared prefix blocks.
        for block in reversed(state.block_table):
            self._decref(block)
        state.block_table.clear()
        state.block_keys.clear()

    def truncate(self, state: SequenceState, num_tokens: int) -> None:
        """Forget `state`'s tokens from `num_tokens` on (speculative rollback): blocks wholly past it
        go back, and a kept block whose tail will be rewritten leaves the prefix cache."""
        keep = self.blocks_for(num_tokens)
        for block in reversed(state.block_table[keep:]):
            self._decref(block)
        del state.block_table[keep:]
        state.table_array = None  # the table may grow back to this length with other blocks
        full = num_tokens // self.block_size
        if len(state.block_keys) > full:
            del state.block_keys[full:]
            if keep > full and self._blocks[state.block_table[full]].ref_count == 1:
                self._evict(state.block_table[full])  # shared copies are copied before writing

    def fork(self, parent: SequenceState, child: SequenceState) -> None:
        """Give `child` the same blocks as `parent` (shared, copy-on-write for the partial last one)."""
        for block in parent.block_table:
            self._blocks[block].ref_count += 1
        child.block_table = list(parent.block_table)
        child.num_computed = parent.num_computed
        child.block_keys = list(parent.block_keys)

    def replace_block(self, state: SequenceState, index: int) -> int | None:
        """Swap a shared block of `state` for a fresh private one (copy-on-write); returns the new
        block id (the caller copies the KV), or None when no block is free."""
        if not self._free:
            return None
        old = state.block_table[index]
        new, _ = self._free.popitem(last=False)
        self._evict(new)
        self._blocks[new].ref_count = 1
        state.block_table[index] = new
        state.table_array = None  # same length, another block
        self._decref(old)
        return new

    def _decref(self, block: int) -> None:
        b = self._blocks[block]
        b.ref_count -= 1
        if b.ref_count < 0:
            raise RuntimeError(f"KV block {block} released more times than it was taken")
        if b.ref_count == 0:
            self._free[block] = None

    def _evict(self, block: int) -> None:
        b = self._blocks[block]
        if b.key is not None and self._cached.get(b.key) == block:
            del self._cached[b.key]
        b.key, b.tokens = None, ()

    # --- prefix cache ---------------------------------------------------------------------

    def forget_unused_prefixes(self) -> None:
        """Drop the prefix-cache entries of every block no sequence holds (the engine's warm-up
        prompts): they would never match, and would show as cached until evicted."""
        for block in self._free:
            self._evict(block)

    def take_cached_prefix(
        self,
        state: SequenceState,
        token_ids: list[int],
        adapter_id: int,
        usable: Callable[[int], bool] | None = None,
    ) -> int:
        """Attach the longest cached prefix of `token_ids` to an empty `state`; returns tokens reused.

        At least one token is always left to compute: the step that computes it yields the logits
        the request samples from. With `usable`, the prefix ends at the last matched block whose key
        it accepts (a recurrent model can resume only where a state snapshot was kept).
        """
        assert not state.block_table
        if not self.enable_prefix_caching:
            return 0
        matched = self._match(token_ids, adapter_id)
        while usable is not None and matched and not usable(matched[-1][0]):
            matched.pop()
        for key, block in matched:
            if self._blocks[block].ref_count == 0:
                del self._free[block]
            self._blocks[block].ref_count += 1
            state.block_table.append(block)
            state.block_keys.append(key)
        state.num_computed = len(state.block_table) * self.block_size
        return state.num_computed

    def _match(self, token_ids: list[int], adapter_id: int) -> list[tuple[int, int]]:
        """(key, block) of each block of the longest cached prefix that leaves a token to compute."""
        bs = self.block_size
        key: int | None = None
        matched: list[tuple[int, int]] = []
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            key = block_key(key, tokens, adapter_id)
            block = self._cached.get(key)
            if block is None or self._blocks[block].tokens != tokens:
                break
            matched.append((key, block))
        return matched

    def register_full_blocks(self, state: SequenceState, token_ids: list[int], adapter_id: int) -> None:
        """Publish `state`'s newly completed blocks to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(len(state.block_keys), state.num_computed // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            key = block_key(state.block_keys[-1] if state.block_keys else None, tokens, adapter_id)
            block = state.block_table[i]
            if key not in self._cached and self._blocks[block].key is None:
                self._cached[key] = block
                self._blocks[block].key, self._blocks[block].tokens = key, tokens
            state.block_keys.append(key)
