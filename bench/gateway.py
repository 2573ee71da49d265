"""What the gateway costs: requests/s and p50/p99 latency through the gateway vs the pod directly.

Setup (printed in every line): loopback; one model pod and one gateway, each its own process.
The pod is the real model-pod server (grpc.aio, AsyncEngine thread, servicers, metrics, tracing
SDK without an exporter) over a FAKE FAST ENGINE (bench/fake_engine.py): every running request
gets one token per step and a step sleeps `--step-ms`, so the numbers measure the serving path,
not a model. The gateway is the real `spindle gateway`. A closed loop
of `--concurrency` clients each sends requests of `--tokens` tokens, first straight to the pod,
then through the gateway, alternating in `--slices` parts (a change in the machine's load then
hits both); "added" = gateway minus pod. `cpu_ms_per_request` is the CPU time
(user + system, from /proc) each process spent per request during the run, the client's (this
process) included: steadier than latency on a shared machine. `--stream-interval N` runs the pod
with `spindle serve --stream-interval N`; `--pin POD GATEWAY CLIENT` gives each its CPUs
(taskset lists, e.g. `--pin 0 1 1`).

    .venv/bin/python bench/gateway.py [--requests 400] [--concurrency 1 16] [--tokens 16] [--step-ms 1]
        [--slices 4] [--stream-interval 1] [--pin POD GATEWAY CLIENT]
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
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from spindle.v1 import generation_pb2 as pb  # noqa: E402
from spindle.v1 import generation_pb2_grpc  # noqa: E402


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_serving(address: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            try:
                if health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise TimeoutError(address)


@dataclass
class Sample:
    """What the closed loops against one target measured, over one or more slices."""

    latencies: list[float] = field(default_factory=list)
    wall: float = 0.0
    requests: int = 0
    messages: int = 0
    cpu_s: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict:
        lat = sorted(self.latencies)
        return {
            "rps": round(len(lat) / self.wall, 1),
            "p50_ms": round(1000 * statistics.median(lat), 2),
            "p99_ms": round(1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], 2),
            "messages_per_request": round(self.messages / self.requests, 2),
            "cpu_ms_per_request": {k: round(1000 * v / self.requests, 2) for k, v in self.cpu_s.items()},
        }


Send = Callable[[int], Awaitable[int]]  # request number -> messages received (its tokens checked)


async def closed_loop(
    send: Send, pids: dict[str, int], requests: int, concurrency: int, into: Sample
) -> None:
    """A closed loop of `concurrency` clients for `requests` requests (after a warm-up), with the
    CPU time each process in `pids` and this one (the client) spent meanwhile, added to `into`."""
    latencies: list[float] = []
    messages = 0

    async def worker(counter: Iterator[int]) -> None:
        nonlocal messages
        for i in counter:
            start = time.perf_counter()
            received = await send(i)  # not `messages += await ...`: that reads `messages` before the wait
            latencies.append(time.perf_counter() - start)
            messages += received

    warm = iter(range(max(8, 2 * concurrency)))
    await asyncio.gather(*(worker(warm) for _ in range(min(concurrency, 4))))  # warm the connections
    latencies.clear()
    messages = 0
    counter = iter(range(requests))
    pids = {**pids, "client": os.getpid()}
    cpu_before = {name: _cpu_s(pid) for name, pid in pids.items()}
    started = time.perf_counter()
    await asyncio.gather(*(worker(counter) for _ in range(concurrency)))
    into.wall += time.perf_counter() - started
    for name, pid in pids.items():
        into.cpu_s[name] = into.cpu_s.get(name, 0.0) + _cpu_s(pid) - cpu_before[name]
    into.latencies += latencies
    into.requests += requests
    into.messages += messages


async def load_test(
    address: str, pids: dict[str, int], requests: int, concurrency: int, tokens: int, into: Sample
) -> None:
    """`closed_loop` of gRPC Generate streams of `tokens` tokens to `address`."""
    async with grpc.aio.insecure_channel(address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)

        async def send(i: int) -> int:
            req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3, i % 1000]), max_tokens=tokens)
            n = messages = 0
            async for resp in stub.Generate(req, timeout=30):
                n += len(resp.chunk.token_ids)
                messages += 1
            assert n == tokens
            return messages

        await closed_loop(send, pids, requests, concurrency, into)


def start_pod_and_gateway(
    step_ms: float,
    stream_interval: int,
    pin: list[str] | None = None,
    gateway_args: Sequence[str] = (),
    gateway_env: Sequence[str] = (),
) -> tuple[subprocess.Popen, subprocess.Popen, int, int]:
    """A fake-engine pod and a `spindle gateway` (with `gateway_args`) in front of it, SERVING:
    the processes and their gRPC ports."""
    from tests.service_helpers import free_port

    pin_pod, pin_gateway = [["taskset", "-c", cpus] for cpus in pin[:2]] if pin else ([], [])
    pod_port, gw_port = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    pod = subprocess.Popen([*pin_pod, sys.executable, __file__, "--role", "pod", "--port", str(pod_port),
                            "--step-ms", str(step_ms), "--stream-interval", str(stream_interval)],
                           env=env, stderr=subprocess.DEVNULL)  # fmt: skip
    gateway = subprocess.Popen(
        [*pin_gateway, sys.executable, "-m", "spindle.cli", "gateway", "--host", "127.0.0.1",
         "--port", str(gw_port), "--http-port", "0", "--pods", f"127.0.0.1:{pod_port}",
         "--allow-unauthenticated", "--log-level", "WARNING", *gateway_args],
        env={**env, **dict(kv.split("=", 1) for kv in gateway_env)}, cwd=ROOT,
    )  # fmt: skip
    try:
        _wait_serving(f"127.0.0.1:{pod_port}")
        _wait_serving(f"127.0.0.1:{gw_port}")
    except BaseException:
        for p in (gateway, pod):
            p.terminate()
        raise
    return pod, gateway, pod_port, gw_port


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", choices=["bench", "pod"], default="bench", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--step-ms", type=float, default=1.0)
    ap.add_argument("--slices", type=int, default=4, help="pod and gateway runs alternate this often [4]")
    ap.add_argument("--stream-interval", type=int, default=1, help="the pod's --stream-interval [1]")
    ap.add_argument("--pin", nargs=3, metavar=("POD", "GATEWAY", "CLIENT"), help="CPU lists (taskset -c)")
    ap.add_argument("--gateway-env", nargs="*", default=[], metavar="NAME=VALUE", help="for the gateway only")
    args = ap.parse_args()
    if args.role == "pod":
        from bench.fake_engine import FakeFastEngine, run_pod

        asyncio.run(run_pod(args.port, FakeFastEngine(args.step_ms / 1000), args.stream_interval))
        return
    if args.pin:  # this process (the client), every thread
        subprocess.run(["taskset", "-a", "-pc", args.pin[2], str(os.getpid())], check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip
    pod, gateway, pod_port, gw_port = start_pod_and_gateway(
        args.step_ms, args.stream_interval, args.pin, gateway_env=args.gateway_env
    )
    try:
        setup = {
            "engine": "fake fast engine (no model; one token per request per step)",
            "step_ms": args.step_ms,
            "tokens_per_request": args.tokens,
            "stream_interval": args.stream_interval,
            "requests": args.requests,
            "slices": args.slices,
            "cpus": os.cpu_count(),
            "gateway_env": args.gateway_env,
            "pinned": dict(zip(("pod", "gateway", "client"), args.pin, strict=True)) if args.pin else None,
        }
        pids = {"pod": pod.pid, "gateway": gateway.pid}
        for c in args.concurrency:
            samples = Sample(), Sample()
            n = args.requests // args.slices
            for _ in range(args.slices):  # alternate, so that a change in the machine's load hits both
                direct_pids = {"pod": pod.pid}
                asyncio.run(load_test(f"127.0.0.1:{pod_port}", direct_pids, n, c, args.tokens, samples[0]))
                asyncio.run(load_test(f"127.0.0.1:{gw_port}", pids, n, c, args.tokens, samples[1]))
            report_pair("gateway", c, ("pod", samples[0]), ("gateway", samples[1]), setup)
    finally:
        for p in (gateway, pod):
            p.terminate()
            p.wait(timeout=30)


def report_pair(
    bench: str, concurrency: int, base: tuple[str, Sample], other: tuple[str, Sample], setup: dict[str, Any]
) -> None:
    """A JSON line for each of two targets at one concurrency, then one for what the second adds
    over the first (`added_by_<other>`: p50 / p99 ms, and its requests/s ratio)."""
    (base_name, base_sample), (other_name, other_sample) = base, other
    first, second = base_sample.summary(), other_sample.summary()
    for target, r in ((base_name, first), (other_name, second)):
        line = {"bench": bench, "target": target, "concurrency": concurrency}
        print(json.dumps({**line, **r, **setup}), flush=True)
    added = {k: round(second[k] - first[k], 2) for k in ("p50_ms", "p99_ms")}
    line = {"bench": bench, "target": f"added_by_{other_name}", "concurrency": concurrency,
            "rps_ratio": round(second["rps"] / first["rps"], 3)}  # fmt: skip
    print(json.dumps({**line, **added, **setup}), flush=True)


if __name__ == "__main__":
    main()
