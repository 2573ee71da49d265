"""Qwen3-Next: a hybrid decoder of Gated DeltaNet (linear attention) and gated full-attention layers.

What differs from the Llama-family decoder (`llama.py`, whose stack and residual stream it reuses):
- Token mixers alternate per `ModelConfig.layer_kinds`: `GatedDeltaNet` layers keep a fixed-size
  recurrent state per sequence (conv state + delta-rule state, in the executor's state tensors,
  see `recurrent.py` and `gated_delta.py`); `GatedAttention` layers use the paged K/V pool.
- Gated attention: q_proj emits, per head, the query and an output gate; the attention output is
  multiplied by sigmoid(gate) before o_proj. q and k get a per-head norm; RoPE covers only the
  first `rotary_dim` dims of each head (partial rotary).
- Every RMSNorm except the gated one inside GatedDeltaNet is zero-centered: it scales by
  (1 + weight), in float32, rounding once at the end.
The MLP is chosen per layer by `mlp_for`: the place where the sparse-MoE block plugs in.
"""

from __future__ import annotations

import torch
from torch import nn

from model_service.kernels.gated_attention import gated_heads, sigmoid_gate
from model_service.kernels.gated_delta import gated_rms_norm
from model_service.models.config import LinearAttentionShape, Mixer, ModelConfig
from model_service.models.context import ForwardContext
from model_service.models.gated_delta import causal_conv, gated_delta_rule
from model_service.models.layers import PackedLinear, ZeroCenteredRMSNorm
from model_service.models.llama import DecoderModel, PreNormLayer
from model_service.models.moe import mlp_for

STATE_TENSORS_PER_LAYER = 2  # conv state [K - 1, conv_dim], delta-rule state [Hv, Dk, Dv]


class GatedRMSNorm(nn.Module):
    """RMSNorm of the DeltaNet output per value head, then times SiLU(z), z being the output gate."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x [T, Hv, Dv]; gate [T, Hk, Hv / Hk, Dv] (each key head's z, as in_proj_qkvz lays it out)."""
        return gated_rms_norm(x, gate, self.weight, self.eps)


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.layer_idx = layer_idx
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = PackedLinear(  # q_proj: per head, head_dim query then head_dim gate
            cfg.hidden_size, {"q_proj": 2 * q, "k_proj": kv, "v_proj": kv}, cfg.qkv_bias
        )
        self.o_proj = PackedLinear(q, {"o_proj": cfg.hidden_size}, cfg.o_proj_bias)
        self.q_norm = ZeroCenteredRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext
    ) -> torch.Tensor:
        norms = (self.q_norm.weight, self.k_norm.weight)
        shape = (self.num_heads, self.num_kv_heads, self.head_dim)
        q, k, v, gate = gated_heads(self.qkv_proj(x), norms, self.q_norm.eps, rope, shape)
        out = ctx.attention.forward(self.layer_idx, q, k, v)
        return self.o_proj(sigmoid_gate(out, gate))


class GatedDeltaNet(nn.Module):
    """Linear attention with a per-sequence recurrent state; `state_index` counts the recurrent
    layers before this one, and picks this layer's tensors out of the executor's state list."""

    def __init__(self, cfg: ModelConfig, shape: LinearAttentionShape, state_index: int) -> None:
        super().__init__()
        self.shape, self.state_index = shape, state_index
        hk, hv, dk, dv = shape.num_key_heads, shape.num_value_heads, shape.key_head_dim, shape.value_head_dim
        self.key_dim, self.value_dim = hk * dk, hv * dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        group = hv // hk
        # Per key head: q (dk), k (dk), v (group * dv), z (group * dv); then b, a (group each).
        self.qkvz_split = [dk, dk, group * dv, group * dv]
        parts = {"in_proj_qkvz": 2 * self.key_dim + 2 * self.value_dim, "in_proj_ba": 2 * hv}
        self.packed = cfg.quantization is None
        if self.packed:  # both projections of x in one GEMM (a launch less a layer), parts by checkpoint name
            self.in_proj = PackedLinear(cfg.hidden_size, parts, False)
        else:  # an FP8 checkpoint may keep in_proj_ba in high precision (Qwen3-Next's release does)
            self.in_proj_qkvz = PackedLinear(cfg.hidden_size, {"in_proj_qkvz": parts["in_proj_qkvz"]}, False)
            self.in_proj_ba = PackedLinear(cfg.hidden_size, {"in_proj_ba": parts["in_proj_ba"]}, False)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, shape.conv_kernel, groups=self.conv_dim, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(hv))
        self.A_log = nn.Parameter(torch.zeros(hv))
        self.norm = GatedRMSNorm(dv, cfg.rms_norm_eps)
        self.out_proj = PackedLinear(self.value_dim, {"out_proj": cfg.hidden_size}, False)

    def state_shapes(self) -> list[tuple[int, ...]]:
        s = self.shape
        return [(s.conv_kernel - 1, self.conv_dim), (s.num_value_heads, s.key_head_dim, s.value_head_dim)]

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(in_proj_qkvz(x), in_proj_ba(x)): column views of one GEMM's rows where they are packed
        (the kernels read them by their row strides), else two GEMMs."""
        if self.packed:
            qkvz, ba = self.in_proj(x).split(self.in_proj.output_sizes, dim=-1)
            return qkvz, ba
        return self.in_proj_qkvz(x), self.in_proj_ba(x)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        assert ctx.recurrent is not None, "a linear-attention layer needs the executor's state tensors"
        n, s = x.shape[0], self.shape
        hk, hv = s.num_key_heads, s.num_value_heads
        qkvz, ba = self.project(x)
        q, k, v, z = qkvz.view(n, hk, -1).split(self.qkvz_split, dim=-1)
        conv_state, ssm_state = ctx.recurrent.layer_state(self.state_index, STATE_TENSORS_PER_LAYER)
        mixed = causal_conv((q, k, v), conv_state, self.conv1d.weight, ctx.recurrent.plan)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        core = gated_delta_rule(
            q.reshape(n, hk, s.key_head_dim),
            k.reshape(n, hk, s.key_head_dim),
            v.reshape(n, hv, s.value_head_dim),
            ba,
            self.A_log,
            self.dt_bias,
            ssm_state,
            ctx.recurrent.plan,
        )
        out = self.norm(core, z.unflatten(-1, (hv // hk, s.value_head_dim)))
        return self.out_proj(out.reshape(n, -1))


class HybridDecoderLayer(PreNormLayer):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.linear = cfg.layer_kinds[layer_idx].mixer is Mixer.LINEAR_ATTENTION
        if self.linear:
            assert cfg.linear_attention is not None
            index = sum(not k.holds_kv for k in cfg.layer_kinds[:layer_idx])
            self.linear_attn = GatedDeltaNet(cfg, cfg.linear_attention, index)
        else:
            self.self_attn = GatedAttention(cfg, layer_idx)
        self.mlp = mlp_for(cfg, layer_idx)

    def mix(
        self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext
    ) -> torch.Tensor:
        return self.linear_attn(h, ctx) if self.linear else self.self_attn(h, rope, ctx)


class Qwen3NextModel(DecoderModel):
    layer_class = HybridDecoderLayer
    norm_class = ZeroCenteredRMSNorm

    def recurrent_state_shapes(self) -> list[tuple[int, ...]]:
        """Per linear-attention layer, in order: its conv state and its delta-rule state."""
        return [
            shape for layer in self.model.layers if layer.linear for shape in layer.linear_attn.state_shapes()
        ]
