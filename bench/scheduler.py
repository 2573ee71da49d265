"""Scheduler benchmarks, one JSON line per result.

1. `scheduler_step`: CPU time of one engine step with 256 running sequences in decode, with
   the model's forward replaced by a fake that returns random logits (vocab 32000). Reports
   the scheduler's `schedule()` alone and the whole step (scheduling, metadata-free fake
   forward, batched sampling, stop checks, outputs).
2. `host_cpu_per_step`: process CPU time (time.process_time) of each decode step with 256
   running greedy sequences (EOS ignored) and a fake forward returning fixed logits over a
   vocab of 512, so the host work (scheduling, batch building, sampling's host side,
   appending, stop checks, outputs) is what is measured, not argmax. KV blocks for every
   token, so nothing is preempted. Median over every decode step of outputs `--output-len`
   tokens long (64 and 512 by default): the per-step cost grows with output length where a
   step copies a whole output. `--async-scheduling on` runs the same with overlapped steps
   (engine/overlap.py; on the CPU the token "copy" is immediate).
3. `multi_turn_prefix_cache`: SmolLM2, float32 CPU, greedy; conversations that resend their
   whole history each turn. Reports the prefix-cache hit rate and mean time-to-first-token
   with the cache on and off (same run, same prompts).

    .venv/bin/python bench/scheduler.py [--seqs 256] [--conversations 4] [--turns 4]
    .venv/bin/python bench/scheduler.py --only host_cpu [--output-len 64 512] [--repeats 3]
        [--async-scheduling off|on]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP; see model_service/startup.py
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

from model_service.engine.config import EngineConfig
from model_service.engine.engine import Engine
from model_service.engine.sampling_params import SamplingParams
from model_service.models.config import ModelConfig
from model_service.models.llama import DecoderModel
from model_service.models.loader import LoadedModel, load_model
from model_service.models.step import StepBatch
from model_service.startup import configure_process


def _fake_model_engine(
    num_seqs: int,
    vocab_size: int = 32000,
    max_len: int = 4096,
    fixed_logits: bool = False,
    async_scheduling: str = "auto",
) -> Engine:
    """An engine whose forward is a fake: random logits each step, or one fixed draw (`fixed_logits`)."""
    cfg = ModelConfig(
        family="llama",
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_layers=1,
        num_heads=4,
        num_kv_heads=4,
        head_dim=16,
        rms_norm_eps=1e-6,
        max_position_embeddings=max_len,
    )
    loaded = LoadedModel("fake", cfg, DecoderModel(cfg), tokenizer=None)
    engine = Engine(
        EngineConfig(
            device="cpu",
            dtype="float32",
            num_kv_blocks=num_seqs * max(16, -(-max_len // 16)),
            max_num_seqs=num_seqs,
            max_num_batched_tokens=max(2048, num_seqs),
            async_scheduling=async_scheduling,
        ),
        loaded=loaded,
    )

    fixed = torch.randn(num_seqs, cfg.vocab_size)

    def fake_execute(batch: StepBatch, fed: torch.Tensor | None = None) -> torch.Tensor:
        if fixed_logits:
            return fixed[: len(batch.logits_rows)]
        return torch.randn(len(batch.logits_rows), cfg.vocab_size)

    engine.executor.execute = fake_execute
    return engine


def bench_scheduler_step(num_seqs: int, steps: int = 50) -> None:
    engine = _fake_model_engine(num_seqs)
    params = SamplingParams(max_tokens=10_000, temperature=0.8, top_p=0.95, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(prompt_token_ids=[1 + (i % 100)] * 64, params=params)
    engine.step()  # all prefills; every sequence decodes from here on
    schedule_times, step_times = [], []
    original = engine.scheduler.schedule

    def timed_schedule():
        t = time.perf_counter()
        batch = original()
        schedule_times.append(time.perf_counter() - t)
        return batch

    engine.scheduler.schedule = timed_schedule
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - t)
    assert engine.stats().num_running == num_seqs
    common = {
        "bench": "scheduler_step",
        "running_seqs": num_seqs,
        "steps": steps,
        "forward": "fake (random logits, vocab 32000)",
        "sampling": "temperature 0.8, top_p 0.95",
    }
    print(
        json.dumps(
            {
                **common,
                "metric": "schedule_ms_per_step",
                "value": round(statistics.median(schedule_times) * 1e3, 3),
            }
        ),
        flush=True,
    )
    print(
        json.dumps(
            {
                **common,
                "metric": "engine_step_overhead_ms_per_step",
                "value": round(statistics.median(step_times) * 1e3, 3),
            }
        ),
        flush=True,
    )


def bench_host_cpu(num_seqs: int, output_len: int, overlap: str = "off", vocab_size: int = 512) -> float:
    """Median process CPU time (ms) of a decode step; see the module docstring."""
    prompt_len = 64
    engine = _fake_model_engine(
        num_seqs, vocab_size, prompt_len + output_len + 16, fixed_logits=True, async_scheduling=overlap
    )
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(prompt_token_ids=[1 + (i % 100)] * prompt_len, params=params)
    while any(seq.num_output_tokens == 0 for seq in engine.requests.values()):
        engine.step()  # chunked prefills, each sequence sampling its first token
    times, preemptions = [], engine.stats().num_preemptions
    while engine.has_unfinished():
        t = time.process_time()
        engine.step()
        times.append(time.process_time() - t)
    assert engine.stats().num_preemptions == preemptions == 0
    value = statistics.median(times) * 1e3
    print(
        json.dumps(
            {
                "bench": "host_cpu_per_step",
                "running_seqs": num_seqs,
                "prompt_len": prompt_len,
                "output_len": output_len,
                "steps": len(times),
                "forward": f"fake (fixed logits, vocab {vocab_size})",
                "sampling": "greedy, ignore_eos",
                "async_scheduling": engine.overlap.enabled,
                "metric": "median_process_cpu_ms_per_step",
                "value": round(value, 3),
                "us_per_seq": round(value * 1e3 / num_seqs, 2),
            }
        ),
        flush=True,
    )
    return value


def bench_multi_turn(loaded: LoadedModel, conversations: int, turns: int) -> None:
    results = {}
    for caching in (True, False):
        engine = Engine(
            EngineConfig(device="cpu", dtype="float32", num_kv_blocks=1024, enable_prefix_caching=caching),
            loaded=loaded,
        )
        histories = [
            [{"role": "user", "content": f"Tell me a fact about the number {c}."}]
            for c in range(conversations)
        ]
        ttfts = []
        for turn in range(turns):
            for history in histories:
                rid = engine.add_request(
                    messages=history, params=SamplingParams(max_tokens=16, temperature=0)
                )
                t, first, text = time.perf_counter(), None, ""
                while engine.has_unfinished():
                    for out in engine.step():
                        if out.request_id == rid and first is None and out.new_token_ids:
                            first = time.perf_counter() - t
                        if out.finished:
                            text = out.text
                ttfts.append(first)
                history += [
                    {"role": "assistant", "content": text},
                    {"role": "user", "content": f"Why? (turn {turn})"},
                ]
        stats = engine.stats()
        results[caching] = statistics.mean(ttfts)
        print(
            json.dumps(
                {
                    "bench": "multi_turn_prefix_cache",
                    "prefix_caching": caching,
                    "model": "SmolLM2-135M-Instruct",
                    "device": "cpu",
                    "dtype": "float32",
                    "conversations": conversations,
                    "turns": turns,
                    "hit_rate": round(stats.prefix_cache_hit_rate, 3),
                    "computed_tokens": stats.num_computed_tokens,
                    "mean_ttft_ms": round(results[caching] * 1e3, 1),
                }
            ),
            flush=True,
        )
    print(
        json.dumps(
            {
                "bench": "multi_turn_prefix_cache",
                "metric": "ttft_speedup_cache_on_vs_off",
                "value": round(results[False] / results[True], 2),
            }
        ),
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--only", choices=["host_cpu"], help="run only this measurement")
    ap.add_argument("--output-len", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--repeats", type=int, default=1, help="host_cpu runs per output length")
    ap.add_argument("--async-scheduling", choices=["off", "on"], default="off", help="for host_cpu")
    args = ap.parse_args()
    for _ in range(args.repeats):
        for output_len in args.output_len:
            bench_host_cpu(args.seqs, output_len, args.async_scheduling)
    if args.only == "host_cpu":
        return
    bench_scheduler_step(args.seqs)
    bench_multi_turn(
        load_model("smollm2", torch.float32, torch.device("cpu")), args.conversations, args.turns
    )


if __name__ == "__main__":
    configure_process()
    main()
