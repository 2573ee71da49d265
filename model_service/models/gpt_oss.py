"""OpenAI's gpt-oss (gpt-oss-20b / 120b): the Llama decoder (`llama.py`) with gpt-oss's
attention and MoE, as HF's modeling_gpt_oss.py defines them.

What differs, each read from `ModelConfig` (config.py's `_gpt_oss_from_hf`) or fixed here:
- Attention has q/k/v/o biases, alternates sliding-window and full layers (`layer_types`), rotates
  with YaRN, and each head has a learned sink: a logit that joins every softmax's denominator
  without a value (`SinkAttention`; both attention backends add it, the Triton kernels under
  their `SINKS` switch).
- Every layer's MLP is a MoE (`GptOssMoe`): a router with a bias, a softmax over the top-k logits
  (Mixtral's renormalized top-k), experts with biases whose activation is the clamped SwiGLU
  (`ModelConfig.expert_swiglu`). Where the fused MoE kernels run (CUDA with Triton) the experts
  take them, biases and clamp under their switches, and the routing kernel (`route_topk`: the
  softmax over every logit renormalized over the top k is the softmax over the top-k logits):
  nothing comes to the host, so decode steps replay from CUDA graphs. Elsewhere the torch
  reference (`experts_reference`).
Parameter names are HF's (`mlp.router`, `mlp.experts.gate_up_proj` and its `_bias`, `down_proj`
and its `_bias`, `self_attn.sinks`); the experts' layouts are the kernels' (`StackedExperts`'):
HF's [E, H, 2I] with gate and up columns interleaved and [E, I, H] are converted once at load
(`kernel_layout`), after MXFP4 experts are dequantized to HF's layout (mxfp4.py).
"""

from __future__ import annotations

import torch
from torch import nn

from model_service.errors import ModelLoadError
from model_service.kernels.experts import experts_reference
from model_service.kernels.fused_moe import ExpertBiases, fused_moe, fused_moe_supported, route_topk
from model_service.models.config import ModelConfig
from model_service.models.context import ForwardContext
from model_service.models.llama import Attention, DecoderLayer, DecoderModel
from model_service.models.moe import Experts


class SinkAttention(Attention):
    """Attention whose heads each add exp(sink) to their softmax's denominator."""

    shardable_by_heads = False  # tensor parallelism would have to cut the sinks too: refused (sharding.py)

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads))

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
        ctx: ForwardContext,
    ) -> torch.Tensor:  # fmt: skip
        return ctx.attention.forward(self.layer_idx, q, k, v, rope, self.head_norms(), sinks=self.sinks)


class GptOssExperts(Experts):
    """Every expert's weights and biases in the fused kernels' layout: gate_up [E, 2I, H] (the
    gate's rows, then up's) and its bias [E, 2I] likewise, down [E, H, I] and its bias [E, H]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        experts, hidden, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inter, hidden))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(experts, 2 * inter))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inter))
        self.down_proj_bias = nn.Parameter(torch.empty(experts, hidden))
        assert cfg.expert_swiglu is not None, "gpt-oss's config sets its experts' activation"
        self.act = cfg.expert_swiglu

    def kernels_apply(self, device: torch.device) -> bool:
        """Whether the fused kernels run these experts on `device` (no host sync: capturable)."""
        return fused_moe_supported(self.gate_up_proj.dtype, device)

    def capturable(self, device: torch.device) -> bool:
        """The fused kernels are these experts' only capturable path (biases and the clamped
        SwiGLU are theirs alone; the torch reference reads each step's experts on the host)."""
        return self.kernels_apply(device)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]): x [T, H], ids and weights [T, k]."""
        args = (x, self.gate_up_proj, self.down_proj, ids, weights)
        biases = ExpertBiases(self.gate_up_proj_bias, self.down_proj_bias)
        if self.kernels_apply(x.device):
            return fused_moe(*args, biases=biases, swiglu=self.act)
        return experts_reference(*args, biases=biases, swiglu=self.act)


class GptOssMoe(nn.Module):
    """Router (with a bias) -> the top-k logits' softmax -> the experts' weighted sum."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=True)
        self.experts = GptOssExperts(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)
        if self.experts.kernels_apply(x.device):
            weights, ids = route_topk(logits, self.top_k, renormalize=True)
            return self.experts(x, ids, weights)
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        return self.experts(x, ids, torch.softmax(top, dim=-1))


def kernel_layout(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """`tensors` with every layer's experts moved from HF's layout to `GptOssExperts`': gate_up
    [E, H, 2I] (gate and up columns interleaved) to [E, 2I, H] with the gate's rows first, its
    bias likewise, down [E, I, H] to [E, H, I]. A tensor of another shape is a ModelLoadError
    naming it in the checkpoint's terms; a missing one is left for the loader to name."""
    experts, hidden, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    hf_shapes = {
        "gate_up_proj": (experts, hidden, 2 * inter), "gate_up_proj_bias": (experts, 2 * inter),
        "down_proj": (experts, inter, hidden),
    }  # fmt: skip
    out = dict(tensors)
    for name, t in tensors.items():
        kind = name.rpartition(".experts.")[2] if ".experts." in name else ""
        if kind not in hf_shapes:
            continue
        if tuple(t.shape) != hf_shapes[kind]:
            raise ModelLoadError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {hf_shapes[kind]}")
        if kind == "gate_up_proj_bias":
            out[name] = torch.cat((t[:, 0::2], t[:, 1::2]), dim=1).contiguous()
        elif kind == "gate_up_proj":
            out[name] = torch.cat((t[:, :, 0::2], t[:, :, 1::2]), dim=2).transpose(1, 2).contiguous()
        else:
            out[name] = t.transpose(1, 2).contiguous()
    return out


class GptOssDecoderLayer(DecoderLayer):
    attention_class = SinkAttention

    def make_mlp(self, cfg: ModelConfig, layer_idx: int) -> nn.Module:
        return GptOssMoe(cfg)


class GptOssModel(DecoderModel):
    layer_class = GptOssDecoderLayer
