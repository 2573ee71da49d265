"""Output tokens/s of a serving workload at a fixed concurrency (issue 9's second benchmark):
Spindle against HF `transformers.generate` on the same shapes in the same run.

    PYTHONPATH=. python3 bench/serving.py [--concurrency 1 16 64 256] [--hf-concurrency 16 64] [--small]
        [--lora-adapters 64 [--lora-rank 16]] [--kv-cache-dtype fp8] [--profile 256:250:30]
        [--no-piecewise-graphs] [--step-times] [--rounds 2] [--host-profile 30]
        [--quantization fp8|fp8-g128 [--compare]] [--moe]

Workload: per concurrency C, `max(16, 4 * C)` requests (`--requests-per-slot`), prompt lengths
uniform in [64, 2,048] and output lengths uniform in [32, 512] (seeded, random token ids, EOS
ignored). Spindle runs closed-loop: C requests in flight and the next one admitted as soon as
one finishes, so prefill chunks and decode rows share steps as they do in service (mixed and
eager steps count here, unlike `bench/gpu.py`'s decode-only figures). HF has no continuous
batching: it runs the first `2 * C` requests of the same workload in arrival order, in static
batches of C padded on the left to the longest prompt and run to the longest output; only the
tokens each request asked for count. Both clocks include prefill; Spindle's runs come after
the pod's warm-up (`Engine.warm_up`: every decode graph captured) and a short closed loop that
compiles the prefill kernels (the first measured run would pay ~1 s a kernel variant). One
JSON line per (system, concurrency), then a table. Random bf16 weights of the 8B shape
(`--small`: SmolLM2's), one GPU. `--lora-adapters N` (issue 9's third benchmark) runs every
concurrency a second time in the same engine with request i through adapter i mod N (random
rank-16 weights on all seven projections) and reports `lora_over_base`; with `--rounds N` the
base and adapter runs alternate N times (other prompts each round) and a last line gives the
ratio over all rounds: the device tool's hosts drift within a call by more than the gaps
measured (0.848x then 0.823x for the same code, docs/performance-notes.md, session m).
`--quantization fp8` runs the same model with its projections quantized online (the engine's
`--quantization fp8`; systems named spindle-fp8...; `fp8-g128` likewise, spindle-fp8-g128...),
and `--compare` runs the bf16 model first in
the same run, with a last line per concurrency giving FP8's output tok/s over bf16's. `--moe`
serves Qwen3-30B-A3B's shape instead (48 layers, 128 experts of top-8, ~61 GB in bf16; 32 GiB of
K/V; no HF run, no adapters), e.g. with and without `--no-piecewise-graphs`.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import json
import math
import pstats
import sys
import time
from collections.abc import Callable, Sequence

import torch

from bench.gpu import (
    LLAMA3_8B,
    SMOLLM2,
    adapter_room,
    hf_llama,
    host_cpu,
    quantized,
    random_model,
    register_random_adapters,
)
from bench.moe import qwen3_30b_shape
from bench.step_times import StepTimes
from model_service.engine.config import EngineConfig
from model_service.engine.engine import Engine
from model_service.models.loader import LoadedModel
from model_service.models.quantization import ONLINE_SCHEMES
from model_service.startup import configure_process


def workload(n: int, vocab: int, seed: int, prompts: tuple[int, int], outputs: tuple[int, int]) -> list:
    """`n` (prompt token ids, output length) pairs, lengths uniform in the given closed ranges."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(prompts[0], prompts[1] + 1, (n,), generator=g).tolist()
    outs = torch.randint(outputs[0], outputs[1] + 1, (n,), generator=g).tolist()
    return [
        (torch.randint(3, vocab, (p,), generator=g).tolist(), o) for p, o in zip(lengths, outs, strict=True)
    ]


def spindle_serving(
    engine: Engine,
    requests: list,
    concurrency: int,
    adapters: Sequence[str] = (),
    before_step: Callable[[int], None] | None = None,
    failed: list[str] | None = None,
    admit_for_s: float | None = None,
) -> dict[str, float]:
    """Closed loop at `concurrency`: output tokens/s over the whole run, and the time to first
    token (median and p99) and time per output token after it (median, ms) of the requests.
    With `adapters`, request i goes through adapter i mod their number; `before_step(i)` runs
    before step i. A failed request raises, unless `failed` is given: then it is listed there
    ("id: error") and left out of the figures, so a run with failures still reports them. With
    `admit_for_s`, no request is admitted after that many seconds (those in flight finish)."""
    queue, submitted, first, done, errors = list(reversed(requests)), {}, {}, {}, {}
    start, steps = time.perf_counter(), 0
    while queue or engine.has_unfinished():
        if before_step is not None:
            before_step(steps)
        steps += 1
        if admit_for_s is not None and time.perf_counter() - start > admit_for_s:
            queue.clear()
        while queue and len(submitted) - len(done) < concurrency:
            prompt, n = queue.pop()
            adapter = adapters[len(submitted) % len(adapters)] if adapters else None
            r = {"prompt_token_ids": prompt, "max_tokens": n, "ignore_eos": True, "adapter": adapter}
            submitted[engine.add_request_dict(r)] = time.perf_counter()
        for out in engine.step():
            now = time.perf_counter()
            if out.error:
                if failed is None:
                    raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                errors[out.request_id] = out.error
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                done[out.request_id] = (now, len(out.token_ids))
    wall = time.perf_counter() - start
    if failed is not None:
        failed += [f"{r}: {e}" for r, e in errors.items()]
    ok = [r for r in submitted if r not in errors]
    ttft = [first[r] - submitted[r] for r in ok]
    tpot = [(done[r][0] - first[r]) / max(done[r][1] - 1, 1) for r in ok]
    return {
        "output_tokens_per_s": sum(done[r][1] for r in ok) / wall,
        "ttft_p50_ms": percentile(ttft, 50) * 1e3,
        "ttft_p99_ms": percentile(ttft, 99) * 1e3,
        "tpot_p50_ms": percentile(tpot, 50) * 1e3,
        "output_tokens": sum(done[r][1] for r in ok),
        "requests": len(submitted),
        "wall_s": wall,
    }


def percentile(values: list[float], q: float) -> float:
    """The `q`th percentile, linear between the two nearest ranks (numpy's default; the median
    at 50); nan for no values (every request failed)."""
    if not values:
        return float("nan")
    ordered, pos = sorted(values), q / 100 * (len(values) - 1)
    low, high = ordered[math.floor(pos)], ordered[math.ceil(pos)]
    return low + (high - low) * (pos - math.floor(pos))


def warm_up(engine: Engine, vocab: int, adapters: Sequence[str]) -> dict[str, float]:
    """What a pod does before it serves (`capture`), then `prime`. Returns what the capture cost."""
    cost = capture(engine)
    prime(engine, vocab, adapters)
    return cost


def capture(engine: Engine) -> dict[str, float]:
    """The pod's warm-up (every decode graph captured; nothing on the CPU): what it cost, in
    seconds and, on a GPU, GiB of device memory."""
    cuda = engine.executor.device.type == "cuda"
    free, start = torch.cuda.mem_get_info()[0] if cuda else 0, time.perf_counter()
    engine.warm_up()
    cost = {"capture_s": time.perf_counter() - start}
    if cuda:
        cost["capture_gib"] = (free - torch.cuda.mem_get_info()[0]) / 2**30
    return cost


def prime(
    engine: Engine,
    vocab: int,
    adapters: Sequence[str],
    prompts: tuple[int, int] = (64, 2048),
    concurrency: int = 64,
) -> None:
    """Prefill chunks and mixed steps, with the adapters' kernels too, so that no measured run
    pays a first use. Every adapter goes through once, so each is in its GPU slot as a pod
    serving them would have it: loaded during the measured run instead, the first uses of 56 of
    64 adapters stalled the engine 1.44 s (26 ms a load on the 8B shape, all seven
    projections), most of the LoRA ratio's run-to-run spread (docs/performance-notes.md, session k).
    With more adapters than slots, a `concurrency` of at most the slots keeps requests from
    waiting for one (and failing after `adapter_wait_timeout_s`)."""
    for names in ((), adapters) if adapters else ((),):
        n = max(8, len(names))
        spindle_serving(engine, workload(n, vocab, 99, prompts, (8, 16)), min(n, concurrency), names)


def hf_serving(hf: torch.nn.Module, requests: list, concurrency: int) -> dict[str, float]:
    """Static batches of `concurrency` in arrival order, each left-padded and run to its longest
    output; output tokens/s counts only the tokens each request asked for."""
    tokens, start = 0, time.perf_counter()
    for i in range(0, len(requests), concurrency):
        batch = requests[i : i + concurrency]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long, device="cuda")
        mask = torch.zeros_like(ids)
        for row, (prompt, _) in enumerate(batch):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        longest = max(n for _, n in batch)
        hf.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                    do_sample=False, pad_token_id=0)  # fmt: skip
        tokens += sum(n for _, n in batch)
    torch.cuda.synchronize()
    return {"output_tokens_per_s": tokens / (time.perf_counter() - start), "output_tokens": tokens}


def requests_at(args: argparse.Namespace, vocab: int, concurrency: int, round_: int = 0) -> list:
    """The workload of one concurrency and round (seeded by both): `--requests-per-slot`
    requests a slot. Rounds draw other prompts, so a round never hits the prefix cache that an
    earlier one left (64 GiB of K/V holds a whole round's prompts)."""
    n = max(16, args.requests_per_slot * concurrency)
    return workload(n, vocab, concurrency + 1000 * round_, *args.ranges)


def profile_steps(
    engine: Engine, requests: list, concurrency: int, skip: int, steps: int, adapters: Sequence[str] = ()
) -> None:
    """Device time per kernel (torch.profiler, CUPTI: graph replays included) and wall time per
    step over steps [skip, skip + steps) of the closed loop at `concurrency` (through `adapters`
    as `spindle_serving` routes them): where a serving step's time goes once prefill chunks and
    decode rows share steps."""
    from torch.profiler import ProfilerActivity, profile

    prof, clock = profile(activities=[ProfilerActivity.CUDA]), {}

    def before_step(i: int) -> None:
        if i == skip:
            torch.cuda.synchronize()
            prof.start()
            clock["start"] = time.perf_counter()
        elif i == skip + steps:
            torch.cuda.synchronize()
            clock["ms"] = (time.perf_counter() - clock["start"]) * 1e3 / steps
            prof.stop()

    spindle_serving(engine, requests, concurrency, adapters, before_step=before_step)
    if "ms" not in clock:
        raise SystemExit(f"the run ended before step {skip + steps}: profile fewer or earlier steps")
    lora = f", {len(adapters)} adapters" if adapters else ""
    ms = clock["ms"]
    print(f"\nconcurrency {concurrency}{lora}, steps {skip}-{skip + steps}: {ms:.1f} ms a step (wall)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=60))


def spindle_runs(loaded: LoadedModel, args: argparse.Namespace, report: Callable[..., None]) -> None:
    """Spindle at each concurrency; with `--lora-adapters N`, each run again with request i
    through adapter i mod N (rank `--lora-rank`, all seven projections), in the same engine."""
    n, vocab = args.lora_adapters, loaded.config.vocab_size
    profile = [int(x) for x in args.profile.split(":")] if args.profile else []
    top = max([*args.concurrency, *profile[:1]])
    engine = Engine(
        EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=top, max_loras=n,
                     lora_memory_bytes=adapter_room(loaded, n, args.lora_rank) if n else None,
                     max_cpu_loras=max(n, 1), max_lora_rank=args.lora_rank,
                     kv_cache_memory_bytes=(32 if args.moe else 64) << 30,
                     max_model_len=8192, kv_cache_dtype=args.kv_cache_dtype,
                     piecewise_graphs=args.piecewise_graphs),
        loaded=loaded,
    )  # fmt: skip
    adapters = register_random_adapters(engine, loaded.config, n, args.lora_rank) if n else []
    report("spindle-warm-up", 0, 0, warm_up(engine, vocab, adapters))
    if profile:  # the base model too, for a side-by-side table (a concurrency not measured below
        c, skip, steps = profile  # avoids prefix-cache hits from the profiled pass)
        for through in [(), adapters] if adapters else [()]:
            profile_steps(engine, requests_at(args, vocab, c), c, skip, steps, through)
    for c in args.concurrency:
        measure_rounds(engine, args, vocab, c, adapters, report)


def measure_rounds(
    engine: Engine, args: argparse.Namespace, vocab: int, c: int, adapters: Sequence[str], report: Callable
) -> None:
    """`--rounds` rounds at concurrency `c`, each the base model then the adapters on the same
    requests; with several, a last line with the ratio over all of them."""
    seconds: dict[str, list[float]] = {"base": [], "lora": []}
    for r in range(args.rounds):
        requests = requests_at(args, vocab, c, r)
        base = measured(engine, requests, c, (), args)
        report("spindle", c, len(requests), base | {"round": r})
        seconds["base"].append(base["output_tokens"] / base["output_tokens_per_s"])
        if adapters:
            lora = measured(engine, requests, c, adapters, args)
            ratio = lora["output_tokens_per_s"] / base["output_tokens_per_s"]
            lora |= {"lora_over_base": ratio, "lora_rank": args.lora_rank, "round": r}
            report(f"spindle-{len(adapters)}-loras", c, len(requests), lora)
            seconds["lora"].append(lora["output_tokens"] / lora["output_tokens_per_s"])
    if adapters and args.rounds > 1:  # the same tokens both ways: the ratio of the summed times
        overall = {"lora_over_base": sum(seconds["base"]) / sum(seconds["lora"]), "rounds": args.rounds}
        report(f"spindle-{len(adapters)}-loras-all-rounds", c, 0, overall)


def measured(
    engine: Engine, requests: list, concurrency: int, adapters: Sequence[str], args: argparse.Namespace
) -> dict[str, float]:
    """`spindle_serving`; with `--step-times` the run's steps by class after it
    (`bench/step_times.py`), with `--host-profile N` the N functions that held the host longest
    (cProfile, which slows Python down: a profiled run's own figures do not count). A step
    whose host time exceeds its device time waits on these."""
    with contextlib.ExitStack() as stack:
        steps = stack.enter_context(StepTimes(engine.executor)) if args.step_times else None
        profile = cProfile.Profile() if args.host_profile else None
        if profile is not None:
            stack.callback(profile.disable)
            profile.enable()
        result = spindle_serving(engine, requests, concurrency, adapters)
    for row in steps.classes() if steps is not None else []:
        line = {"bench": "serving_steps", "concurrency": concurrency, "adapters": len(adapters), **row}
        print(json.dumps(line), flush=True)
    if profile is not None:
        print(f"\nhost profile, concurrency {concurrency}, {len(adapters)} adapters:")
        pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(args.host_profile)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="*", default=[1, 16, 64, 256])
    hf_help = "HF generate's concurrencies (default 16 64; none with --moe)"
    ap.add_argument("--hf-concurrency", type=int, nargs="*", default=None, help=hf_help)
    ap.add_argument("--requests-per-slot", type=int, default=4)
    rounds_help = "base and adapter runs alternate this many times, other prompts each round"
    ap.add_argument("--rounds", type=int, default=1, help=rounds_help)
    ap.add_argument("--prompt-range", type=int, nargs=2, default=[64, 2048])
    ap.add_argument("--output-range", type=int, nargs=2, default=[32, 512])
    ap.add_argument("--small", action="store_true", help="SmolLM2's shape instead of the 8B one")
    ap.add_argument("--moe", action="store_true", help="Qwen3-30B-A3B's shape instead of the 8B one")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    ap.add_argument("--lora-adapters", type=int, default=0, help="also run through N distinct adapters")
    ap.add_argument("--lora-rank", type=int, default=16)
    profile_help = "first, device time per kernel over steps SKIP.. at concurrency C (and with the adapters)"
    ap.add_argument("--profile", default="", metavar="C:SKIP:STEPS", help=profile_help)
    host_help = "print the N functions that held the host longest in each run (cProfile)"
    ap.add_argument("--host-profile", type=int, default=0, metavar="N", help=host_help)
    ap.add_argument("--step-times", action="store_true", help="host and device time of each kind of step")
    ap.add_argument(
        "--piecewise-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="prefill and mixed steps as graphs too (the engine's default)",
    )
    ap.add_argument(
        "--quantization", default="none", choices=["none", *ONLINE_SCHEMES], help="the engine's flag"
    )
    ap.add_argument("--compare", action="store_true", help="with --quantization fp8: the bf16 model too")
    args = ap.parse_args()
    if args.compare and args.quantization == "none":
        ap.error("--compare compares --quantization fp8 (or fp8-g128) with bf16: give --quantization")
    if args.hf_concurrency is None:
        args.hf_concurrency = [] if args.moe else [16, 64]
    if args.moe and (args.hf_concurrency or args.lora_adapters or args.small):
        ap.error("--moe runs Spindle alone: no --hf-concurrency values, --lora-adapters or --small")
    shape = LLAMA3_8B if not args.small else SMOLLM2
    args.ranges = (tuple(args.prompt_range), tuple(args.output_range))
    model = "llama3-8b-shape" if shape is LLAMA3_8B else "smollm2-135m-shape"
    model = "qwen3-30b-a3b-shape" if args.moe else model
    setup = {"model": model, "dtype": "bfloat16",
             "device": torch.cuda.get_device_name(), "host_cpu": host_cpu(), "prompt_range": args.ranges[0],
             "output_range": args.ranges[1], "kv_cache_dtype": args.kv_cache_dtype,
             "piecewise_graphs": args.piecewise_graphs}  # fmt: skip
    loaded, rows = qwen3_30b_shape(48) if args.moe else random_model(shape), []
    flag = "none"  # the --quantization of the model being run: its systems are named spindle-fp8...

    def report(system: str, concurrency: int, requests: int, result: dict) -> None:
        system = system.replace("spindle", f"spindle-{flag}", 1) if flag != "none" else system
        rows.append((system, concurrency, result))
        line = {"bench": "serving", "system": system, "concurrency": concurrency, "requests": requests}
        quantization = {"quantization": flag}
        print(json.dumps({**line, **{k: round(v, 3) for k, v in result.items()}, **setup, **quantization}))

    bf16_run = ["none"] if args.quantization == "none" or args.compare else []
    for flag in bf16_run + ([args.quantization] if args.quantization != "none" else []):
        spindle_runs(quantized(loaded, flag) if flag != "none" else loaded, args, report)
        gc.collect()  # the engine and its K/V pool, before the next model's or HF's copy of the weights
        torch.cuda.empty_cache()
    hf = hf_llama(loaded) if args.hf_concurrency else None
    for c in args.hf_concurrency:  # the first 2c requests of Spindle's workload at c
        report("hf-generate", c, 2 * c, hf_serving(hf, requests_at(args, shape["vocab_size"], c)[: 2 * c], c))
    print(f"\n{'system':16s} {'concurrency':>11s} {'out tok/s':>10s} {'ttft p50 ms':>12s} {'tpot p50':>9s}")
    for system, c, r in rows:
        if "output_tokens_per_s" not in r:
            continue  # the warm-up's line
        ttft, tpot = r.get("ttft_p50_ms", float("nan")), r.get("tpot_p50_ms", float("nan"))
        print(f"{system:16s} {c:11d} {r['output_tokens_per_s']:10.1f} {ttft:12.1f} {tpot:9.2f}")
    for system, c, r in rows:
        if "lora_over_base" in r:
            print(f"{system} at {c}: {r['lora_over_base']:.3f}x the base model's out tok/s")
    rates = {(s, c): r["output_tokens_per_s"] for s, c, r in rows if "output_tokens_per_s" in r}
    for (system, c), rate in rates.items():
        fp8_rate = rates.get((system.replace("spindle", f"spindle-{args.quantization}", 1), c))
        if "-fp8" not in system and fp8_rate is not None:
            line = {"bench": "serving", "metric": "fp8_over_bf16", "system": system, "concurrency": c}
            print(json.dumps({**line, "bf16": round(rate, 1), "fp8": round(fp8_rate, 1),
                              "value": round(fp8_rate / rate, 3), **setup}))  # fmt: skip


if __name__ == "__main__":
    configure_process()
    main()
