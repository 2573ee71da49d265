"""MLA on CUDA: decode rows through the Triton latent-cache kernel, every other row as the torch
reference attends them.

Decode rows are what serving an MLA model is mostly made of, and the reference serves them by
gathering each context into a padded grid; the kernel (kernels/mla_decode.py) reads the latent
cache in place through the block table, split-KV. Prefill chunks and verify runs keep the
reference's decompression (gather, `kv_b_proj`, SDPA): there is no Triton MLA prefill kernel
yet, and no CUDA graphs for MLA models (the reference's `prepare` is not capturable).
"""

from __future__ import annotations

import torch

from model_service.attention.reference import TorchReferenceBackend
from model_service.kernels.mla_decode import mla_decode_attention, mla_kernel_applies
from model_service.kernels.paged_attention import num_splits_for
from model_service.models.step import StepBatch


class TritonLatentBackend(TorchReferenceBackend):
    num_splits = 1
    _decode_table = _decode_lens = torch.empty(0, dtype=torch.long)

    def prepare(self, batch: StepBatch) -> None:
        super().prepare(batch)
        self._decode_table, self._decode_lens = batch.block_table, batch.seq_lens
        self.num_splits = num_splits_for(self._num_decode, 1)

    def _latent_attention(self, cache: torch.Tensor, q: torch.Tensor, latent: int) -> torch.Tensor:
        if not mla_kernel_applies(q, latent):
            return super()._latent_attention(cache, q, latent)
        d = q.shape[0]
        return mla_decode_attention(
            q.contiguous(), cache, self._decode_table[:d], self._decode_lens[:d], self.kv_cache.block_size,
            self.scale, latent, self.num_splits,
        )  # fmt: skip
