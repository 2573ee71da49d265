"""Builds each step's `StepBatch` on the host, into one preallocated buffer, and moves it in one copy.

Every index array of a step (token ids, positions, slot mapping, LoRA slots, query offsets,
sequence lengths, state slots, logits rows, the block table) is written into consecutive regions
of a single int64 host buffer (pinned on CUDA), and that prefix is copied to a device buffer of
the same layout with one `copy_`; the batch's tensors are views into it. The buffers grow only
when a step needs more than any step before, so their addresses are stable in steady state.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from model_service.engine.seq_state import SequenceState
from model_service.models.step import StepBatch


@dataclass
class StepItem:
    """`tokens` continue `state` at position `state.num_computed`. Logits are wanted for the last
    `num_logits` of them: 0 for a prefill chunk that does not end the prompt, 1 for a decode row
    or a prompt's last chunk, k + 1 to verify k speculated tokens."""

    state: SequenceState
    tokens: list[int]
    num_logits: int


class BatchBuilder:
    def __init__(self, block_size: int, device: torch.device) -> None:
        self.block_size, self.device = block_size, device
        self._host = torch.empty(0, dtype=torch.long)
        self._device = torch.empty(0, dtype=torch.long, device=device)

    def build(self, items: list[StepItem]) -> StepBatch:
        if not items:
            raise ValueError("a step batch needs at least one sequence")
        lens = np.array([len(it.tokens) for it in items], dtype=np.int64)
        starts = np.array([it.state.num_computed for it in items], dtype=np.int64)
        total, num_seqs = int(lens.sum()), len(items)
        max_blocks = max(len(it.state.block_table) for it in items)
        num_logits = sum(it.num_logits for it in items)
        sizes = _sizes((total, num_seqs, num_logits, max_blocks))
        host = self._host_buffer(sum(sizes))
        ids, pos, slots, lora, q_start, seq_lens, state_slots, rows, table = np.split(
            host[: sum(sizes)], np.cumsum(sizes)[:-1]
        )
        q_start[0] = 0
        np.cumsum(lens, out=q_start[1:])
        np.add(starts, lens, out=seq_lens)
        table = table.reshape(num_seqs, max_blocks)
        table.fill(0)
        within = np.arange(self.block_size)
        snapshots = np.full(total, -1, dtype=np.int64)
        r = 0
        for i, it in enumerate(items):
            n, s, o = lens[i], starts[i], q_start[i]
            if it.state.freed:
                raise RuntimeError(f"sequence {it.state.seq_id} used after free")
            if len(it.state.block_table) * self.block_size < s + n:
                raise RuntimeError(f"sequence {it.state.seq_id} has too few KV blocks reserved for this step")
            blocks = np.asarray(it.state.block_table, dtype=np.int64)
            table[i, : len(blocks)] = blocks
            p = np.arange(s, s + n)
            ids[o : o + n] = it.tokens
            pos[o : o + n] = p
            slots[o : o + n] = blocks[p // self.block_size] * self.block_size + within[p % self.block_size]
            lora[o : o + n] = it.state.lora_slot
            state_slots[i] = it.state.state_slot
            for length, slot in it.state.snapshots.items():  # checkpoints this step's tokens reach
                if s < length <= s + n:
                    snapshots[o + length - s - 1] = slot
            rows[r : r + it.num_logits] = np.arange(o + n - it.num_logits, o + n)
            r += it.num_logits
        max_query, max_seq = int(lens.max()), int((starts + lens).max())
        return self._batch((total, num_seqs, num_logits, max_blocks, max_query, max_seq), snapshots)

    def host_region(self, shape: tuple[int, ...]) -> torch.Tensor:
        """The host buffer a batch of `shape` is packed into: a tensor-parallel worker receives rank
        0's packed batch there, then calls `from_host`."""
        size = sum(_sizes(shape))
        self._host_buffer(size)
        return self._host[:size]

    def from_host(self, shape: tuple[int, ...]) -> StepBatch:
        """The batch of `shape` packed in the host buffer (by `build`, or received into `host_region`)."""
        return self._batch(shape, np.full(shape[0], -1, dtype=np.int64))  # no recurrent layers under TP

    def _batch(self, shape: tuple[int, ...], snapshots: np.ndarray) -> StepBatch:
        sizes = _sizes(shape)
        used = sum(sizes)
        regions = np.split(self._host.numpy()[:used], np.cumsum(sizes)[:-1])
        views = self._to_device(sizes)
        num_seqs, max_blocks = shape[1], shape[3]
        return StepBatch(
            input_ids=views[0],
            positions=views[1],
            slot_mapping=views[2],
            lora_slots=views[3],
            query_start=views[4],
            seq_lens=views[5],
            state_slots=views[6],
            logits_rows=views[7],
            block_table=views[8].view(num_seqs, max_blocks),
            max_query_len=shape[4],
            max_seq_len=shape[5],
            host_lora_slots=regions[3].copy(),
            host_query_start=regions[4].copy(),
            host_state_snapshots=snapshots,
            packed=self._host[:used],
            packed_shape=shape,
        )

    def _host_buffer(self, size: int) -> np.ndarray:
        if self._host.numel() < size:
            capacity = max(size, 2 * self._host.numel())
            self._host = torch.empty(capacity, dtype=torch.long, pin_memory=self.device.type == "cuda")
            self._device = torch.empty(capacity, dtype=torch.long, device=self.device)
        return self._host.numpy()

    def _to_device(self, sizes: list[int]) -> list[torch.Tensor]:
        used = sum(sizes)
        if self.device.type == "cpu":
            flat = self._host[:used].clone()  # the next step reuses the host buffer
        else:
            flat = self._device[:used]
            flat.copy_(self._host[:used], non_blocking=True)
        return list(flat.split(sizes))


def _sizes(shape: tuple[int, ...]) -> list[int]:
    """Region sizes of the packed buffer of a batch of (tokens, sequences, logits rows, blocks per
    sequence, ...): ids, positions, slot mapping, LoRA slots, query starts, sequence lengths, state
    slots, logits rows, block table."""
    total, num_seqs, num_logits, max_blocks = shape[:4]
    return [total] * 4 + [num_seqs + 1, num_seqs, num_seqs, num_logits, num_seqs * max_blocks]
