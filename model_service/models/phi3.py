"""Phi-3 (HF's `modeling_phi3.py`): the Llama decoder with q/k/v in one `qkv_proj` and gate/up
in one `gate_up_proj` in the checkpoint, and RoPE on the first `rotary_dim` dims of each head
where `partial_rotary_factor` says (Phi-4-mini: 0.75).

The projections stay fused under their checkpoint names: one `PackedLinear` part each, so the
loader reads them as they are and a PEFT LoRA on `qkv_proj` or `gate_up_proj` (one A, one B over
the whole output) is applied as PEFT applies it. The split of q/k/v (`Attention.qkv_sizes`) and
of gate/up (`silu_and_mul`, first half gate) is the one HF makes. The attention backends rotate
whole heads, so partial rotary is applied here and the backend is handed no RoPE.
"""

from __future__ import annotations

import torch

from model_service.kernels.fp8_gemm import QuantizedRows
from model_service.kernels.fused import apply_rotary_reference
from model_service.models.config import ModelConfig
from model_service.models.context import ForwardContext
from model_service.models.layers import MLP, PackedLinear
from model_service.models.llama import Attention, DecoderLayer, DecoderModel


class Phi3Attention(Attention):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        self.qkv_proj = PackedLinear(cfg.hidden_size, {"qkv_proj": sum(self.qkv_sizes)}, False)
        self.rotary_dim = cfg.rotary_dim or cfg.head_dim

    def forward(
        self, x: torch.Tensor | QuantizedRows, rope: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext
    ) -> torch.Tensor:
        if self.rotary_dim == self.head_dim:
            return super().forward(x, rope, ctx)
        q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        n = q.shape[0]
        q = partial_rotary(q.reshape(n, self.num_heads, self.head_dim), rope, self.rotary_dim)
        k = partial_rotary(k.reshape(n, self.num_kv_heads, self.head_dim), rope, self.rotary_dim)
        out = ctx.attention.forward(self.layer_idx, q, k, v.reshape(n, self.num_kv_heads, self.head_dim))
        return self.o_proj(out.reshape(n, -1))


def partial_rotary(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], rotary_dim: int) -> torch.Tensor:
    """x [T, H, D] with RoPE (cos, sin [T, rotary_dim]) on its first rotary_dim dims, as HF's
    `apply_rotary_pos_emb` for a partial rotary."""
    rotated = apply_rotary_reference(x[..., :rotary_dim], *rope)
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


class Phi3MLP(MLP):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.gate_up_proj = PackedLinear(cfg.hidden_size, {"gate_up_proj": 2 * cfg.intermediate_size}, False)


class Phi3Layer(DecoderLayer):
    attention_class = Phi3Attention

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        self.mlp = Phi3MLP(cfg)


class Phi3Model(DecoderModel):
    layer_class = Phi3Layer
