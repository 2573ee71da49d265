"""Rank 0's commands to the other ranks of a tensor-parallel group, and how all ranks agree on the
outcome of each (the seed's expert-parallel worker protocol, for any model).

Two channels, one order. The per-step path is host shared memory (shm_channel.py): rank 0 writes
a command, a header (kind + batch shape) and the first `INLINE` int64s of a step's packed index
buffer (batch_builder.py), into the shared message and publishes its number; each worker copies it
into its own host buffer and runs it. Everything else goes over the gloo control group (loopback
TCP), always after the shared-memory message or agreement that leads to it on every rank, so the
two never reorder: a step's payload beyond `INLINE` follows in a gloo broadcast, a CALL /
GATHER's pickled method and arguments in `broadcast_object_list`, a GATHER's results and the
error strings of a failed command in gather collectives. Both are separate from the device group
the model's collectives use: a worker waits for its next command on the host without holding
the GPU. The step's payload carries the sequences' state slots, so a model that keeps
per-sequence state on a worker addresses it from the same command, and async scheduling's feed
index; the in-flight tokens it names are on rank 0's device and follow on the device group
(rank.py), never through the host.

After every command all ranks call `agree`: each writes "did it fail here" into its ack word and
waits for everyone's (shared memory; the error strings follow on gloo only when a rank failed).
A command that ran and failed (on any rank) is that step's error on every rank: rank 0 fails the
step's requests and the workers stay up (the seed's `EpCommandFailed`). A failure to send,
receive or agree means a rank is gone: the link is lost for good (`LinkLostError`), the worker
exits, and rank 0's pod turns NOT_SERVING instead of waiting forever. A shared-memory wait cannot
see a dead peer by itself, so rank 0's watch on its worker processes aborts the channel
(`ShmChannel.abort`), which ends every wait on every rank, and a worker's wait checks that rank 0
is still its parent.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch
import torch.distributed as dist

from model_service.distributed.shm_channel import ShmChannel
from model_service.engine.batch_builder import BatchBuilder
from model_service.errors import SpindleError, UnavailableError


class Command(IntEnum):
    STEP = 1  # header: the batch shape (7 words: HEADER - 1); payload: the packed step buffer
    CALL = 2  # gloo: (method, args) every rank's RankExecutor runs
    GATHER = 3  # a CALL whose per-rank results are gathered on rank 0
    STOP = 4


class LinkLostError(UnavailableError):
    """A rank of the tensor-parallel group is gone; this pod cannot serve until it restarts."""


class CommandFailedError(SpindleError):
    """A command ran and failed on some rank; every rank knows, and every rank stays up."""


@dataclass
class Received:
    kind: Command
    shape: tuple[int, ...] = ()  # STEP
    method: str = ""  # CALL, GATHER
    args: tuple[Any, ...] = ()


class CommandLink:
    def __init__(self, group: dist.ProcessGroup, channel: ShmChannel) -> None:
        self.group, self.channel = group, channel
        self.rank, self.world = channel.rank, channel.world

    # --- rank 0 ------------------------------------------------------------------------------

    def send_step(self, packed: torch.Tensor, shape: tuple[int, ...]) -> None:
        inline = min(packed.numel(), self.channel.inline)
        self.channel.payload[:inline] = packed[:inline].numpy()
        self._publish(Command.STEP, shape)
        if packed.numel() > inline:
            dist.broadcast(packed[inline:], 0, group=self.group)

    def send_call(self, kind: Command, method: str, args: tuple[Any, ...]) -> None:
        self._publish(kind, ())
        dist.broadcast_object_list([method, args], 0, group=self.group)

    def send_stop(self) -> None:
        self._publish(Command.STOP, ())

    def _publish(self, kind: Command, shape: tuple[int, ...]) -> None:
        header = self.channel.header
        header[0] = kind
        header[1 : 1 + len(shape)] = shape
        self.channel.publish()

    # --- workers -----------------------------------------------------------------------------

    def receive(self, builder: BatchBuilder) -> Received:
        """The next command; a STEP's packed buffer lands in `builder`'s host buffer."""
        self.channel.wait_message()
        header = self.channel.header
        kind = Command(int(header[0]))
        if kind is Command.STEP:
            shape = tuple(int(v) for v in header[1:8])
            region = builder.host_region(shape)
            inline = min(region.numel(), self.channel.inline)
            region[:inline] = torch.from_numpy(self.channel.payload[:inline])
            if region.numel() > inline:
                dist.broadcast(region[inline:], 0, group=self.group)
            return Received(kind, shape=shape)
        if kind in (Command.CALL, Command.GATHER):
            message: list[Any] = [None, None]
            dist.broadcast_object_list(message, 0, group=self.group)
            return Received(kind, method=message[0], args=message[1])
        return Received(kind)

    # --- every rank --------------------------------------------------------------------------

    def agree(self, error: str | None) -> list[str | None]:
        """Every rank's error for the command just run (None where it succeeded). A STEP is
        agreed on once every rank has launched it, not run it (no rank waits for its device per
        step): this reports what fails at launch; a fault on the device surfaces in a later
        command that reads from it (rank 0 reading sampled tokens, a swap-out)."""
        errors: list[str | None] = [None] * self.world
        if self.channel.agree(error is not None):
            dist.all_gather_object(errors, error, group=self.group)
        return errors

    def gather(self, result: Any) -> list[Any]:
        """Every rank's result on rank 0 (an empty list elsewhere)."""
        out: list[Any] = [None] * self.world if self.rank == 0 else []
        dist.gather_object(result, out if self.rank == 0 else None, dst=0, group=self.group)
        return out


def describe(error: BaseException | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {error}"


def raise_agreed(
    errors: list[str | None], what: str, error_type: type[SpindleError] = CommandFailedError
) -> None:
    """Raise `error_type` naming every rank whose `agree` reported an error for `what`."""
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
    if failed:
        raise error_type(f"{what} failed on {'; '.join(failed)}")
