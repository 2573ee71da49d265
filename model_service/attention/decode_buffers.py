"""The static decode metadata CUDA graphs of decode steps read, for every capturable backend.

Slot mapping and sequence lengths are rows of the graph runner's `StaticRows` (which every
replay fills, one copy for every per-row input); the block table is the backend's own, sized
once for the largest captured batch. A graph is captured reading views of them, and every
replay first copies the step's metadata in (`fill`): a graph is never replayed over stale
metadata, and padding rows (slot -1, length 0) write and read nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from model_service.models.step import StaticRows, StepBatch

if TYPE_CHECKING:
    from model_service.attention.kv_cache import KVCache


class DecodeBuffers:
    def __init__(self, rows: StaticRows, max_seq_len: int, block_size: int) -> None:
        """`rows`: the graphs' per-row inputs, whose K/V slots and lengths the backend reads; the
        block table is its own."""
        max_blocks = -(-max_seq_len // block_size)
        self.rows = rows
        self.table = torch.zeros(rows.data.shape[1], max_blocks, dtype=torch.long, device=rows.data.device)

    def for_capture(self, num_seqs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(slot mapping, block table, sequence lengths) views of `num_seqs` padding rows."""
        self.rows.for_capture()
        return self.rows.slot_mapping[:num_seqs], self.table[:num_seqs], self.rows.seq_lens[:num_seqs]

    def fill(self, batch: StepBatch) -> None:
        """`batch`'s block table in the first rows (the graph runner fills `rows`)."""
        n, width = batch.num_seqs, batch.block_table.shape[1]
        if width > self.table.shape[1]:
            raise ValueError(f"a context of {width} blocks exceeds the captured {self.table.shape[1]}")
        self.table[:n, :width] = batch.block_table


class StaticDecodeMetadata:
    """The part of `GraphCapturable` both capturable backends share: their decode metadata
    (`slot_mapping`, `block_table`, `seq_lens`) read from `DecodeBuffers` under graphs."""

    kv_cache: KVCache
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    _static: DecodeBuffers | None = None

    def init_graph_capture(self, rows: StaticRows, max_seq_len: int) -> None:
        self._static = DecodeBuffers(rows, max_seq_len, self.kv_cache.block_size)

    def prepare_for_replay(self, batch: StepBatch) -> None:
        assert self._static is not None, "init_graph_capture first"
        self._static.fill(batch)

    def _capture_metadata(self, num_seqs: int) -> None:
        """The metadata a capture records: views of `num_seqs` padding rows of the buffers."""
        assert self._static is not None, "init_graph_capture first"
        self.slot_mapping, self.block_table, self.seq_lens = self._static.for_capture(num_seqs)
