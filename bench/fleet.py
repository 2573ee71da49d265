"""Fleet simulation: many adapters, skewed traffic, the real gateway and adapter service, on the CPU.

Setup (printed in the first line): loopback; a real Redis server; the adapter service (Redis
registry, a local storage directory holding every adapter) and the gateway, each the real
`spindle` command in its own process; `--pods` model pods, each the real model-pod server
(grpc.aio, AsyncEngine thread, servicers) over a FAKE ENGINE whose adapters take device memory
and load time (bench/fake_engine.py FakeLoraEngine, bench/fake_lora.py): `--device-mib` of
adapter memory per pod, an adapter's bytes from its rank (ranks 8/16/32/64, mostly small), a
load lasting bytes / bandwidth, least recently used idle adapters evicted to make room. The
pods run in this process, with the load generator: a closed loop of `--concurrency` clients
sending `--requests` requests through the gateway, each for an adapter drawn from a Zipf(`--zipf`)
distribution over `--adapters` adapters, `--tokens` tokens each. No adapter is on any pod at the
start: the service places each on demand (least adapters for the tail) and replicates the hot
head by popularity.

Output: JSON lines, one every `--report-every` requests and a summary: requests, failures,
residency hit ratio (requests that found their adapter loaded on the device of the pod the
gateway chose), churn (adapter loads and evictions per second, fleet-wide), latency, and at the
end the placements and replicas the service made and how many adapters each pod holds.
`first` counts the requests that were the first for their adapter: no pod could hold it, so
the gateway waited for the service to place it, and the request then found it resident (a
hit, paid for in latency); `warm_hit_ratio` is the hit ratio of all the other requests.

    .venv/bin/python bench/fleet.py [--pods 16] [--adapters 10000] [--requests 20000]
        [--concurrency 64] [--zipf 1.0] [--device-mib 512] [--report-every 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from adapter_service.store import LocalStore, Version  # noqa: E402
from bench.fake_engine import FakeLoraEngine  # noqa: E402
from bench.fake_lora import BYTES_PER_RANK, AdapterTiers, Speeds  # noqa: E402
from spindle.v1 import generation_pb2 as pb  # noqa: E402
from spindle.v1 import generation_pb2_grpc  # noqa: E402
from tests.adapter_helpers import redis_server  # noqa: E402
from tests.service_helpers import Service, free_port, spawn, wait_serving  # noqa: E402

RANKS, RANK_WEIGHTS = (8, 16, 32, 64), (4, 3, 2, 1)


@dataclass
class FleetConfig:
    pods: int = 16
    adapters: int = 10_000
    requests: int = 20_000
    concurrency: int = 64
    zipf: float = 1.0
    tokens: int = 4
    step_ms: float = 2.0
    device_mib: int = 512  # adapter memory of each pod's device
    host_adapters: int = 64  # adapters each pod keeps parsed in host memory
    slots: int = 64  # most adapters on one device at once, whatever their size
    poll_interval: float = 0.5  # the adapter service's
    hot_share: float = 0.02
    max_replicas: int = 4
    report_every: int = 2000
    seed: int = 0


@dataclass
class Window:
    """What the fleet did over a span of requests (the counters are differences)."""

    requests: int = 0
    failed: int = 0
    hits: int = 0
    misses: int = 0
    first: int = 0  # requests that were the first for their adapter (placed on demand for them)
    first_hits: int = 0
    loads: int = 0
    evictions: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)

    def line(self) -> dict:
        lat = sorted(self.latencies) or [0.0]
        arrived, warm = self.hits + self.misses, self.hits + self.misses - self.first
        return {
            "requests": self.requests,
            "failed": self.failed,
            "hit_ratio": _ratio(self.hits, arrived),
            "first": self.first,
            "warm_hit_ratio": _ratio(self.hits - self.first_hits, warm),
            "loads_per_s": round(self.loads / self.seconds, 1),
            "evictions_per_s": round(self.evictions / self.seconds, 1),
            "rps": round(self.requests / self.seconds, 1),
            "p50_ms": round(1000 * statistics.median(lat), 1),
            "p99_ms": round(1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], 1),
        }


def _ratio(part: int, whole: int) -> float | None:
    return round(part / whole, 4) if whole else None


class Fleet:
    """The fake pods' engines, read for their counters (without a lock: one step stale at most)."""

    def __init__(self, engines: list[FakeLoraEngine]) -> None:
        self.engines = engines

    def found(self, request_id: str) -> bool | None:
        """Whether the request found its adapter resident on its pod; None if it reached none."""
        for e in self.engines:
            hit = e.found.pop(request_id, None)
            if hit is not None:
                return hit
        return None

    def churn(self) -> tuple[int, int]:
        """Adapter loads and evictions so far, over all pods."""
        return sum(x.tiers.loads for x in self.engines), sum(x.tiers.evictions for x in self.engines)

    def placement(self, names: list[str]) -> dict:
        """How many pods hold each of `names` (any tier), and the adapters per pod."""
        held = [set(x.tiers.disk) for x in self.engines]
        per_pod = [len(h) for h in held]
        return {
            "replicas_of_top": [sum(n in h for h in held) for n in names],
            "adapters_per_pod": {"min": min(per_pod), "max": max(per_pod), "mean": statistics.fmean(per_pod)},
        }


# --- the adapters ---------------------------------------------------------------------------------


def adapter_names(n: int) -> list[str]:
    """By popularity: a-00000 is the most requested."""
    return [f"a-{i:05d}" for i in range(n)]


async def write_store(root: Path, names: list[str], rng: random.Random) -> None:
    """Every adapter registered in the service's storage (what Register leaves there), so the
    service indexes them all at its start. The weights file is a few unique bytes: only its
    sha256 travels; the fake pods take an adapter's size from its rank."""
    store = LocalStore(root)
    now = time.time()

    async def one(tmp: Path, name: str) -> None:
        rank = rng.choices(RANKS, RANK_WEIGHTS)[0]
        config = json.dumps({"peft_type": "LORA", "r": rank, "target_modules": ["q_proj", "v_proj"]}).encode()
        weights = tmp / name
        weights.write_bytes(f"{name}:{rng.random()}".encode())
        v = Version(name, 1, _sha256(weights), rank * BYTES_PER_RANK, rank, ["q_proj", "v_proj"], "fake", now)
        await store.put(v, config, weights)

    with tempfile.TemporaryDirectory(prefix="fleet-weights-") as tmp:
        for i in range(0, len(names), 256):
            await asyncio.gather(*(one(Path(tmp), n) for n in names[i : i + 256]))


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def zipf_draws(names: list[str], s: float, k: int, rng: random.Random) -> Iterator[str]:
    weights = [1.0 / (i + 1) ** s for i in range(len(names))]
    cum, total = [], 0.0
    for w in weights:
        total += w
        cum.append(total)
    for _ in range(k):
        yield names[min(bisect.bisect(cum, rng.random() * total), len(names) - 1)]


# --- the processes ----------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def fake_pods(cfg: FleetConfig, workdir: Path) -> Iterator[tuple[list[str], list[str], Fleet]]:
    """`cfg.pods` model pods in this event loop: (serving addresses, control addresses, engines)."""
    from model_service.pod import server
    from model_service.pod.state import ModelPod

    pods, servers, engines = [], [], []
    try:
        for i in range(cfg.pods):
            tiers = AdapterTiers(cfg.device_mib << 20, cfg.host_adapters, cfg.slots, Speeds())
            engine = FakeLoraEngine(cfg.step_ms / 1000, tiers)
            pod = ModelPod("fake-fleet", drain_timeout=1.0)
            srv = await server.start(pod, "127.0.0.1", 0, 0, None, str(workdir / f"pod{i}"))
            await pod.load(lambda engine=engine: engine)
            pods.append(pod)
            servers.append(srv)
            engines.append(engine)
        yield (
            [f"127.0.0.1:{s.port}" for s in servers],
            [f"127.0.0.1:{s.control_port}" for s in servers],
            Fleet(engines),
        )
    finally:
        for srv in servers:
            await srv.stop(0)
        for pod in pods:
            pod.close()


async def start_services(
    cfg: FleetConfig, workdir: Path, redis_url: str, pods: list[str], controls: list[str]
) -> tuple[Service, Service, int]:
    """The adapter service and the gateway (real `spindle` processes), once the gateway has
    polled every pod; and the service's metrics port."""
    metrics = free_port()
    service_args = [
        "--pods", ",".join(controls), "--redis-url", redis_url, "--storage-dir", str(workdir / "store"),
        "--base-model", "smollm2", "--metrics-port", str(metrics), "--poll-interval", str(cfg.poll_interval),
        "--lease-ttl", "10", "--hot-share", str(cfg.hot_share), "--max-replicas", str(cfg.max_replicas),
        "--log-level", "WARNING",
    ]  # fmt: skip
    service = spawn("adapter-service", service_args, workdir, "adapter-service")
    await asyncio.to_thread(wait_serving, service)
    gateway_args = [
        "--pods", ",".join(pods), "--allow-unauthenticated", "--adapter-service", service.address,
        "--health-interval", "1.0",
    ]  # fmt: skip
    gateway = spawn("gateway", gateway_args, workdir, "gateway")
    await asyncio.to_thread(wait_serving, gateway)
    deadline = time.monotonic() + 30
    while gateway.output().count("is healthy") < len(pods) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return service, gateway, metrics


def _scrape(port: int, names: tuple[str, ...]) -> dict[str, float]:
    """Sums of the service's Prometheus samples named `names` (every label set)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        sample = line.split("{")[0].split(" ")[0]
        if sample in out:
            out[sample] += float(line.rsplit(" ", 1)[1])
    return out


# --- the load ---------------------------------------------------------------------------------------


async def drive(
    cfg: FleetConfig, target: str, fleet: Fleet, names: list[str], emit: Callable[[dict], None]
) -> Window:
    """The closed loop; a JSON line every `report_every` requests. Returns the whole run."""
    draws = zipf_draws(names, cfg.zipf, cfg.requests, random.Random(cfg.seed + 1))
    total, window = Window(), Window()
    started = mark = time.monotonic()
    churn, seen, ids = fleet.churn(), set(), itertools.count()

    def close_window(now: float) -> None:
        nonlocal window, mark, churn
        now_churn = fleet.churn()
        window.loads, window.evictions = (b - a for a, b in zip(churn, now_churn, strict=True))
        window.seconds = now - mark
        emit({"window_end": total.requests, "elapsed_s": round(now - started, 1), **window.line()})
        window, mark, churn = Window(), now, now_churn

    def count(w: Window, latency: float, hit: bool | None, first: bool) -> None:
        w.requests += 1
        w.latencies.append(latency)
        w.hits += hit is True
        w.misses += hit is False
        w.first += first and hit is not None
        w.first_hits += first and hit is True

    async with grpc.aio.insecure_channel(target) as ch:
        generation = generation_pb2_grpc.GenerationStub(ch)

        async def worker() -> None:
            for name in draws:
                rid, first = f"r{next(ids)}", name not in seen
                seen.add(name)
                req = pb.GenerateRequest(
                    request_id=rid, token_ids=pb.TokenIds(ids=[1, 2, 3]), max_tokens=cfg.tokens, adapter=name
                )
                t0 = time.monotonic()
                try:
                    async for _ in generation.Generate(req, timeout=120):
                        pass
                except grpc.aio.AioRpcError as e:
                    window.failed += 1
                    total.failed += 1
                    emit({"failed": name, "code": e.code().name, "details": e.details()})
                latency, hit = time.monotonic() - t0, fleet.found(rid)
                for w in (window, total):
                    count(w, latency, hit, first)
                if window.requests >= cfg.report_every:
                    close_window(time.monotonic())

        await asyncio.gather(*(worker() for _ in range(cfg.concurrency)))
    if window.requests:
        close_window(time.monotonic())
    total.loads, total.evictions = fleet.churn()
    total.seconds = time.monotonic() - started
    return total


async def simulate(cfg: FleetConfig, workdir: Path, emit: Callable[[dict], None]) -> dict:
    """Run the whole simulation; returns the summary (also emitted as the last line)."""
    names = adapter_names(cfg.adapters)
    emit({"setup": dataclasses.asdict(cfg)})
    logging.getLogger("spindle.security").setLevel(logging.ERROR)  # open control ports: loopback only
    await write_store(workdir / "store", names, random.Random(cfg.seed))
    with redis_server(workdir) as redis_url:
        async with fake_pods(cfg, workdir) as (pods, controls, fleet):
            service, gateway, metrics = await start_services(cfg, workdir, redis_url, pods, controls)
            try:
                total = await drive(cfg, gateway.address, fleet, names, emit)
                placed = await asyncio.to_thread(
                    _scrape, metrics, ("spindle_adapter_placements_total", "spindle_adapter_spreads_total")
                )
                summary = {
                    "summary": True,
                    **total.line(),
                    "loads": total.loads,
                    "evictions": total.evictions,
                    "placements": int(placed["spindle_adapter_placements_total"]),
                    "spreads": int(placed["spindle_adapter_spreads_total"]),
                    **fleet.placement(names[:5]),
                }
            finally:
                gateway.stop()
                service.stop()
    emit(summary)
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(FleetConfig):
        ap.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    args = ap.parse_args()
    cfg = FleetConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(FleetConfig)})
    with tempfile.TemporaryDirectory(prefix="spindle-fleet-") as tmp:
        asyncio.run(simulate(cfg, Path(tmp), lambda line: print(json.dumps(line), flush=True)))


if __name__ == "__main__":
    main()
