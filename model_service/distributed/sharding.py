"""Which slice of a dense decoder each tensor-parallel rank holds, and the slicing itself.

Weights are loaded whole (from the checkpoint, on the host) and each rank keeps its slice, so
the loader and its named errors stay the single-device ones.

- Attention is split by KV-head groups: rank r holds a contiguous run of KV heads and exactly
  the query heads that attend to them. Splitting query heads evenly instead would separate a
  query head from its KV head (GQA), and SmolLM2's 9 query / 3 KV heads do not split evenly in
  two anyway. Runs may be uneven (3 KV heads over 2 ranks: 2 + 1), which costs balance, not
  correctness, since attention never crosses a KV group; only tp <= num_kv_heads is required
  (replicating KV heads for a larger tp would need a second K/V layout).
- The MLP's intermediate columns are split into contiguous runs (uneven when not divisible): no
  collective reads the intermediate, so unevenness again costs only balance.
- The vocabulary is split into runs of ceil(V / tp) rows, the last one zero-padded: the logits
  are all-gathered, and all-gather wants equal sizes; the padding columns are cut off after.

Column-parallel projections (q/k/v, gate/up) keep their shard's output rows; row-parallel ones
(o, down) keep their shard's input columns and sum partial outputs in one all-reduce. LoRA
follows S-LoRA's split so it adds no collective: a column-parallel projection keeps A whole and
B's rows of its shard; a row-parallel one keeps A's columns of its shard and B whole, and its
partial delta joins the partial output before the block's one all-reduce (the sum is linear).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

import torch
from torch import nn

from model_service.distributed.layers import (
    Collectives,
    RowParallel,
    VocabParallelEmbedding,
    VocabParallelHead,
)
from model_service.engine.executor import own_module_tree
from model_service.errors import ModelLoadError
from model_service.lora.adapter import LoraAdapter, LoraWeights
from model_service.models.config import ModelConfig
from model_service.models.layers import MLP, PackedLinear
from model_service.models.llama import Attention

COLUMN_PARALLEL = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}  # the rest are row-parallel


def runs(n: int, world: int) -> list[range]:
    """`n` items in `world` contiguous runs; the first n % world runs are one longer."""
    base, extra = divmod(n, world)
    bounds = list(itertools.accumulate((base + (r < extra) for r in range(world)), initial=0))
    return [range(lo, hi) for lo, hi in itertools.pairwise(bounds)]


@dataclass(frozen=True)
class Partition:
    """What rank `rank` of `world` holds of a model."""

    rank: int
    world: int
    kv_heads: range
    q_heads: range
    inter: range
    vocab: range  # real vocabulary rows; the shard has `vocab_rows` rows, the rest zero padding
    vocab_rows: int
    head_dim: int

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int, world: int) -> Partition:
        if world > cfg.num_kv_heads:
            raise ModelLoadError(
                f"--tensor-parallel-size {world} is larger than the model's {cfg.num_kv_heads} KV heads; "
                "attention is split by KV-head groups, so use at most that many ranks"
            )
        if cfg.num_state_layers:
            raise ModelLoadError(
                "tensor parallelism shards attention-only models; this one has recurrent layers"
            )
        group = cfg.num_heads // cfg.num_kv_heads
        kv = runs(cfg.num_kv_heads, world)[rank]
        rows = math.ceil(cfg.vocab_size / world)
        lo = min(rank * rows, cfg.vocab_size)
        return cls(
            rank=rank,
            world=world,
            kv_heads=kv,
            q_heads=range(kv.start * group, kv.stop * group),
            inter=runs(cfg.intermediate_size, world)[rank],
            vocab=range(lo, min(lo + rows, cfg.vocab_size)),
            vocab_rows=rows,
            head_dim=cfg.head_dim,
        )

    def slices(self) -> dict[str, range]:
        """Per PEFT projection name: its output rows (column-parallel) or input columns (row-parallel)
        that this rank holds, in the full projection's coordinates."""
        d = self.head_dim
        q = range(self.q_heads.start * d, self.q_heads.stop * d)
        kv = range(self.kv_heads.start * d, self.kv_heads.stop * d)
        return {
            "q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": q,
            "gate_proj": self.inter, "up_proj": self.inter, "down_proj": self.inter,
        }  # fmt: skip

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """`cfg` as this rank's K/V cache and attention see it: its own heads only."""
        return dataclasses.replace(cfg, num_heads=len(self.q_heads), num_kv_heads=len(self.kv_heads))


def _frozen(t: torch.Tensor, device: torch.device) -> nn.Parameter:
    return nn.Parameter(t.to(device).contiguous(), requires_grad=False)


def _column(lin: PackedLinear, slices: dict[str, range], device: torch.device) -> PackedLinear:
    """The rows of each fused part that this rank keeps, still fused in part order."""
    starts = itertools.accumulate(lin.output_sizes, initial=0)  # each part's first row in `lin`
    keep = [range(s + slices[p].start, s + slices[p].stop) for s, p in zip(starts, lin.parts, strict=False)]

    def rows(t: torch.Tensor) -> nn.Parameter:
        return _frozen(torch.cat([t.detach()[r.start : r.stop] for r in keep]), device)

    with torch.device("meta"):
        out = PackedLinear(lin.in_features, {p: len(r) for p, r in zip(lin.parts, keep, strict=True)}, False)
    out.weight = rows(lin.weight)
    if lin.bias is not None:
        out.bias = rows(lin.bias)
    return out


def _row(lin: PackedLinear, cols: range, collectives: Collectives, device: torch.device) -> RowParallel:
    with torch.device("meta"):
        inner = PackedLinear(len(cols), dict(zip(lin.parts, lin.output_sizes, strict=True)), False)
    inner.weight = _frozen(lin.weight.detach()[:, cols.start : cols.stop], device)
    bias = None if lin.bias is None else _frozen(lin.bias.detach(), device)
    return RowParallel(inner, bias, collectives)


def _shard_layer(
    attn: nn.Module, mlp: nn.Module, part: Partition, coll: Collectives, device: torch.device
) -> None:
    if not isinstance(attn, Attention) or not isinstance(mlp, MLP):
        raise ModelLoadError(
            "tensor parallelism shards dense attention and MLP blocks; this model has other layers "
            "(MoE layers need expert parallelism)"
        )
    s = part.slices()
    attn.qkv_proj = _column(attn.qkv_proj, s, device)
    attn.o_proj = _row(attn.o_proj, s["o_proj"], coll, device)
    attn.num_heads, attn.num_kv_heads = len(part.q_heads), len(part.kv_heads)
    attn.qkv_sizes = attn.qkv_proj.output_sizes
    mlp.gate_up_proj = _column(mlp.gate_up_proj, s, device)
    mlp.down_proj = _row(mlp.down_proj, s["down_proj"], coll, device)


def _vocab_shard(weight: torch.Tensor, part: Partition, device: torch.device) -> nn.Parameter:
    rows = weight.detach()[part.vocab.start : part.vocab.stop]
    padded = rows.new_zeros(part.vocab_rows, rows.shape[1])
    padded[: len(part.vocab)] = rows
    return _frozen(padded, device)


def _replicate(module: nn.Module, device: torch.device) -> None:
    """Put every remaining (replicated) parameter and buffer of the shard on `device` by replacing
    the shard's own entries, never moving the full model's tensors (on their own device they stay
    shared: nothing writes them)."""
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None and p.device != device:
                sub._parameters[name] = _frozen(p.detach(), device)
        for name, b in list(sub._buffers.items()):
            if b is not None:
                sub._buffers[name] = b.to(device)


def shard_module(full: nn.Module, part: Partition, coll: Collectives, device: torch.device) -> nn.Module:
    """This rank's shard of a Llama-family `DecoderModel` on `device`; `full` is left unchanged."""
    cfg: ModelConfig = full.config
    shard = own_module_tree(full)
    for layer in shard.model.layers:
        _shard_layer(layer.self_attn, layer.mlp, part, coll, device)
    embed = _vocab_shard(full.model.embed_tokens.weight, part, device)
    shard.model.embed_tokens = VocabParallelEmbedding(embed, part.vocab.start, coll)
    head = embed if cfg.tie_word_embeddings else _vocab_shard(full.lm_head.weight, part, device)
    shard.lm_head = VocabParallelHead(head, cfg.vocab_size, coll)
    _replicate(shard, device)
    return shard


def shard_adapter(adapter: LoraAdapter, part: Partition) -> LoraAdapter:
    """`adapter` as this rank's LoRA layers hold it (S-LoRA's split, see the module docstring)."""
    s = part.slices()
    modules = {}
    for (layer, name), w in adapter.modules.items():
        r = s[name]
        if name in COLUMN_PARALLEL:
            modules[(layer, name)] = LoraWeights(w.a, w.b[r.start : r.stop], w.scaling)
        else:
            modules[(layer, name)] = LoraWeights(w.a[:, r.start : r.stop].contiguous(), w.b, w.scaling)
    return dataclasses.replace(adapter, modules=modules)
