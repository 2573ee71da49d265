"""The paged K/V pool: the device memory every attention backend reads and writes.

The pool is kept in the compute dtype, or in FP8 (e4m3, `--kv-cache-dtype fp8`): half the bytes
of bfloat16, so twice the tokens fit and a decode step reads half the K/V, for a rounding of K
and V to three mantissa bits. No scales are stored (a scale of 1, as vLLM's default for
uncalibrated models): values beyond e4m3's +-448 saturate there.

Multi-head latent attention (DeepSeek's MLA) caches no K or V: per token and layer one row of
`kv_lora_rank + qk_rope_head_dim` values, the compressed latent every head's keys and values
are made from, then the rotated rotary key all heads share (one plane, one "head"; `for_model`).
In 16-bit, per token and layer:
- DeepSeek-V3 (128 heads, latent 512, rope 64; K 192 and V 128 per head): 576 values, 1,152 bytes,
  against 128 * (192 + 128) = 40,960 values (81,920 bytes) of full K/V: 1/71.
- DeepSeek-V2-Lite (16 heads, latent 512, rope 64; K 192, V 128): 576 values, 1,152 bytes,
  against 16 * (192 + 128) = 5,120 values (10,240 bytes): 1/8.9.
"""

from __future__ import annotations

import torch

from model_service.kernels.paged_attention import FP8, indexable
from model_service.models.config import LayerKind, ModelConfig


def cache_dtype(name: str, compute: torch.dtype, device: torch.device) -> torch.dtype:
    """The pool's dtype for `--kv-cache-dtype` `name` (auto: the compute dtype)."""
    if name == "auto":
        return compute
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(
            f"--kv-cache-dtype fp8 needs a GPU of compute capability 8.9 or later (Ada, Hopper, "
            f"Blackwell); {torch.cuda.get_device_name(device)} is {major}.{minor}: use auto"
        )
    return FP8


def cache_entry(config: ModelConfig) -> tuple[int, int, int]:
    """(planes, heads, width) of one token's row in one layer: K and V, or MLA's one latent row."""
    mla = config.latent_attention
    if mla is not None:
        return 1, 1, mla.cache_dim
    return 2, config.num_kv_heads, config.head_dim


def cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Pool bytes one block of `block_size` tokens takes for `config`'s layers."""
    planes, heads, width = cache_entry(config)
    return KVCache.bytes_per_block(config.layer_kinds, block_size, heads, width, dtype, planes)


class KVCache:
    """Per KV-holding layer, K and V of shape [num_blocks * block_size, kv_heads, head_dim]
    (`planes` 2), or one plane of MLA latents [num_blocks * block_size, 1, latent + rope].

    One flat slot axis (block * block_size + offset) is what paged kernels index, so a token's
    K/V is one row whatever block it is in. Layers without K/V (linear attention) get no entry.
    """

    @classmethod
    def for_model(
        cls, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> KVCache:
        planes, heads, width = cache_entry(config)
        return cls(config.layer_kinds, num_blocks, block_size, heads, width, dtype, device, planes)

    def __init__(
        self,
        layer_kinds: list[LayerKind],
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        planes: int = 2,
    ) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        kv_layers = [i for i, kind in enumerate(layer_kinds) if kind.holds_kv]
        self.index = {layer: n for n, layer in enumerate(kv_layers)}  # model layer -> pool layer
        shape = (len(kv_layers), planes, num_blocks * block_size, kv_heads, head_dim)
        self.data = torch.zeros(shape, dtype=dtype, device=device)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        kv = self.data[self.index[layer]]
        return kv[0], kv[1]

    def latent(self, layer: int) -> torch.Tensor:
        """An MLA layer's rows [slots, 1, latent + rope] (a pool of one plane)."""
        return self.data[self.index[layer], 0]

    @property
    def movable(self) -> torch.Tensor:
        """The pool as block copies and swaps index it (an FP8 pool as its bytes: `indexable`)."""
        return indexable(self.data)

    def block_slots(self, blocks: list[int], num_tokens: int) -> torch.Tensor:
        """Flat slot ids of the first `num_tokens` tokens held in `blocks`, on the pool's device."""
        table = torch.tensor(blocks, dtype=torch.long)
        slots = (table[:, None] * self.block_size + torch.arange(self.block_size)[None, :]).reshape(-1)
        return slots[:num_tokens].to(self.data.device)

    @staticmethod
    def bytes_per_block(
        layer_kinds: list[LayerKind],
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        planes: int = 2,
    ) -> int:
        kv_layers = sum(kind.holds_kv for kind in layer_kinds)
        return planes * kv_layers * block_size * kv_heads * head_dim * torch.finfo(dtype).bits // 8
