"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, and their MoE kin Mixtral, Qwen2-MoE,
Qwen3-MoE) over the paged KV cache.

One module serves them all; they differ only in switches read from `ModelConfig`: q/k/v bias
(Qwen2), per-head RMSNorm on q and k before RoPE (Qwen3), sliding windows (Mistral, some Qwen
layers), tied embeddings, optional attention/MLP biases (Llama, Qwen3), and a sparse MoE block
instead of the dense MLP in the layers whose kind says `moe`. Parameter names follow HF
checkpoints, except that q/k/v and gate/up are fused into one `PackedLinear` each (one matmul
instead of three or two); the loader packs them by `parts`.
"""

from __future__ import annotations

import torch
from torch import nn

from model_service.kernels.fp8_gemm import ActivationQuant, QuantizedRows
from model_service.kernels.paged_attention import HeadNorms
from model_service.models.config import ModelConfig
from model_service.models.context import ForwardContext, LayerOutput, Rope
from model_service.models.layers import PackedLinear, RMSNorm, input_quant
from model_service.models.moe import mlp_for
from model_service.models.rope import RotaryEmbedding


class Attention(nn.Module):
    shardable_by_heads = True  # a rank can run its heads alone (no norm across every head)

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.layer_idx = layer_idx
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_sizes = (q, kv, kv)
        self.qkv_proj = PackedLinear(cfg.hidden_size, {"q_proj": q, "k_proj": kv, "v_proj": kv}, cfg.qkv_bias)
        self.o_proj = PackedLinear(q, {"o_proj": cfg.hidden_size}, cfg.o_proj_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def input_quant(self, x: torch.Tensor) -> ActivationQuant | None:
        """The qkv projection's (`PackedLinear.input_quant`): it alone reads the input."""
        return self.qkv_proj.input_quant(x)

    def project(self, x: torch.Tensor | QuantizedRows) -> tuple[torch.Tensor, ...]:
        """q, k and v, each [tokens, heads * head_dim]: where a family's own q/k math goes."""
        return self.qkv_proj(x).split(self.qkv_sizes, dim=-1)

    def forward(
        self, x: torch.Tensor | QuantizedRows, rope: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext
    ) -> torch.Tensor:
        q, k, v = self.project(x)
        n = q.shape[0]
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attend(q, k, v, rope, ctx).reshape(n, -1))

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
        ctx: ForwardContext,
    ) -> torch.Tensor:  # fmt: skip
        """The backend's attention over the heads q [T, H, D], k, v [T, KVH, D]: where a family's
        own softmax terms go (gpt-oss's sinks)."""
        return ctx.attention.forward(self.layer_idx, q, k, v, rope, self.head_norms())

    def head_norms(self) -> HeadNorms | None:
        """Qwen3's q_norm and k_norm (both with the config's eps), for the backend to apply where
        it rotates the heads: no launch of their own in a decode step."""
        if not self.qk_norm:
            return None
        return HeadNorms(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)


class PreNormLayer(nn.Module):
    """norm -> token mixer -> add & norm -> MLP, over a residual stream the next norm adds in.
    Subclasses set `input_layernorm`, `post_attention_layernorm`, `mlp` and define `mix`."""

    input_layernorm: nn.Module
    post_attention_layernorm: nn.Module
    mlp: nn.Module

    def mix(
        self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext
    ) -> torch.Tensor:
        raise NotImplementedError

    def mixer(self) -> nn.Module | None:
        """The module `mix` hands its input to, asked how to quantize it (`layers.input_quant`);
        None: `mix` reads it otherwise, in the compute dtype."""
        return None

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope, ctx: ForwardContext
    ) -> LayerOutput:
        """(this layer's output, the residual stream before it): the next norm adds the two."""
        h, residual = add_and_norm(self.input_layernorm, x, residual, self.mixer())
        h = self.mix(h, rope, ctx)
        h, residual = add_and_norm(self.post_attention_layernorm, h, residual, self.mlp)
        return self.mlp(h), residual


def add_and_norm(
    norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None, consumer: nn.Module | None
) -> tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
    """(norm(x + residual), x + residual), or (norm(x), x) for the first layer. An `RMSNorm` whose
    `consumer` starts with an FP8 GEMM quantizes its output for it in the same launch
    (`layers.input_quant`); other norms (EAGLE-3's taps) give it unquantized."""
    quant = input_quant(consumer, x) if isinstance(norm, RMSNorm) else None
    if quant is not None:
        return norm.with_residual(x, residual, quant)
    if residual is None:
        return norm(x), x
    return norm.with_residual(x, residual)


class DecoderLayer(PreNormLayer):
    """Attention state lives in the shared paged pool, so prefill chunks, decode rows and mixed
    batches are one flat-batch operation that differs only in the step batch."""

    attention_class: type[nn.Module] = Attention  # a family's own attention (DeepSeek's MLA)
    norm_class: type[RMSNorm] = RMSNorm  # Gemma's scale by 1 + weight

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self.attention_class(cfg, layer_idx)
        self.post_attention_layernorm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = self.make_mlp(cfg, layer_idx)

    def make_mlp(self, cfg: ModelConfig, layer_idx: int) -> nn.Module:
        """Layer `layer_idx`'s MLP: dense or sparse-MoE by its kind (gpt-oss: its own MoE)."""
        return mlp_for(cfg, layer_idx)

    def mix(
        self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext
    ) -> torch.Tensor:
        return self.self_attn(h, rope, ctx)

    def mixer(self) -> nn.Module:
        return self.self_attn


def sliding_rotary(cfg: ModelConfig) -> RotaryEmbedding | None:
    """The sliding layers' rotary embedding where it differs from the full layers' (Gemma 3)."""
    if cfg.sliding_rope is None:
        return None
    return RotaryEmbedding(cfg.rotary_dim or cfg.head_dim, *cfg.sliding_rope)


class DecoderModel(nn.Module):
    """Embeddings, the layer stack, final norm and LM head; logits only for requested rows.

    A decoder whose layers or norm differ (the hybrid Qwen3-Next) subclasses this and names its
    own `layer_class` / `norm_class`: the stack, the residual stream and the LM head are shared."""

    layer_class: type[nn.Module] = DecoderLayer
    norm_class: type[nn.Module] = RMSNorm

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList(self.layer_class(cfg, i) for i in range(cfg.num_layers))
        self.model.norm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg.rotary_dim or cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.sliding_rotary = sliding_rotary(cfg)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions: [T] flat batch. Returns float32 logits [len(ctx.logits_rows), vocab]."""
        return self.logits(self.hidden_states(input_ids, positions, ctx), ctx.logits_rows)

    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """The residual stream after the last layer, [T, hidden], before the final norm: every row,
        so a caller may capture it for a padded token count (engine/piecewise_graphs.py)."""
        x = self.embed(input_ids)
        residual = None
        for layer, rope in zip(self.model.layers, self.layer_ropes(positions, x.dtype), strict=True):
            x, residual = layer(x, residual, rope, ctx)
        return x + residual

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings the first layer reads (Granite scales them)."""
        return self.model.embed_tokens(input_ids)

    def layer_ropes(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's rotary tables: one pair for every layer, or (Gemma 3) the sliding layers'
        own pair from their own base."""
        rope = self.rotary(positions, dtype)
        if self.sliding_rotary is None:
            return [rope] * len(self.model.layers)
        local = self.sliding_rotary(positions, dtype)
        return [local if window else rope for window in self.config.sliding_windows]

    def logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Float32 logits of `hidden`'s `rows` (final norm, LM head)."""
        return self.lm_head(self.model.norm(hidden[rows])).float()
