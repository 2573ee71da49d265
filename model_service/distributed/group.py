"""Process-group setup for one tensor-parallel rank: its device, the device group the model's
collectives use (NCCL on GPUs, gloo on the CPU) and the gloo control group that carries what rank
0's commands do not fit in shared memory (distributed/link.py)."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from model_service.engine.config import EngineConfig
from model_service.errors import ModelLoadError

# A collective of the model that waits this long has lost a peer (NCCL's watchdog then ends the
# process); a step takes milliseconds.
DEVICE_TIMEOUT = timedelta(minutes=5)
# A rank enters a control-group collective only once a shared-memory message announced it, but
# that may be while a peer still runs a long command. A dead peer is seen at once (its sockets
# close), not through this timeout.
CONTROL_TIMEOUT = timedelta(days=365)


@dataclass
class RankGroups:
    rank: int
    world: int
    device: torch.device
    device_group: dist.ProcessGroup
    control: dist.ProcessGroup


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank r runs on the host's GPU r (all ranks share the CPU when there is none)."""
    device = config.torch_device()
    if device.type != "cuda":
        return device
    if torch.cuda.device_count() < config.tensor_parallel_size:
        raise ModelLoadError(
            f"--tensor-parallel-size {config.tensor_parallel_size} needs that many GPUs; "
            f"this host has {torch.cuda.device_count()}"
        )
    return torch.device("cuda", rank)


def init_rank(rank: int, world: int, port: int, device: torch.device) -> RankGroups:
    """Join the group rendezvousing on 127.0.0.1:`port` (the ranks of one pod share a host)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=DEVICE_TIMEOUT,
    )
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return RankGroups(rank, world, device, dist.group.WORLD, control)
