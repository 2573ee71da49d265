"""MLA with the Triton latent-cache kernel for decode rows; every other row as the torch
reference attends them.

Decode rows are what serving an MLA model is mostly made of, and the reference serves them by
gathering each context into a padded grid; the kernel (kernels/mla_decode.py) reads the latent
cache in place through the block table, split-KV, and writes nothing a graph could not replay:
decode steps are captured in CUDA graphs (`GraphCapturable`, over `DecodeBuffers`) when the
kernel applies (CUDA, a power-of-two latent). Prefill chunks and verify runs that are not
replayed keep the reference's decompression (gather, `kv_b_proj`, SDPA): there is no Triton
MLA prefill kernel yet. Off CUDA the kernel's torch reference stands in, so CPU tests run this
backend's bookkeeping (static buffers, padding rows) too.
"""

from __future__ import annotations

import torch

from model_service.attention.decode_buffers import StaticDecodeMetadata
from model_service.attention.kv_cache import KVCache
from model_service.attention.reference import TorchReferenceBackend
from model_service.kernels.mla_decode import mla_decode_attention
from model_service.kernels.paged_attention import num_splits_for, store_kv
from model_service.models.step import StepBatch


class TritonLatentBackend(StaticDecodeMetadata, TorchReferenceBackend):
    def __init__(self, kv_cache: KVCache, windows: list[int | None], head_dim: int, scale: float) -> None:
        super().__init__(kv_cache, windows, head_dim, scale)
        self.num_splits = 1
        self.slot_mapping = self.block_table = self.seq_lens = torch.empty(0, dtype=torch.long)

    def prepare(self, batch: StepBatch) -> None:
        super().prepare(batch)
        self.slot_mapping, self.block_table, self.seq_lens = (
            batch.slot_mapping,
            batch.block_table,
            batch.seq_lens,
        )
        self.num_splits = num_splits_for(self._num_decode, 1)

    def _write_rows(self, cache: torch.Tensor, rows: torch.Tensor) -> None:
        """One store launch that skips padding rows (slot -1); the pool as its K and V planes
        both: MLA's one plane written twice with the same row."""
        store_kv(rows, rows, cache, cache, self.slot_mapping)

    def _latent_attention(self, cache: torch.Tensor, q: torch.Tensor, latent: int) -> torch.Tensor:
        d = q.shape[0]
        return mla_decode_attention(
            q.contiguous(), cache, self.block_table[:d], self.seq_lens[:d], self.kv_cache.block_size,
            self.scale, latent, self.num_splits,
        )  # fmt: skip

    # --- GraphCapturable ----------------------------------------------------------------------

    def prepare_for_capture(self, num_seqs: int) -> None:
        """A decode step of `num_seqs` padding rows: every row takes the kernel."""
        self._capture_metadata(num_seqs)
        self._num_decode = num_seqs
        self.num_splits = num_splits_for(num_seqs, 1)
