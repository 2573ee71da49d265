"""The CUDA attention backend: Triton kernels over the block table, decode steps graph-capturable.

Every step writes its K/V with `store_kv`, or, when the model hands over its RoPE tables,
with `rotary_store_kv`, which rotates q and k and writes K/V in one launch; a decode step that
splits each context several ways (a small batch, where launches are what a step costs) leaves
that to the attention kernel itself (`rotary_decode_attention`). Decode steps (one
query token per sequence) attend with the split-KV `paged_decode_attention` kernel; prefill
chunks with the varlen `paged_prefill_attention` kernel, which skips key tiles above the causal
diagonal. A mixed step runs both: its leading one-token sequences (the scheduler puts decode rows
first) through the decode kernel, the rest through the prefill kernel, into one output. The
prefill kernel would give each decode row a 64-row query tile with one live row, one program per
query head, each reading the whole context (on an 8B model with 256 decode rows of ~1.2k tokens
beside a chunk that is ~10 TFLOP of padding a step). Neither kernel gathers context: both read
K/V in place through the block table.

Gemma 2's soft-capped logits (`softcap`, fixed per model) and gpt-oss's attention sinks (the
layer's parameter, with each call) are compile-time switches of both kernels: other models run
the kernels they always did.

For CUDA graphs the backend reads static metadata buffers (attention/decode_buffers.py: block
table, sequence lengths, slot mapping) that every replay fills first.
"""

from __future__ import annotations

from typing import Any

import torch

from model_service.attention.decode_buffers import StaticDecodeMetadata
from model_service.attention.paged import PagedAttention
from model_service.kernels.fused import head_rms_norm, rotary_decode_attention, rotary_store_kv
from model_service.kernels.paged_attention import HeadNorms, num_splits_for, paged_decode_attention, store_kv
from model_service.kernels.prefill_attention import paged_prefill_attention, prefill_tiles
from model_service.models.step import StepBatch, to_device


class TritonBackend(StaticDecodeMetadata, PagedAttention):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # PagedAttention's: StaticDecodeMetadata has none
        self.decode = False
        self.num_decode = 0  # a mixed step's leading one-token sequences: the decode kernel's
        self.query_start = torch.empty(0, dtype=torch.long)
        self.tiles = (self.query_start, self.query_start)
        self.num_splits = 1
        self.slot_mapping = self.block_table = self.seq_lens = torch.empty(0, dtype=torch.long)

    def prepare(self, batch: StepBatch) -> None:
        self.decode = batch.max_query_len == 1
        self.slot_mapping, self.block_table, self.seq_lens = (
            batch.slot_mapping,
            batch.block_table,
            batch.seq_lens,
        )
        kv_heads = self.kv_cache.data.shape[3]
        if self.decode:
            self.num_splits = num_splits_for(batch.num_seqs, kv_heads)
            return
        self.query_start = batch.query_start
        self.num_decode = batch.num_leading_decodes
        self.num_splits = num_splits_for(self.num_decode, kv_heads)
        seqs, rows = prefill_tiles(batch.host_query_start, first_seq=self.num_decode)
        device = batch.input_ids.device
        self.tiles = (to_device(seqs, device), to_device(rows, device))

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        norms: HeadNorms | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        k_cache, v_cache = self.kv_cache.layer(layer)
        block_size, window, softcap = self.kv_cache.block_size, self.windows[layer], self.softcap
        if self.decode and rope is not None and self.num_splits > 1:  # docs/performance-notes.md, session n
            return rotary_decode_attention(
                q, k, v, rope, k_cache, v_cache, self.slot_mapping, norms, block_table=self.block_table,
                seq_lens=self.seq_lens, block_size=block_size, scale=self.scale, window=window,
                num_splits=self.num_splits, softcap=softcap, sinks=sinks,
            )  # fmt: skip
        if rope is not None:
            q = rotary_store_kv(q, k, v, rope, k_cache, v_cache, self.slot_mapping, norms)
        else:
            if norms is not None:
                q, k = head_rms_norm(q, k, norms)
            store_kv(k.contiguous(), v.contiguous(), k_cache, v_cache, self.slot_mapping)
        if self.decode:
            return paged_decode_attention(
                q, k_cache, v_cache, self.block_table, self.seq_lens, block_size, self.scale, window,
                self.num_splits, softcap=softcap, sinks=sinks,
            )  # fmt: skip
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if (d := self.num_decode) > 0:
            paged_decode_attention(
                q[:d], k_cache, v_cache, self.block_table[:d], self.seq_lens[:d], block_size, self.scale,
                window, self.num_splits, out=out[:d], softcap=softcap, sinks=sinks,
            )  # fmt: skip
        return paged_prefill_attention(
            q, k_cache, v_cache, self.block_table, self.query_start, self.seq_lens, block_size, self.scale,
            window, self.tiles, out=out, softcap=softcap, sinks=sinks,
        )  # fmt: skip

    # --- GraphCapturable ----------------------------------------------------------------------

    def prepare_for_capture(self, num_seqs: int) -> None:
        self.decode = True
        self._capture_metadata(num_seqs)
        self.num_splits = num_splits_for(num_seqs, self.kv_cache.data.shape[3])
