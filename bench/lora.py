"""Multi-LoRA throughput and promotion latency, one JSON line per result.

Setup: SmolLM2-135M (embedded), random PEFT adapters of rank 8 on all seven projections,
written as real `adapter_config.json` + `adapter_model.safetensors` directories. A batch of
`--batch` requests, each decoding `--new-tokens` tokens greedily (EOS ignored), served with
1, 8 or 64 distinct adapters spread over the batch, against the same batch on the base model
in the same run. Then the latency of promoting an adapter from disk into a slot (parse,
validate, copy to device) at a quiescent point. CPU float32 by default; `--device cuda` on a GPU.

    .venv/bin/python bench/lora.py [--batch 64] [--new-tokens 8] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP; see model_service/startup.py
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
from safetensors.torch import save_file

from bench.gpu import adapter_room, generate_or_raise
from model_service.engine.config import EngineConfig
from model_service.engine.engine import Engine
from model_service.lora.adapter import module_shapes
from model_service.lora.control import LoadAdapter
from model_service.models.config import ModelConfig
from model_service.models.loader import load_model
from model_service.startup import configure_process


def write_adapter(
    path: Path, cfg: ModelConfig, rank: int, seed: int, targets: Sequence[str] | None = None
) -> Path:
    """A random PEFT adapter of `rank` on `targets` (all seven projections without it)."""
    torch.manual_seed(seed)
    path.mkdir(parents=True)
    tensors = {}
    shapes = {m: s for m, s in module_shapes(cfg).items() if targets is None or m in targets}
    for layer in range(cfg.num_layers):
        for module, (fan_in, fan_out) in shapes.items():
            block = "self_attn" if module[0] in "qkvo" else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank) * 0.01
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(shapes),
    }
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def decode_tps(
    engine: Engine, prompts: list[list[int]], adapters: list[str | None], new_tokens: int
) -> float:
    def run(n: int) -> float:
        reqs = [
            {"prompt_token_ids": p, "max_tokens": n, "temperature": 0, "ignore_eos": True, "adapter": a}
            for p, a in zip(prompts, adapters, strict=True)
        ]
        t = time.perf_counter()
        generate_or_raise(engine, reqs)
        if engine.executor.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    run(2)  # warm-up; also promotes every adapter into its slot
    full, first = run(new_tokens), run(1)
    return (new_tokens - 1) * len(prompts) / max(full - first, 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    loaded = load_model("smollm2", dtype, device)
    root = Path(tempfile.mkdtemp(prefix="spindle-lora-bench-"))
    names = [f"a{i}" for i in range(64)]
    dirs = {n: str(write_adapter(root / n, loaded.config, args.rank, i)) for i, n in enumerate(names)}
    engine = Engine(
        EngineConfig(
            model="smollm2",
            device=args.device,
            dtype=str(dtype).removeprefix("torch."),
            num_kv_blocks=2048,
            max_loras=64,
            lora_memory_bytes=adapter_room(loaded, 64, args.rank, dtype.itemsize),
            max_cpu_loras=64,
            max_lora_rank=args.rank,
            lora_modules=dirs,
        ),
        loaded=loaded,
    )
    tok = loaded.tokenizer
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": f"Tell me about topic {i}."}])
        for i in range(args.batch)
    ]
    setup = {
        "model": "SmolLM2-135M-Instruct",
        "device": args.device,
        "dtype": str(dtype),
        "batch": args.batch,
        "new_tokens": args.new_tokens,
        "rank": args.rank,
        "targets": "q,k,v,o,gate,up,down",
        "lora_path": "torch reference (grouped gather + matmul)",
    }
    base = decode_tps(engine, prompts, [None] * args.batch, args.new_tokens)
    print(
        json.dumps({"bench": "lora", "distinct_adapters": 0, "decode_tokens_per_s": round(base, 1), **setup})
    )
    for distinct in (1, 8, 64):
        adapters = [names[i % distinct] for i in range(args.batch)]
        tps = decode_tps(engine, prompts, adapters, args.new_tokens)
        print(
            json.dumps(
                {
                    "bench": "lora",
                    "distinct_adapters": distinct,
                    "decode_tokens_per_s": round(tps, 1),
                    "ratio_to_base": round(tps / base, 3),
                    **setup,
                }
            ),
            flush=True,
        )

    # Promotion: a fresh engine with one slot; each load evicts the previous adapter, and the
    # adapter is read from disk (the host tier is kept at one entry so nothing is cached).
    promo = Engine(
        EngineConfig(
            model="smollm2",
            device=args.device,
            num_kv_blocks=16,
            max_loras=1,
            max_cpu_loras=1,
            max_lora_rank=args.rank,
        ),
        loaded=loaded,
    )
    times = []
    for name in names[:10]:
        t = time.perf_counter()
        future = promo.submit_control(LoadAdapter(name, path=dirs[name]))
        promo.step()
        future.result()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    print(
        json.dumps(
            {
                "bench": "lora_promotion",
                "from": "disk",
                "to": "slot",
                "samples": len(times),
                "median_ms": round(statistics.median(times) * 1e3, 1),
                "max_ms": round(max(times) * 1e3, 1),
                "adapter_mb": round(
                    os.path.getsize(Path(dirs[names[0]]) / "adapter_model.safetensors") / 1e6, 1
                ),
                **setup,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    configure_process()
    main()
