"""An EAGLE-3 draft head (a checkpoint of its own, `LlamaForCausalLMEagle3`), loaded for speculation.

The head reads three of the target's hidden states at each position p: the residual stream
entering the target's layers `aux_layers` (vLLM's numbering: id j is layer j's input, 0 the
embeddings; by default (2, L // 2, L - 3)), fused by `fc` into one hidden row g_p. With the
embedding of token p + 1 it predicts token p + 2, through one decoder layer (`midlayer`) whose
attention reads both:

    x = [input_layernorm(embed(t_{p+1})); hidden_norm(g_p)]    (2 * hidden into q, k, v)
    a = o_proj(attention(x)) + g_p                             (the residual: g_p itself)
    y = mlp(post_attention_layernorm(a)) + a
    logits = lm_head(norm(y))  over the head's reduced vocabulary

Chained for more tokens, y (before the final norm) stands in for the next position's g, and `fc`
is not applied to it: vLLM's and SGLang's reading. `norm_before_residual` checkpoints take the
normed g_p as the residual instead.

The head's vocabulary is a subset of the target's (`draft_vocab_size`, the most frequent tokens):
draft id d is target id d + d2t[d]. Its logits are scattered into the target's vocabulary with
-inf elsewhere, so the proposals, and q for the rejection sampler, are over target ids (a token
outside the head's vocabulary is never proposed, which the verify tolerates).

Checkpoint names: `midlayer.*` (SGLang / EAGLE's) or `layers.0.*` (vLLM speculators'), optionally
under `model.`; `fc`, `norm`, `lm_head`, `d2t` (and `t2d`, unused); `embed_tokens` is often absent
(the target's is used) and, like a `lm_head` over the full vocabulary, shared with the target when
absent or equal to its tensor. The speculators format's config (`transformer_layer_config` and
`speculators_config`) is read too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from model_service.errors import ModelLoadError
from model_service.models.config import ModelConfig
from model_service.models.context import ForwardContext
from model_service.models.layers import MLP, PackedLinear, RMSNorm
from model_service.models.llama import Attention
from model_service.models.loader import (
    LoadedModel,
    load_weights,
    read_tensors,
    resolve_model_path,
    weight_files,
)
from model_service.models.rope import RotaryEmbedding

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator")
# The head's tensors the target may hold instead (and the target's parameter names).
SHARED = {"embed_tokens.weight": "model.embed_tokens.weight", "lm_head.weight": "lm_head.weight"}


@dataclass(frozen=True)
class Eagle3Config:
    """The head's shape (`layer`: its decoder layer as a one-layer Llama over the target's
    vocabulary, which sizes its K/V cache) and how it reads the target."""

    layer: ModelConfig
    draft_vocab_size: int
    aux_layers: tuple[int, ...]
    target_hidden_size: int
    norm_before_residual: bool = False


class Eagle3Midlayer(nn.Module):
    """The head's decoder layer: attention over [embedding; hidden] (2 * hidden wide), its own
    K/V in the head's cache (layer 0 there), the fused hidden as the residual stream."""

    def __init__(self, cfg: ModelConfig, norm_before_residual: bool) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm, self.hidden_norm = RMSNorm(hidden, eps), RMSNorm(hidden, eps)
        self.self_attn = Attention(replace(cfg, hidden_size=2 * hidden), 0)
        width = cfg.num_heads * cfg.head_dim
        self.self_attn.o_proj = PackedLinear(width, {"o_proj": hidden}, cfg.o_proj_bias)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = MLP(cfg)
        self.norm_before_residual = norm_before_residual

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MLP's output, the residual stream before it): the final norm adds the two."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat((self.input_layernorm(embeds), normed), dim=-1)
        h, residual = self.post_attention_layernorm.with_residual(self.self_attn(x, rope, ctx), residual)
        return self.mlp(h), residual


class Eagle3Draft(nn.Module):
    """The EAGLE-3 head over a K/V cache of its own; `forward` as the MTP layer's (ids, positions,
    hidden, ctx) -> (logits over the target's vocabulary, the hidden the next chained step reads)."""

    rotary: RotaryEmbedding
    d2t: torch.Tensor  # [draft_vocab]: draft id -> target id offset

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        layer = cfg.layer
        self.vocab_size, self.draft_vocab_size = layer.vocab_size, cfg.draft_vocab_size
        self.embed_tokens = nn.Embedding(layer.vocab_size, layer.hidden_size)
        self.fc = nn.Linear(len(cfg.aux_layers) * cfg.target_hidden_size, layer.hidden_size, bias=False)
        self.midlayer = Eagle3Midlayer(layer, cfg.norm_before_residual)
        self.norm = RMSNorm(layer.hidden_size, layer.rms_norm_eps)
        self.lm_head = nn.Linear(layer.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long), persistent=False)
        self.same_ids = self.draft_vocab_size == self.vocab_size  # draft id d is target id d

    def map_vocabulary(self, d2t: torch.Tensor) -> None:
        """Set the draft -> target id offsets; whether any id moves is read here, once, not in
        every step (a CUDA graph's capture cannot wait on the device)."""
        self.d2t = d2t
        self.same_ids = self.draft_vocab_size == self.vocab_size and not bool(d2t.any())

    def fuse(self, aux: list[torch.Tensor]) -> torch.Tensor:
        """The first step's hidden rows: `fc` over the target's kept states [T, hidden] each."""
        return self.fc(torch.cat(aux, dim=-1))

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [T]: token p + 1 at each position p; hidden [T, H]: the fused g_p (or the
        head's own output at p - 1 when chained). Returns (float32 logits of `ctx.logits_rows`
        over the target's vocabulary, the pre-norm output [T, H])."""
        embeds = self.embed_tokens(input_ids)
        out, residual = self.midlayer(embeds, hidden, self.rotary(positions, embeds.dtype), ctx)
        normed, out = self.norm.with_residual(out, residual)
        return self.to_target(self.lm_head(normed[ctx.logits_rows]).float()), out

    def to_target(self, logits: torch.Tensor) -> torch.Tensor:
        """[N, draft_vocab] -> [N, vocab]: each draft id's logit at its target id, -inf elsewhere."""
        if self.same_ids:
            return logits
        ids = torch.arange(self.draft_vocab_size, device=logits.device) + self.d2t
        full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        full[:, ids] = logits
        return full


def is_eagle3_head(name: str) -> bool:
    """Whether `name` is a directory whose config.json declares an EAGLE-3 head (an architecture
    of one, or the speculators format's algorithm): vLLM infers method "eagle3" from it."""
    file = Path(name).expanduser() / "config.json"
    try:
        raw = json.loads(file.read_text()) if file.is_file() else {}
    except (OSError, json.JSONDecodeError):
        return False
    if not isinstance(raw, dict):
        return False
    speculators = raw.get("speculators_config")
    algorithm = speculators.get("algorithm") if isinstance(speculators, dict) else None
    return algorithm == "eagle3" or any(a in ARCHITECTURES for a in raw.get("architectures") or [])


def is_eagle_1_2_head(path: Path) -> bool:
    """Whether the checkpoint at `path` is an EAGLE-1/2 head (a Llama-shaped config, but an `fc`
    tensor beside one decoder layer, which no causal LM has, and no EAGLE-3 `hidden_norm`; only
    tensor names are read), which is not supported: loaded as a draft model or an EAGLE-3 head
    it failed on a tensor name."""
    from safetensors import safe_open

    try:
        files = weight_files(path) if path.is_dir() and not is_eagle3_head(str(path)) else []
        names = set()
        for f in files:
            with safe_open(str(f), framework="pt") as shard:
                names |= set(shard.keys())
    except Exception:  # unreadable: the load's own error says why
        return False
    eagle3 = any(n.startswith("midlayer.") or "hidden_norm" in n for n in names)  # a mislabelled EAGLE-3
    return bool(names & {"fc.weight", "model.fc.weight"}) and not eagle3


def read_eagle3_config(path: Path, target: ModelConfig) -> Eagle3Config:
    """The head's config.json (EAGLE / SGLang's flat one, or the speculators format), checked
    against the target it will read."""
    file = path / "config.json"
    if not file.is_file():
        raise ModelLoadError(f"EAGLE-3 head {path} has no config.json")
    try:
        raw: dict[str, Any] = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{file} is not valid JSON: {e}") from e
    archs = raw.get("architectures") or []
    if not any(a in ARCHITECTURES for a in archs):
        kind = (
            "an EAGLE-1/2 head, which is not supported" if is_eagle_1_2_head(path) else "not an EAGLE-3 head"
        )
        raise ModelLoadError(
            f"{path} is {kind} (architectures {archs!r}; expected one of {list(ARCHITECTURES)})"
        )
    layer_raw = {**raw, **(raw.get("transformer_layer_config") or {})}
    eagle = raw.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state") is False:
        raise ModelLoadError(f"EAGLE-3 head {path} does not read auxiliary hidden states (an EAGLE-1/2 head)")
    layer_raw |= {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1}
    layer_raw.setdefault("vocab_size", target.vocab_size)
    layer = ModelConfig.from_hf(layer_raw)
    if layer.vocab_size != target.vocab_size:
        raise ModelLoadError(
            f"EAGLE-3 head {path} is for a vocabulary of {layer.vocab_size} tokens; the target has "
            f"{target.vocab_size}: the head must be trained for this target"
        )
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
    n = target.num_layers
    aux = tuple(int(i) for i in ids) if ids else (2, n // 2, n - 3)
    if not all(0 <= i < n for i in aux):
        raise ModelLoadError(
            f"EAGLE-3 head {path} reads the target's layers {list(aux)}; the target has {n} layers"
        )
    return Eagle3Config(
        layer=layer,
        draft_vocab_size=int(raw.get("draft_vocab_size") or layer.vocab_size),
        aux_layers=aux,
        target_hidden_size=int(raw.get("target_hidden_size") or target.hidden_size),
        norm_before_residual=bool(raw.get("norm_before_residual", False)),
    )


def load_eagle3(name: str, target: LoadedModel) -> tuple[Eagle3Draft, Eagle3Config]:
    """The EAGLE-3 head at `name` (a checkpoint directory), on the target's device and in its
    dtype, its embedding (and a full-vocabulary LM head) the target's where absent or equal."""
    path = resolve_model_path(name)
    if not path.is_dir():
        raise ModelLoadError(
            f"an EAGLE-3 head is a checkpoint directory (config.json + safetensors), not {path}"
        )
    cfg = read_eagle3_config(path, target.config)
    if cfg.target_hidden_size != target.config.hidden_size:
        raise ModelLoadError(
            f"EAGLE-3 head {path} reads hidden states of width {cfg.target_hidden_size}; the target's "
            f"are {target.config.hidden_size} wide"
        )
    files = weight_files(path)
    if not files:
        pickles = sorted(p.name for p in [*path.glob("*.bin"), *path.glob("*.pt")])
        convert = f" (only pickle weights: {', '.join(pickles)}; convert them with safetensors' save_file)"
        raise ModelLoadError(
            f"EAGLE-3 head {path} has no *.safetensors weight files{convert if pickles else ''}"
        )
    tensors = {_own_name(k): t for k, t in read_tensors(files, lambda k: True).items()}
    tensors.pop("t2d", None)  # target id -> whether in the draft vocabulary: d2t says it all
    d2t = _target_ids(tensors.pop("d2t", None), cfg, path)
    param = next(target.module.parameters())
    with torch.device("meta"):
        head = Eagle3Draft(cfg)
    theirs = {name: target.module.get_parameter(their) for name, their in SHARED.items()}
    shared = {name for name, p in theirs.items() if _shareable(tensors.get(name), p, head, name)}
    load_weights(head, tensors, "EAGLE-3 head", param.dtype, param.device, shared)
    for name in shared:
        head.get_submodule(name.rpartition(".")[0]).weight = theirs[name]
    head.map_vocabulary(d2t.to(param.device))
    layer = cfg.layer
    rotary = RotaryEmbedding(layer.rotary_dim or layer.head_dim, layer.rope_theta, layer.rope_scaling)
    head.rotary = rotary.to(param.device)
    return head.eval(), cfg


def _own_name(name: str) -> str:
    """A checkpoint name in the head's parameter names (`midlayer.*`)."""
    name = name.removeprefix("model.")
    return "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name


def _target_ids(d2t: torch.Tensor | None, cfg: Eagle3Config, path: Path) -> torch.Tensor:
    """`d2t` checked: one offset per draft id, each landing on a distinct target id."""
    draft, vocab = cfg.draft_vocab_size, cfg.layer.vocab_size
    if d2t is None:
        if draft != vocab:
            raise ModelLoadError(
                f"EAGLE-3 head {path} has a reduced vocabulary ({draft} of {vocab} tokens) but no "
                "'d2t' tensor mapping its ids to the target's"
            )
        return torch.zeros(draft, dtype=torch.long)
    if tuple(d2t.shape) != (draft,) or d2t.is_floating_point():
        raise ModelLoadError(
            f"EAGLE-3 head {path}: 'd2t' has shape {tuple(d2t.shape)} and dtype {d2t.dtype}; "
            f"expected integer offsets of shape ({draft},) (draft_vocab_size)"
        )
    ids = torch.arange(draft) + d2t.long()
    if ids.min() < 0 or ids.max() >= vocab or len(ids.unique()) != draft:
        raise ModelLoadError(
            f"EAGLE-3 head {path}: 'd2t' maps draft ids outside the target's {vocab} tokens or two "
            "draft ids to one target id"
        )
    return d2t.long()


def _shareable(tensor: torch.Tensor | None, target: torch.Tensor, head: nn.Module, name: str) -> bool:
    """Whether the head uses the target's tensor for `name`: absent from the checkpoint (when the
    shapes agree) or a copy of it."""
    want = tuple(head.get_parameter(name).shape)
    if tensor is None:
        return tuple(target.shape) == want
    return tensor.shape == target.shape and torch.equal(tensor.to(target.device, target.dtype), target)
