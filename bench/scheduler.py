"""Scheduler benchmarks, one JSON line per result.

1. `scheduler_step`: CPU time of one engine step with 256 running sequences in decode, with
   the model's forward replaced by a fake that returns random logits (vocab 32000). Reports
   the scheduler's `schedule()` alone and the whole step (scheduling, metadata-free fake
   forward, batched sampling, stop checks, outputs).
2. `multi_turn_prefix_cache`: SmolLM2, float32 CPU, greedy; conversations that resend their
   whole history each turn. Reports the prefix-cache hit rate and mean time-to-first-token
   with the cache on and off (same run, same prompts).

    .venv/bin/python bench/scheduler.py [--seqs 256] [--conversations 4] [--turns 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP; see model_service/__init__
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

from model_service.engine.config import EngineConfig
from model_service.engine.engine import Engine
from model_service.engine.sampling_params import SamplingParams
from model_service.models.config import ModelConfig
from model_service.models.llama import DecoderModel
from model_service.models.loader import LoadedModel, load_model
from model_service.models.step import StepBatch


def _fake_model_engine(num_seqs: int) -> Engine:
    cfg = ModelConfig(
        family="llama",
        vocab_size=32000,
        hidden_size=64,
        intermediate_size=128,
        num_layers=1,
        num_heads=4,
        num_kv_heads=4,
        head_dim=16,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
    )
    loaded = LoadedModel("fake", cfg, DecoderModel(cfg), tokenizer=None)
    engine = Engine(
        EngineConfig(
            device="cpu",
            dtype="float32",
            num_kv_blocks=num_seqs * 16,
            max_num_seqs=num_seqs,
            max_num_batched_tokens=max(2048, num_seqs),
        ),
        loaded=loaded,
    )

    def fake_execute(batch: StepBatch) -> torch.Tensor:
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
    args = ap.parse_args()
    bench_scheduler_step(args.seqs)
    bench_multi_turn(
        load_model("smollm2", torch.float32, torch.device("cpu")), args.conversations, args.turns
    )


if __name__ == "__main__":
    main()
