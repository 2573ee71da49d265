"""What one all-reduce of a decode step costs on this host's GPUs: the floor under tensor
parallelism's per-layer collectives (distributed/layers.py: two a layer, 64 a step on 8B).

Setup (printed in every line): `--tp` processes, one GPU each, NCCL (NVLink multicast off, as
the device tool requires), bf16 tensors of `[rows, --hidden]` for each of `--rows`. Two timings:
- eager: one `all_reduce` then a device synchronize, median over `--iters` (launch + NCCL + sync);
- graph: `--per-graph` all-reduces captured in one CUDA graph (as a decode step records them),
  the replay's time divided by their number: the per-collective cost inside a captured step.

    python bench/allreduce.py [--tp 2] [--rows 1 64 256] [--hidden 4096]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import time

import torch
import torch.distributed as dist

from model_service.distributed.group import free_port, init_rank


def eager_us(t: torch.Tensor, iters: int) -> float:
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dist.all_reduce(t)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def graph_us(t: torch.Tensor, per_graph: int, iters: int) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # NCCL's first calls set up its channels; keep them out of the capture
            dist.all_reduce(t)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            dist.all_reduce(t)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6 / per_graph


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    init_rank(rank, world, port, torch.device("cuda", rank))
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
    setup = f"{world} GPUs ({torch.cuda.get_device_name()}), NCCL {nccl}"
    for rows in args.rows:
        t = torch.ones(rows, args.hidden, dtype=torch.bfloat16, device="cuda")
        eager = eager_us(t, args.iters)
        graph = graph_us(t, args.per_graph, args.iters)
        if rank == 0:
            for metric, value in (("eager_us", eager), ("graph_us_per_collective", graph)):
                print(json.dumps({"bench": "allreduce", "metric": metric, "rows": rows, "hidden": args.hidden,
                                  "value": round(value, 1), "setup": setup}), flush=True)  # fmt: skip
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 64, 256])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--per-graph", type=int, default=64)
    args = ap.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, args.tp, port, args)) for r in range(1, args.tp)]
    for p in procs:
        p.start()
    rank_main(0, args.tp, port, args)
    for p in procs:
        p.join()


if __name__ == "__main__":
    main()
