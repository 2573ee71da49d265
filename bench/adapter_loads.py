"""How long an adapter's load holds the engine thread (every step waits for it), and how many
adapters the device holds.

Setup: one GPU, random bf16 weights of the 8B shape (`--small`: SmolLM2's), `--adapters`
adapters of rank `--rank` on `--modules` (all seven projections by default) in the pool's host
tier (as registration leaves them: `adapter.HostForm`), device memory for about `--slots`
adapters of that rank on every projection (or `--memory-gb`), so once it is full loads evict.
Each `LoraPool.load` is timed twice: the host's time (what the engine thread spends) and the
time until its copies are done (a synchronize after it). One JSON line: the medians, the
adapters resident at the end and the evictions. With `--disk N`, N more adapters are written as
PEFT directories (float32 safetensors) to a temporary directory, registered, and their host
copies dropped; each is then timed from disk to usable on the device through the pool's
worker-thread read (`host_ready`) and the load: a second JSON line. The files were just written,
so the page cache is warm (what a pod sees right after the adapter service stages a file).

With `--cpu` (no GPU needed) only the host side of a load from disk, stage by stage, for one
adapter (`host_path`): one JSON line of medians over `--repeat` runs.

    PYTHONPATH=. python3 bench/adapter_loads.py [--small] [--adapters 24] [--slots 8] [--rank 16]
    PYTHONPATH=. python3 bench/adapter_loads.py --adapters 1000 --rank 8 --modules q_proj,v_proj \
        --memory-gb 16
    PYTHONPATH=. python3 bench/adapter_loads.py --cpu [--rank 16] [--repeat 7]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP; see model_service/startup.py

import torch

from bench.gpu import LLAMA3_8B, SMOLLM2, host_cpu, random_model, register_random_adapters
from bench.lora import write_adapter
from model_service.engine.config import EngineConfig
from model_service.engine.engine import Engine
from model_service.lora.adapter import HostForm, LoraAdapter, parse_peft_adapter
from model_service.lora.buffers import HostBuffers
from model_service.lora.files import MAX_ADAPTER_BYTES
from model_service.lora.layers import full_adapter_elements
from model_service.lora.pool import LoraPool
from model_service.lora.reading import read_weights, sha256_of
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


class NoSlots:
    """A pool's writer for pools that never make an adapter resident (`host_path`'s)."""

    def load_slot(self, slot: int, adapter: LoraAdapter, offset: int) -> None:
        raise AssertionError("this pool loads nothing onto a device")

    def clear_slot(self, slot: int) -> None:
        pass

    def move_slot(self, slot: int, offset: int) -> None:
        pass


def host_path(args: argparse.Namespace) -> dict[str, object]:
    """Median ms of the host side of a load from disk, one adapter of `--rank` on `--modules` of
    the 8B shape (SmolLM2's with `--small`), into the bf16 host form (pageable: no GPU here):
    `read_ms` (the file into a reused buffer, its chunks read and hashed at once in threads),
    `parse_convert_ms` (header, checks, each tensor converted into the packed buffer),
    `sha256_ms` (the plain hash: registration only, beside the conversion; a read for
    admission takes it from the registration) and `host_ready_ms` (a registered adapter without
    its host copy to host-ready through the pool's worker read, as admission waits for it), with
    `host_ready_cpu_ms`, the CPU time of all threads meanwhile: what a host with cores to spare
    hides and a busy one pays (the wall times move with other work on shared cores; this less)."""
    shape = SMOLLM2 if args.small else LLAMA3_8B
    cfg = ModelConfig(family="llama", rms_norm_eps=1e-5, max_position_embeddings=8192, **shape)
    form = HostForm(torch.bfloat16, HostBuffers(torch.device("cpu")))
    stages = ("read", "parse_convert", "sha256", "host_ready", "host_ready_cpu")
    times: dict[str, list[float]] = {stage: [] for stage in stages}
    with tempfile.TemporaryDirectory() as tmp:
        path = write_adapter(Path(tmp) / "a", cfg, args.rank, seed=0, targets=args.modules)
        weights, config = path / "adapter_model.safetensors", (path / "adapter_config.json").read_bytes()
        file_mb = weights.stat().st_size / 2**20
        pool = LoraPool(cfg, 1, 1, args.rank, NoSlots(), (0, 2), host_form=form)
        registered = pool.register("a", path)
        for _ in range(args.repeat):
            clock = time.perf_counter()
            read = read_weights(weights, MAX_ADAPTER_BYTES)
            clock = lap(times["read"], clock)
            parse_peft_adapter("a", config, read, cfg, args.rank, path, form, registered.sha256)
            clock = lap(times["parse_convert"], clock)
            sha256_of(read.data).result()
            lap(times["sha256"], clock)
            del read  # its buffer goes back for the next read
            pool.drop_host_copy("a")
            clock, cpu = time.perf_counter(), time.process_time()
            while not pool.host_ready("a"):
                concurrent.futures.wait(pool.pending_reads())
            lap(times["host_ready"], clock)
            times["host_ready_cpu"].append((time.process_time() - cpu) * 1e3)
    return {
        "bench": "adapter_loads_host", "rank": args.rank, "modules": args.modules or "all",
        "file_mb": round(file_mb, 1), "host_mb": round(registered.nbytes / 2**20, 1),
        **{f"{stage}_ms": round(statistics.median(ms), 1) for stage, ms in times.items()},
        "repeat": args.repeat, "model": "smollm2-135m-shape" if args.small else "llama3-8b-shape",
        "cpu": host_cpu(), "cores": os.cpu_count(),
    }  # fmt: skip


def lap(into: list[float], since: float) -> float:
    """Append the ms since `since` to `into`; returns now."""
    now = time.perf_counter()
    into.append((now - since) * 1e3)
    return now


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="SmolLM2's shape instead of the 8B one")
    ap.add_argument("--adapters", type=int, default=24)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--modules", type=lambda s: s.split(","), help="PEFT names, comma-separated")
    ap.add_argument("--memory-gb", type=float, default=None, help="adapter memory instead of --slots'")
    ap.add_argument("--disk", type=int, default=0, help="adapters also timed from disk")
    ap.add_argument("--cpu", action="store_true", help="only the host side from disk, by stage (no GPU)")
    ap.add_argument("--repeat", type=int, default=7, help="--cpu: runs to take the median of")
    args = ap.parse_args()
    if args.cpu:
        print(json.dumps(host_path(args)))
        return
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
