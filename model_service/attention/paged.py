"""What both paged attention backends (the torch reference and the Triton one) hold alike."""

from __future__ import annotations

from model_service.attention.kv_cache import KVCache


class PagedAttention:
    """The cache a backend reads, each layer's sliding window (None: full), and how a query-key
    product becomes a logit: the scale (1/sqrt(head_dim) unless the config sets one: Granite's
    `attention_multiplier`, Gemma's `query_pre_attn_scalar`) and Gemma 2's soft-cap, cap *
    tanh(logits / cap). Attention sinks (gpt-oss's) come with each call: they are the layer's
    parameters."""

    def __init__(
        self,
        kv_cache: KVCache,
        windows: list[int | None],
        head_dim: int,
        scale: float | None = None,
        softcap: float | None = None,
    ) -> None:
        self.kv_cache, self.windows, self.softcap = kv_cache, windows, softcap
        self.scale = scale if scale is not None else head_dim**-0.5
