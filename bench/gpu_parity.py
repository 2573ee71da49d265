"""SmolLM2 on CUDA (bfloat16) against the CPU float32 engine, plus GPU decode throughput.

For each chat prompt, both engines decode greedily; we report how many leading tokens agree
(bf16 rounding makes later divergence expected where two logits are near-tied). Then the GPU
engine's decode tokens/s at several batch sizes, measured as in bench/engine_cpu.py. This is
the eager torch reference path (no CUDA graphs, no custom kernels): a baseline, not the target.

    python bench/gpu_parity.py [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from model_service.engine.config import EngineConfig
from model_service.engine.engine import Engine
from model_service.models.loader import load_model
from model_service.startup import configure_process

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
]


def greedy(engine: Engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    reqs = [{"prompt_token_ids": p, "max_tokens": n, "temperature": 0} for p in prompts]
    return [o.token_ids for o in engine.generate(reqs)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    cpu = Engine(
        EngineConfig(device="cpu", dtype="float32", num_kv_blocks=256),
        loaded=load_model("smollm2", torch.float32, torch.device("cpu")),
    )
    gpu = Engine(
        EngineConfig(device="cuda", dtype="bfloat16"),
        loaded=load_model("smollm2", torch.bfloat16, torch.device("cuda")),
    )
    tok = cpu.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    ref, got = greedy(cpu, prompts, args.new_tokens), greedy(gpu, prompts, args.new_tokens)
    for p, a, b in zip(PROMPTS, ref, got, strict=True):
        agree = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        print(
            json.dumps(
                {
                    "bench": "gpu_parity",
                    "prompt": p,
                    "leading_tokens_equal": agree,
                    "cpu_fp32_tokens": len(a),
                    "gpu_bf16_tokens": len(b),
                    "cpu_text": tok.decode(a),
                    "gpu_text": tok.decode(b),
                }
            ),
            flush=True,
        )
    for batch in (1, 16, 64):
        batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]
        reqs = lambda n, bp=batch_prompts: [  # noqa: E731
            {"prompt_token_ids": p, "max_tokens": n, "temperature": 0, "ignore_eos": True} for p in bp
        ]
        gpu.generate(reqs(4))
        times = []
        for n in (args.new_tokens * 4, 1):
            torch.cuda.synchronize()
            t = time.perf_counter()
            gpu.generate(reqs(n))
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        tps = (args.new_tokens * 4 - 1) * batch / (times[0] - times[1])
        print(
            json.dumps(
                {
                    "bench": "gpu_decode",
                    "device": torch.cuda.get_device_name(),
                    "dtype": "bfloat16",
                    "path": "eager torch reference",
                    "batch": batch,
                    "decode_tokens_per_s": round(tps, 1),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    configure_process()
    main()
