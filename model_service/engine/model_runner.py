"""The `Model` the scheduler talks to: module + KV pool + block accounting + step metadata.

Every entry point (prefill chunk, decode batch, mixed batch) becomes one list of work items
-- a sequence and the tokens to append to it -- and one forward pass. The attention metadata
for that pass is built here, once, with numpy over per-sequence arrays; the model's layers
only see flat tensors.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from model_service.engine.block_manager import BlockManager
from model_service.engine.config import EngineConfig
from model_service.lora.batch import LoraBatch
from model_service.lora.pool import LoraPool
from model_service.models.attention import AttentionMetadata, KVCache
from model_service.models.loader import LoadedModel
from model_service.models.protocol import PrefillChunk, SequenceState

_DEFAULT_CPU_KV_BYTES = 1 << 30


@dataclass
class SwappedState:
    """A preempted sequence's KV, in host memory: [layers, 2, tokens, kv_heads, head_dim]."""

    kv: torch.Tensor
    num_tokens: int

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


@dataclass
class _Work:
    state: SequenceState
    tokens: list[int]
    want_logits: bool


class ModelRunner:
    """Implements `models.protocol.Model` for the Llama-family decoder."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.loaded = loaded
        self.module = loaded.module
        self.device = next(self.module.parameters()).device
        self.dtype = next(self.module.parameters()).dtype
        cfg = loaded.config
        self.block_size = config.block_size
        num_blocks = config.num_kv_blocks or self._blocks_from_budget(config)
        self.kv_cache = KVCache(
            cfg.num_layers,
            num_blocks,
            self.block_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            self.dtype,
            self.device,
        )
        self.block_manager = BlockManager(num_blocks, self.block_size, config.enable_prefix_caching)
        self.lora = LoraPool(
            cfg, config.max_loras, config.max_cpu_loras, config.max_lora_rank, self.device, self.dtype
        )
        self._seq_ids = itertools.count()
        if self.device.type == "cuda":
            # cuDNN's SDPA builds a new graph for every new context length: 2.2 ms of CPU per layer
            # call on an H200, 25x the GPU time. The flash/efficient kernels have no such cost.
            torch.backends.cuda.enable_cudnn_sdp(False)

    def _blocks_from_budget(self, config: EngineConfig) -> int:
        cfg = self.loaded.config
        per_block = KVCache.bytes_per_block(
            cfg.num_layers, self.block_size, cfg.num_kv_heads, cfg.head_dim, self.dtype
        )
        budget = config.kv_cache_memory_bytes
        if budget is None:
            if self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                budget = int(free - total * (1 - config.gpu_memory_utilization))
            else:
                budget = _DEFAULT_CPU_KV_BYTES
        return max(budget // per_block, 0)

    # --- Model protocol -------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.loaded.config.vocab_size

    def alloc_sequence(self) -> SequenceState:
        return SequenceState(
            seq_id=next(self._seq_ids), layer_states=[layer.alloc_state() for layer in self.module.layers]
        )

    def free_sequence(self, state: SequenceState) -> None:
        if state.freed:
            raise RuntimeError(f"sequence {state.seq_id} freed twice: its blocks could go to two owners")
        self.lora.release(state.lora_slot)
        state.lora_slot = -1
        self.block_manager.release(state)
        for layer, layer_state in zip(self.module.layers, state.layer_states, strict=True):
            layer.release_state(layer_state)
        state.num_computed = 0
        state.freed = True

    def reserve(self, state: SequenceState, num_tokens: int) -> bool:
        """Make `state`'s block table cover `num_tokens` tokens; False (and no change) if blocks run out."""
        return self.block_manager.reserve(state, num_tokens)

    def adapter_id_for(self, slot: int) -> int:
        return self.lora.adapter_id_for(slot)

    def acquire_adapter_slot(self, state: SequenceState, slot: int) -> int:
        if state.lora_slot >= 0:
            raise RuntimeError(f"sequence {state.seq_id} already holds LoRA slot {state.lora_slot}")
        state.lora_slot = self.lora.acquire(slot)
        return state.lora_slot

    def set_active_lora(self, name: str | None) -> int:
        return self.lora.set_active(name)

    def promote_lora_from_disk(self, name: str) -> tuple[int, str | None]:
        return self.lora.load(name)

    def num_free_blocks(self) -> int:
        return self.block_manager.num_free

    def num_total_blocks(self) -> int:
        return self.block_manager.num_blocks

    def prefill_chunk(self, state: SequenceState, tokens: list[int], is_last: bool) -> torch.Tensor | None:
        _, chunk_logits = self.mixed_forward_batch([], [], [PrefillChunk(state, tokens, is_last)])
        return chunk_logits[0]

    def decode_batch(self, states: list[SequenceState], tokens: list[int]) -> torch.Tensor:
        decode_logits, _ = self.mixed_forward_batch(states, tokens, [])
        return decode_logits

    def mixed_forward_batch(
        self, decode_states: list[SequenceState], decode_tokens: list[int], chunks: list[PrefillChunk]
    ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        # Prefill rows first, decode rows after: each item's logits row is assigned by its own
        # position in this list, so no request can read a row another request wrote.
        work = [_Work(c.state, c.tokens, c.is_last) for c in chunks]
        work += [_Work(s, [t], True) for s, t in zip(decode_states, decode_tokens, strict=True)]
        logits = self._forward(work)
        chunk_logits: list[torch.Tensor | None] = []
        row = 0
        for c in chunks:
            chunk_logits.append(logits[row] if c.is_last else None)
            row += int(c.is_last)
        return logits[row:], chunk_logits

    def swap_bytes(self, state: SequenceState) -> int:
        cfg = self.loaded.config
        per_token = KVCache.bytes_per_block(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, self.dtype)
        return per_token * state.num_computed

    def save_sequence_state(self, state: SequenceState) -> SwappedState:
        """Copy `state`'s computed KV to host memory and free its blocks (swap-out)."""
        slots = self._slots(state.block_table, state.num_computed)
        kv = self.kv_cache.data[:, :, slots].to("cpu")
        saved = SwappedState(kv, state.num_computed)
        self.free_sequence(state)
        return saved

    def restore_sequence_state(self, saved: SwappedState) -> SequenceState | None:
        """Swap-in: a new state holding the saved KV, or None (nothing changed) if blocks run out."""
        state = self.alloc_sequence()
        if not self.reserve(state, saved.num_tokens):
            self.free_sequence(state)
            return None
        slots = self._slots(state.block_table, saved.num_tokens)
        self.kv_cache.data[:, :, slots] = saved.kv.to(self.device)
        state.num_computed = saved.num_tokens
        return state

    def fork_sequence(self, parent: SequenceState) -> SequenceState:
        """A new sequence sharing `parent`'s KV blocks (beam search); writes go through `make_writable`."""
        child = self.alloc_sequence()
        self.block_manager.fork(parent, child)
        if parent.lora_slot >= 0:
            self.acquire_adapter_slot(child, parent.lora_slot)
        return child

    def make_writable(self, state: SequenceState) -> bool:
        """Copy-on-write: before appending into a partial last block shared with another sequence,
        give `state` its own copy of it. False if no block is free."""
        index = state.num_computed // self.block_size
        if state.num_computed % self.block_size == 0 or index >= len(state.block_table):
            return True  # the next token starts a fresh block
        old = state.block_table[index]
        if self.block_manager.ref_count(old) == 1:
            return True
        new = self.block_manager.replace_block(state, index)
        if new is None:
            return False
        bs, kv = self.block_size, self.kv_cache.data
        kv[:, :, new * bs : (new + 1) * bs] = kv[:, :, old * bs : (old + 1) * bs]
        return True

    def _slots(self, block_table: list[int], num_tokens: int) -> torch.Tensor:
        table = torch.tensor(block_table, dtype=torch.long)
        slots = (table[:, None] * self.block_size + torch.arange(self.block_size)[None, :]).reshape(-1)
        return slots[:num_tokens].to(self.device)

    def teardown(self) -> None:
        self.kv_cache.data = torch.empty(0)
        self.module.to("meta")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # --- one forward pass -----------------------------------------------------------------

    @torch.inference_mode()
    def _forward(self, work: list[_Work]) -> torch.Tensor:
        for w in work:
            if w.state.freed:
                raise RuntimeError(f"sequence {w.state.seq_id} used after free")
            if len(w.state.block_table) * self.block_size < w.state.num_computed + len(w.tokens):
                raise RuntimeError(f"sequence {w.state.seq_id} has too few KV blocks reserved for this step")
        meta = self._metadata(work)
        if any(w.state.lora_slot >= 0 for w in work):
            meta.lora = LoraBatch(self.lora, [w.state.lora_slot for w in work for _ in w.tokens], self.device)
        input_ids = torch.tensor([t for w in work for t in w.tokens], dtype=torch.long, device=self.device)
        logits = self.module(input_ids, meta, self.kv_cache)
        for w in work:
            w.state.num_computed += len(w.tokens)
        return logits

    def _metadata(self, work: list[_Work]) -> AttentionMetadata:
        bs = self.block_size
        lens = np.array([len(w.tokens) for w in work])
        starts = np.array([w.state.num_computed for w in work])
        ctx = starts + lens
        total, num_seqs, max_q, max_k = int(lens.sum()), len(work), int(lens.max()), int(ctx.max())
        offsets = np.concatenate(([0], np.cumsum(lens)[:-1]))

        query_index = np.full((num_seqs, max_q), total, dtype=np.int64)
        query_positions = np.full((num_seqs, max_q), -1, dtype=np.int64)
        key_slots = np.zeros((num_seqs, max_k), dtype=np.int64)
        positions = np.empty(total, dtype=np.int64)
        slot_mapping = np.empty(total, dtype=np.int64)
        token_rows = np.empty(total, dtype=np.int64)
        within_block = np.arange(bs)
        for i, w in enumerate(work):
            n, s, o = lens[i], starts[i], offsets[i]
            table = np.asarray(w.state.block_table, dtype=np.int64)
            slots = (table[:, None] * bs + within_block[None, :]).reshape(-1)[: ctx[i]]
            key_slots[i, : ctx[i]] = slots
            pos = np.arange(s, s + n)
            positions[o : o + n] = pos
            slot_mapping[o : o + n] = slots[s : s + n]
            query_index[i, :n] = np.arange(o, o + n)
            query_positions[i, :n] = pos
            token_rows[o : o + n] = i * max_q + np.arange(n)
        logits_rows = np.array([offsets[i] + lens[i] - 1 for i, w in enumerate(work) if w.want_logits])

        def t(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a.astype(np.int64)).to(self.device, non_blocking=True)

        return AttentionMetadata(
            positions=t(positions),
            slot_mapping=t(slot_mapping),
            query_index=t(query_index),
            token_rows=t(token_rows),
            key_slots=t(key_slots),
            query_positions=t(query_positions),
            logits_rows=t(logits_rows),
        )
