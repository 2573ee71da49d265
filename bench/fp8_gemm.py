"""One projection's time on CUDA as the engine runs it, by weight format: bf16 (stored
transposed), per-channel FP8 (`--quantization fp8`) and per row and 128 columns (`fp8-g128`), at
the 8B model's projection shapes. Each layer is the engine's own (`PackedLinear`,
`Fp8Linear.quantized`, then `store_weights_transposed`), so rows <= 16 take the few-row kernels
(the one-row GEMV at 1) and more rows cuBLAS / `torch._scaled_mm` (row-wise or 1x128 block
scales), the activations quantized by the layer's Triton launch (in a decode step their
producer quantizes them instead). Each product in a CUDA graph, replayed over layer copies that
together outgrow the L2 cache (so every replay reads its weight from HBM, as a decode step
does). Prints one JSON line per shape, rows and format, then a short table.

`--sweep-gemv`: the one-row e4m3 GEMV (`fp8_gemv`) over a grid of tilings instead, each checked
against the dequantized product, per shape and format: the engine's choice (`gemv_config`) and
the five fastest, one JSON line each.

    python bench/fp8_gemm.py [--rows 1 16 64 256 2048]
    python bench/fp8_gemm.py --sweep-gemv [--shapes o qkv down]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
from collections.abc import Callable
from dataclasses import asdict

import torch
from torch import nn

from model_service.kernels.fp8_gemm import dequantize_groups, has_block_scaled_mm
from model_service.kernels.skinny_gemm import GemvConfig, fp8_gemv, gemv_config
from model_service.models.fp8_linear import Fp8Linear
from model_service.models.layers import PackedLinear, store_weights_transposed
from model_service.models.quantization import ONLINE_SCHEMES

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
FORMATS = ("bf16", *ONLINE_SCHEMES)


def time_graph(fn: Callable[[int], object], copies: int, iters: int = 20) -> float:
    """Microseconds a call of fn(i) takes, each of `copies` calls captured in one graph."""
    for i in range(copies):
        fn(i)  # warm-up (compiles, workspace, counters) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn(i)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (iters * copies)


def layer(w: torch.Tensor, fmt: str) -> nn.Module:
    """w [n, k] as the engine holds a projection in `fmt`."""
    n, k = w.shape
    linear = PackedLinear(k, {"proj": n}, bias=False).to(device=w.device, dtype=w.dtype)
    linear.weight.data.copy_(w)
    out = linear if fmt == "bf16" else Fp8Linear.quantized(linear, ONLINE_SCHEMES[fmt])
    store_weights_transposed(out)
    return out


def copies_of(k: int, n: int, fmt: str) -> int:
    """Layer copies that outgrow the L2 cache: > 200 MB of weights."""
    return max(2, (200 << 20) // (k * n * (2 if fmt == "bf16" else 1)))


def time_layers(args: argparse.Namespace, setup: dict) -> None:
    table = []
    for name in args.shapes:
        k, n = SHAPES[name]
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
        layers = {fmt: [layer(w, fmt) for _ in range(copies_of(k, n, fmt))] for fmt in FORMATS}
        for rows in args.rows:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            us = {
                fmt: time_graph(functools.partial(call_layer, ls, x), len(ls)) for fmt, ls in layers.items()
            }
            for fmt, t in us.items():
                tb_s = round(n * k * (2 if fmt == "bf16" else 1) / t / 1e6, 2)  # weight bytes a us
                line = {"bench": "fp8_gemm", "shape": name, "k": k, "n": n, "rows": rows, "format": fmt}
                print(json.dumps({**line, "us": round(t, 2), "tb_s": tb_s, **setup}))
            table.append((name, rows, us))
        del layers
        torch.cuda.empty_cache()
    print(f"{'shape':8} {'rows':>5} {'bf16 us':>8} {'fp8 us':>8} {'g128 us':>8} {'g128/fp8':>8}")
    for name, rows, us in table:
        print(f"{name:8} {rows:5d} {us['bf16']:8.1f} {us['fp8']:8.1f} {us['fp8-g128']:8.1f} "
              f"{us['fp8-g128'] / us['fp8']:8.2f}")  # fmt: skip


def call_layer(layers: list[nn.Module], x: torch.Tensor, i: int) -> torch.Tensor:
    return layers[i](x)


def gemv_grid(k: int, n: int) -> list[GemvConfig]:
    """The engine's tiling, then tiles of 8-32 KB in 1-4 K slices, 4 or 8 warps, 2 or
    4 stages (each tiling once)."""
    tiles = ((4, 2048), (8, 1024), (8, 2048), (16, 512), (16, 1024), (32, 256), (32, 512))
    grid = itertools.product(tiles, (1, 2, 4), (4, 8), (2, 4))
    configs = [GemvConfig(bn, bk, split, warps, stages) for (bn, bk), split, warps, stages in grid]
    whole = [c for c in configs if n % c.block_n == 0 and k % (c.split * c.block_k) == 0]
    return list(dict.fromkeys([gemv_config(k), *(c for c in whole if c.split == 1 or n % 64 == 0)]))


def call_gemv(
    layers: list[Fp8Linear], x: torch.Tensor, arrivals: torch.Tensor, cfg: GemvConfig, i: int
) -> torch.Tensor:
    return fp8_gemv(x, layers[i].weight, None, layers[i].weight_scale, arrivals, cfg)


def sweep_format(w: torch.Tensor, fmt: str) -> list[tuple[float, GemvConfig]]:
    """(us, tiling) of one row times w in `fmt` over `gemv_grid`; a tiling whose result is off
    is printed and left out."""
    n, k = w.shape
    layers = [layer(w, fmt) for _ in range(copies_of(k, n, fmt))]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    arrivals = torch.zeros(n // 64, dtype=torch.int32, device="cuda")
    exact = x.float() @ dequantize_groups(layers[0].weight, layers[0].weight_scale, layers[0].group).T
    timed = []
    for cfg in gemv_grid(k, n):
        call = functools.partial(call_gemv, layers, x, arrivals, cfg)
        error = float((call(0).float() - exact).abs().max() / exact.abs().max())
        if error > 1e-2:
            print(
                json.dumps(
                    {"bench": "fp8_gemv", "format": fmt, "n": n, "k": k, **asdict(cfg), "error": error}
                )
            )
            continue
        timed.append((time_graph(call, len(layers)), cfg))
    return timed


def sweep_gemv(args: argparse.Namespace, setup: dict) -> None:
    for name in args.shapes:
        k, n = SHAPES[name]
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
        for fmt in ONLINE_SCHEMES:
            timed = sweep_format(w, fmt)
            line = {"bench": "fp8_gemv", "shape": name, "k": k, "n": n, "format": fmt, **setup}
            engine = [t for t in timed if t[1] == gemv_config(k)]  # none if its result was off
            ranked = [("engine", *t) for t in engine]
            ranked += [(f"best{rank}", *t) for rank, t in enumerate(sorted(timed, key=lambda t: t[0])[:5], 1)]
            ranked += [("grid", *t) for t in timed] if args.every_tiling else []
            for role, us, cfg in ranked:
                tb_s = round(n * k / us / 1e6, 2)
                print(json.dumps({**line, "role": role, "us": round(us, 2), "tb_s": tb_s, **asdict(cfg)}))
            torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 16, 64, 256, 2048])
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--sweep-gemv", action="store_true", help="the one-row GEMV's tilings")
    ap.add_argument("--every-tiling", action="store_true", help="with --sweep-gemv: a line for each tiling")
    args = ap.parse_args()
    setup = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
             "block_scaled_mm": has_block_scaled_mm(torch.device("cuda"))}  # fmt: skip
    (sweep_gemv if args.sweep_gemv else time_layers)(args, setup)


if __name__ == "__main__":
    main()
