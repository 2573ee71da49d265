"""DeepSeek-V3's multi-token-prediction (MTP) layer, loaded as a module of its own for speculation.

A V3 checkpoint declares `num_nextn_predict_layers` layers after its decoder layers
(`model.layers.{num_hidden_layers + i}.*`). The layer at position p reads two things: the target's
hidden state h_p (the residual stream after its last layer, before the final norm: what the LM
head read to predict token p + 1) and the embedding of token p + 1. It predicts token p + 2:

    x = eh_proj([enorm(embed(t_{p+1})); hnorm(h_p)])     (embedding half first, as the checkpoint)
    y = a full decoder layer (MLA, MoE or dense MLP) over x, its own K/V cache, its output plus
        its residual stream
    logits = shared_head.head(shared_head.norm(y))

Chained for more tokens, y stands in for the next position's h (vLLM's and SGLang's reading of the
DeepSeek-V3 report). As vLLM, the embedding at position 0 is zeroed.

The layer's own tensors are `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, and the decoder
layer's; `embed_tokens` and `shared_head.head` are in V3's checkpoints too, copies of the target's
embedding and LM head: a copy equal to the target's (or an absent one) is the target's tensor,
not a second one in memory. Only the first MTP layer is loaded: later ones predict further ahead
from the one before at the same position, a chain with caches of its own that is not built.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from model_service.errors import ModelLoadError
from model_service.models.config import ModelConfig
from model_service.models.context import ForwardContext
from model_service.models.deepseek import DeepseekDecoderLayer
from model_service.models.expert_weights import stack_expert_tensors
from model_service.models.fp8_linear import quantize_online
from model_service.models.fp8_weights import fp8_checkpoint
from model_service.models.layers import RMSNorm
from model_service.models.loader import (
    LoadedModel,
    load_weights,
    read_tensors,
    resolve_model_path,
    weight_files,
)
from model_service.models.rope import RotaryEmbedding

# The layer's own tensor names; every other tensor of the layer is its decoder block's.
OWN = ("embed_tokens.", "enorm.", "hnorm.", "eh_proj.", "shared_head.")
# Tensors the checkpoint repeats from the target (and the target's parameter names).
SHARED = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}


class SharedHead(nn.Module):
    """The layer's output norm and LM head (`shared_head.*`; the head is the target's in V3)."""

    def __init__(self, hidden_size: int, vocab_size: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)
        self.head = nn.Linear(hidden_size, vocab_size, bias=False)


class MtpLayer(nn.Module):
    """One MTP layer over a K/V cache of its own (its decoder block is that cache's layer 0)."""

    rotary: RotaryEmbedding  # the target's

    def __init__(self, cfg: ModelConfig) -> None:
        """`cfg`: the layer's own (`ModelConfig.mtp_layer_config`)."""
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.embed_tokens = nn.Embedding(cfg.vocab_size, hidden)
        self.enorm, self.hnorm = RMSNorm(hidden, eps), RMSNorm(hidden, eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.block = DeepseekDecoderLayer(cfg, 0)
        self.shared_head = SharedHead(hidden, cfg.vocab_size, eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [T]: token p + 1 at each position p; hidden [T, H]: h_p. Returns (float32
        logits of `ctx.logits_rows`, the layer's output [T, H], the next chained step's h)."""
        embeds = self.embed_tokens(input_ids).masked_fill((positions == 0)[:, None], 0.0)
        x = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(hidden)), dim=-1))
        out, residual = self.block(x, None, self.rotary(positions, x.dtype), ctx)
        out = out + residual
        return self.shared_head.head(self.shared_head.norm(out[ctx.logits_rows])).float(), out


def load_mtp_layer(target: LoadedModel) -> MtpLayer:
    """The first MTP layer of `target`'s checkpoint, on the target's device and in its dtype
    (and FP8 scheme: an FP8 checkpoint's, or `--quantization`'s applied after the load as to the
    target); read from disk now (the target's load left it there)."""
    cfg = target.config
    if cfg.qwen3_next_mtp_layers:
        raise ModelLoadError(
            f"model {target.name!r} ships Qwen3-Next's MTP layer (mtp.* tensors), which MTP "
            "speculation does not run (only DeepSeek-V3's num_nextn_predict_layers); use method "
            "'ngram' or 'draft'"
        )
    if not cfg.mtp_layers:
        raise ModelLoadError(
            f"model {target.name!r} has no multi-token-prediction layers (config.json's "
            "num_nextn_predict_layers is 0 or absent): MTP speculation needs a checkpoint that "
            "ships them, such as DeepSeek-V3's; use method 'ngram' or 'draft'"
        )
    path = resolve_model_path(target.name)
    if not path.is_dir():
        raise ModelLoadError(f"MTP speculation reads its layer from an HF checkpoint directory, not {path}")
    prefix = cfg.mtp_prefixes[0]
    # --quantization fp8 quantized the target after its float load: the layer is float on disk too.
    online = cfg.quantization is not None and cfg.quantization.method == "online"
    layer_cfg = replace(cfg.mtp_layer_config(), quantization=None) if online else cfg.mtp_layer_config()
    with torch.device("meta"):
        layer = MtpLayer(layer_cfg)
    tensors = {
        _layer_name(k[len(prefix) :]): t
        for k, t in read_tensors(weight_files(path), lambda k: k.startswith(prefix)).items()
    }
    if cfg.quantization is not None and not online:  # DeepSeek-V3's hub weights: FP8 as the rest
        tensors = fp8_checkpoint(layer, tensors, cfg.quantization)
    tensors = _stack_block_experts(tensors, layer_cfg)
    param = next(target.module.parameters())
    theirs = {name: target.module.get_parameter(their_name) for name, their_name in SHARED.items()}
    shared = {name for name, param in theirs.items() if _same(tensors.get(name), param)}
    load_weights(layer, tensors, f"{cfg.family} MTP layer", param.dtype, param.device, shared)
    for name in shared:
        owner, _, attr = name.rpartition(".")
        setattr(layer.get_submodule(owner), attr, theirs[name])
    layer.rotary = target.module.rotary
    if online:  # as the target was quantized (its embedding and LM head, shared here, stay as they are)
        quantize_online(layer, cfg.quantization)
    return layer.eval()


def _layer_name(name: str) -> str:
    """A checkpoint name of the MTP layer (its prefix cut) as `MtpLayer` names it: its own
    modules as they are, its decoder block's under `block.`."""
    return name if name.startswith(OWN) else "block." + name


def _stack_block_experts(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """`tensors` with the block's experts stacked, as a decoder's layer 0 (which the stacking reads)."""
    own = {k: t for k, t in tensors.items() if not k.startswith("block.")}
    block = {"model.layers.0." + k.removeprefix("block."): t for k, t in tensors.items() if k not in own}
    stacked = stack_expert_tensors(block, cfg)
    return own | {"block." + k.removeprefix("model.layers.0."): t for k, t in stacked.items()}


def _same(tensor: torch.Tensor | None, target: torch.Tensor) -> bool:
    """Whether the checkpoint's copy (None: absent) is the target's tensor, so that it is shared."""
    if tensor is None:
        return True
    return tensor.shape == target.shape and torch.equal(tensor.to(target.device, target.dtype), target)
