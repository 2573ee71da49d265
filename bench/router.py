"""The MoE routing launch alone (`route_hidden`: the router's GEMV, top-k and renormalization in
one launch), over how it cuts the router's weight (`RouterLaunch`): microseconds a call per model
shape and token count, the engine's launch beside the best.

    PYTHONPATH=. python3 bench/router.py [--shapes qwen3-30b ...] [--tokens 1 2 4 8 16]
        [--max-slices 8 16 32 64 128] [--min-rows 16 32 64] [--warps 4]

Setup (in every line): one CUDA device, bf16 hidden states and router weights of random values
(stored transposed, as the engine keeps them), each shape's routing (softmax top-k, Qwen3-Next's
shared-expert gate and slot, DeepSeek's grouped sigmoid with its bias and float32 logits); 20
calls captured in a CUDA graph, the median of 10 replays. `same_ids`: each launch chose the
engine launch's experts (the slices' sums may round differently; a near-tie may then differ).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json

import torch

from bench.allreduce import graph_us
from model_service.kernels.fused_moe import ROUTER_MAX_ROWS, RouterLaunch, route_hidden, router_launch
from model_service.models.config import PLAIN_TOP_K, Routing

V3 = Routing("sigmoid", "top2_sum", 8, 4, True, 2.5, True)
V2_LITE = Routing(scaling_factor=1.0, float32_logits=True)
# name: (hidden, experts, top_k, routing, a shared expert's gate and slot)
SHAPES = {
    "qwen3-30b": (2048, 128, 8, PLAIN_TOP_K, False),
    "qwen3-235b": (4096, 128, 8, PLAIN_TOP_K, False),
    "qwen3-next": (2048, 512, 10, PLAIN_TOP_K, True),
    "mixtral": (4096, 8, 2, PLAIN_TOP_K, False),
    "deepseek-v2-lite": (2048, 64, 6, V2_LITE, False),
    "deepseek-v3": (7168, 256, 8, V3, False),
}


def sweep(name: str, tokens: int, launches: list[RouterLaunch]) -> dict[str, object]:
    """One JSON line: the engine's launch and every launch of `launches`, us a call."""
    hidden, experts, top_k, routing, shared = SHAPES[name]
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g).to("cuda", torch.bfloat16)
    gate = (torch.randn(hidden, experts, generator=g) / hidden**0.5).to("cuda", torch.bfloat16).t()
    bias = (torch.randn(experts, generator=g) * 0.01).to("cuda") if routing.correction_bias else None
    gated = None
    if shared:
        weight = (torch.randn(1, hidden, generator=g) / hidden**0.5).to("cuda", torch.bfloat16)
        gated = (weight, torch.empty(tokens, dtype=torch.bfloat16, device="cuda"))
    arrivals = torch.zeros(ROUTER_MAX_ROWS, dtype=torch.int32, device="cuda")

    def call(launch: RouterLaunch) -> tuple[torch.Tensor, torch.Tensor]:
        slots = (1, experts) if shared else (0, 0)
        return route_hidden(x, gate, top_k, True, arrivals, routing, bias, 0, gated, *slots, launch=launch)

    engine_launch = router_launch(tokens, experts, torch.cuda.get_device_properties(0).multi_processor_count)
    engine_ids = call(engine_launch)[1].clone()
    times, same = {}, True
    for launch in launches:
        same &= torch.equal(call(launch)[1], engine_ids)
        key = f"slices{launch.max_slices}-rows{launch.min_rows}-warps{launch.warps}"
        times[key] = round(graph_us(lambda launch=launch: call(launch), 20, 10), 2)
    best = min(times, key=times.get)
    engine = round(graph_us(lambda: call(engine_launch), 20, 10), 2)
    return {"bench": "router", "shape": name, "tokens": tokens, "engine_us": engine, "best": best,
            "best_us": times[best], "same_ids": same, "engine_launch": dataclasses.asdict(engine_launch),
            "launches": times}  # fmt: skip


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    parser.add_argument("--max-slices", nargs="+", type=int, default=[8, 16, 32, 64, 128])
    parser.add_argument("--min-rows", nargs="+", type=int, default=[16, 32, 64])
    parser.add_argument("--warps", nargs="+", type=int, default=[4])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/router.py needs a CUDA device")
    if max(args.tokens) > ROUTER_MAX_ROWS:
        raise SystemExit(f"--tokens: the routing launch takes at most {ROUTER_MAX_ROWS} rows")
    launches = [RouterLaunch(*k) for k in itertools.product(args.max_slices, args.min_rows, args.warps)]
    device = torch.cuda.get_device_properties(0)
    setup = {"device": device.name, "sms": device.multi_processor_count}
    print(json.dumps({"setup": setup}), flush=True)
    for name, tokens in itertools.product(args.shapes, args.tokens):
        print(json.dumps(sweep(name, tokens, launches)), flush=True)


if __name__ == "__main__":
    main()
