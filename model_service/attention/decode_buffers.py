"""The static decode metadata CUDA graphs of decode steps read, for every capturable backend.

Slot mapping, block table and sequence lengths, sized once for the largest captured batch. A
graph is captured reading views of them, and every replay first copies the step's metadata in
(`fill`): a graph is never replayed over stale metadata, and padding rows (slot -1, length 0)
write and read nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from model_service.models.step import StepBatch

if TYPE_CHECKING:
    from model_service.attention.kv_cache import KVCache


class DecodeBuffers:
    def __init__(self, max_num_seqs: int, max_seq_len: int, block_size: int, device: torch.device) -> None:
        max_blocks = -(-max_seq_len // block_size)
        self.slots = torch.full((max_num_seqs,), -1, dtype=torch.long, device=device)
        self.table = torch.zeros(max_num_seqs, max_blocks, dtype=torch.long, device=device)
        self.lens = torch.zeros(max_num_seqs, dtype=torch.long, device=device)

    def for_capture(self, num_seqs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(slot mapping, block table, sequence lengths) views of `num_seqs` padding rows."""
        self.slots[:num_seqs] = -1
        self.lens[:num_seqs] = 0
        return self.slots[:num_seqs], self.table[:num_seqs], self.lens[:num_seqs]

    def fill(self, batch: StepBatch, padded_num_seqs: int) -> None:
        """`batch`'s metadata in the first rows, padding up to `padded_num_seqs`."""
        n, width = batch.num_seqs, batch.block_table.shape[1]
        if width > self.table.shape[1]:
            raise ValueError(f"a context of {width} blocks exceeds the captured {self.table.shape[1]}")
        self.slots[:n] = batch.slot_mapping
        self.table[:n, :width] = batch.block_table
        self.lens[:n] = batch.seq_lens
        if padded_num_seqs > n:  # a device op of no elements still costs the host ~10-20 us
            self.slots[n:padded_num_seqs] = -1
            self.lens[n:padded_num_seqs] = 0


class StaticDecodeMetadata:
    """The part of `GraphCapturable` both capturable backends share: their decode metadata
    (`slot_mapping`, `block_table`, `seq_lens`) read from `DecodeBuffers` under graphs."""

    kv_cache: KVCache
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    _static: DecodeBuffers | None = None

    def init_graph_capture(self, max_num_seqs: int, max_seq_len: int) -> None:
        device = self.kv_cache.data.device
        self._static = DecodeBuffers(max_num_seqs, max_seq_len, self.kv_cache.block_size, device)

    def prepare_for_replay(self, batch: StepBatch, padded_num_seqs: int) -> None:
        assert self._static is not None, "init_graph_capture first"
        self._static.fill(batch, padded_num_seqs)

    def _capture_metadata(self, num_seqs: int) -> None:
        """The metadata a capture records: views of `num_seqs` padding rows of the buffers."""
        assert self._static is not None, "init_graph_capture first"
        self.slot_mapping, self.block_table, self.seq_lens = self._static.for_capture(num_seqs)
