"""The LoRA kernels of one step on the 8B shape, per projection, against the base GEMM.

Setup: one H200 (CUDA only), bf16, Llama-3-8B projection shapes (q/k/v fused, o, gate/up fused,
down), `--adapters` distinct rank-`--rank` adapters in the arena (random weights, on all seven
projections or, with `--targets qv`, PEFT's default q and v: the other projections then show what
a projection no row's adapter targets costs). Three steps: `decode` (one row per adapter, the
per-row kernels a decode graph replays), `mixed` (those decode rows first, then a
`--chunk`-token prefill chunk of adapter 0, as the scheduler orders a mixed step: what
`LoraStepPlan` runs now, decode rows per row and the chunk as tiles) and `mixed-all-tiles` (the
same step with every row a tile, as before); then, on the decode step, gate_up's expand followed
by SiLU-mul against the fused `silu_mul_lora_rows` that decode steps and graphs run. Each result
is checked against the float32 reference, then timed with CUDA events (`--iters` calls in one
CUDA graph), one JSON line per step and projection, a table last.

    PYTHONPATH=. python3 bench/lora_kernels.py [--adapters 64] [--rank 16] [--targets all|qv]
        [--chunk 2048]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from model_service.engine.batch_builder import BatchBuilder, StepItem
from model_service.engine.seq_state import SequenceState
from model_service.kernels.lora import AdapterTable, aligned_up, lora_delta_reference
from model_service.kernels.lora_grouped import lora_tiles
from model_service.lora.layers import LoraStepPlan
from model_service.models.step import StepBatch, to_device

# in_features, output sizes of each fused projection of the 8B shape
PROJECTIONS = {
    "qkv": (4096, (4096, 1024, 1024)),
    "o": (4096, (4096,)),
    "gate_up": (4096, (14336, 14336)),
    "down": (14336, (4096,)),
}
BLOCK_SIZE = 16
TARGETS = {"all": None, "qv": {"qkv": (0, 2)}}  # parts each projection's adapters target (None: all)


def step_batch(slots: list[int], lengths: list[int], device: torch.device) -> StepBatch:
    """A step batch as the engine packs it (`BatchBuilder`): sequences of `lengths` new rows,
    each through LoRA slot `slots[i]`, on blocks of their own."""
    items, first_block = [], 0
    for i, (slot, n) in enumerate(zip(slots, lengths, strict=True)):
        blocks = list(range(first_block, first_block + -(-n // BLOCK_SIZE)))
        first_block += len(blocks)
        state = SequenceState(seq_id=i, block_table=blocks, num_computed=0)
        state.lora_slot = slot
        items.append(StepItem(state, [0] * n, 1))
    return BatchBuilder(BLOCK_SIZE, device).build(items)


def timed(fn, iters: int) -> float:
    """Microseconds of one `fn` on the device: `iters` calls captured in one CUDA graph, as a
    decode step replays them (timed eagerly, a call would measure the host's launches)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def adapter_table(name: str, args: argparse.Namespace, g: torch.Generator) -> AdapterTable:
    """`args.adapters` adapters of rank `args.rank` laid out in an arena as the engine lays them
    out (kernels/lora.py: A [rank, in], B rows `aligned_up(rank)` apart), on the parts of
    projection `name` that `--targets` names."""
    in_features, sizes = PROJECTIONS[name]
    wanted = TARGETS[args.targets]
    parts = range(len(sizes)) if wanted is None else wanted.get(name, ())
    rank, stride = args.rank, aligned_up(args.rank)
    per_part = [aligned_up(rank * in_features) + size * stride for size in sizes]
    entries = torch.zeros(args.adapters, len(sizes), 3, dtype=torch.long)
    cursor = 0
    for slot in range(args.adapters):
        for part in parts:
            entries[slot, part] = torch.tensor([cursor, cursor + aligned_up(rank * in_features), rank])
            cursor += per_part[part]
    weights = (torch.randn(max(cursor, 1), generator=g, device="cuda") * in_features**-0.5).to(torch.bfloat16)
    scaling = torch.full((args.adapters, len(sizes)), 2.0, device="cuda")
    return AdapterTable(weights, entries.cuda(), scaling, max_rank=max(16, 1 << (rank - 1).bit_length()))


def run_projection(name: str, batch: StepBatch, tiles_only: bool, args: argparse.Namespace) -> dict:
    in_features, sizes = PROJECTIONS[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    n, out = batch.num_tokens, sum(sizes)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)

    x, w = randn(n, in_features), randn(out, in_features, scale=in_features**-0.5)
    table = adapter_table(name, args, g)
    starts = tuple(itertools.accumulate(sizes[:-1], initial=0))
    plan = LoraStepPlan(use_kernels=True)
    plan.prepare(batch)
    if tiles_only:  # the plan before the decode rows were split off
        plan.lead, plan.tiles = 0, to_device(lora_tiles(batch.host_lora_slots), torch.device("cuda"))

    def lora(y: torch.Tensor) -> None:
        plan.expand(plan.shrink(x, table), y, table, starts)

    y = x @ w.T
    want, got = y.float(), y.clone()
    lora_delta_reference(x.float(), want, table, batch.lora_slots, sizes)
    lora(got)
    err = float((got.float() - want).norm() / max(float(want.norm()), 1e-30))
    return {
        "projection": name,
        "rows": n,
        "base_gemm_us": round(timed(lambda: x @ w.T, args.iters), 1),
        "lora_us": round(timed(lambda: lora(y), args.iters), 1),
        "rel_err": float(f"{err:.2e}"),
    }


def run_fused_activation(batch: StepBatch, args: argparse.Namespace) -> dict:
    """gate_up's LoRA expand and then SiLU-mul (what steps with row tiles run) against the
    activation with each row's delta added inside it (decode steps), the shrink's output given.
    Checked against each other."""
    from model_service.kernels.fused import silu_and_mul
    from model_service.kernels.lora import silu_mul_lora_rows

    sizes = PROJECTIONS["gate_up"][1]
    g = torch.Generator(device="cuda").manual_seed(1)
    n, out = batch.num_tokens, sum(sizes)
    y = torch.randn(n, out, generator=g, device="cuda").to(torch.bfloat16)
    table = adapter_table("gate_up", args, g)
    xa = torch.randn(n, 2 * table.max_rank, generator=g, device="cuda")
    starts = (0, sizes[0])
    plan = LoraStepPlan(use_kernels=True)
    plan.prepare(batch)

    def unfused(target: torch.Tensor) -> torch.Tensor:
        plan.expand(xa, target, table, starts)
        return silu_and_mul(target)

    def fused() -> torch.Tensor:
        return silu_mul_lora_rows(y, xa, table, plan.slots)

    want, got = unfused(y.clone()), fused()
    return {
        "projection": "gate_up+silu_mul",
        "rows": n,
        "unfused_us": round(timed(lambda: unfused(y.clone()), args.iters), 1),
        "fused_us": round(timed(fused, args.iters), 1),
        "rel_err": float(f"{float((got.float() - want.float()).norm() / want.float().norm()):.2e}"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapters", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", choices=list(TARGETS), default="all")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    decode_slots, cuda = list(range(args.adapters)), torch.device("cuda")
    mixed = ([*decode_slots, 0], [1] * args.adapters + [args.chunk], cuda)
    steps = {
        "decode": (step_batch(decode_slots, [1] * args.adapters, cuda), False),
        "mixed": (step_batch(*mixed), False),
        "mixed-all-tiles": (step_batch(*mixed), True),
    }
    setup = {"adapters": args.adapters, "rank": args.rank, "targets": args.targets, "chunk": args.chunk,
             "dtype": "bfloat16", "device": torch.cuda.get_device_name()}  # fmt: skip
    rows = []
    for step, (batch, tiles_only) in steps.items():
        for name in PROJECTIONS:
            result = {"bench": "lora_kernels", "step": step, **run_projection(name, batch, tiles_only, args)}
            print(json.dumps({**result, **setup}), flush=True)
            rows.append(result)
    print(f"\n{'step':<16} {'projection':<9} {'rows':>5} {'base us':>8} {'lora us':>8} {'rel err':>8}")
    for r in rows:
        print(
            f"{r['step']:<16} {r['projection']:<9} {r['rows']:>5} {r['base_gemm_us']:>8} "
            f"{r['lora_us']:>8} {r['rel_err']:>8.1e}"
        )
    fused = run_fused_activation(steps["decode"][0], args)
    print(json.dumps({"bench": "lora_kernels", "step": "decode", **fused, **setup}), flush=True)
    for step in steps:
        total = [r for r in rows if r["step"] == step]
        base, lora = sum(r["base_gemm_us"] for r in total), sum(r["lora_us"] for r in total)
        layers_ms = lora * 32 / 1000
        print(f"{step:<16} a layer: base {base:.0f} us, LoRA {lora:.0f} us, 32 layers {layers_ms:.2f} ms")
    print(
        f"{'decode':<16} gate_up expand + SiLU-mul {fused['unfused_us']} us, fused {fused['fused_us']} us"
        f" (rel err {fused['rel_err']:.1e})"
    )


if __name__ == "__main__":
    main()
