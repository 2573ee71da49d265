"""The worker processes of a tensor-parallel pod (ranks 1..N-1), started by rank 0 and watched by it.

Rank 0 spawns its workers itself (one container, one command) and keeps their process handles:
a worker that dies is seen through its process sentinel at once, whatever rank 0 is doing, even
while its own thread waits on a GPU collective that will never complete.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.process import BaseProcess

import torch.distributed as dist

from model_service.distributed.group import init_rank, rank_device
from model_service.distributed.link import CommandLink
from model_service.distributed.rank import build_rank, serve_commands
from model_service.distributed.shm_channel import ShmChannel, process_alive, spin_for
from model_service.engine.batch_builder import BatchBuilder
from model_service.engine.config import EngineConfig
from model_service.models.loader import LoadedModel
from model_service.startup import configure_process

log = logging.getLogger(__name__)


@dataclass
class WorkerSpec:
    rank: int
    world: int
    port: int
    config: EngineConfig
    source: Callable[[], LoadedModel]  # loads the same full weights rank 0 has (picklable)
    channel: str  # rank 0's shared-memory command channel (shm_channel.py), mapped before the rendezvous
    rank0_pid: int = dataclasses.field(default_factory=os.getpid)  # made by rank 0: its pid


def worker_main(spec: WorkerSpec) -> None:
    # Rank 0 decides when a worker ends (STOP, an aborted channel, or rank 0 gone). A Ctrl-C or
    # a SIGTERM sent to the whole process group must not kill a worker under a draining rank 0,
    # which would take it for a lost rank.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _exit_with_rank0(spec.rank0_pid)
    configure_process()  # a process of its own (spawned): rank 0's settings do not carry over
    device = rank_device(spec.config, spec.rank)
    channel = ShmChannel.attach(spec.channel, spec.world, spec.rank, spin_for(device.type))
    groups = init_rank(spec.rank, spec.world, spec.port, device)
    link = CommandLink(groups.control, channel)
    try:
        rank = build_rank(link, spec.source, spec.config, groups)
    except Exception as e:  # logged where it happened; rank 0 raises it
        log.error("rank %d could not start: %s", spec.rank, e)
        sys.exit(1)
    code = serve_commands(link, rank, BatchBuilder(spec.config.block_size, device), log)
    if code == 0:  # STOP: leave the group with rank 0 (see TensorParallelExecutor.teardown)
        rank.executor.teardown()
        dist.destroy_process_group()
    sys.exit(code)


def _exit_with_rank0(pid: int) -> None:
    """End this worker as soon as rank 0 is gone, whatever it is doing. Ignoring SIGTERM, forked by
    the fork server (which outlives rank 0, so no parent-death signal comes), a worker whose rank 0
    was killed before the rendezvous waited there for its timeout: `spindle generate
    --tensor-parallel-size 2` stopped by SIGTERM left it and the fork server running."""

    def watch() -> None:
        while process_alive(pid):
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="spindle-tp-rank0-watch", daemon=True).start()


class Workers:
    """Rank 0's handles on its worker processes."""

    def __init__(self, specs: list[WorkerSpec]) -> None:
        # CUDA cannot be used in a child forked from a process that initialized it, so workers
        # are forked from the fork server, a clean process that has imported this module (torch
        # and the engine) once and never touched a device: a rank starts in a fraction of a
        # second instead of re-importing everything as a spawned interpreter (~4 s of CPU).
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
        self.processes: list[BaseProcess] = [
            ctx.Process(target=worker_main, args=(spec,), name=f"spindle-tp-rank{spec.rank}", daemon=True)
            for spec in specs
        ]
        self.stopping = False
        for p in self.processes:
            p.start()

    def watch(self, on_exit: Callable[[str], None]) -> None:
        """Call `on_exit(why)` from a watcher thread when any worker exits other than by `stop`."""

        def wait() -> None:
            sentinels = {p.sentinel: rank for rank, p in enumerate(self.processes, start=1)}
            ready = multiprocessing.connection.wait(list(sentinels))
            if self.stopping:
                return
            rank = sentinels[ready[0]]
            code = self.processes[rank - 1].exitcode
            on_exit(f"tensor-parallel rank {rank} exited (exit code {code})")

        threading.Thread(target=wait, name="spindle-tp-watch", daemon=True).start()

    def stop(self, timeout: float) -> None:
        """Wait for the workers to exit (after a STOP command); kill any still running."""
        self.stopping = True
        for p in self.processes:
            p.join(timeout)
            if p.is_alive():
                p.kill()
                p.join()
