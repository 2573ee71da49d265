"""The tensor-parallel control link (distributed/link.py) and its shared-memory channel
(distributed/shm_channel.py), without a model: messages arrive whole and in order, agreements
report any rank's failure, nothing waits forever for a rank that is gone, and the segment's
name is gone from /dev/shm once every rank mapped it. The pod-level behaviour (a killed rank
turns the pod NOT_SERVING) is in test_tensor_parallel.py.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from multiprocessing.connection import wait
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from model_service.distributed.group import free_port, init_rank
from model_service.distributed.link import Command, CommandLink
from model_service.distributed.shm_channel import CPU_SPIN, ChannelClosedError, ShmChannel
from model_service.engine.batch_builder import BatchBuilder, _layout

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def pair():
    """Rank 0's channel and rank 1's mapping of it, in this process (threads play the ranks)."""
    rank0 = ShmChannel.create(2, CPU_SPIN, inline=16)
    rank1 = ShmChannel.attach(rank0.path, 2, 1, CPU_SPIN, inline=16)
    rank0.unlink()
    rank0.unlink()  # once only: the second is a no-op
    assert not os.path.exists(rank0.path)
    return rank0, rank1


def _in_thread(target) -> tuple[threading.Thread, list]:
    out: list = []

    def run() -> None:
        try:
            out.append(target())
        except Exception as e:
            out.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_messages_arrive_whole_and_in_order_and_agreements_report_any_failure(pair):
    rank0, rank1 = pair
    steps = 300

    def worker() -> list:
        seen = []
        for _ in range(steps):
            rank1.wait_message()
            kind, n = int(rank1.header[0]), int(rank1.header[1])
            seen.append((kind, rank1.payload[:n].tolist(), rank1.agree(failed=kind % 3 == 0)))
        return seen

    thread, out = _in_thread(worker)
    for i in range(steps):
        n = i % 17  # up to the whole payload; every message overwrites the last one's words
        rank0.header[:2] = (i, n)
        rank0.payload[:n] = i * 100 + torch.arange(n).numpy()
        rank0.publish()
        assert rank0.agree(failed=i % 5 == 0) == (i % 3 == 0 or i % 5 == 0)
    thread.join(10)
    assert out[0] == [
        (i, list(range(i * 100, i * 100 + i % 17)), i % 3 == 0 or i % 5 == 0) for i in range(steps)
    ]


def test_abort_ends_a_worker_waiting_for_a_message_and_rank_0_waiting_for_acks(pair):
    rank0, rank1 = pair
    waiting, out = _in_thread(rank1.wait_message)
    # rank 0 waits for an ack rank 1 never writes; its watch (here: a timer) gives the group up
    threading.Timer(0.2, rank0.abort).start()
    start = time.monotonic()
    with pytest.raises(ChannelClosedError, match="gave the tensor-parallel group up"):
        rank0.agree(failed=False)
    assert time.monotonic() - start < 2.0
    waiting.join(2.0)
    assert isinstance(out[0], ChannelClosedError)


# Rank 0 (this script) maps the channel, starts a worker as its child, agrees once with it (the
# worker has mapped the segment by then), unlinks the name, and waits to be killed. The worker
# then waits for a message that never comes.
RANK0 = """
import subprocess, sys, time
from model_service.distributed.shm_channel import CPU_SPIN, ShmChannel
channel = ShmChannel.create(2, CPU_SPIN)
worker = subprocess.Popen([sys.executable, "-c", sys.argv[1], channel.path])
channel.agree(False)
channel.unlink()
print(worker.pid, channel.path, flush=True)
time.sleep(60)
"""
WORKER = """
import sys
from model_service.distributed.shm_channel import CPU_SPIN, ChannelClosedError, ShmChannel
channel = ShmChannel.attach(sys.argv[1], 2, 1, CPU_SPIN)
channel.agree(False)
try:
    channel.wait_message()
except ChannelClosedError as e:
    print("worker:", e, flush=True)
"""


def test_a_worker_waiting_for_a_message_exits_when_rank_0_is_killed():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    rank0 = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(RANK0), textwrap.dedent(WORKER)],
        stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        _, path = rank0.stdout.readline().split()
        assert not os.path.exists(path)  # unlinked while both ranks still map it
        rank0.kill()
        killed = time.monotonic()
        # The pipe closes when the worker (which inherited it) exits too.
        rest = rank0.communicate(timeout=10)[0]
        assert time.monotonic() - killed < 5.0
        assert rest.strip() == "worker: rank 0 exited"
    finally:
        rank0.kill()
        rank0.wait()


def _echo_worker(port: int, path: str, inline: int) -> None:
    """Rank 1: runs rank 0's commands the way rank.serve_commands does, on no model."""
    channel = ShmChannel.attach(path, 2, 1, CPU_SPIN, inline)  # before the rendezvous: then rank 0 unlinks it
    link = CommandLink(init_rank(1, 2, port, torch.device("cpu")).control, channel)
    builder = BatchBuilder(16, torch.device("cpu"))
    received: list[list[int]] = []
    while (cmd := link.receive(builder)).kind is not Command.STOP:
        error, result = None, None
        if cmd.kind is Command.STEP:
            received.append(builder.from_host(cmd.shape).packed.tolist())
        elif cmd.method == "fail":
            error = "ValueError: asked to"
        else:
            result = (cmd.method, cmd.args, received)
        if not any(link.agree(error)) and cmd.kind is Command.GATHER:
            link.gather(result)
    dist.destroy_process_group()


def test_steps_larger_than_a_message_calls_failures_and_gathers_keep_their_order():
    """A step's payload past the channel's inline words follows on gloo; a CALL's arguments
    follow on gloo after the shared-memory message announcing it; neither overtakes a step."""
    port, inline = free_port(), 256
    channel = ShmChannel.create(2, CPU_SPIN, inline)
    try:
        ctx = multiprocessing.get_context("spawn")
        worker = ctx.Process(target=_echo_worker, args=(port, channel.path, inline), daemon=True)
        worker.start()
        link = CommandLink(init_rank(0, 2, port, torch.device("cpu")).control, channel)
    finally:
        channel.unlink()
    # as rank 0's executor does (Workers.watch): a worker that exits ends every wait on the channel
    watch = threading.Thread(target=lambda: (wait([worker.sentinel]), channel.abort()), daemon=True)
    watch.start()
    stopped = False
    try:
        sent = []
        for rows, blocks in [(1, 2), (16, 24), (2, 3)]:  # 144 words inline, 528 (272 over gloo), 144
            shape = (rows, rows, rows, blocks, 0, 1, blocks * 16)
            packed = torch.randint(0, 1 << 40, (_layout(shape)[1],))
            link.send_step(packed, shape)
            assert link.agree(None) == [None, None]
            sent.append(packed.tolist())
        assert len(sent[1]) > inline
        link.send_call(Command.CALL, "fail", ())
        assert link.agree(None) == [None, "ValueError: asked to"]
        link.send_call(Command.GATHER, "echo", ("x", 3))
        assert link.agree(None) == [None, None]
        assert link.gather(None) == [None, ("echo", ("x", 3), sent)]
        link.send_stop()
        stopped = True
    finally:
        if not stopped:
            channel.abort()
        dist.destroy_process_group()  # with the worker, as TensorParallelExecutor.teardown does
        worker.join(30)
        if worker.is_alive():
            worker.kill()
    assert worker.exitcode == 0


# The worker through a process between it and rank 0 that outlives rank 0, as the fork server does.
MIDDLE = """
import os, subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
os.close(1)  # only the worker holds rank 0's stdout pipe: it closes when the worker exits
time.sleep(60)
"""


def test_a_worker_forked_by_a_process_that_outlives_rank_0_exits_when_rank_0_is_killed():
    """Workers are children of the fork server, not of rank 0: their check that "my parent is rank
    0" never fired, and after a SIGTERM of `spindle generate --tensor-parallel-size 2` the worker
    waited on (ignoring SIGTERM), with the fork server, for good. The segment now names rank 0."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    rank0_script = textwrap.dedent(RANK0).replace(
        '[sys.executable, "-c", sys.argv[1], channel.path]',
        '[sys.executable, "-c", sys.argv[2], sys.argv[1], channel.path]',
    )
    assert rank0_script != textwrap.dedent(RANK0)
    rank0 = subprocess.Popen(
        [sys.executable, "-c", rank0_script, textwrap.dedent(WORKER), textwrap.dedent(MIDDLE)],
        stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    middle = None
    try:
        middle, _ = rank0.stdout.readline().split()
        rank0.kill()
        rest = rank0.communicate(timeout=10)[0]  # the worker (holding the pipe) has exited
        assert rest.strip() == "worker: rank 0 exited"
    finally:
        rank0.kill()
        rank0.wait()
        if middle is not None:
            os.kill(int(middle), signal.SIGKILL)


def test_a_tensor_parallel_worker_exits_when_rank_0_is_gone_whatever_it_is_doing():
    """A worker whose rank 0 died before the rendezvous waited there (SIGTERM ignored) until its
    timeout; its watch thread ends it within a second of rank 0's end."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    code = (
        "import signal, sys, time\n"
        "from model_service.distributed.worker import _exit_with_rank0\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"_exit_with_rank0({gone.pid})\n"
        "time.sleep(30)\n"
    )
    worker = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)},
                            timeout=25, capture_output=True, text=True)  # fmt: skip
    assert worker.returncode == 1 and "Traceback" not in worker.stderr, worker.stderr
