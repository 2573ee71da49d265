"""The split-KV decode kernel alone, over how many splits each (sequence, KV head) is cut into:
microseconds a call and achieved K/V GB/s, per batch size and context-length range.

    PYTHONPATH=. python3 bench/decode_splits.py [--cases 16:64:2500 64:64:2500 ...] [--splits 1 2 4 8 16]
        [--kv-cache-dtype fp8] [--sweep]

Setup (in every line): one CUDA device, bf16 queries and K/V cache (`--kv-cache-dtype fp8`:
float8 e4m3 K/V, as the engine's flag stores it), the 8B shape's attention (32 query heads, 8 KV
heads of 128), block size 16, each row's context length uniform in the case's range, its blocks
shuffled over the pool; 20 calls captured in a CUDA graph, the median of 5 replays. Engine today: splits
= `num_splits_for(rows, kv_heads)`, fixed when a decode graph is captured (whatever the context
lengths it will replay over): the sweep shows what that costs at long and short contexts.
`--sweep`: at the engine's split count, the kernel's launch instead (`DecodeTiling`: context
tokens a tile, warps, pipeline stages, FP8 widened to float16), the engine's marked.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json

import torch

from bench.allreduce import graph_us
from model_service.kernels.paged_attention import (
    FP8,
    DecodeTiling,
    decode_tiling,
    num_splits_for,
    paged_decode_attention,
)

HEADS, KV_HEADS, DIM, BLOCK = 32, 8, 128, 16


def case(rows: int, lo: int, hi: int, g: torch.Generator, kv: torch.dtype) -> tuple[torch.Tensor, ...]:
    """(q, k_cache, v_cache, block table, lengths) for `rows` sequences of lo..hi tokens."""
    lens = torch.randint(lo, hi + 1, (rows,), generator=g)
    blocks = (lens + BLOCK - 1) // BLOCK
    perm = torch.randperm(int(blocks.sum()), generator=g)
    table = torch.zeros(rows, int(blocks.max()), dtype=torch.long)
    starts = torch.cumsum(blocks, 0) - blocks
    for i, (start, n) in enumerate(zip(starts.tolist(), blocks.tolist(), strict=True)):
        table[i, :n] = perm[start : start + n]
    k_cache, v_cache = (torch.randn(len(perm) * BLOCK, KV_HEADS, DIM, generator=g) for _ in "kv")
    k_cache, v_cache = k_cache.to("cuda", kv), v_cache.to("cuda", kv)
    q = torch.randn(rows, HEADS, DIM, generator=g).to("cuda", torch.bfloat16)
    return q, k_cache, v_cache, table.cuda(), lens.cuda()


def tilings(kv: torch.dtype) -> list[DecodeTiling]:
    """Tiles of 32-128 tokens, 4 or 8 warps, 2 or 3 stages; for an FP8 cache each widened to
    bfloat16 and to float16. (Transposed products, K q^T and V^T P^T so that the tile's tokens
    are the MMA's rows, were no faster in 2026-12-02 y's sweep and are gone.)"""
    widen = (False, True) if kv == FP8 else (False,)
    knobs = itertools.product((32, 64, 128), (4, 8), (2, 3), widen)
    return [DecodeTiling(*k) for k in knobs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="*", default=["16:64:2500", "64:64:2500", "256:64:2500", "64:128:192",
                                                     "1:1000:1000"], help="rows:min_len:max_len")  # fmt: skip
    ap.add_argument("--splits", type=int, nargs="*", default=[1, 2, 4, 8, 16])
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    ap.add_argument("--sweep", action="store_true", help="tilings at the engine's split count")
    args = ap.parse_args()
    from triton.runtime.errors import OutOfResources  # CUDA machines only

    g = torch.Generator().manual_seed(0)
    kv = FP8 if args.kv_cache_dtype == "fp8" else torch.bfloat16
    setup = {"device": torch.cuda.get_device_name(), "dtype": "bfloat16",
             "kv_cache_dtype": args.kv_cache_dtype, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": DIM,
             "block_size": BLOCK}  # fmt: skip
    head = f"{'rows':>5} {'context':>10} {'splits':>6} {'tiling':>16} {'us':>8} {'GB/s':>7}"
    lines = [f"{head}  (*: the engine's)"]
    for spec in args.cases:
        rows, lo, hi = (int(x) for x in spec.split(":"))
        inputs = case(rows, lo, hi, g, kv)
        kv_gb = int(inputs[-1].sum()) * KV_HEADS * DIM * 2 * kv.itemsize / 1e9
        want = paged_decode_attention(*inputs, BLOCK, DIM**-0.5, None, 1)
        engine = (num_splits_for(rows, KV_HEADS), decode_tiling(kv))
        runs = [(engine[0], t) for t in tilings(kv)] if args.sweep else [(n, engine[1]) for n in args.splits]
        for splits, tiling in runs:
            call = functools.partial(
                paged_decode_attention, *inputs, BLOCK, DIM**-0.5, None, splits, tiling=tiling
            )
            try:
                assert (call().float() - want.float()).abs().max() < 2e-2, "the launches disagree"
            except OutOfResources as e:  # a tiling past the shared memory
                print(json.dumps({"bench": "decode_splits", "tiling": tiling._asdict(), "error": str(e)}))
                continue
            us = graph_us(call, per_graph=20, iters=5)
            chosen = (splits, tiling) == engine
            line = {"bench": "decode_splits", "rows": rows, "context": [lo, hi], "splits": splits,
                    "tiling": tiling._asdict(), "us": round(us, 1), "kv_gb_s": round(kv_gb / us * 1e6),
                    "engine_choice": chosen}  # fmt: skip
            print(json.dumps({**line, **setup}), flush=True)
            mark = " *" if chosen else ""
            knobs = "{}/{}w/{}s{}".format(*tiling[:3], "/f16" if tiling.f16 else "")
            lines.append(
                f"{rows:5d} {lo:4d}-{hi:5d} {splits:6d} {knobs:>16} {us:8.1f} {kv_gb / us * 1e6:7.0f}{mark}"
            )
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
