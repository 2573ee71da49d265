"""Per-step control overhead of a tensor-parallel pod: rank 0's command to the workers and the
`agree` after it (distributed/link.py), with nothing run in between.

Setup (printed in every line): two processes on this host, exactly the code a step runs
(`send_step` / `receive` / `agree`): the shared-memory channel (shm_channel.py) with the GPU
ranks' spin times unless `--spin cpu`, and the gloo control group over loopback TCP
for what does not fit it; payloads the size of a decode step's packed batch at `--batches` rows
(`--blocks` K/V blocks each). `step_control_us` is rank 0's time from `send_step` to the end of
`agree`, the median over `--steps` round trips after `--warmup`; with `--gap-us G` rank 0 first
busy-waits G us outside the timed part, as its sampling and scheduling would (a gap longer than
the spin time finds the worker asleep). For scale, `one_collective_us` is one bare all-reduce of
one int64 on the gloo control group (what each of the two collectives of a step cost before the
channel). On GPUs this traffic sits on the critical path of every decode step: the workers start
their step only once the command has arrived, and rank 0 samples only after the agree.

    python bench/tp_control.py [--batches 1 64] [--blocks 12] [--gap-us 0 2000] [--spin cuda] [--steps 2000]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import threading
import time
from multiprocessing.connection import wait

import torch
import torch.distributed as dist

from model_service.distributed.group import free_port, init_rank
from model_service.distributed.link import Command, CommandLink
from model_service.distributed.shm_channel import ShmChannel, Spin, spin_for
from model_service.engine.batch_builder import BatchBuilder, _layout


def step_shape(rows: int, blocks: int) -> tuple[int, ...]:
    """A decode step of `rows` sequences, one token each, `blocks` K/V blocks per sequence."""
    return (rows, rows, rows, blocks, 0, 1, blocks * 16)


def worker(port: int, path: str, spin: Spin, collectives: int) -> None:
    torch.set_num_threads(1)
    channel = ShmChannel.attach(path, 2, 1, spin)
    link = CommandLink(init_rank(1, 2, port, torch.device("cpu")).control, channel)
    builder = BatchBuilder(16, torch.device("cpu"))
    while link.receive(builder).kind is not Command.STOP:
        link.agree(None)
    one = torch.zeros(1, dtype=torch.long)
    for _ in range(collectives):
        dist.all_reduce(one, group=link.group)
    dist.destroy_process_group()


def bare_collectives(link: CommandLink, steps: int, warmup: int) -> list[float]:
    one = torch.zeros(1, dtype=torch.long)
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        dist.all_reduce(one, group=link.group)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def line(metric: str, times: list[float], spin: str, **fields: object) -> str:
    return json.dumps({
        "bench": "tp_control", "metric": metric, **fields, "median": round(statistics.median(times) * 1e6, 1),
        "p90": round(statistics.quantiles(times, n=10)[-1] * 1e6, 1), "steps": len(times),
        "setup": f"2 processes, shared-memory channel ({spin} ranks' spin) + gloo control group over "
                 f"loopback TCP, {os.cpu_count()} CPUs",
    })  # fmt: skip


def timed_steps(
    link: CommandLink, shape: tuple[int, ...], gap_s: float, steps: int, warmup: int
) -> list[float]:
    packed = torch.zeros(_layout(shape)[1], dtype=torch.long)
    times = []
    for i in range(warmup + steps):
        until = time.perf_counter() + gap_s
        while time.perf_counter() < until:  # rank 0's host work between two steps
            pass
        start = time.perf_counter()
        link.send_step(packed, shape)
        link.agree(None)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 64])
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--gap-us", type=float, nargs="*", default=[0.0])
    ap.add_argument("--spin", choices=["cuda", "cpu"], default="cuda", help="whose shm_channel.Spin")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)
    port, spin = free_port(), spin_for(args.spin)
    channel = ShmChannel.create(2, spin)
    try:
        proc = multiprocessing.get_context("spawn").Process(
            target=worker, args=(port, channel.path, spin, args.steps + args.warmup)
        )
        proc.start()
        link = CommandLink(init_rank(0, 2, port, torch.device("cpu")).control, channel)
    finally:
        channel.unlink()
    # as rank 0's executor does: a worker that dies ends rank 0's waits rather than hanging the bench
    threading.Thread(target=lambda: (wait([proc.sentinel]), channel.abort()), daemon=True).start()
    for gap in args.gap_us:
        for rows in args.batches:
            shape = step_shape(rows, args.blocks)
            times = timed_steps(link, shape, gap / 1e6, args.steps, args.warmup)
            bytes_ = 8 * _layout(shape)[1]
            print(line("step_control_us", times, args.spin, batch=rows, payload_bytes=bytes_, gap_us=gap))
    link.send_stop()
    print(line("one_collective_us", bare_collectives(link, args.steps, args.warmup), args.spin))
    proc.join()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
