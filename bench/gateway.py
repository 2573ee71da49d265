"""What the gateway costs: requests/s and p50/p99 latency through the gateway vs the pod directly.

Setup (printed in every line): loopback; one model pod and one gateway, each its own process.
The pod is the real model-pod server (grpc.aio, AsyncEngine thread, servicers, metrics, tracing
SDK without an exporter) over a FAKE FAST ENGINE: the forward pass is replaced by a stub that
gives every running request one token per step and sleeps `--step-ms` per step, so the numbers
measure the serving path, not a model. The gateway is the real `spindle gateway`. A closed loop
of `--concurrency` clients each sends requests of `--tokens` tokens, first straight to the pod,
then through the gateway; "added" = gateway minus pod.

    .venv/bin/python bench/gateway.py [--requests 400] [--concurrency 1 16] [--tokens 16] [--step-ms 1]
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
import uuid
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from spindle.v1 import generation_pb2 as pb  # noqa: E402
from spindle.v1 import generation_pb2_grpc  # noqa: E402


class FakeFastEngine:
    """The engine surface the model pod uses (`model_service.pod.handle.EngineHandle`), no model behind it."""

    max_model_len = 4096
    vocab_size = 32000

    def __init__(self, step_s: float) -> None:
        from model_service.engine.config import EngineConfig

        self.step_s = step_s
        self.config = EngineConfig(max_loras=0)
        self.running: dict[str, list] = {}  # request id -> [prompt length, max tokens, tokens so far]
        self._pending: list = []

    def add_request(self, prompt=None, *, messages=None, prompt_token_ids=None, params=None, request_id=None,
                    priority=0, adapter=None):  # fmt: skip
        from model_service.errors import NotFoundError

        if adapter is not None:
            raise NotFoundError(f"unknown adapter {adapter!r}; this engine serves no adapters")
        n = len(prompt_token_ids or []) or len(prompt or "") or 1
        request_id = request_id or uuid.uuid4().hex
        self.running[request_id] = [n, params.max_tokens, [], time.monotonic()]
        return request_id

    def abort(self, request_id: str) -> bool:
        entry = self.running.pop(request_id, None)
        if entry is not None:
            self._pending.append(self._out(request_id, entry, [], "abort"))
        return entry is not None

    def has_unfinished(self) -> bool:
        return bool(self.running or self._pending)

    def step(self):
        time.sleep(self.step_s)
        outputs, self._pending = self._pending, []
        for rid, entry in list(self.running.items()):
            token = 100 + len(entry[2])
            entry[2].append(token)
            done = len(entry[2]) >= entry[1]
            if done:
                del self.running[rid]
            outputs.append(self._out(rid, entry, [token], "length" if done else None))
        return outputs

    def _out(self, rid, entry, new, reason):
        from model_service.engine.sequence import RequestOutput

        text = "x" * len(entry[2])
        return RequestOutput(
            rid, new, "x" * len(new), list(entry[2]), text, reason is not None, reason, entry[0],
            first_scheduled_at=entry[3],
        )  # fmt: skip

    def stats(self):
        from model_service.engine.engine import EngineStats

        return EngineStats(0, 0, len(self.running), 1000, 1000, 0, 0, 0, 0, 0, 0)

    def list_adapters(self):
        return []

    def on_lost(self, callback):
        """No device to lose."""

    def submit_control(self, op):
        from concurrent.futures import Future

        from model_service.lora.pool import AdapterNotFoundError

        future = Future()
        future.set_exception(AdapterNotFoundError(f"{op!r}: this engine serves no adapters"))
        return future


async def run_pod(port: int, step_s: float) -> None:
    from model_service.pod import server
    from model_service.pod.state import ModelPod
    from spindle import serving, telemetry

    pod = ModelPod("fake-fast-engine", drain_timeout=1.0)
    srv = await server.start(pod, "127.0.0.1", port, 0, telemetry.tracer_provider_from_env("bench-pod"))
    await pod.load(lambda: FakeFastEngine(step_s))
    serving.on_shutdown_signal(pod.request_exit)
    await pod.exit_requested.wait()
    await srv.stop(0)
    pod.close()


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


async def load_test(address: str, requests: int, concurrency: int, tokens: int) -> dict:
    latencies: list[float] = []
    counter = iter(range(requests))
    async with grpc.aio.insecure_channel(address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)

        async def worker() -> None:
            for i in counter:
                req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3, i % 1000]), max_tokens=tokens)
                start = time.perf_counter()
                n = 0
                async for resp in stub.Generate(req, timeout=30):
                    n += len(resp.chunk.token_ids)
                assert n == tokens
                latencies.append(time.perf_counter() - start)

        await asyncio.gather(*(worker() for _ in range(min(concurrency, 4))))  # warm the connections
        latencies.clear()
        counter = iter(range(requests))
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    latencies.sort()
    return {
        "rps": round(len(latencies) / wall, 1),
        "p50_ms": round(1000 * statistics.median(latencies), 2),
        "p99_ms": round(1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", choices=["bench", "pod"], default="bench", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--step-ms", type=float, default=1.0)
    args = ap.parse_args()
    if args.role == "pod":
        asyncio.run(run_pod(args.port, args.step_ms / 1000))
        return
    from tests.service_helpers import free_port

    pod_port, gw_port = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    pod = subprocess.Popen([sys.executable, __file__, "--role", "pod", "--port", str(pod_port),
                            "--step-ms", str(args.step_ms)], env=env, stderr=subprocess.DEVNULL)  # fmt: skip
    gateway = subprocess.Popen(
        [sys.executable, "-m", "spindle.cli", "gateway", "--host", "127.0.0.1", "--port", str(gw_port),
         "--pods", f"127.0.0.1:{pod_port}", "--allow-unauthenticated", "--log-level", "WARNING"],
        env=env, cwd=ROOT,
    )  # fmt: skip
    try:
        _wait_serving(f"127.0.0.1:{pod_port}")
        _wait_serving(f"127.0.0.1:{gw_port}")
        setup = {
            "engine": "fake fast engine (no model; one token per request per step)",
            "step_ms": args.step_ms,
            "tokens_per_request": args.tokens,
            "requests": args.requests,
            "cpus": os.cpu_count(),
        }
        for c in args.concurrency:
            direct = asyncio.run(load_test(f"127.0.0.1:{pod_port}", args.requests, c, args.tokens))
            via = asyncio.run(load_test(f"127.0.0.1:{gw_port}", args.requests, c, args.tokens))
            for target, r in (("pod", direct), ("gateway", via)):
                print(
                    json.dumps({"bench": "gateway", "target": target, "concurrency": c, **r, **setup}),
                    flush=True,
                )
            added = {k: round(via[k] - direct[k], 2) for k in ("p50_ms", "p99_ms")}
            ratio = round(via["rps"] / direct["rps"], 3)
            line = {"bench": "gateway", "target": "added_by_gateway", "concurrency": c, "rps_ratio": ratio}
            print(json.dumps({**line, **added, **setup}), flush=True)
    finally:
        for p in (gateway, pod):
            p.terminate()
            p.wait(timeout=30)


if __name__ == "__main__":
    main()
