"""Load through the gateway: many concurrent streams, latency per adapter and per API key, memory.

Setup (printed in every line): loopback; the real `spindle gateway` (API keys file, three keys)
in front of real model-pod servers, each its own process.

- phase `fake`: `--fake-pods` pods over the fake fast engine (bench/fake_engine.py: one token
  per request per step, `--step-ms` a step; adapters a1 and a2 resident), `--streams` streams
  open at once (a closed loop: each finished stream is replaced until `--requests` are done),
  spread over the keys and over base / a1 / a2. No error is expected.
- phase `overload`: the same pods capped at `--max-running` requests each, with slower steps
  (`--overload-step-ms`) so requests stay in them: more streams than they take at once, so the
  pods refuse the rest with RESOURCE_EXHAUSTED, the gateway tries the other pod, then returns
  RESOURCE_EXHAUSTED. That code is the only error expected.
- phase `smollm2`: one SmolLM2 pod on the CPU at `--smol-concurrency` streams (base model).

Per phase: one line per adapter and per key (TTFT and end-to-end p50 / p90 / p99 in ms), one
summary line (requests/s, tokens/s, errors by code, the gateway's peak RSS and its RSS before
and after: memory must stay bounded by what is in flight, not grow with what was served).

    .venv/bin/python bench/load.py [--streams 1000] [--requests 4000] [--skip-smollm2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gateway import _wait_serving  # noqa: E402
from spindle.v1 import generation_pb2 as pb  # noqa: E402
from spindle.v1 import generation_pb2_grpc  # noqa: E402
from tests.service_helpers import Service, free_port, spawn, spawn_pod, wait_serving  # noqa: E402

KEYS = {"team-a": "key-a", "team-b": "key-b", "team-c": "key-c"}
ADAPTERS = ("a1", "a2")


@dataclass
class Result:
    key: str
    adapter: str
    code: str  # "OK" or the status code's name
    ttft: float
    e2e: float
    tokens: int


def _rss_mb(pid: int, field: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


async def _one(stub, key: str, adapter: str, i: int, tokens: int, text: bool) -> Result:
    req = pb.GenerateRequest(max_tokens=tokens)
    if text:
        req.text = f"Request {i}: tell me about the sea."
    else:
        req.token_ids.ids.extend([1, 2, 3, i % 1000])
    if adapter != "base":
        req.adapter = adapter
    req.sampling.ignore_eos = True
    start = time.perf_counter()
    first, n = 0.0, 0
    metadata = (("authorization", f"Bearer {KEYS[key]}"),)
    try:
        async for resp in stub.Generate(req, metadata=metadata, timeout=120):
            n += len(resp.chunk.token_ids)
            first = first or time.perf_counter() - start
        code = "OK" if n == tokens else "SHORT"
    except grpc.aio.AioRpcError as e:
        code = e.code().name
    return Result(key, adapter, code, first, time.perf_counter() - start, n)


async def _phase(address: str, streams: int, requests: int, tokens: int, adapters: tuple, text: bool,
                 gateway_pid: int) -> tuple[list[Result], float, float]:  # fmt: skip
    """A closed loop of `streams` concurrent streams until `requests` are done; (results, wall
    seconds, peak gateway RSS in MB sampled every 100 ms)."""
    results: list[Result] = []
    counter = iter(range(requests))
    keys = list(KEYS)
    channels = [grpc.aio.insecure_channel(address, options=[("grpc.channel_id", c)]) for c in range(8)]
    stubs = [generation_pb2_grpc.GenerationStub(ch) for ch in channels]

    async def worker(w: int) -> None:
        for i in counter:
            kind = adapters[i // len(keys) % len(adapters)]  # every key uses every adapter
            results.append(await _one(stubs[w % len(stubs)], keys[i % len(keys)], kind, i, tokens, text))

    peak = _rss_mb(gateway_pid)

    async def sample_rss() -> None:
        nonlocal peak
        while True:
            peak = max(peak, _rss_mb(gateway_pid))
            await asyncio.sleep(0.1)

    sampler = asyncio.create_task(sample_rss())
    started = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(streams)))
    wall = time.perf_counter() - started
    sampler.cancel()
    for ch in channels:
        await ch.close()
    return results, wall, peak


def _percentiles(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    if not xs:
        return {}
    pick = lambda q: round(1000 * xs[min(len(xs) - 1, int(q * len(xs)))], 2)  # noqa: E731
    return {"p50_ms": round(1000 * statistics.median(xs), 2), "p90_ms": pick(0.9), "p99_ms": pick(0.99)}


def report(phase: str, results: list[Result], wall: float, rss: dict[str, float], setup: dict) -> None:
    ok = [r for r in results if r.code == "OK"]
    for group, key_of in (("adapter", lambda r: r.adapter), ("key", lambda r: r.key)):
        by: dict[str, list[Result]] = defaultdict(list)
        for r in ok:
            by[key_of(r)].append(r)
        for name, rs in sorted(by.items()):
            line = {"bench": "load", "phase": phase, group: name, "requests": len(rs)}
            line |= {f"ttft_{k}": v for k, v in _percentiles([r.ttft for r in rs]).items()}
            line |= {f"e2e_{k}": v for k, v in _percentiles([r.e2e for r in rs]).items()}
            print(json.dumps(line | setup), flush=True)
    errors = Counter(r.code for r in results if r.code != "OK")
    summary = {
        "bench": "load", "phase": phase, "requests": len(results), "ok": len(ok),
        "errors": dict(errors), "rps": round(len(ok) / wall, 1),
        "tokens_per_s": round(sum(r.tokens for r in ok) / wall, 1), **rss,
    }  # fmt: skip
    print(json.dumps(summary | setup), flush=True)


def _fake_pod(step_ms: float, max_running: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, __file__, "--role", "pod", "--port", str(port), "--step-ms", str(step_ms),
           "--max-running", str(max_running)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL), f"127.0.0.1:{port}"


def _gateway(pods: list[str], logs: Path) -> Service:
    keys = logs / "keys"
    keys.write_text("".join(f"{name} {key} *\n" for name, key in KEYS.items()))
    args = ["--pods", ",".join(pods), "--api-keys-file", str(keys), "--health-interval", "0.5"]
    gateway = wait_serving(spawn("gateway", args, logs, "gateway"))
    deadline = time.monotonic() + 30
    while gateway.output().count("is healthy") < len(pods) and time.monotonic() < deadline:
        time.sleep(0.1)
    return gateway


@dataclass
class Phase:
    procs: list[subprocess.Popen]
    pods: list[str]
    streams: int
    requests: int
    tokens: int
    adapters: tuple[str, ...]


def _start_pods(name: str, args: argparse.Namespace, logs: Path) -> Phase:
    if name == "smollm2":
        pod = wait_serving(spawn_pod("smollm2", logs, "smollm2"), timeout=300)
        return Phase([pod.proc], [pod.address], args.smol_concurrency, args.smol_requests, args.smol_tokens,
                     ("base",))  # fmt: skip
    overload = name == "overload"
    cap, step_ms = (args.max_running, args.overload_step_ms) if overload else (1 << 30, args.step_ms)
    started = [_fake_pod(step_ms, cap) for _ in range(args.fake_pods)]
    for _, address in started:
        _wait_serving(address, timeout=300)
    return Phase([p for p, _ in started], [a for _, a in started], args.streams, args.requests, args.tokens,
                 ("base", *ADAPTERS))  # fmt: skip


def run_phase(name: str, args: argparse.Namespace, logs: Path, setup: dict) -> None:
    """Start the phase's pods and gateway, drive them, report, stop them."""
    phase = _start_pods(name, args, logs)
    gateway = None
    try:
        gateway = _gateway(phase.pods, logs)
        before = _rss_mb(gateway.proc.pid)
        results, wall, peak = asyncio.run(
            _phase(gateway.address, phase.streams, phase.requests, phase.tokens, phase.adapters,
                   name == "smollm2", gateway.proc.pid)
        )  # fmt: skip
        rss = {"gateway_rss_mb_before": round(before, 1), "gateway_rss_mb_peak": round(peak, 1),
               "gateway_rss_mb_after": round(_rss_mb(gateway.proc.pid), 1)}  # fmt: skip
        phase_setup = {"streams": phase.streams, "tokens_per_request": phase.tokens, "pods": len(phase.pods)}
        if name == "fake":
            phase_setup["engine_step_ms"] = args.step_ms
        elif name == "overload":
            phase_setup |= {"max_running_per_pod": args.max_running, "engine_step_ms": args.overload_step_ms}
        report(name, results, wall, rss, setup | phase_setup)
    finally:
        if gateway is not None:
            gateway.stop()
        for proc in phase.procs:
            proc.terminate()
            proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", choices=["bench", "pod"], default="bench", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--streams", type=int, default=1000, help="streams open at once [1000]")
    ap.add_argument("--requests", type=int, default=4000, help="requests per fake phase [4000]")
    ap.add_argument("--tokens", type=int, default=16, help="tokens per request, fake phases [16]")
    ap.add_argument("--step-ms", type=float, default=5.0, help="fake engine step [5 ms]")
    ap.add_argument("--fake-pods", type=int, default=2)
    ap.add_argument("--max-running", type=int, default=50, help="per fake pod, overload phase [50]")
    ap.add_argument("--overload-step-ms", type=float, default=50.0, help="fake step, overload phase [50 ms]")
    ap.add_argument("--smol-concurrency", type=int, default=4)
    ap.add_argument("--smol-requests", type=int, default=24)
    ap.add_argument("--smol-tokens", type=int, default=16)
    ap.add_argument("--phases", nargs="+", default=["fake", "overload", "smollm2"])
    args = ap.parse_args()
    if args.role == "pod":
        from bench.fake_engine import FakeFastEngine, run_pod

        engine = FakeFastEngine(args.step_ms / 1000, ADAPTERS, args.max_running)
        asyncio.run(run_pod(args.port, engine))
        return
    import tempfile

    logs = Path(tempfile.mkdtemp(prefix="spindle-load-"))
    setup = {"cpus": os.cpu_count(), "keys": len(KEYS)}
    for name in args.phases:
        run_phase(name, args, logs, setup)


if __name__ == "__main__":
    main()
