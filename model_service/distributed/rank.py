"""One tensor-parallel rank's share of the model, and the commands every rank runs on it.

A `RankExecutor` is the single-device `ModelExecutor` over this rank's shard (its heads' K/V
cache, its LoRA slots, its CUDA graphs) plus what a shard changes: adapters are sliced to the
shard before they are written, and swapped-out K/V is this rank's heads only. Rank 0 and the
workers run the same methods for the same command, so their pools never drift apart.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from model_service.distributed.group import RankGroups
from model_service.distributed.layers import Collectives
from model_service.distributed.link import Command, CommandLink, Received, describe, raise_agreed
from model_service.distributed.sharding import Partition, shard_adapter, shard_module
from model_service.engine.batch_builder import BatchBuilder
from model_service.engine.config import EngineConfig
from model_service.engine.executor import ModelExecutor, kv_layout, lora_arena_elements
from model_service.errors import ModelLoadError
from model_service.lora.adapter import LoraAdapter
from model_service.models.loader import LoadedModel
from model_service.models.step import StepBatch

T = TypeVar("T")


class RankShard:
    """A rank's shard of the weights before its K/V cache exists (see `RankExecutor.build`)."""

    def __init__(self, full: LoadedModel, groups: RankGroups, expert_parallel: bool) -> None:
        self.part = Partition.of(full.config, groups.rank, groups.world, expert_parallel)
        coll = Collectives(groups.device_group, groups.world)
        module = shard_module(full.module, self.part, coll, groups.device)
        self.loaded = LoadedModel(full.name, self.part.local_config(full.config), module, None)
        self.device_group = groups.device_group


class RankExecutor:
    # The methods rank 0 may ask every rank to run (CALL / GATHER commands): the rank's
    # `ModelExecutor`'s own, but for those a shard changes (`SHARDED`), which this class wraps.
    COMMANDS = frozenset(
        {
            "copy_blocks",
            "save_blocks",
            "load_blocks",
            "copy_state",
            "load_slot",
            "clear_slot",
            "move_slot",
            "capture_graphs",
        }
    )
    SHARDED = frozenset({"load_blocks", "load_slot"})

    def __init__(self, shard: RankShard, config: EngineConfig, num_blocks: int, max_model_len: int) -> None:
        self.part, self.device_group = shard.part, shard.device_group
        self.executor = ModelExecutor(shard.loaded, config, num_blocks, max_model_len)

    @staticmethod
    def layout(shard: RankShard, config: EngineConfig, control: dist.ProcessGroup) -> tuple[int, int]:
        """(K/V blocks, context length): rank 0's budget (it holds the most heads), the same on all ranks."""
        layout: list[Any] = [None]
        if dist.get_rank() == 0:
            param = next(shard.loaded.module.parameters())
            arena = lora_arena_elements(shard.loaded.module, config) * param.element_size()
            layout[0] = kv_layout(shard.loaded.config, config, param.dtype, param.device, state_bytes=arena)
        dist.broadcast_object_list(layout, 0, group=control)
        return layout[0]

    def run(self, cmd: Received, builder: BatchBuilder) -> Any:
        """A worker's side of one command from rank 0. A step is only launched: the worker goes on
        to receive the next command while its device runs it (the builder receives into its
        other host buffer, and waits for the copy out of one before reusing it)."""
        if cmd.kind is Command.STEP:
            self.execute(builder.from_host(cmd.shape))
            return None
        return self.call(cmd.method, cmd.args)

    def call(self, method: str, args: tuple[Any, ...]) -> Any:
        if method not in self.COMMANDS:
            raise ValueError(f"{method!r} is not a tensor-parallel command")
        return getattr(self if method in self.SHARDED else self.executor, method)(*args)

    def execute(self, batch: StepBatch, fed: torch.Tensor | None = None) -> torch.Tensor:
        self._share_fed(batch, fed)
        return self.executor.execute(batch)

    def _share_fed(self, batch: StepBatch, fed: torch.Tensor | None) -> None:
        """Async scheduling (engine/overlap.py): only rank 0 holds the step before's sampled tokens
        (`fed`, on its device); the workers' input ids come from rank 0's host words, which hold
        placeholders in those rows. Rank 0 broadcasts the rows' tokens over the device group,
        queued behind the step that samples them like any collective (no rank waits on the
        host), and every rank writes them into the same rows."""
        index = batch.feed_index
        if index is None or not index.shape[1]:
            return
        if self.part.rank == 0:
            assert fed is not None, "rank 0 is handed the in-flight tokens its batch's rows take"
            ids = fed.index_select(0, index[1])
        else:
            ids = torch.empty(index.shape[1], dtype=torch.long, device=index.device)
        dist.broadcast(ids, 0, group=self.device_group)
        batch.input_ids.index_copy_(0, index[0], ids)  # plain ops, as `ModelExecutor.execute` feeds

    def load_blocks(self, saved: torch.Tensor, blocks: list[int]) -> None:
        """`saved` holds every rank's heads (dim 3, rank order); this rank writes its own."""
        heads = self.part.kv_heads
        self.executor.load_blocks(saved[:, :, :, heads.start : heads.stop], blocks)

    def load_slot(self, slot: int, adapter: LoraAdapter, offset: int) -> None:
        self.executor.load_slot(slot, shard_adapter(adapter, self.part), offset)


def serve_commands(link: CommandLink, rank: RankExecutor, builder: BatchBuilder, log: Any) -> int:
    """A worker's loop: run rank 0's commands until STOP (returns 0) or until the link is gone (1).

    A command that raises here is that command's failure, reported to every rank through `agree`;
    the worker stays up for the next one. Only a failed receive or agree ends the loop.
    """
    while True:
        try:
            cmd = link.receive(builder)
        except Exception as e:
            log.error("rank %d lost rank 0 (%s); exiting", link.rank, e)
            return 1
        if cmd.kind is Command.STOP:
            return 0
        result, error = None, None
        try:
            result = rank.run(cmd, builder)
        except Exception as e:
            log.exception("rank %d: %s command failed; staying up", link.rank, cmd.kind.name)
            error = describe(e)
        try:
            if not any(link.agree(error)) and cmd.kind is Command.GATHER:
                link.gather(result)
        except Exception as e:
            log.error("rank %d lost rank 0 (%s); exiting", link.rank, e)
            return 1


def build_rank(
    link: CommandLink, load: Callable[[], LoadedModel], config: EngineConfig, groups: RankGroups
) -> RankExecutor:
    """Load and shard, then size and allocate the K/V cache: every rank in the same order, with an
    `agree` after each phase, so one rank's failure is every rank's `ModelLoadError` and nobody
    waits in a collective the failed rank will never join."""
    expert_parallel = config.enable_expert_parallel
    shard = _phase(link, lambda: RankShard(load(), groups, expert_parallel), "loading the model shard")
    layout = RankExecutor.layout(shard, config, groups.control)
    return _phase(link, lambda: RankExecutor(shard, config, *layout), "allocating the K/V cache")


def _phase(link: CommandLink, build: Callable[[], T], what: str) -> T:
    result, error = None, None
    try:
        result = build()
    except Exception as e:
        error = e
    errors = link.agree(describe(error))
    if error is not None:
        raise error
    raise_agreed(errors, what, ModelLoadError)
    assert result is not None
    return result
