"""Rank 0's executor of a tensor-parallel pod: the engine's one executor, in front of all ranks.

The engine (scheduler, cache manager, LoRA pool) runs on rank 0 only and talks to this class as
to a single-device `ModelExecutor`: `execute`, the `KVMover` and the `SlotWriter` calls. Each
call is broadcast as a command (distributed/link.py), run by rank 0's own `RankExecutor` and by
every worker's, and agreed on. Logits come back gathered, so sampling happens on rank 0 alone.

Losing a rank (a worker process that exits, or a send / agree that fails) is final: `lost` is set
once, the command channel is aborted (so no rank waits on it for a rank that is gone), every
`on_lost` listener is told (the pod turns NOT_SERVING and fails its streams as
UNAVAILABLE), and every later call raises `LinkLostError` without touching a collective.
Models with recurrent layers are refused by `Partition.of`, so no state is ever swapped here.
"""

from __future__ import annotations

import atexit
import functools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from model_service.distributed.group import free_port, init_rank, rank_device
from model_service.distributed.link import (
    Command,
    CommandFailedError,
    CommandLink,
    LinkLostError,
    describe,
    raise_agreed,
)
from model_service.distributed.rank import RankExecutor, build_rank
from model_service.distributed.shm_channel import ShmChannel, spin_for
from model_service.distributed.worker import Workers, WorkerSpec
from model_service.engine.batch_builder import PackedBatch
from model_service.engine.config import EngineConfig
from model_service.errors import ModelLoadError
from model_service.lora.adapter import LoraAdapter
from model_service.models.loader import LoadedModel, load_model
from model_service.models.step import StepBatch

log = logging.getLogger(__name__)


class TensorParallelExecutor:
    def __init__(self, rank: RankExecutor, link: CommandLink, workers: Workers) -> None:
        self.rank, self.link, self.workers = rank, link, workers
        local = rank.executor
        self.device, self.dtype, self.kv_cache = local.device, local.dtype, local.kv_cache
        self.max_model_len, self.config = local.max_model_len, local.config
        self.lora_arena = local.lora_arena  # every rank's: the pool places whole adapters, ranks hold shards
        self.lora_slots = local.lora_slots
        self.hidden: torch.Tensor | list[torch.Tensor] | None = None  # no MTP or EAGLE-3 under TP
        self.lost: str | None = None
        self._listeners: list[Callable[[str], None]] = []
        self._lock = threading.Lock()
        workers.watch(self._lose)
        # A process that ends without `teardown` (spindle generate, a signal) still stops its
        # workers in order first, rather than having them terminated under a live process group.
        atexit.register(self.teardown)

    def on_lost(self, callback: Callable[[str], None]) -> None:
        """Call `callback(why)` (from any thread) once, when a rank is lost; at once if it is already."""
        with self._lock:
            lost = self.lost
            if lost is None:
                self._listeners.append(callback)
        if lost is not None:
            callback(lost)

    def _lose(self, why: str) -> None:
        # Listeners are told under the lock: a second caller (the engine thread, after a failed
        # collective) returns only once they have been, so nothing it reports afterwards can
        # reach the pod before the pod knows the rank is gone.
        with self._lock:
            if self.lost is not None:
                return
            self.lost = why
            self.link.channel.abort()  # ends this rank's and the workers' waits on the channel
            log.error("tensor-parallel group lost: %s", why)
            for callback in self._listeners:
                callback(why)
            self._listeners = []

    # --- commands ------------------------------------------------------------------------

    def execute(self, batch: StepBatch, fed: torch.Tensor | None = None) -> torch.Tensor:
        """Launch the step on every rank; returns once all launched it, without waiting for any
        device (the logits are queued on rank 0's), so async scheduling overlaps as on one GPU."""
        assert isinstance(batch, PackedBatch), "a tensor-parallel step sends the batch's packed words"
        send = functools.partial(self.link.send_step, batch.packed, batch.packed_shape)
        return self._command(send, lambda: self.rank.execute(batch, fed))

    def _call(self, method: str, *args: Any) -> Any:
        send = functools.partial(self.link.send_call, Command.CALL, method, args)
        return self._command(send, lambda: self.rank.call(method, args))

    def _command(self, send: Callable[[], None], run: Callable[[], Any]) -> Any:
        if self.lost is not None:
            raise LinkLostError(f"this pod lost a tensor-parallel rank: {self.lost}")
        self._over_link(send)
        result, error = None, None
        try:
            result = run()
        except Exception as e:
            error = e
        errors = self._over_link(lambda: self.link.agree(describe(error)))
        try:
            raise_agreed(errors, "a tensor-parallel command")
        except CommandFailedError as e:
            raise e from error
        return result

    def _over_link(self, op: Callable[[], Any]) -> Any:
        try:
            return op()
        except Exception as e:
            self._lose(f"the link to the other ranks failed: {e}")
            raise LinkLostError(f"this pod lost a tensor-parallel rank: {self.lost}") from e

    # --- KVMover and SlotWriter, on every rank ---------------------------------------------

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self._call("copy_blocks", pairs)

    def save_blocks(self, blocks: list[int], num_tokens: int) -> torch.Tensor:
        """Every rank's heads of `blocks`, gathered on rank 0 in head order (dim 3)."""
        args = (blocks, num_tokens)
        send = functools.partial(self.link.send_call, Command.GATHER, "save_blocks", args)
        mine = self._command(send, lambda: self.rank.call("save_blocks", args))
        return torch.cat(self._over_link(lambda: self.link.gather(mine)), dim=3)

    def load_blocks(self, saved: torch.Tensor, blocks: list[int]) -> None:
        self._call("load_blocks", saved, blocks)

    def copy_state(self, src: int, dst: int) -> None:
        self._call("copy_state", src, dst)

    def save_state(self, slot: int) -> torch.Tensor:
        return self.rank.executor.save_state(slot)  # empty: no recurrent layers (see the docstring)

    def load_state(self, saved: torch.Tensor, slot: int) -> None:
        self.rank.executor.load_state(saved, slot)

    def load_slot(self, slot: int, adapter: LoraAdapter, offset: int) -> None:
        self._call("load_slot", slot, adapter, offset)

    def clear_slot(self, slot: int) -> None:
        self._call("clear_slot", slot)

    def move_slot(self, slot: int, offset: int) -> None:
        self._call("move_slot", slot, offset)

    def capture_graphs(self, adapter_targets: Sequence[frozenset[str]] = ()) -> None:
        """Every rank captures the same sizes together: a graph records the step's collectives."""
        self._call("capture_graphs", list(adapter_targets))

    def teardown(self) -> None:
        """Stop the workers and leave the process group; the executor is unusable afterwards.
        With a rank lost, the survivors are killed, and an NCCL group is left as it is: the engine
        thread may still wait in one of its collectives (gloo's fail as soon as a peer is gone)."""
        atexit.unregister(self.teardown)
        if self.workers.stopping:
            return
        self.workers.stopping = True
        if self.lost is None:
            try:
                self.link.send_stop()
            except Exception as e:
                log.warning("could not send STOP to the workers: %s", e)
        self.rank.executor.teardown()
        # Every rank destroys the group at the same time (NCCL finalizes its communicator with
        # its peers), and only then does rank 0 wait for the workers to exit.
        if self.lost is None or self.device.type == "cpu":
            dist.destroy_process_group()
        self.workers.stop(timeout=30 if self.lost is None else 0)


def start_tensor_parallel(loaded: LoadedModel, config: EngineConfig) -> TensorParallelExecutor:
    """Spawn ranks 1..N-1, join them as rank 0 and shard `loaded` (full weights, left unchanged).

    The workers load the same weights through `loaded.source` (a checkpoint's loader by default).
    """
    world = config.tensor_parallel_size
    if dist.is_initialized():  # torch.distributed has one default group per process
        raise ModelLoadError("this process already runs a tensor-parallel engine; it can run one")
    source = loaded.source or functools.partial(
        load_model,
        config.model,
        config.torch_dtype(),
        torch.device("cpu"),
        with_tokenizer=False,
        quantization=config.quantization,
    )
    port, device = free_port(), rank_device(config, 0)
    channel = ShmChannel.create(world, spin_for(device.type))
    try:
        workers = Workers([WorkerSpec(r, world, port, config, source, channel.path) for r in range(1, world)])
        try:
            groups = init_rank(0, world, port, device)
        except BaseException:
            workers.stop(timeout=5)
            raise
    finally:
        channel.unlink()  # every worker mapped it before joining the group (or never will)
    # Until the executor watches them too: a worker that dies while loading ends rank 0's waits.
    workers.watch(lambda _why: channel.abort())
    try:
        link = CommandLink(groups.control, channel)
        rank = build_rank(link, lambda: loaded, config, groups)
    except BaseException:
        workers.stop(timeout=5)
        dist.destroy_process_group()
        raise
    return TensorParallelExecutor(rank, link, workers)
