"""What the OpenAI-compatible HTTP API costs over gRPC, through the gateway.

(Not `bench/http.py`: run as a script, a file's folder comes first on sys.path, and a `bench/http.py`
would stand in for the standard library's `http` in every bench script that imports aiohttp.)

Setup (printed in every line): loopback; bench/gateway.py's fake-engine pod (the real pod
server over a fake fast engine: every running request gets one token per `--step-ms` step, so
the serving path is measured, not a model) behind the real `spindle gateway`, with its HTTP
port on. A closed loop of `--concurrency` clients sends the same requests (4 prompt token ids,
`--tokens` tokens, streamed) through the gateway over gRPC (grpc.aio) and over HTTP (aiohttp:
POST /v1/completions with `stream: true`, server-sent events to [DONE]; `--no-stream` for one
JSON answer), alternating in `--slices` parts so a change in the machine's load hits both.
"added" = HTTP minus gRPC; `cpu_ms_per_request` per process (the gateway's is what the HTTP
layer adds on the server; the client's is aiohttp's against grpc.aio's).
Targets (issue 31): HTTP adds <= 1 ms p50 at concurrency 1 and keeps >= 0.9x gRPC's requests/s
at 16.

    .venv/bin/python bench/openai_http.py [--requests 400] [--concurrency 1 16] [--tokens 16] [--step-ms 1]
        [--slices 4] [--no-stream]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gateway import Sample, closed_loop, load_test, report_pair, start_pod_and_gateway
from tests.service_helpers import free_port


async def http_load_test(
    url: str, pids: dict[str, int], requests: int, concurrency: int, tokens: int, stream: bool, into: Sample
) -> None:
    """`closed_loop` of POST /v1/completions of `tokens` tokens, streamed or not."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:

        async def send(i: int) -> int:
            body = {"prompt": [1, 2, 3, i % 1000], "max_tokens": tokens, "stream": stream}
            if stream:
                body["stream_options"] = {"include_usage": True}
            async with session.post(f"{url}/v1/completions", json=body) as response:
                assert response.status == 200, await response.text()
                if not stream:
                    assert (await response.json())["usage"]["completion_tokens"] == tokens
                    return 1
                events, usage = 0, None
                async for line in response.content:
                    if line.startswith(b"data: {"):
                        events += 1
                        usage = json.loads(line[6:]).get("usage") or usage
                assert usage["completion_tokens"] == tokens
                return events

        await closed_loop(send, pids, requests, concurrency, into)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--step-ms", type=float, default=1.0)
    ap.add_argument("--slices", type=int, default=4, help="gRPC and HTTP runs alternate this often [4]")
    ap.add_argument("--no-stream", dest="stream", action="store_false", help="HTTP answers as one JSON")
    args = ap.parse_args()
    http_port = free_port()
    pod, gateway, _, gw_port = start_pod_and_gateway(
        args.step_ms, 1, gateway_args=["--http-port", str(http_port)]
    )
    setup = {
        "engine": "fake fast engine (no model; one token per request per step)",
        "step_ms": args.step_ms,
        "tokens_per_request": args.tokens,
        "http_stream": args.stream,
        "requests": args.requests,
        "slices": args.slices,
        "cpus": os.cpu_count(),
    }
    try:
        pids = {"pod": pod.pid, "gateway": gateway.pid}
        url = f"http://127.0.0.1:{http_port}"
        for c in args.concurrency:
            grpc_sample, http_sample = Sample(), Sample()
            n = args.requests // args.slices
            for _ in range(args.slices):
                asyncio.run(load_test(f"127.0.0.1:{gw_port}", pids, n, c, args.tokens, grpc_sample))
                asyncio.run(http_load_test(url, pids, n, c, args.tokens, args.stream, http_sample))
            report_pair("http", c, ("grpc", grpc_sample), ("http", http_sample), setup)
    finally:
        for p in (gateway, pod):
            p.terminate()
            p.wait(timeout=30)


if __name__ == "__main__":
    main()
