"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over the paged KV cache.

One module serves the four architectures; they differ only in switches read from
`ModelConfig`: q/k/v bias (Qwen2), per-head RMSNorm on q and k before RoPE (Qwen3), sliding
windows (Mistral, some Qwen layers), tied embeddings, optional attention/MLP biases (Llama,
Qwen3). Parameter names follow HF checkpoints so weights load by name, with no renaming table.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model_service.models.attention import AttentionMetadata, KVCache, paged_attention
from model_service.models.config import ModelConfig
from model_service.models.protocol import LayerState
from model_service.models.rope import RotaryEmbedding, apply_rotary


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in float32 as the reference implementations do; bf16 variance drifts.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def project(
    linear: nn.Linear, name: str, layer: int, x: torch.Tensor, meta: AttentionMetadata
) -> torch.Tensor:
    """A base projection plus, for rows served by an adapter, that adapter's LoRA delta."""
    y = linear(x)
    return meta.lora.add_delta(layer, name, x, y) if meta.lora is not None else y


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.layer_idx = layer_idx
        self.sliding_window = cfg.sliding_windows[layer_idx] if cfg.sliding_windows else None
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_proj_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        masks: dict[int | None, torch.Tensor],
        kv: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        n = x.shape[0]
        i = self.layer_idx
        q = project(self.q_proj, "q_proj", i, x, meta).view(n, self.num_heads, self.head_dim)
        k = project(self.k_proj, "k_proj", i, x, meta).view(n, self.num_kv_heads, self.head_dim)
        v = project(self.v_proj, "v_proj", i, x, meta).view(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        out = paged_attention(
            q, k, v, kv[0], kv[1], meta, masks[self.sliding_window], scale=self.head_dim**-0.5
        )
        return project(self.o_proj, "o_proj", i, out.reshape(n, -1), meta)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        i = self.layer_idx
        h = F.silu(project(self.gate_proj, "gate_proj", i, x, meta)) * project(
            self.up_proj, "up_proj", i, x, meta
        )
        return project(self.down_proj, "down_proj", i, h, meta)


class DecoderLayer(nn.Module):
    """A `TransformerLayer`: attention state lives in the shared paged pool, so per-sequence
    state is empty and prefill, decode and mixed batches are one flat-batch operation."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, layer_idx)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        masks: dict[int | None, torch.Tensor],
        kv: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, meta, masks, kv)
        return x + self.mlp(self.post_attention_layernorm(x), meta)

    # Prefill chunks, decode rows and mixed batches differ only in their metadata.
    prefill = decode = forward

    def alloc_state(self) -> LayerState:
        return LayerState()

    def release_state(self, state: LayerState) -> None:
        state.released = True


class DecoderModel(nn.Module):
    """Embeddings, the layer stack, final norm and LM head; logits only for requested rows."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache) -> torch.Tensor:
        """input_ids: [T] flat batch. Returns float32 logits [len(meta.logits_rows), vocab]."""
        x = self.model.embed_tokens(input_ids)
        rope = self.rotary(meta.positions, x.dtype)
        masks = {w: meta.mask(w) for w in {layer.self_attn.sliding_window for layer in self.layers}}
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, meta, masks, kv_cache.layer(i))
        x = self.model.norm(x[meta.logits_rows])
        return self.lm_head(x).float()
