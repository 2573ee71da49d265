"""Which slice of a decoder (dense or sparse-MoE) each tensor-parallel rank holds, and the slicing itself.

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

Sparse MoE layers (models/moe.py) keep the router and route every token on every rank; each
rank computes its share of the block and the layer's output is one all-reduce of the shares:
- by default the experts are tensor-parallel: every rank holds all experts, each expert's
  intermediate split into the same runs (vLLM's default);
- with `--enable-expert-parallel` rank r owns a contiguous run of whole experts (uneven when
  not divisible), and routed ids outside its run add nothing there (kernels/experts.py).
A shared expert (Qwen2-MoE) is split tensor-parallel by its intermediate columns in both modes,
as vLLM does: every token goes through it, so computing it on one rank would make that rank
every layer's straggler, and its partial output joins the same all-reduce (its sigmoid gate is
a per-token scalar, replicated, and the sum is linear). Dense layers of an MoE model (Qwen3-MoE's
`mlp_only_layers`) are split as any MLP.

Multi-head latent attention (DeepSeek) splits by query heads (every head is its own "KV group"):
each rank keeps its heads' rows of the query projection and of `kv_b_proj`, and its columns of
o_proj; the latent projection is replicated, and with it the latent cache, which every head reads
whole (vLLM's split too: the cache is 1/8.9 to 1/71 of full K/V, so each rank holding all of it is
what MLA affords).

Column-parallel projections (q/k/v, gate/up) keep their shard's output rows; row-parallel ones
(o, down) keep their shard's input columns and sum partial outputs in one all-reduce. FP8
projections (models/fp8_linear.py) slice their per-row scales with the rows; a row-parallel one
keeps them whole (per channel) or its columns' 128-column groups (block-wise, whose shard must
then start on a group boundary). Per-token activation scales become per token and rank: each
rank quantizes its own columns, finer than one process does, so the two differ in rounding. LoRA
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
    SummedOverRanks,
    VocabParallelEmbedding,
    VocabParallelHead,
)
from model_service.engine.executor import own_module_tree
from model_service.errors import ModelLoadError
from model_service.lora.adapter import LoraAdapter, LoraWeights
from model_service.models.config import LatentAttentionShape, ModelConfig
from model_service.models.deepseek import LatentAttention
from model_service.models.fp8_linear import Fp8Linear
from model_service.models.layers import MLP, PackedLinear
from model_service.models.llama import Attention
from model_service.models.moe import SparseMoeBlock, StackedExperts

# The rest are row-parallel. MLA's q_a_proj and kv_a_proj_with_mqa are replicated: column-parallel
# over all their rows.
COLUMN_PARALLEL = {
    "q_proj",
    "k_proj",
    "v_proj",
    "gate_proj",
    "up_proj",
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
}


def runs(n: int, world: int) -> list[range]:
    """`n` items in `world` contiguous runs; the first n % world runs are one longer."""
    base, extra = divmod(n, world)
    bounds = list(itertools.accumulate((base + (r < extra) for r in range(world)), initial=0))
    return [range(lo, hi) for lo, hi in itertools.pairwise(bounds)]


def _expert_runs(cfg: ModelConfig, rank: int, world: int, expert_parallel: bool) -> dict[str, range]:
    """The MoE fields of a `Partition` (empty ranges for a dense model)."""
    if not cfg.num_experts:
        return {}
    if expert_parallel and world > cfg.num_experts:
        raise ModelLoadError(
            f"--enable-expert-parallel over {world} ranks needs at least {world} experts; this model "
            f"has {cfg.num_experts}: use fewer ranks or leave the experts tensor-parallel"
        )
    experts, inter = range(cfg.num_experts), range(cfg.moe_intermediate_size)
    if expert_parallel:
        experts = runs(cfg.num_experts, world)[rank]
    else:
        inter = runs(cfg.moe_intermediate_size, world)[rank]
    shared = runs(cfg.shared_expert_intermediate_size or 0, world)[rank]
    return {"experts": experts, "expert_inter": inter, "shared_inter": shared}


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
    experts: range = range(0)  # the MoE experts this rank holds (all of them unless expert-parallel)
    expert_inter: range = range(0)  # each held expert's intermediate rows (all of them if expert-parallel)
    shared_inter: range = range(0)  # the shared expert's intermediate columns
    mla: LatentAttentionShape | None = None  # MLA: `kv_heads` is `q_heads` (a KV "head" per query head)

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int, world: int, expert_parallel: bool = False) -> Partition:
        if world > cfg.num_kv_heads:
            raise ModelLoadError(
                f"--tensor-parallel-size {world} is larger than the model's {cfg.num_kv_heads} KV heads; "
                "attention is split by KV-head groups, so use at most that many ranks"
            )
        if cfg.num_state_layers:
            raise ModelLoadError(
                "tensor parallelism shards attention-only models; this one has recurrent layers"
            )
        if cfg.attention_sinks:
            raise ModelLoadError(
                "tensor and expert parallelism do not split gpt-oss (its per-head attention sinks, its "
                "experts' biases and clamped SwiGLU): serve it on one device"
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
            mla=cfg.latent_attention,
            **_expert_runs(cfg, rank, world, expert_parallel),
        )

    def slices(self) -> dict[str, range]:
        """Per PEFT projection name: its output rows (column-parallel) or input columns (row-parallel)
        that this rank holds, in the full projection's coordinates."""
        mlp = {"gate_proj": self.inter, "up_proj": self.inter, "down_proj": self.inter}
        if self.mla is not None:
            m = self.mla
            q = self.head_rows(m.qk_head_dim)
            latent = {"q_a_proj": range(m.q_lora_rank or 0), "kv_a_proj_with_mqa": range(m.cache_dim)}
            return {"q_proj": q, "q_b_proj": q, **latent, "o_proj": self.head_rows(m.v_head_dim), **mlp}
        d = self.head_dim
        q = range(self.q_heads.start * d, self.q_heads.stop * d)
        kv = range(self.kv_heads.start * d, self.kv_heads.stop * d)
        return {
            "q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": q,
            "gate_proj": self.inter, "up_proj": self.inter, "down_proj": self.inter,
        }  # fmt: skip

    def head_rows(self, per_head: int) -> range:
        """Rows (or columns) of this rank's query heads in a projection `per_head` wide a head."""
        return range(self.q_heads.start * per_head, self.q_heads.stop * per_head)

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """`cfg` as this rank's K/V cache and attention see it: its own heads only."""
        return dataclasses.replace(cfg, num_heads=len(self.q_heads), num_kv_heads=len(self.kv_heads))


def _frozen(t: torch.Tensor, device: torch.device) -> nn.Parameter:
    return nn.Parameter(t.to(device).contiguous(), requires_grad=False)


def _empty_like(lin: PackedLinear, in_features: int, parts: dict[str, int]) -> PackedLinear:
    """A meta projection of `lin`'s kind (FP8 or not) and these sizes, without bias."""
    if isinstance(lin, Fp8Linear):
        return Fp8Linear(in_features, parts, False, lin.scheme)
    with torch.device("meta"):
        return PackedLinear(in_features, parts, False)


def _column(lin: PackedLinear, slices: dict[str, range], device: torch.device) -> PackedLinear:
    """The rows of each fused part that this rank keeps, still fused in part order."""
    starts = itertools.accumulate(lin.output_sizes, initial=0)  # each part's first row in `lin`
    keep = [range(s + slices[p].start, s + slices[p].stop) for s, p in zip(starts, lin.parts, strict=False)]

    def rows(t: torch.Tensor) -> nn.Parameter:
        return _frozen(torch.cat([t.detach()[r.start : r.stop] for r in keep]), device)

    out = _empty_like(lin, lin.in_features, {p: len(r) for p, r in zip(lin.parts, keep, strict=True)})
    out.weight = rows(lin.weight)
    if lin.bias is not None:
        out.bias = rows(lin.bias)
    if isinstance(lin, Fp8Linear):
        out.weight_scale = rows(lin.weight_scale).data
        out.input_scale = lin.input_scale
    return out


def _columns(lin: PackedLinear, cols: range, device: torch.device) -> PackedLinear:
    """A row-parallel projection's input columns `cols`, without bias or collective."""
    inner = _empty_like(lin, len(cols), dict(zip(lin.parts, lin.output_sizes, strict=True)))
    inner.weight = _frozen(lin.weight.detach()[:, cols.start : cols.stop], device)
    if isinstance(lin, Fp8Linear):
        inner.weight_scale = _scale_columns(lin, cols).to(device)
        inner.input_scale = lin.input_scale
    return inner


def _scale_columns(lin: Fp8Linear, cols: range) -> torch.Tensor:
    """The weight scales of input columns `cols`: all of them per channel, else their groups."""
    if lin.group == lin.in_features:
        return lin.weight_scale
    if cols.start % lin.group:
        raise ModelLoadError(
            f"a tensor-parallel shard of input columns {cols.start}..{cols.stop} of a block-wise FP8 "
            f"projection must start on a {lin.group}-column block; use another --tensor-parallel-size"
        )
    return lin.weight_scale[:, cols.start // lin.group : -(-cols.stop // lin.group)]


def _row(lin: PackedLinear, cols: range, collectives: Collectives, device: torch.device) -> RowParallel:
    bias = None if lin.bias is None else _frozen(lin.bias.detach(), device)
    return RowParallel(_columns(lin, cols, device), bias, collectives)


def _check_split_parts(attn: nn.Module, mlp: nn.Module, slices: dict[str, range]) -> None:
    """Refuse projections fused under one checkpoint name (Phi-3's qkv_proj, gate_up_proj): a
    rank's rows of q, k and v are three runs of such a part, which `_column` cannot cut."""
    lins = [getattr(attn, "qkv_proj", None), getattr(mlp, "gate_up_proj", None)]
    fused = [p for lin in lins if isinstance(lin, PackedLinear) for p in lin.parts if p not in slices]
    if fused:
        raise ModelLoadError(
            f"tensor parallelism splits q/k/v and gate/up by their own rows; this model has {fused} "
            "fused in one projection each (Phi-3): serve it on one device"
        )


def _shard_layer(
    layer: nn.Module, part: Partition, coll: Collectives, device: torch.device, cfg: ModelConfig
) -> None:
    attn, mlp = layer.self_attn, layer.mlp
    by_heads = isinstance(attn, LatentAttention) or (isinstance(attn, Attention) and attn.shardable_by_heads)
    if not by_heads or not isinstance(mlp, MLP | SparseMoeBlock):
        raise ModelLoadError(
            "tensor parallelism shards attention with dense or sparse-MoE MLP blocks; this model "
            f"has a {type(attn).__name__} / {type(mlp).__name__} layer"
        )
    s = part.slices()
    _check_split_parts(attn, mlp, s)
    if isinstance(attn, LatentAttention):
        _shard_latent_attention(attn, part, coll, device)
    else:
        attn.qkv_proj = _column(attn.qkv_proj, s, device)
        attn.o_proj = _row(attn.o_proj, s["o_proj"], coll, device)
        attn.num_heads, attn.num_kv_heads = len(part.q_heads), len(part.kv_heads)
        attn.qkv_sizes = attn.qkv_proj.output_sizes
    if isinstance(mlp, SparseMoeBlock):
        layer.mlp = SummedOverRanks(_moe_share(mlp, part, device, cfg), coll)
        return
    mlp.gate_up_proj = _column(mlp.gate_up_proj, s, device)
    mlp.down_proj = _row(mlp.down_proj, s["down_proj"], coll, device)


def _shard_latent_attention(
    attn: LatentAttention, part: Partition, coll: Collectives, device: torch.device
) -> None:
    """MLA split by query heads: each rank's query rows, `kv_b_proj` rows and o_proj columns;
    the latent projection (`a_proj`: kv_a, and q_a with a q LoRA rank) is replicated, so every
    rank writes the whole latent cache its heads all read."""
    m, s = attn.shape, part.slices()
    if m.q_lora_rank is None:
        attn.q_proj = _column(attn.q_proj, s, device)
    else:
        attn.q_b_proj = _column(attn.q_b_proj, s, device)
    rows = part.head_rows(m.qk_nope_head_dim + m.v_head_dim)
    with torch.device("meta"):
        kv_b = nn.Linear(m.kv_lora_rank, len(rows), bias=False)
    kv_b.weight = _frozen(attn.kv_b_proj.weight.detach()[rows.start : rows.stop], device)
    attn.kv_b_proj = kv_b
    attn.o_proj = _row(attn.o_proj, s["o_proj"], coll, device)
    attn.num_heads = len(part.q_heads)


def _moe_share(
    block: SparseMoeBlock, part: Partition, device: torch.device, cfg: ModelConfig
) -> SparseMoeBlock:
    """`block` computing only this rank's share: its experts (`part.experts`), each over its
    intermediate rows (`part.expert_inter`), and its columns of the shared expert (fused into the
    stack, its slots' columns as every expert's; under expert parallelism, an MLP again). The
    caller sums the shares over the ranks (the router and the shared expert's gate stay whole)."""
    e, i = part.experts, part.expert_inter
    if len(e) < block.gate.out_features:  # expert parallelism
        block.unfuse_shared_expert(cfg)
    held = [*e, *range(block.gate.out_features, block.gate.out_features + block.shared_slots)]
    gate_up = block.experts.gate_up_proj.detach()[held]
    down = block.experts.down_proj.detach()[held]
    scales = block.experts.scales()
    inter = down.shape[2]
    rows = [*range(i.start, i.stop), *range(inter + i.start, inter + i.stop)]  # gate rows, then up rows
    with torch.device("meta"):
        block.experts = StackedExperts(len(held), down.shape[1], len(i))
    block.experts.gate_up_proj = _frozen(gate_up[:, rows], device)
    block.experts.down_proj = _frozen(down[:, :, i.start : i.stop], device)
    if scales is not None:  # FP8 experts: gate_up's rows' scales, down's groups of its columns
        block.experts.gate_up_scale = scales.gate_up[held][:, rows].to(device)
        groups = _scale_groups(i, inter, scales.group)  # contiguous: the kernels would copy a view each call
        block.experts.down_scale = scales.down[held][:, :, groups].to(device).contiguous()
        block.experts.scale_group = scales.group
    block.expert_range = e
    shared = block.shared_mlp()
    if shared is not None:
        cols = part.shared_inter
        shared.gate_up_proj = _column(shared.gate_up_proj, {"gate_proj": cols, "up_proj": cols}, device)
        bias = shared.down_proj.bias
        shared.down_proj = _columns(shared.down_proj, cols, device)
        if bias is not None and part.rank == 0:  # added once to the sum
            shared.down_proj.bias = _frozen(bias.detach(), device)
    return block


def _scale_groups(cols: range, width: int, group: int) -> slice:
    """The scale groups of input columns `cols` of `width`: all of them for one scale a row
    (`group` 0), else those of `group` columns each, `cols` starting on a group."""
    if group == 0:
        return slice(None)
    if cols.start % group or (cols.stop % group and cols.stop != width):
        raise ModelLoadError(
            f"an expert shard of columns {cols.start}-{cols.stop} does not start and end on the "
            f"{group}-column blocks of the checkpoint's scales; use another --tensor-parallel-size "
            "or --enable-expert-parallel"
        )
    return slice(cols.start // group, -(-cols.stop // group))


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
        _shard_layer(layer, part, coll, device, cfg)
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
    return dataclasses.replace(adapter, modules=modules, packed_layout=None)  # not views at those places
