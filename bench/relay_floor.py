"""The floor under the gateway's cost: bare gRPC relays (bytes in, bytes out; no auth, routing,
limits, tracing or failover) next to the real gateway, all in front of one fake-engine pod.

Targets, each its own process: the pod directly; a grpc.aio relay (what the gateway is built on);
a relay on grpc's sync server (a thread a stream); the real `spindle gateway`. A closed loop of
`--concurrency` clients sends requests of 16 tokens (17 messages) to each in turn, alternating in
`--slices` parts (bench/gateway.py's load test and CPU accounting). If the gateway costs what the
bare aio relay costs, its own logic is not where the time goes.

    .venv/bin/python bench/relay_floor.py [--requests 400] [--concurrency 1 16] [--slices 4]

One JSON line per (concurrency, target); a table last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gateway import ROOT, Sample, _wait_serving, load_test

METHOD = "/spindle.v1.Generation/Generate"


def _handler(generate: object) -> grpc.GenericRpcHandler:
    method = grpc.unary_stream_rpc_method_handler(generate)  # no (de)serializers: bytes as they are
    return grpc.method_handlers_generic_handler("spindle.v1.Generation", {"Generate": method})


async def serve_aio(port: int, pod: str) -> None:
    call = grpc.aio.insecure_channel(pod).unary_stream(METHOD)

    async def generate(request: bytes, context: grpc.aio.ServicerContext):
        async for message in call(request):
            yield message

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((_handler(generate),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def serve_sync(port: int, pod: str) -> None:
    call = grpc.insecure_channel(pod).unary_stream(METHOD)

    def generate(request: bytes, context: grpc.ServicerContext):
        yield from call(request)

    server = grpc.server(ThreadPoolExecutor(max_workers=64))
    server.add_generic_rpc_handlers((_handler(generate),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


def _start(ports: dict[str, int]) -> dict[str, subprocess.Popen]:
    from tests.service_helpers import free_port

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for name in ("pod", "aio", "sync", "gateway"):
        ports[name] = free_port()
    pod = f"127.0.0.1:{ports['pod']}"
    me = [sys.executable, __file__, "--role"]
    procs = {
        "pod": [sys.executable, str(ROOT / "bench/gateway.py"), "--role", "pod", "--port", str(ports["pod"])],
        "aio": [*me, "aio", "--port", str(ports["aio"]), "--pod", pod],
        "sync": [*me, "sync", "--port", str(ports["sync"]), "--pod", pod],
        "gateway": [sys.executable, "-m", "spindle.cli", "gateway", "--host", "127.0.0.1", "--port",
                    str(ports["gateway"]), "--http-port", "0", "--pods", pod, "--allow-unauthenticated",
                    "--log-level", "ERROR"],
    }  # fmt: skip
    quiet = subprocess.DEVNULL
    return {name: subprocess.Popen(cmd, env=env, cwd=ROOT, stderr=quiet) for name, cmd in procs.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", choices=["bench", "aio", "sync"], default="bench", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--pod", default="", help=argparse.SUPPRESS)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--slices", type=int, default=4)
    args = ap.parse_args()
    if args.role == "aio":
        return asyncio.run(serve_aio(args.port, args.pod))
    if args.role == "sync":
        return serve_sync(args.port, args.pod)
    ports: dict[str, int] = {}
    procs = _start(ports)
    try:
        _wait_serving(f"127.0.0.1:{ports['pod']}")
        _wait_serving(f"127.0.0.1:{ports['gateway']}")
        time.sleep(1)  # the bare relays have no health service
        rows = []
        for c in args.concurrency:
            samples = {name: Sample() for name in ports}
            for _ in range(args.slices):
                for name, port in ports.items():
                    pids = {"pod": procs["pod"].pid} | ({"relay": procs[name].pid} if name != "pod" else {})
                    n = args.requests // args.slices
                    asyncio.run(load_test(f"127.0.0.1:{port}", pids, n, c, 16, samples[name]))
            direct = samples["pod"].summary()
            for name, sample in samples.items():
                r = sample.summary()
                line = {"bench": "relay_floor", "concurrency": c, "target": name, **r, "cpus": os.cpu_count()}
                line["rps_ratio"] = round(r["rps"] / direct["rps"], 3)
                line["added_p50_ms"] = round(r["p50_ms"] - direct["p50_ms"], 2)
                print(json.dumps(line), flush=True)
                rows.append(line)
        print(f"\n{'c':>3} {'target':<8} {'rps ratio':>9} {'added p50 ms':>12} {'relay CPU ms/request':>20}")
        for r in rows:
            cpu = r["cpu_ms_per_request"].get("relay", "")
            c, target = r["concurrency"], r["target"]
            print(f"{c:>3} {target:<8} {r['rps_ratio']:>9} {r['added_p50_ms']:>12} {cpu:>20}")
    finally:
        for p in procs.values():
            p.terminate()
            p.wait(timeout=30)


if __name__ == "__main__":
    main()
