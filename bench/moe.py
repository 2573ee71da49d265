"""One MoE layer's experts: the grouped path (two grouped_mm launches, no loop over experts)
against the reference (one matmul pair per expert that has tokens), at Qwen3-30B-A3B's shapes.

Setup (printed in every line): random weights of the real shapes (128 experts, top-8,
H=2048, I=768; no router: each token's experts drawn uniformly, weights a softmax of random
logits), T tokens, the device and dtype below. Times are the median of `--iters` calls after a
warm-up; "graph" is the grouped path replayed from a CUDA graph, as decode steps run it.
`weight_gbps` = bytes of the experts hit / time: against the card's bandwidth it says how close a
decode-sized call is to reading its weights once. Prints one JSON line per (T, path).

    python bench/moe.py [--tokens 1 64 512] [--device cuda] [--dtype bfloat16]
    python bench/moe.py --device cpu --dtype float32 --experts 16 --hidden 256 --inter 128  # a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from model_service.kernels.experts import experts_grouped, experts_reference


def timed(fn: Callable[[], object], iters: int, device: torch.device) -> float:
    """Median seconds of one call."""
    fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def graphed(fn: Callable[[], object]) -> Callable[[], object]:
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def bench(args: argparse.Namespace, tokens: int) -> list[dict[str, object]]:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(tokens)
    h, inter, experts, k = args.hidden, args.inter, args.experts, args.top_k
    x = torch.randn(tokens, h, generator=g).to(device, dtype)
    gate_up = (torch.randn(experts, 2 * inter, h, generator=g) / h**0.5).to(device, dtype)
    down = (torch.randn(experts, h, inter, generator=g) / inter**0.5).to(device, dtype)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)]).to(device)
    weights = torch.softmax(torch.randn(tokens, k, generator=g), dim=-1).to(device)
    hit = ids.unique().numel()
    weight_bytes = hit * 3 * h * inter * gate_up.element_size()
    paths: dict[str, Callable[[], object]] = {
        "reference": lambda: experts_reference(x, gate_up, down, ids, weights),
        "grouped": lambda: experts_grouped(x, gate_up, down, ids, weights),
    }
    if device.type == "cuda":
        paths["graph"] = graphed(paths["grouped"])
    setup = {"experts": experts, "top_k": k, "hidden": h, "inter": inter, "device": args.device,
             "dtype": args.dtype, "experts_hit": hit}  # fmt: skip
    rows = []
    for name, fn in paths.items():
        seconds = timed(fn, args.iters, device)
        gbps = round(weight_bytes / seconds / 1e9, 1)
        rows.append({"bench": "moe_experts", "path": name, "tokens": tokens, **setup,
                     "ms": round(seconds * 1e3, 4), "weight_gbps": gbps})  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="*", default=[1, 64, 512])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    for tokens in args.tokens:
        for row in bench(args, tokens):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
