"""Attention over the paged KV cache, for one flat batch of tokens from many sequences.

The batch is a concatenation of per-sequence token runs (decode rows of length 1 and prefill
chunks of any length, in any order). `AttentionMetadata` is built once per step by the model
runner and shared by every layer, so no layer loops over sequences in Python.

This is the torch reference path: queries are scattered into a padded [seqs, max_q] grid, each
sequence's context is gathered from the block pool by precomputed cache slots, and SDPA runs
with an explicit causal/padding/sliding-window mask. A GPU kernel replaces `paged_attention`
behind the same metadata.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from model_service.lora.batch import LoraBatch


@dataclass
class AttentionMetadata:
    """Per-step index tensors, all on the compute device."""

    positions: torch.Tensor  # [T] absolute position of each token
    slot_mapping: torch.Tensor  # [T] flat cache slot (block * block_size + offset) to write each token's K/V
    query_index: torch.Tensor  # [S, Q] row of the flat batch for each padded query (T = padding row)
    token_rows: torch.Tensor  # [T] index into the flattened [S*Q] grid for each token (unpadding)
    key_slots: torch.Tensor  # [S, K] cache slot of each sequence's context position (0 where padding)
    query_positions: torch.Tensor  # [S, Q] position of each padded query (-1 where padding)
    logits_rows: torch.Tensor  # [N] rows of the flat batch whose logits the caller wants
    lora: LoraBatch | None = None  # which rows use which LoRA slot; None when no row does

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """[S, 1, Q, K] boolean mask: causal, within context, optionally within a sliding window."""
        key_pos = torch.arange(self.key_slots.shape[1], device=self.key_slots.device)
        q = self.query_positions[:, :, None]
        allowed = key_pos[None, None, :] <= q
        if sliding_window is not None:
            allowed &= key_pos[None, None, :] > q - sliding_window
        # Padding query rows attend to position 0 so SDPA never sees an all-masked row (NaN).
        allowed[:, :, 0] |= self.query_positions < 0
        return allowed[:, None]


class KVCache:
    """The block pool: per layer, K and V of shape [num_blocks, block_size, kv_heads, head_dim]."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (num_layers, 2, num_blocks * block_size, kv_heads, head_dim)
        self.data = torch.zeros(shape, dtype=dtype, device=device)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, 0], self.data[i, 1]

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * block_size * kv_heads * head_dim * torch.finfo(dtype).bits // 8


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend each token to its own sequence's context.

    q: [T, H, D]; k, v: [T, KVH, D]; caches: [slots, KVH, D]. Returns [T, H, D].
    """
    k_cache[meta.slot_mapping] = k
    v_cache[meta.slot_mapping] = v
    _, heads, dim = q.shape
    q_padded = torch.cat((q, q.new_zeros(1, heads, dim)))[meta.query_index]  # [S, Q, H, D]
    keys = k_cache[meta.key_slots]  # [S, K, KVH, D]
    values = v_cache[meta.key_slots]
    out = F.scaled_dot_product_attention(
        q_padded.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=mask,
        scale=scale,
        enable_gqa=heads != k.shape[1],
    )  # [S, H, Q, D]
    return out.transpose(1, 2).reshape(-1, heads, dim)[meta.token_rows]
