"""SmolLM2-135M decode throughput on this CPU: Spindle's engine vs HF transformers.generate.

Setup (printed in every line): float32, greedy, chat prompts, EOS ignored so every row
generates exactly `new_tokens`; torch threads = all cores. Decode throughput is measured as
(time(new_tokens) - time(1 token)) / ((new_tokens - 1) * batch), so prefill is excluded for
both systems in the same way. Prints one JSON line per (system, batch) and one ratio line.

    .venv/bin/python bench/engine_cpu.py [--new-tokens 64] [--batches 1 16]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP; see model_service/startup.py
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

from model_service.engine.config import EngineConfig
from model_service.engine.engine import Engine
from model_service.models.loader import load_model, resolve_model_path
from model_service.startup import configure_process

TOPICS = [
    "the sea",
    "a city at night",
    "mountains",
    "a cat",
    "rain",
    "the moon",
    "a library",
    "trains",
    "coffee",
    "winter",
    "a garden",
    "the desert",
    "music",
    "a bridge",
    "stars",
    "autumn",
]


def _time_ours(engine: Engine, prompts: list[list[int]], new_tokens: int) -> float:
    reqs = [
        {"prompt_token_ids": p, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
        for p in prompts
    ]
    t = time.perf_counter()
    engine.generate(reqs)
    return time.perf_counter() - t


def _time_hf(hf, tok, prompts: list[list[int]], new_tokens: int) -> float:
    width = max(map(len, prompts))
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t = time.perf_counter()
    with torch.inference_mode():
        hf.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad,
        )
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    loaded = load_model("smollm2", torch.float32, torch.device("cpu"))
    engine = Engine(EngineConfig(device="cpu", dtype="float32", num_kv_blocks=512), loaded=loaded)
    path = resolve_model_path("smollm2")
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    tok = loaded.tokenizer
    setup = {
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized)",
        "dtype": "float32",
        "device": "cpu",
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "new_tokens": args.new_tokens,
        "greedy": True,
    }
    for batch in args.batches:
        prompts = [
            tok.apply_chat_template([{"role": "user", "content": f"Write a poem about {TOPICS[i % 16]}."}])
            for i in range(batch)
        ]
        results = {}
        for name, run in (
            ("spindle", lambda n, p=prompts: _time_ours(engine, p, n)),
            ("hf_transformers", lambda n, p=prompts: _time_hf(hf, tok.hf, p, n)),
        ):
            run(2)  # warm-up
            full, first = run(args.new_tokens), run(1)
            tps = (args.new_tokens - 1) * batch / max(full - first, 1e-9)
            results[name] = tps
            print(
                json.dumps(
                    {
                        "bench": "engine_cpu",
                        "system": name,
                        "batch": batch,
                        "decode_tokens_per_s": round(tps, 1),
                        **setup,
                    }
                ),
                flush=True,
            )
        print(
            json.dumps(
                {
                    "bench": "engine_cpu",
                    "batch": batch,
                    "metric": "spindle_over_hf_decode_ratio",
                    "value": round(results["spindle"] / results["hf_transformers"], 3),
                    **setup,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    configure_process()
    main()
