"""CPU time of one engine decode step (SmolLM2-135M, float32, one thread), for A/B comparisons.

Process CPU time, not wall time: on a shared machine other processes' load barely moves it, so
two trees can be compared (run each with PYTHONPATH pointing at it). Median of `--steps` decode
steps after a warm-up, at each batch size. Prints one JSON line per batch size.

    .venv/bin/python bench/engine_step.py [--steps 40] [--batches 1 16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP; see model_service/startup.py

import torch

from model_service.engine.config import EngineConfig
from model_service.engine.engine import Engine
from model_service.engine.sampling_params import SamplingParams
from model_service.startup import configure_process


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    args = ap.parse_args()
    torch.set_num_threads(1)
    engine = Engine(EngineConfig(device="cpu", dtype="float32", num_kv_blocks=512))
    for batch in args.batches:
        params = SamplingParams(max_tokens=args.steps + 20, temperature=0, ignore_eos=True)
        for i in range(batch):
            engine.add_request(prompt_token_ids=[5 + i] * 40, params=params)
        for _ in range(6):  # prefill, then warm decode steps
            engine.step()
        times = []
        for _ in range(args.steps):
            start = time.process_time()
            engine.step()
            times.append(time.process_time() - start)
        engine.run_to_completion()
        print(
            json.dumps(
                {
                    "bench": "engine_step",
                    "batch": batch,
                    "cpu_ms_per_decode_step": round(statistics.median(times) * 1e3, 2),
                    "model": "SmolLM2-135M-Instruct",
                    "dtype": "float32",
                    "threads": 1,
                    "steps": args.steps,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    configure_process()
    main()
