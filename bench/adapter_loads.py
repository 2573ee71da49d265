"""How long an adapter's load holds the engine thread (every step waits for it), and how many
adapters the device holds.

Setup: one GPU, random bf16 weights of the 8B shape (`--small`: SmolLM2's), `--adapters`
adapters of rank `--rank` on `--modules` (all seven projections by default) in the pool's host
tier (as registration leaves them: `adapter.host_form`), device memory for about `--slots`
adapters of that rank on every projection (or `--memory-gb`), so once it is full loads evict.
Each `LoraPool.load` is timed twice: the host's time (what the engine thread spends) and the
time until its copies are done (a synchronize after it). One JSON line: the medians, the
adapters resident at the end and the evictions. With `--disk N`, N more adapters are written as
PEFT directories (float32 safetensors) to a temporary directory, registered, and their host
copies dropped; each is then timed from disk to usable on the device through the pool's
worker-thread read (`host_ready`) and the load: a second JSON line. The files were just written,
so the page cache is warm (what a pod sees right after the adapter service stages a file).

    PYTHONPATH=. python3 bench/adapter_loads.py [--small] [--adapters 24] [--slots 8] [--rank 16]
    PYTHONPATH=. python3 bench/adapter_loads.py --adapters 1000 --rank 8 --modules q_proj,v_proj \
        --memory-gb 16
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.gpu import LLAMA3_8B, SMOLLM2, random_model, register_random_adapters
from bench.lora import write_adapter
from model_service.engine.config import EngineConfig
from model_service.engine.engine import Engine
from model_service.lora.layers import full_adapter_elements
from model_service.models.config import ModelConfig
from model_service.startup import configure_process


def from_disk(engine: Engine, cfg: ModelConfig, args: argparse.Namespace) -> dict[str, object]:
    """Median ms from a registered directory to usable on the device (worker read + load)."""
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.disk):
            name = f"disk{k}"
            path = write_adapter(Path(tmp) / name, cfg, args.rank, seed=k, targets=args.modules)
            engine.lora.register(name, path)
            engine.lora.drop_host_copy(name)
            torch.cuda.synchronize()
            start = time.perf_counter()
            while not engine.lora.host_ready(name):
                concurrent.futures.wait(engine.lora.pending_reads())
            engine.lora.load(name)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
    return {"from_disk_loads": args.disk, "from_disk_ms_p50": round(statistics.median(times), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="SmolLM2's shape instead of the 8B one")
    ap.add_argument("--adapters", type=int, default=24)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--modules", type=lambda s: s.split(","), help="PEFT names, comma-separated")
    ap.add_argument("--memory-gb", type=float, default=None, help="adapter memory instead of --slots'")
    ap.add_argument("--disk", type=int, default=0, help="adapters also timed from disk")
    args = ap.parse_args()
    shape = SMOLLM2 if args.small else LLAMA3_8B
    loaded = random_model(shape)
    room = args.slots * full_adapter_elements(loaded.module, args.rank) * 2  # bf16
    room = int(args.memory_gb * 1e9) if args.memory_gb else room
    config = EngineConfig(
        device="cuda", dtype="bfloat16", lora_memory_bytes=room, max_cpu_loras=args.adapters,
        max_lora_rank=args.rank, kv_cache_memory_bytes=1 << 30, piecewise_graphs=False,
    )  # fmt: skip
    engine = Engine(config, loaded=loaded)
    start = time.perf_counter()
    names = register_random_adapters(engine, loaded.config, args.adapters, args.rank, args.modules)
    host_tier_s = time.perf_counter() - start
    host, done, evictions = [], [], 0
    for name in names:
        torch.cuda.synchronize()
        start = time.perf_counter()
        evictions += len(engine.lora.load(name)[1])
        host.append((time.perf_counter() - start) * 1e3)
        torch.cuda.synchronize()
        done.append((time.perf_counter() - start) * 1e3)
    adapter = engine.lora.host[names[-1]]
    host_ms, done_ms = round(statistics.median(host), 2), round(statistics.median(done), 2)
    result = {
        "bench": "adapter_loads", "loads": len(names), "host_ms_p50": host_ms, "done_ms_p50": done_ms,
        "adapter_mb": round(adapter.nbytes / 2**20, 1),
        "host_tier_s_per_adapter": round(host_tier_s / len(names), 3), "rank": args.rank,
        "modules": args.modules or "all", "adapter_memory_gb": round(room / 1e9, 2),
        "resident": sum(a.tier == "gpu" for a in engine.list_adapters()), "evictions": evictions,
        "model": "smollm2-135m-shape" if args.small else "llama3-8b-shape",
        "device": torch.cuda.get_device_name(),
    }  # fmt: skip
    print(json.dumps(result))
    if args.disk:
        print(json.dumps(result | from_disk(engine, loaded.config, args)))
    print(f"\na slot load: {host_ms} ms of the engine thread, {done_ms} ms until its copies are done")


if __name__ == "__main__":
    configure_process()
    main()
