"""The layers of a tensor-parallel shard that talk to the other ranks: one all-reduce after each
attention and MLP block (in the row-parallel o / down projection, or after a sparse-MoE block's
per-rank share), one in the vocab-parallel
embedding, and one all-gather of the logits. Column-parallel projections need no layer of their
own: they are ordinary `PackedLinear`s over fewer output rows (distributed/sharding.py).

The collectives run on the device group (NCCL on GPUs, gloo on the CPU) and are recorded in
CUDA graphs like any other kernel, so each rank replays its own graphs in lockstep.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from model_service.models.layers import PackedLinear


class Collectives:
    """The device group's collectives. Module copies share it (a process group cannot be copied)."""

    def __init__(self, group: dist.ProcessGroup, world: int) -> None:
        self.group, self.world = group, world

    def __deepcopy__(self, memo: dict) -> Collectives:
        return self

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=self.group)
        return t

    def all_gather_last(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's `t` concatenated along the last dimension, in rank order."""
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


class RowParallel(nn.Module):
    """o_proj or down_proj of one rank: the partial product of its input columns, summed over ranks.

    `inner` is a plain `PackedLinear` so the LoRA wrapper replaces it like any projection; its
    partial delta is then part of the sum. The bias is added once, after the sum.
    """

    def __init__(self, inner: PackedLinear, bias: nn.Parameter | None, collectives: Collectives) -> None:
        super().__init__()
        self.inner, self.bias, self.collectives = inner, bias, collectives

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.collectives.all_reduce(self.inner(x))
        return y if self.bias is None else y + self.bias


class SummedOverRanks(nn.Module):
    """A block whose ranks each compute a share of its output (a sparse-MoE layer's experts,
    distributed/sharding.py): one all-reduce makes it the whole block's output."""

    def __init__(self, share: nn.Module, collectives: Collectives) -> None:
        super().__init__()
        self.share, self.collectives = share, collectives

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.collectives.all_reduce(self.share(x))


class VocabParallelEmbedding(nn.Module):
    """This rank's run of embedding rows; ids outside it contribute zeros to the all-reduce."""

    def __init__(self, weight: nn.Parameter, start: int, collectives: Collectives) -> None:
        super().__init__()
        self.weight, self.start, self.collectives = weight, start, collectives

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.collectives.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0))


class VocabParallelHead(nn.Module):
    """LM head over this rank's vocabulary rows; the logits of all ranks are gathered, so every rank
    (and the sampler on rank 0) sees the full vocabulary."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, collectives: Collectives) -> None:
        super().__init__()
        self.weight, self.vocab_size, self.collectives = weight, vocab_size, collectives

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.collectives.all_gather_last(F.linear(x, self.weight))[..., : self.vocab_size]
