"""The paged K/V pool: the device memory every attention backend reads and writes."""

from __future__ import annotations

import torch

from model_service.models.config import LayerKind


class KVCache:
    """Per KV-holding layer, K and V of shape [num_blocks * block_size, kv_heads, head_dim].

    One flat slot axis (block * block_size + offset) is what paged kernels index, so a token's
    K/V is one row whatever block it is in. Layers without K/V (linear attention) get no entry.
    """

    def __init__(
        self,
        layer_kinds: list[LayerKind],
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        kv_layers = [i for i, kind in enumerate(layer_kinds) if kind.holds_kv]
        self.index = {layer: n for n, layer in enumerate(kv_layers)}  # model layer -> pool layer
        shape = (len(kv_layers), 2, num_blocks * block_size, kv_heads, head_dim)
        self.data = torch.zeros(shape, dtype=dtype, device=device)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        kv = self.data[self.index[layer]]
        return kv[0], kv[1]

    def block_slots(self, blocks: list[int], num_tokens: int) -> torch.Tensor:
        """Flat slot ids of the first `num_tokens` tokens held in `blocks`, on the pool's device."""
        table = torch.tensor(blocks, dtype=torch.long)
        slots = (table[:, None] * self.block_size + torch.arange(self.block_size)[None, :]).reshape(-1)
        return slots[:num_tokens].to(self.data.device)

    @staticmethod
    def bytes_per_block(
        layer_kinds: list[LayerKind], block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        kv_layers = sum(kind.holds_kv for kind in layer_kinds)
        return 2 * kv_layers * block_size * kv_heads * head_dim * torch.finfo(dtype).bits // 8
