"""The per-step half of a tensor-parallel pod's control link (link.py): host shared memory every
rank of the pod maps, instead of a gloo collective over loopback TCP (vLLM's shm_broadcast idea).

The ranks of a pod share a host (group.py rendezvous on 127.0.0.1), so rank 0 can hand its
workers a command by writing it where they can read it: one memory copy and a flag, where a gloo
broadcast costs a TCP round trip through the kernel on every step's critical path.

Layout (int64 words; each flag word has a 64-byte cache line of its own, so a rank polling one
flag does not contend with the rank writing another):

    line 0        seq     number of the last message rank 0 published
    line 1        abort   set once by rank 0 when it gives the group up: every waiter raises
    line 2 + r    ack[r]  2 * round + failed: rank r's outcome of its `round`-th agreement
    then          message `HEADER` words, then `inline` words of payload (link.py fills them)

There is one message slot, not a ring: the link is lockstep. Rank 0 writes message n + 1 only
after the agreement that follows message n, whose acks every worker writes only after it copied
message n out, so a message is never overwritten while a worker still reads it.

Ordering: payload before flag. A writer fills the message (or finishes reading it) before it
stores a flag word, and a reader reads the message only after it saw the flag. Flags are single
aligned 8-byte stores and loads (never torn on x86-64 or aarch64). The protocol needs stores
ordered with stores, loads with loads, and loads with later stores (never a store with a later
load: no rank waits on a flag to decide whether to store one). x86-64's TSO guarantees exactly
that for the numpy copies and flag stores, separate C calls in program order; x86-64 is what this
is measured and tested on. `_fence` between data and flag is what vLLM's shm_broadcast uses for
weakly ordered CPUs (aarch64, e.g. GH200): a lock acquire + release, which glibc implements with
barrier instructions, but which is not a full fence by the C11 definition.

Waiting: a waiter polls its flag, yielding the CPU (`sched_yield`, which releases the GIL: rank
0's gRPC thread keeps running while its engine thread waits) for a while (`Spin`), then sleeps
with a back-off doubling from 20 us to 1 ms, so an idle pod does not burn a core, yet a command
that arrives within a busy pod's host work between steps is seen within microseconds. Every
poll checks `abort`; a worker's sleeps also check that rank 0 (its pid is in the segment) still lives.

The segment is a file under /dev/shm that rank 0 creates and unlinks exactly once, as soon as
every rank has mapped it (the process group's rendezvous comes after each worker's `attach`), so
nothing is left behind even if a rank is killed; the mappings live until each process exits.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

HEADER = 8  # message words before the payload (link.py: kind, batch shape)
# Payload words a message carries (512 KiB): a decode step of 256 rows at 247 K/V blocks each, or
# a prefill step of 16k tokens; only what a step uses is copied. A larger step's remainder follows
# on gloo.
INLINE = 1 << 16


@dataclass(frozen=True)
class Spin:
    """How long a waiter spins before it sleeps. A worker waits for its next `message` while the
    pod is idle, too, so that spin is short; a rank waits in an agreement (`agree`) only while
    the pod runs a command, for as long as the other ranks' step takes, which it should not
    overshoot by a sleep."""

    message_s: float
    agree_s: float


# GPU ranks: a busy pod's next command comes after rank 0's host work between two steps
# (sampling, scheduling, packing: about a millisecond), a step takes milliseconds. CPU ranks:
# the ranks' compute shares the cores a spinning waiter would take.
GPU_SPIN, CPU_SPIN = Spin(message_s=5e-3, agree_s=5e-2), Spin(message_s=2e-4, agree_s=2e-4)


def spin_for(device_type: str) -> Spin:
    return GPU_SPIN if device_type == "cuda" else CPU_SPIN


_LINE = 8  # int64 words per cache line
_SEQ, _ABORT, _ACKS = 0, _LINE, 2 * _LINE
_RANK0_PID = _ABORT + 1  # written once by rank 0, on the abort flag's line
_SLEEP_MIN_S, _SLEEP_MAX_S = 2e-5, 1e-3
_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None  # else the temp dir (still mapped shared)
_fence_lock = threading.Lock()


class ChannelClosedError(ConnectionError):
    """The peer a rank waits on is gone, or rank 0 gave the group up."""


def process_alive(pid: int) -> bool:
    """Whether process `pid` runs: it exists and is no zombie (a killed rank 0 stays one until its
    own parent reaps it, and a signal 0 still reaches a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: signal 0 checks that it exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's: the pid was reused
            return False
        return True


def _fence() -> None:
    with _fence_lock:
        pass


class ShmChannel:
    def __init__(self, path: str, world: int, rank: int, spin: Spin, inline: int, create: bool) -> None:
        self.path, self.world, self.rank, self.spin, self.inline = path, world, rank, spin, inline
        size = 8 * ((2 + world) * _LINE + HEADER + inline)
        fd = os.open(path, os.O_RDWR)
        try:
            if create:
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        words = np.frombuffer(self._map, dtype=np.int64)
        self._words = words
        self._acks = words[_ACKS : _ACKS + world * _LINE : _LINE]
        message = words[(2 + world) * _LINE :]
        self.header, self.payload = message[:HEADER], message[HEADER:]
        self._seq, self._round = 0, 0  # the last message published / seen; the last agreement
        if create:
            words[_RANK0_PID] = os.getpid()
        # Rank 0's pid, not this process's parent: a worker is forked by the fork server, which
        # outlives rank 0, so a worker checking its parent waited forever (ignoring SIGTERM) after
        # `spindle generate --tensor-parallel-size N` was killed.
        self._rank0 = int(words[_RANK0_PID]) if rank > 0 else None
        self._unlinked = False

    @classmethod
    def create(cls, world: int, spin: Spin, inline: int = INLINE) -> ShmChannel:
        """Rank 0's channel: a new segment the workers `attach` to by its path."""
        fd, path = tempfile.mkstemp(prefix="spindle-tp-", dir=_SHM_DIR)  # mode 0600: this user's only
        os.close(fd)
        try:
            return cls(path, world, 0, spin, inline, create=True)
        except BaseException:
            os.unlink(path)
            raise

    @classmethod
    def attach(cls, path: str, world: int, rank: int, spin: Spin, inline: int = INLINE) -> ShmChannel:
        """A worker's mapping of rank 0's segment; call it before joining the process group."""
        return cls(path, world, rank, spin, inline, create=False)

    def unlink(self) -> None:
        """Remove the segment's name (rank 0, once every rank mapped it or never will); idempotent."""
        if not self._unlinked:
            self._unlinked = True
            os.unlink(self.path)

    # --- messages ----------------------------------------------------------------------------

    def publish(self) -> None:
        """Rank 0: the message in `header` / `payload` is complete; let the workers read it."""
        self._seq += 1
        _fence()
        self._words[_SEQ] = self._seq

    def wait_message(self) -> None:
        """A worker: return once rank 0 published its next message (then in `header` / `payload`)."""
        self._seq += 1
        self._wait(lambda: self._words[_SEQ] >= self._seq, self.spin.message_s)

    # --- agreement ---------------------------------------------------------------------------

    def agree(self, failed: bool) -> bool:
        """Whether any rank failed this round; every rank calls it once per round, in the same order.

        A rank whose ack is already past this round has finished it, which it can have done only
        if nobody failed (a failed round continues on gloo with every rank), so that counts as ok.
        """
        self._round += 1
        done = 2 * self._round
        _fence()  # this rank's reads of the message happen before rank 0 may overwrite it
        self._acks[self.rank] = done + int(failed)
        self._wait(lambda: self._acks.min() >= done, self.spin.agree_s)
        return bool((self._acks == done + 1).any())

    def abort(self) -> None:
        """Rank 0 gives the group up: every rank waiting on this channel raises, now and later."""
        self._words[_ABORT] = 1

    # --- waiting -----------------------------------------------------------------------------

    def _wait(self, ready: Callable[[], bool], spin_s: float) -> None:
        deadline = time.perf_counter() + spin_s
        while not ready():
            self._check()
            if time.perf_counter() > deadline:
                self._sleep(ready)
                break
            os.sched_yield()
        _fence()  # what the flag announced is read after the flag

    def _sleep(self, ready: Callable[[], bool]) -> None:
        pause = _SLEEP_MIN_S
        while not ready():
            self._check()
            if self._rank0 is not None and not process_alive(self._rank0):
                raise ChannelClosedError("rank 0 exited")
            time.sleep(pause)
            pause = min(2 * pause, _SLEEP_MAX_S)

    def _check(self) -> None:
        if self._words[_ABORT]:
            raise ChannelClosedError("rank 0 gave the tensor-parallel group up")
