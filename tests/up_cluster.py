"""`spindle up` once per test session, shared by the tests of the quickstart and of the HTTP API.

Starting it (a model pod on the embedded SmolLM2, the adapter service, a gateway) is most of
what those tests cost, so they share one. Starting it is also a test: while the pod loads it is
up but NOT_SERVING and refuses work with UNAVAILABLE; what was seen is kept for the quickstart
test to check. At the end of the session Ctrl-C must stop it cleanly (exit 0, ports closed).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from spindle.v1 import generation_pb2 as pb
from spindle.v1 import generation_pb2_grpc
from tests.service_helpers import ROOT, free_port

ADAPTER = "demo"  # the random adapter `spindle up` registers


@dataclass
class Up:
    process: subprocess.Popen
    gateway: str  # gRPC HOST:PORT
    http: str  # the gateway's OpenAI base URL (…/v1)
    pod: str  # the pod's gRPC HOST:PORT
    pod_http: str  # the pod's OpenAI base URL
    storage: Path
    stderr: Path  # where it says what it serves and how to try it
    health_seen: set[int] = field(default_factory=set)  # the pod's statuses while it loaded
    refused_while_loading: str | None = None
    answers: list[str] = field(default_factory=list)  # the first lines it printed


def try_lines(up: Up, timeout: float = 30) -> list[str]:
    """The commands `spindle up` printed under "Try:" (it prints them once it has answered)."""
    deadline = time.monotonic() + timeout
    while "Ctrl-C stops" not in up.stderr.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    text = up.stderr.read_text()
    return [line.strip() for line in text[text.index("Try:") : text.index("Ctrl-C stops")].splitlines()[1:]]


def _watch_loading(up: Up, timeout: float = 90) -> None:
    """Until the pod is SERVING: its health statuses, and a Generate refused while it loads. The
    channel retries a refused connection every 50-100 ms (gRPC's default backoff waits 1 s, then
    longer): the pod binds its port before it loads, and a load from the GGUF conversion cache
    takes ~2 s, which the default backoff could sleep through."""
    fast_retry = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.min_reconnect_backoff_ms", 50),
                  ("grpc.max_reconnect_backoff_ms", 100)]  # fmt: skip
    with grpc.insecure_channel(up.pod, options=fast_retry) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        deadline = time.monotonic() + timeout
        while health_pb2.HealthCheckResponse.SERVING not in up.health_seen and time.monotonic() < deadline:
            try:
                up.health_seen.add(health.Check(health_pb2.HealthCheckRequest(), timeout=1).status)
                if up.refused_while_loading is None and up.health_seen == {
                    health_pb2.HealthCheckResponse.NOT_SERVING
                }:
                    list(
                        generation_pb2_grpc.GenerationStub(ch).Generate(
                            pb.GenerateRequest(text="hi"), timeout=5
                        )
                    )
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.UNAVAILABLE and "loading" in (e.details() or ""):
                    up.refused_while_loading = e.details()
            time.sleep(0.05)


@pytest.fixture(scope="session")
def spindle_up(smollm2, tmp_path_factory) -> Iterator[Up]:
    from bench.lora import write_adapter

    tmp = tmp_path_factory.mktemp("spindle_up")
    adapter = write_adapter(tmp / ADAPTER, smollm2.config, rank=4, seed=0)
    gw, http, pod, pod_http, control, metrics, adapters = (free_port() for _ in range(7))
    args = [
        "up", "--gateway-port", str(gw), "--http-port", str(http), "--pod-port", str(pod),
        "--pod-http-port", str(pod_http), "--pod-control-port", str(control), "--metrics-port", str(metrics),
        "--adapter-port", str(adapters), "--storage-dir", str(tmp / "registered"),
        "--lora", f"{ADAPTER}={adapter}",
    ]  # fmt: skip
    env = {**os.environ, "OTEL_SDK_DISABLED": "true"}
    err = open(tmp / "up.err", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "spindle.cli", *args],
        stdout=subprocess.PIPE,
        stderr=err,
        text=True,
        cwd=ROOT,
        env=env,
    )
    up = Up(proc, f"127.0.0.1:{gw}", f"http://127.0.0.1:{http}/v1", f"127.0.0.1:{pod}",
            f"http://127.0.0.1:{pod_http}/v1", tmp / "registered", tmp / "up.err")  # fmt: skip
    try:
        _watch_loading(up)
        up.answers = [proc.stdout.readline() for _ in range(3)]  # the prompt, the base model, the adapter
        yield up
        assert proc.poll() is None, "spindle up exited while the tests ran"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        with grpc.insecure_channel(up.gateway) as ch, pytest.raises(grpc.FutureTimeoutError):
            grpc.channel_ready_future(ch).result(timeout=0.5)  # every service is gone
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        err.close()
