"""One MoE layer's experts: the fused Triton kernels (kernels/fused_moe.py: alignment, gate_up +
SiLU, down and the combine), the grouped path (two grouped_mm launches, no loop over experts) and the
reference (one matmul pair per expert that has tokens), at Qwen3-30B-A3B's shapes.

Setup (printed in every line): random weights of the real shapes (128 experts, top-8,
H=2048, I=768; no router: each token's experts drawn uniformly, weights a softmax of random
logits), T tokens, the device and dtype below. Times are the median of `--iters` calls after a
warm-up; "graph" is the grouped path replayed from a CUDA graph, as decode steps run it, and
"fused_graph" the fused kernels so (what `fused_experts` runs up to FUSED_MAX_ROWS_PER_EXPERT rows
an expert).
With `--sweep`, instead: "fused_graph" over a grid of tilings, 16-row ones for decode sizes and
64- or 128-row ones for prefill sizes (`path`: fused_graph/m<block_m>/n<gate_up block_n>x<down
block_n>/k<block_k>/s<stages>/w<warps>/split<K slices>), to tune `fused_moe_config`; at one token
also the GEMVs (kernels/expert_gemv.py) over their tilings (`path`: gemv/n<columns>k<K step>w<warps>
for gate_up, then for down), to tune `expert_gemv.engine_tilings`.
`weight_gbps` = bytes of the experts hit / time: against the card's bandwidth it says how close a
decode-sized call is to reading its weights once; `tflops` = the experts' matrix FLOPs / time,
and `fraction_of_bf16_peak` that over the H200's dense bf16 peak (989 TFLOP/s): for prefill-sized
calls (`--tokens 2048 8192`) it says how close the grouped GEMMs run to the matrix rate. Prints one
JSON line per (T, path).

With `--engine`, instead: decode tokens/s of the whole engine on a Qwen3-30B-A3B-shaped model
(48 layers, every one MoE; random bf16 weights, ~61 GB) at `--batches`, with CUDA graphs and
eagerly, measured as bench/gpu.py measures it (prefill excluded), on one GPU or over `--tp`
GPUs (experts tensor-parallel, or whole experts per rank with `--enable-expert-parallel`);
`active_gb_s` = bytes of the weights one token reads at batch 1 (attention, 8 experts a layer,
embeddings row, LM head: `step_bytes` without K/V) x tokens/s; at every batch,
`fraction_of_copy_bandwidth` = the step's floor bytes (`step_bytes`: the experts a step's
tokens are expected to hit under uniform routing, E x (1 - (1 - k/E)^batch) a layer, plus
attention, LM head and K/V) x steps/s over the card's measured copy bandwidth. `--profile B`:
device time per kernel of 8 decode steps at batch B. `--quantization fp8`: the experts in e4m3
with a scale per expert and output row (W8A16 in the fused kernels), and with `--engine` the
model quantized as the engine's `--quantization fp8` does it (attention projections W8A8 too);
bytes counted at one a weight.

    python bench/moe.py [--tokens 1 64 512] [--device cuda] [--dtype bfloat16]
    python bench/moe.py --device cpu --dtype float32 --experts 16 --hidden 256 --inter 128  # a smoke run
    python bench/moe.py --tokens 1 64 --sweep  # fused tilings
    python bench/moe.py --engine [--batches 1 16 64] [--layers 48] [--tp 2 [--enable-expert-parallel]]
                        [--profile 1] [--quantization fp8]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import statistics
import time
from collections.abc import Callable

import torch

from bench.gpu import copy_bandwidth, decode_tok_s, kernel_profile, quantized, random_module
from model_service.engine.config import EngineConfig
from model_service.engine.engine import Engine
from model_service.kernels.expert_gemv import ExpertGemvTiling, engine_tilings, expert_gemv
from model_service.kernels.experts import experts_grouped, experts_path, experts_reference
from model_service.kernels.fused_moe import (
    ExpertScales,
    FusedMoeConfig,
    fused_counters,
    fused_moe,
    fused_moe_config,
    fused_moe_supported,
)
from model_service.models.config import LayerKind, ModelConfig
from model_service.models.fp8_linear import quantize_stack
from model_service.models.loader import LoadedModel
from model_service.models.moe import StackedExperts
from model_service.startup import configure_process


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
    scales = None
    if args.quantization == "fp8":  # as `--quantization fp8` stores experts (`quantize_experts`)
        (gate_up, gate_up_scale), (down, down_scale) = quantize_stack(gate_up), quantize_stack(down)
        scales = ExpertScales(gate_up_scale, down_scale)
    hit = ids.unique().numel()
    weight_bytes = hit * 3 * h * inter * gate_up.element_size()
    paths: dict[str, Callable[[], object]] = {}
    arrivals = torch.zeros(fused_counters(tokens, h), dtype=torch.int32, device=device)  # a layer's own
    if args.sweep:
        from triton.runtime.errors import OutOfResources  # CUDA machines only

        for cfg in sweep_configs(tokens, args, gate_up.element_size()):
            name = (f"fused_graph/m{cfg.block_m}/n{cfg.gate_up_block_n}x{cfg.down_block_n}/k{cfg.block_k}"
                    f"/s{cfg.num_stages}/w{cfg.num_warps}/split{cfg.gate_up_split}"
                    f"{'/gemv' if cfg.gemv else ''}")  # fmt: skip
            fused = functools.partial(fused_moe, x, gate_up, down, ids, weights, cfg, arrivals, scales)
            try:
                paths[name] = graphed(fused)
            except OutOfResources as error:  # a tiling past the shared memory: say so, go on
                row = {"bench": "moe_experts", "path": name, "tokens": tokens, "error": str(error)}
                print(json.dumps(row), flush=True)
        if tokens == 1:
            up_scale, down_scale = (scales.gate_up, scales.down) if scales is not None else (None, None)
            for tilings in gemv_tilings(h, inter, k):
                gemv = functools.partial(
                    expert_gemv, x, gate_up, down, ids, weights, up_scale, down_scale, tilings=tilings
                )
                name = "gemv/" + "/".join(f"n{t.block_n}k{t.block_k}w{t.num_warps}" for t in tilings)
                paths[name] = graphed(gemv)
    else:
        paths["reference"] = lambda: experts_reference(x, gate_up, down, ids, weights, scales)
        if scales is None:
            paths["grouped"] = lambda: experts_grouped(x, gate_up, down, ids, weights)
            if device.type == "cuda":
                paths["graph"] = graphed(paths["grouped"])
        if fused_moe_supported(gate_up.dtype, device):
            paths["fused"] = lambda: fused_moe(
                x, gate_up, down, ids, weights, arrivals=arrivals, scales=scales
            )
            paths["fused_graph"] = graphed(paths["fused"])
    setup = {"experts": experts, "top_k": k, "hidden": h, "inter": inter, "device": args.device,
             "dtype": args.dtype, "quantization": args.quantization, "experts_hit": hit}  # fmt: skip
    rows = []
    for name, fn in paths.items():
        seconds = timed(fn, args.iters, device)
        gbps = round(weight_bytes / seconds / 1e9, 1)
        tflops = 6 * tokens * k * h * inter / seconds / 1e12  # gate_up's 2 x 2 I H and down's 2 I H a pair
        rows.append({"bench": "moe_experts", "path": name, "tokens": tokens, **setup,
                     "ms": round(seconds * 1e3, 4), "weight_gbps": gbps, "tflops": round(tflops, 1),
                     "fraction_of_bf16_peak": round(tflops / BF16_PEAK_TFLOPS, 3)})  # fmt: skip
    return rows


BF16_PEAK_TFLOPS = 989.0  # H200 (SXM) dense bf16 tensor-core peak


def sweep_configs(tokens: int, args: argparse.Namespace, item_bytes: int) -> list[FusedMoeConfig]:
    """The engine's tiling for `tokens` (`fused_moe_config`) with gate_up's K in 1-8 slices (bf16:
    2 and 3 slices at 2 and 3 stages too), then 16-row tilings around it: column blocks (64 /
    128), K blocks (128 / 256 with e4m3 weights) and warps (4 / 8), in the stages that fit. Past
    sweeps (2026-12-02 v, x): bf16 64 x 64 columns and K 128 at one token; e4m3 the same at 8
    warps, K 256 and swapped operands worse."""
    chosen = fused_moe_config(
        tokens, args.top_k, args.experts, args.hidden, args.inter, item_bytes=item_bytes
    )
    if chosen.block_m > 16:
        return [chosen, *prefill_configs(item_bytes)]
    tiled = dataclasses.replace(chosen, gemv=False)  # at one token the chosen path is the GEMVs
    splits = [dataclasses.replace(tiled, gate_up_split=s) for s in (1, 2, 3, 4, 6, 8)]
    if item_bytes == 2:  # bf16's four stages hold one program an SM: split with fewer (lead of x)
        splits += [dataclasses.replace(tiled, gate_up_split=s, num_stages=n) for s in (2, 3) for n in (2, 3)]
    widths = ((64, 64), (64, 128), (128, 128))
    k_blocks = (128, 256) if item_bytes == 1 else (128,)
    grid = [(k, g, d, w) for k in k_blocks for g, d in widths for w in (4, 8)]
    tilings = [
        FusedMoeConfig(16, gate_up_n, down_n, block_k, stages, warps)
        for block_k, gate_up_n, down_n, warps in grid
        if (stages := fitting_stages(block_k, gate_up_n, item_bytes)) >= 2
    ]
    return list(dict.fromkeys([chosen, *splits, *tilings]))


def gemv_tilings(hidden: int, inter: int, top_k: int) -> list[tuple[ExpertGemvTiling, ExpertGemvTiling]]:
    """One-token GEMV tilings (kernels/expert_gemv.py): the engine's pair first, then gate_up's
    columns a program (2-16), K step and warps with down's kept, and down's with gate_up's kept;
    tiles of at most 32K weight elements."""
    engine = engine_tilings(hidden, inter, top_k)

    def grid(k: int, rows: int) -> list[ExpertGemvTiling]:
        steps = [s for s in (128, 256, 512, 1024, 2048) if s <= triton_next_pow2(k)]
        cells = itertools.product((2, 4, 8, 16), steps, (4, 8))
        return [ExpertGemvTiling(n, s, w) for n, s, w in cells if rows * n * s <= 32768]

    ups = [(t, engine[1]) for t in grid(hidden, 2)]
    downs = [(engine[0], t) for t in grid(inter, triton_next_pow2(top_k))]
    return list(dict.fromkeys([engine, *ups, *downs]))


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def prefill_configs(item_bytes: int) -> list[FusedMoeConfig]:
    """Tilings for prefill-sized calls (more than 16 rows an expert): 64- and 128-row blocks, K
    32 / 64, 128 columns, 3 or 4 stages where they fit, 4 / 8 warps (2026-12-02 y: the engine's
    64 x 128 / K 32 / 3 stages ran Qwen3-30B-A3B's experts at 19-26% of the bf16 peak)."""
    grid = itertools.product((64, 128), (32, 64), (3, 4), (4, 8))
    return [
        FusedMoeConfig(block_m, 128, 128, block_k, stages, warps)
        for block_m, block_k, stages, warps in grid
        if stages <= fitting_stages(block_k, 128, item_bytes, block_m)
    ]


def fitting_stages(
    block_k: int, gate_up_n: int, item_bytes: int, block_m: int = 16, shared: int = 220_000
) -> int:
    """Pipeline stages (at most 4) whose tiles fit the shared memory: gate_up's two weight tiles
    and a `block_m`-row bf16 activation tile a stage."""
    return min(4, shared // (2 * block_k * gate_up_n * item_bytes + block_m * block_k * 2))


QWEN3_30B_A3B = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_heads": 32,
    "num_kv_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
}


def hit_fraction(cfg: ModelConfig, batch: int) -> float:
    """The share of a layer's experts that `batch` tokens are expected to hit under uniform
    routing: 1 - (1 - k/E)^batch."""
    return 1 - (1 - cfg.num_experts_per_tok / cfg.num_experts) ** batch


def step_bytes(cfg: ModelConfig, batch: int, context: int, weight_bytes: int = 2) -> float:
    """Bytes a decode step of `batch` tokens at `context` must move at least: attention and
    router weights, the experts its tokens are expected to hit (uniform routing), the LM head,
    the batch's embedding rows and K/V, in bf16 but for attention's and the experts' weights
    (`weight_bytes` each: 1 in FP8)."""
    e = cfg.num_experts
    hit = e * hit_fraction(cfg, batch)
    attention = cfg.hidden_size * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    quantized = attention + hit * 3 * cfg.moe_intermediate_size * cfg.hidden_size
    kv = batch * context * 2 * cfg.num_kv_heads * cfg.head_dim
    plain = cfg.num_layers * (e * cfg.hidden_size + kv) + (cfg.vocab_size + batch) * cfg.hidden_size
    return 2 * plain + weight_bytes * cfg.num_layers * quantized


def qwen3_30b_shape(layers: int) -> LoadedModel:
    """Seeded random weights on the current CUDA device: every tensor-parallel rank builds the same."""
    kinds = [LayerKind(moe=True)] * layers
    cfg = ModelConfig(
        family="qwen3_moe", num_layers=layers, rms_norm_eps=1e-6, max_position_embeddings=8192,
        rope_theta=1e6, qk_norm=True, norm_topk_prob=True, layer_kinds=kinds, **QWEN3_30B_A3B,
    )  # fmt: skip
    return LoadedModel("random-qwen3-30b-a3b", cfg, random_module(cfg), None)


def engine_decode(args: argparse.Namespace) -> None:
    loaded = qwen3_30b_shape(args.layers)
    loaded.source = functools.partial(qwen3_30b_shape, args.layers)
    fp8 = args.quantization == "fp8"
    loaded = quantized(loaded) if fp8 else loaded
    cfg, item = loaded.config, 1 if fp8 else 2
    setup = {"model": "qwen3-30b-a3b-shape", "layers": args.layers, "dtype": "bfloat16",
             "quantization": args.quantization, "device": torch.cuda.get_device_name(), "prompt_len": 128,
             "new_tokens": 64, "tp": args.tp, "expert_parallel": args.enable_expert_parallel}  # fmt: skip
    bandwidth = copy_bandwidth()
    experts_dtype = next(
        m for m in loaded.module.modules() if isinstance(m, StackedExperts)
    ).gate_up_proj.dtype
    for eager in (False, True):
        config = EngineConfig(
            device="cuda", dtype="bfloat16", max_num_seqs=max(args.batches), max_loras=0,
            enforce_eager=eager, kv_cache_memory_bytes=20 << 30, max_model_len=8192,
            tensor_parallel_size=args.tp, enable_expert_parallel=args.enable_expert_parallel,
        )  # fmt: skip
        engine = Engine(config, loaded=loaded)
        for batch in args.batches:
            rate = decode_tok_s(engine, batch, 128, 64, cfg.vocab_size)
            system = "spindle-eager" if eager else "spindle"
            line = {"bench": "moe_engine", "system": system, "batch": batch}
            k, e = cfg.num_experts_per_tok, cfg.num_experts
            line["experts_path"] = experts_path(batch, k, e, experts_dtype, torch.device("cuda"))
            line["decode_tokens_per_s"] = round(rate, 1)
            if batch == 1:
                line["active_gb_s"] = round(step_bytes(cfg, 1, 0, item) * rate / 1e9)  # weights alone
            floor = step_bytes(cfg, batch, 128 + 32, item)
            line["fraction_of_copy_bandwidth"] = round(floor * rate / batch / 1e9 / bandwidth, 3)
            print(json.dumps({**line, **setup}), flush=True)
        if args.profile and not eager:
            print(kernel_profile(engine, args.profile, 128, cfg.vocab_size), flush=True)
        if args.tp > 1:  # one tensor-parallel engine per process at a time
            engine.executor.teardown()


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
    ap.add_argument("--sweep", action="store_true", help="the fused kernels over a grid of tilings")
    ap.add_argument("--engine", action="store_true", help="whole-engine decode on a Qwen3-30B-A3B shape")
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 16, 64])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--profile", type=int, default=0, metavar="B", help="--engine: kernel times at batch B")
    ap.add_argument("--tp", type=int, default=1, help="--engine: tensor-parallel ranks (GPUs)")
    ap.add_argument(
        "--enable-expert-parallel", action="store_true", help="--engine with --tp: whole experts per rank"
    )
    ap.add_argument(
        "--quantization", default="none", choices=["none", "fp8"], help="experts (and --engine's model)"
    )
    args = ap.parse_args()
    if args.quantization == "fp8" and args.tp > 1:
        ap.error("--quantization fp8 runs on one GPU here (tensor-parallel ranks rebuild the bf16 model)")
    if args.engine:
        engine_decode(args)
        return
    for tokens in args.tokens:
        for row in bench(args, tokens):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    configure_process()
    main()
