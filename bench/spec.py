"""Speculative decoding on the CPU: SmolLM2-135M-Instruct, greedy, with prompt lookup (n-gram)
or a draft model.

Setup (printed in every line): float32, one request at a time (batch 1, where speculation pays
most), `--max-tokens` new tokens, EOS honoured; each workload runs with speculation off and on
in the same process. Reports acceptance rate (accepted / proposed), tokens per step and the
wall-clock speed-up. Outputs are checked identical (greedy).

    .venv/bin/python bench/spec.py [--max-tokens 96] [--k 4]
    .venv/bin/python bench/spec.py --method draft [--draft-model smollm2] [--device cuda]

`--method draft` with the default draft, SmolLM2 itself, measures the machinery: acceptance is
~100%, so tokens per step is what k allows, and the speed-up is what is left after the draft's k
forward passes cost as much as the target's (a real draft is 10-50x smaller than its target).
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP; see model_service/startup.py

import torch

from model_service.engine.config import EngineConfig
from model_service.engine.engine import Engine
from model_service.models.loader import load_model
from model_service.startup import configure_process

CODE = (
    "Rename the function `area` to `rectangle_area` in this code and show the whole file:\n\n"
    "def area(width, height):\n    return width * height\n\n"
    "def describe(width, height):\n    a = area(width, height)\n    return f'{width}x{height} has area {a}'\n"
)
WORKLOADS = {
    "code-edit (repetitive)": [{"role": "user", "content": CODE}],
    "quoting (repetitive)": [
        {
            "role": "user",
            "content": "Quote this sentence back to me twice, word for word: "
            "'The committee will reconvene on Thursday to review the budget proposal in detail.'",
        }
    ],
    "open question (non-repetitive)": [{"role": "user", "content": "Why do leaves change colour in autumn?"}],
}


def run(engine: Engine, messages: list[dict[str, str]], max_tokens: int) -> tuple[list[int], float, int]:
    steps = engine.num_steps
    start = time.perf_counter()
    out = engine.generate([{"messages": messages, "max_tokens": max_tokens, "temperature": 0}])[0]
    return out.token_ids, time.perf_counter() - start, engine.num_steps - steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--method", choices=["ngram", "draft"], default="ngram")
    ap.add_argument("--draft-model", default="smollm2", help="alias, checkpoint dir or .gguf [smollm2]")
    ap.add_argument("--device", default="cpu", help="cpu (float32) or cuda (bfloat16)")
    args = ap.parse_args()
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    loaded = load_model("smollm2", getattr(torch, dtype), torch.device(args.device))
    method = {"prompt_lookup_max": 4} if args.method == "ngram" else {"model": args.draft_model}
    spec = json.dumps({"method": args.method, "num_speculative_tokens": args.k, **method})
    engines = {
        on: Engine(
            EngineConfig(
                device=args.device, dtype=dtype, num_kv_blocks=512, speculative_config=spec if on else None
            ),
            loaded=loaded,
        )
        for on in (False, True)
    }
    setup = {
        "model": "SmolLM2-135M-Instruct",
        "device": args.device,
        "dtype": dtype,
        "batch": 1,
        "max_tokens": args.max_tokens,
        **({"method": "ngram"} if args.method == "ngram" else {"method": "draft", "draft": args.draft_model}),
        "k": args.k,
        "threads": torch.get_num_threads(),
    }
    for name, messages in WORKLOADS.items():
        for engine in engines.values():  # warm-up (on CUDA: graph capture)
            run(engine, messages, 8)
        base_tokens, base_s, base_steps = run(engines[False], messages, args.max_tokens)
        e = engines[True]
        proposed, accepted = e.speculation.proposed, e.speculation.accepted
        tokens, spec_s, steps = run(e, messages, args.max_tokens)
        proposed, accepted = e.speculation.proposed - proposed, e.speculation.accepted - accepted
        line = {
            "bench": "spec",
            "workload": name,
            "identical": tokens == base_tokens,
            "acceptance_rate": round(accepted / max(proposed, 1), 3),
            "tokens_per_step": round(len(tokens) / max(steps, 1), 2),
            "tokens_per_step_without": round(len(base_tokens) / max(base_steps, 1), 2),
            "speedup": round(base_s / spec_s, 2),
            **setup,
        }
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    configure_process()
    main()
