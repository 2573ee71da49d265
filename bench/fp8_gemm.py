"""One FP8 projection's time on CUDA by scale layout: per channel (`--quantization fp8`:
`torch._scaled_mm` with row-wise scales, activations quantized by the Triton launch) against per
row and 128 columns (`fp8-g128`: 1x128 block scaling on both operands, activations quantized by
torch ops) and against the bf16 weight, at the 8B model's projection shapes. Each product in a
CUDA graph, replayed over weight copies that together outgrow the L2 cache (so every replay
reads its weight from HBM, as a decode step does). Prints one JSON line per shape, rows and
layout, then a short table.

    python bench/fp8_gemm.py [--rows 16 64 256 2048]
"""

from __future__ import annotations

import argparse
import json

import torch

from model_service.kernels.fp8_gemm import ActivationQuant, fp8_linear, has_block_scaled_mm, quantize_groups

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}


def time_graph(fn, copies: int, iters: int = 20) -> float:
    """Microseconds a call of fn(i) takes, each of `copies` calls captured in one graph."""
    for i in range(copies):
        fn(i)  # warm-up (autotuning, workspace) outside the capture
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


def layouts(w: torch.Tensor, copies: int) -> dict[str, list[tuple[torch.Tensor, torch.Tensor, int]]]:
    """`copies` copies of w quantized per channel and per row and 128 columns: (e4m3, scales, group)."""
    k = w.shape[1]
    out = {}
    for layout, group in (("fp8", k), ("fp8-g128", 128)):
        q, scale = quantize_groups(w, group)
        out[layout] = [(q.clone(), scale.clone(), group) for _ in range(copies)]
    return out


def time_rows(x: torch.Tensor, weights: dict, bf16: list[torch.Tensor]) -> dict[str, float]:
    """Microseconds of x's product with each layout's weight (and the bf16 one)."""
    us = {"bf16": time_graph(lambda i: x @ bf16[i].T, len(bf16))}
    for layout, ws in weights.items():
        acts = ActivationQuant("dynamic", ws[0][2])
        us[layout] = time_graph(lambda i, ws=ws, a=acts: fp8_linear(x, *ws[i], None, a), len(ws))
    return us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="*", default=[16, 64, 256, 2048])
    args = ap.parse_args()
    setup = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
             "block_scaled_mm": has_block_scaled_mm(torch.device("cuda"))}  # fmt: skip
    table = []
    for name, (k, n) in SHAPES.items():
        copies = max(2, (200 << 20) // (k * n))  # > 200 MB of e4m3 weights: past the L2 cache
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
        weights, bf16 = layouts(w, copies), [w.clone() for _ in range(max(2, copies // 2))]
        for rows in args.rows:
            us = time_rows(torch.randn(rows, k, device="cuda", dtype=torch.bfloat16), weights, bf16)
            for layout, t in us.items():
                line = {"bench": "fp8_gemm", "shape": name, "k": k, "n": n, "rows": rows, "layout": layout}
                print(json.dumps({**line, "us": round(t, 2), **setup}))
            table.append((name, rows, us))
        del weights, bf16
        torch.cuda.empty_cache()
    print(f"{'shape':8} {'rows':>5} {'bf16 us':>8} {'fp8 us':>8} {'g128 us':>8} {'g128/fp8':>8}")
    for name, rows, us in table:
        print(f"{name:8} {rows:5d} {us['bf16']:8.1f} {us['fp8']:8.1f} {us['fp8-g128']:8.1f} "
              f"{us['fp8-g128'] / us['fp8']:8.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
