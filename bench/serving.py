"""Output tokens/s of a serving workload at a fixed concurrency (issue 9's second benchmark):
Spindle against HF `transformers.generate` on the same shapes in the same run.

    PYTHONPATH=. python3 bench/serving.py [--concurrency 1 16 64 256] [--hf-concurrency 16 64] [--small]

Workload: per concurrency C, `max(16, 4 * C)` requests (`--requests-per-slot`), prompt lengths
uniform in [64, 2,048] and output lengths uniform in [32, 512] (seeded, random token ids, EOS
ignored). Spindle runs closed-loop: C requests in flight and the next one admitted as soon as
one finishes, so prefill chunks and decode rows share steps as they do in service (mixed and
eager steps count here, unlike `bench/gpu.py`'s decode-only figures). HF has no continuous
batching: it runs the first `2 * C` requests of the same workload in arrival order, in static
batches of C padded on the left to the longest prompt and run to the longest output; only the
tokens each request asked for count. Both clocks include prefill; Spindle's runs come after a
warm-up that captures its decode graphs (a pod's first minutes pay those captures, once). One
JSON line per (system, concurrency), then a table. Random bf16 weights of the 8B shape
(`--small`: SmolLM2's), one GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.gpu import LLAMA3_8B, SMOLLM2, hf_llama, random_model
from model_service.engine.config import EngineConfig
from model_service.engine.cuda_graphs import batch_ladder
from model_service.engine.engine import Engine


def workload(n: int, vocab: int, seed: int, prompts: tuple[int, int], outputs: tuple[int, int]) -> list:
    """`n` (prompt token ids, output length) pairs, lengths uniform in the given closed ranges."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(prompts[0], prompts[1] + 1, (n,), generator=g).tolist()
    outs = torch.randint(outputs[0], outputs[1] + 1, (n,), generator=g).tolist()
    return [(torch.randint(3, vocab, (p,), generator=g).tolist(), o)
            for p, o in zip(lengths, outs, strict=True)]


def spindle_serving(engine: Engine, requests: list, concurrency: int) -> dict[str, float]:
    """Closed loop at `concurrency`: output tokens/s over the whole run, and the median time to
    first token and time per output token after it (ms) of the requests."""
    queue, submitted, first, done = list(reversed(requests)), {}, {}, {}
    start = time.perf_counter()
    while queue or engine.has_unfinished():
        while queue and len(submitted) - len(done) < concurrency:
            prompt, n = queue.pop()
            rid = engine.add_request_dict({"prompt_token_ids": prompt, "max_tokens": n, "ignore_eos": True})
            submitted[rid] = time.perf_counter()
        for out in engine.step():
            now = time.perf_counter()
            if out.error:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                done[out.request_id] = (now, len(out.token_ids))
    wall = time.perf_counter() - start
    tokens = sum(n for _, n in done.values())
    ttft = [first[r] - t for r, t in submitted.items()]
    tpot = [(done[r][0] - first[r]) / max(done[r][1] - 1, 1) for r in submitted]
    return {
        "output_tokens_per_s": tokens / wall,
        "ttft_p50_ms": statistics.median(ttft) * 1e3,
        "tpot_p50_ms": statistics.median(tpot) * 1e3,
        "output_tokens": tokens,
    }


def warm_up(engine: Engine, vocab: int, concurrency: int) -> None:
    """Compile the kernels and capture every decode graph up to `concurrency` rows (one per size of
    the padded batch ladder), so that no measured run pays a first-use cost: the engine captures a
    graph the first time a batch size shows up (~0.1-0.5 s each on the 8B shape)."""
    for n in batch_ladder(concurrency):
        spindle_serving(engine, workload(n, vocab, 99, (16, 32), (8, 8)), n)


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


def report(rows: list, system: str, concurrency: int, requests: int, result: dict, setup: dict) -> None:
    rows.append((system, concurrency, result))
    line = {"bench": "serving", "system": system, "concurrency": concurrency, "requests": requests}
    print(json.dumps({**line, **{k: round(v, 1) for k, v in result.items()}, **setup}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="*", default=[1, 16, 64, 256])
    ap.add_argument("--hf-concurrency", type=int, nargs="*", default=[16, 64])
    ap.add_argument("--requests-per-slot", type=int, default=4)
    ap.add_argument("--prompt-range", type=int, nargs=2, default=[64, 2048])
    ap.add_argument("--output-range", type=int, nargs=2, default=[32, 512])
    ap.add_argument("--small", action="store_true", help="SmolLM2's shape instead of the 8B one")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    args = ap.parse_args()
    shape = LLAMA3_8B if not args.small else SMOLLM2
    ranges = (tuple(args.prompt_range), tuple(args.output_range))
    setup = {"model": "llama3-8b-shape" if shape is LLAMA3_8B else "smollm2-135m-shape", "dtype": "bfloat16",
             "device": torch.cuda.get_device_name(), "prompt_range": ranges[0],
             "output_range": ranges[1], "kv_cache_dtype": args.kv_cache_dtype}  # fmt: skip
    loaded, vocab, rows = random_model(shape), shape["vocab_size"], []

    def requests_for(c: int) -> list:
        return workload(max(16, args.requests_per_slot * c), vocab, c, *ranges)

    engine = Engine(
        EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=max(args.concurrency), max_loras=0,
                     kv_cache_memory_bytes=64 << 30, max_model_len=8192, kv_cache_dtype=args.kv_cache_dtype),
        loaded=loaded,
    )  # fmt: skip
    spindle_serving(engine, workload(8, vocab, 99, (64, 512), (8, 16)), 8)  # prefill and mixed kernels
    warm_up(engine, vocab, max(args.concurrency))
    for c in args.concurrency:
        requests = requests_for(c)
        report(rows, "spindle", c, len(requests), spindle_serving(engine, requests, c), setup)
    del engine
    torch.cuda.empty_cache()
    hf = hf_llama(loaded) if args.hf_concurrency else None
    for c in args.hf_concurrency:
        requests = requests_for(c)[: 2 * c]  # the first requests of Spindle's workload at c
        report(rows, "hf-generate", c, len(requests), hf_serving(hf, requests, c), setup)
    print(f"\n{'system':14s} {'concurrency':>11s} {'out tok/s':>10s} {'ttft p50 ms':>12s} {'tpot p50':>9s}")
    for system, c, r in rows:
        ttft, tpot = r.get("ttft_p50_ms", float("nan")), r.get("tpot_p50_ms", float("nan"))
        print(f"{system:14s} {c:11d} {r['output_tokens_per_s']:10.1f} {ttft:12.1f} {tpot:9.2f}")


if __name__ == "__main__":
    main()
