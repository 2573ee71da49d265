"""What one all-reduce of a decode step costs on this host's GPUs: the floor under tensor
parallelism's per-layer collectives (distributed/layers.py: two a layer, 64 a step on 8B).

Setup (printed in every line): `--tp` processes, one GPU each, NCCL (NVLink multicast off, as
the device tool requires), bf16 tensors of `[rows, --hidden]` for each of `--rows`. Two timings:
- eager: one `all_reduce` then a device synchronize, median over `--iters` (launch + NCCL + sync);
- graph: `--per-graph` all-reduces captured in one CUDA graph (as a decode step records them),
  the replay's time divided by their number: the per-collective cost inside a captured step.
Each for NCCL and, where this PyTorch has them, symmetric memory's one- and two-shot
all-reduces (the copies in and out of the symmetric buffer included).

    python bench/allreduce.py [--tp 2] [--rows 1 64 256] [--hidden 4096]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from model_service.distributed.group import free_port, init_rank


def eager_us(op: Callable[[], object], iters: int) -> float:
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        op()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def graph_us(op: Callable[[], object], per_graph: int, iters: int) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # NCCL's first calls set up its channels; keep them out of the capture
            op()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            op()
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
        for name, op in variants(t):
            try:
                eager, graph = eager_us(op, args.iters), graph_us(op, args.per_graph, args.iters)
            except Exception as e:  # symmetric memory is alpha in PyTorch: report, do not fail
                result = {"error": f"{type(e).__name__}: {e}"[:300]}
            else:
                result = {"eager_us": round(eager, 1), "graph_us_per_collective": round(graph, 1)}
            if rank == 0:
                print(json.dumps({"bench": "allreduce", "impl": name, "rows": rows, "hidden": args.hidden,
                                  **result, "setup": setup}), flush=True)  # fmt: skip
    dist.destroy_process_group()


def variants(t: torch.Tensor) -> list[tuple[str, Callable[[], object]]]:
    """NCCL's all-reduce, and PyTorch symmetric memory's one- and two-shot all-reduces over NVLink
    peer access (what vLLM uses on 2 GPUs; never the multimem ones, which need NVLink multicast)."""
    ops: list[tuple[str, Callable[[], object]]] = [("nccl", lambda: dist.all_reduce(t))]
    try:
        import torch.distributed._symmetric_memory as symm_mem

        group = dist.group.WORLD.group_name
        buf = symm_mem.empty(t.numel(), dtype=t.dtype, device=t.device)
        symm_mem.rendezvous(buf, group)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"[:300]
        print(json.dumps({"bench": "allreduce", "impl": "symm_mem", "error": error}))
        return ops

    def one_shot() -> None:
        buf.copy_(t.view(-1))
        t.view(-1).copy_(torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group))

    def two_shot() -> None:
        buf.copy_(t.view(-1))
        torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", group)
        t.view(-1).copy_(buf)

    return [*ops, ("symm_mem_one_shot", one_shot), ("symm_mem_two_shot", two_shot)]


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
