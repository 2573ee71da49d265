"""Rank 0's commands to the other ranks of a tensor-parallel group, and how all ranks agree on the
outcome of each (the seed's expert-parallel worker protocol, for any model).

The control group is gloo over host memory, separate from the device group the model's
collectives use: a worker waits for its next command on the host without holding the GPU, and
a step's packed index buffer (batch_builder.py) is broadcast as it is, one int64 tensor, before
each rank copies it to its own device. Every command is one fixed-size message: a header (kind
+ batch shape) and the first `_INLINE` int64s of a step's payload, which hold a whole decode
step of 64 rows at up to 368 tokens of context; only a larger payload's remainder follows in a
second broadcast.
Each collective is a round trip on the critical path of every step (the workers start only once
the command has arrived), so a decode step costs two (this message and `agree`), not three. The
step's payload carries the sequences' state slots, so a model that keeps per-sequence state on a
worker addresses it from the same command.

After every command all ranks call `agree`: one all-reduce of "did it fail here". A command that
ran and failed (on any rank) is that step's error on every rank: rank 0 fails the step's
requests and the workers stay up (the seed's `EpCommandFailed`). A failure to send, receive or
agree means a rank is gone: the link is lost for good (`LinkLostError`), the worker exits, and
rank 0's pod turns NOT_SERVING instead of waiting in a collective forever.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch
import torch.distributed as dist

from model_service.engine.batch_builder import BatchBuilder
from model_service.errors import SpindleError, UnavailableError

_HEADER = 8
# A decode step's packed batch is 1 + (8 + K/V blocks per sequence) int64s per row: 2040 carry 64
# rows of 23 blocks (368 tokens of context at block size 16), or 16 rows of 119. The message is
# then 16 KiB; over loopback a step costs about the same at 168 bytes and at 10 KiB of payload
# (bench/tp_control.py, batch 1 and 64).
_INLINE = 2040


class Command(IntEnum):
    STEP = 1  # header: the batch shape; payload: the packed step buffer
    CALL = 2  # payload: (method, args) every rank's RankExecutor runs
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
    def __init__(self, group: dist.ProcessGroup, rank: int, world: int) -> None:
        self.group, self.rank, self.world = group, rank, world

    # --- rank 0 ------------------------------------------------------------------------------

    def send_step(self, packed: torch.Tensor, shape: tuple[int, ...]) -> None:
        self._message(Command.STEP, shape, packed[:_INLINE])
        if packed.numel() > _INLINE:
            dist.broadcast(packed[_INLINE:], 0, group=self.group)

    def send_call(self, kind: Command, method: str, args: tuple[Any, ...]) -> None:
        self._message(kind, ())
        dist.broadcast_object_list([method, args], 0, group=self.group)

    def send_stop(self) -> None:
        self._message(Command.STOP, ())

    def _message(self, kind: Command, shape: tuple[int, ...], inline: torch.Tensor | None = None) -> None:
        message = torch.zeros(_HEADER + _INLINE, dtype=torch.long)
        message[0] = kind
        message[1 : 1 + len(shape)] = torch.tensor(shape, dtype=torch.long)
        if inline is not None:
            message[_HEADER : _HEADER + inline.numel()] = inline
        dist.broadcast(message, 0, group=self.group)

    # --- workers -----------------------------------------------------------------------------

    def receive(self, builder: BatchBuilder) -> Received:
        """The next command; a STEP's packed buffer lands in `builder`'s host buffer."""
        message = torch.empty(_HEADER + _INLINE, dtype=torch.long)
        dist.broadcast(message, 0, group=self.group)
        kind = Command(int(message[0]))
        if kind is Command.STEP:
            shape = tuple(int(v) for v in message[1:7])
            region = builder.host_region(shape)
            inline = min(region.numel(), _INLINE)
            region[:inline] = message[_HEADER : _HEADER + inline]
            if region.numel() > _INLINE:
                dist.broadcast(region[_INLINE:], 0, group=self.group)
            return Received(kind, shape=shape)
        if kind in (Command.CALL, Command.GATHER):
            message: list[Any] = [None, None]
            dist.broadcast_object_list(message, 0, group=self.group)
            return Received(kind, method=message[0], args=message[1])
        return Received(kind)

    # --- every rank --------------------------------------------------------------------------

    def agree(self, error: str | None) -> list[str | None]:
        """Every rank's error for the command just run (None where it succeeded)."""
        failed = torch.tensor([int(error is not None)], dtype=torch.long)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self.group)
        errors: list[str | None] = [None] * self.world
        if failed.item():
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
