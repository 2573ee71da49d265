"""The main job: `spindle up` (model pod + gateway on the embedded SmolLM2) and the client CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from spindle.v1 import generation_pb2 as pb
from spindle.v1 import generation_pb2_grpc
from tests.service_helpers import ROOT, free_port

CLI = [sys.executable, "-m", "spindle.cli"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_up_answers_through_the_gateway_then_serves_until_ctrl_c(tmp_path, smollm2):
    from bench.lora import write_adapter

    adapter = write_adapter(tmp_path / "demo", smollm2.config, rank=4, seed=0)
    gw, pod, control, metrics, adapters = (free_port() for _ in range(5))
    env = {**os.environ, "OTEL_SDK_DISABLED": "true"}
    args = [
        "up",
        "--gateway-port",
        str(gw),
        "--pod-port",
        str(pod),
        "--pod-control-port",
        str(control),
        "--metrics-port",
        str(metrics),
        "--adapter-port",
        str(adapters),
        "--storage-dir",
        str(tmp_path / "registered"),
        "--lora",
        f"demo={adapter}",
    ]
    err = open(tmp_path / "up.err", "w")  # noqa: SIM115
    up = subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT, env=env)
    try:
        # While the pod loads it is up but NOT_SERVING, and refuses work with UNAVAILABLE.
        seen: set[int] = set()
        refused = None
        with grpc.insecure_channel(f"127.0.0.1:{pod}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            deadline = time.monotonic() + 60
            while health_pb2.HealthCheckResponse.SERVING not in seen and time.monotonic() < deadline:
                try:
                    seen.add(health.Check(health_pb2.HealthCheckRequest(), timeout=1).status)
                    if refused is None and seen == {health_pb2.HealthCheckResponse.NOT_SERVING}:
                        stub = generation_pb2_grpc.GenerationStub(ch)
                        list(stub.Generate(pb.GenerateRequest(text="hi"), timeout=5))
                except grpc.RpcError as e:
                    if e.code() == grpc.StatusCode.UNAVAILABLE and "loading" in (e.details() or ""):
                        refused = e.details()
                time.sleep(0.05)
        assert health_pb2.HealthCheckResponse.NOT_SERVING in seen and refused, (seen, refused)
        assert up.stdout.readline().startswith("> What is the capital of France?")
        answer = up.stdout.readline()
        assert answer.startswith("[base model] ") and "Paris" in answer
        with_adapter = up.stdout.readline()
        assert with_adapter.startswith("[demo] ") and len(with_adapter.strip()) > len("[demo]")
        question = "What is the capital of Italy? Answer in one sentence."
        chat = _cli(
            "chat",
            "--gateway",
            f"127.0.0.1:{gw}",
            "--temperature",
            "0",
            "--max-tokens",
            "24",
            "--json",
            question,
        )
        assert chat.returncode == 0, chat.stderr
        out = json.loads(chat.stdout)
        assert "Rome" in out["text"] and out["usage"]["completion_tokens"] == len(out["token_ids"])
        complete = _cli(
            "complete", "--gateway", f"127.0.0.1:{gw}", "--max-tokens", "5", "--seed", "1", "Once upon a"
        )
        assert complete.returncode == 0 and complete.stdout.strip(), complete.stderr
        models = _cli("models", "--gateway", f"127.0.0.1:{gw}")
        assert models.stdout.startswith("smollm2-135m-instruct\tbase") and "demo" in models.stdout
        listed = _cli("adapters", "--gateway", f"127.0.0.1:{gw}", "list")  # registered through the admin API
        assert listed.returncode == 0 and json.loads(listed.stdout)["name"] == "demo", listed.stderr
        assert (tmp_path / "registered" / "demo" / "v000001" / "meta.json").is_file()
        bad = _cli("chat", "--gateway", f"127.0.0.1:{gw}", "--temperature", "-1", "hi")
        assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "temperature" in bad.stderr
        assert up.poll() is None  # still serving
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        err.close()
    with grpc.insecure_channel(f"127.0.0.1:{gw}") as ch:  # both services are gone
        try:
            grpc.channel_ready_future(ch).result(timeout=0.5)
            raise AssertionError("the gateway still listens")
        except grpc.FutureTimeoutError:
            pass


def test_every_command_explains_itself():
    usage = _cli("--help").stdout
    for command in ("generate", "serve", "gateway", "up", "chat", "complete", "models", "adapters"):
        assert command in usage
    serve = _cli("serve", "--help").stdout
    for flag in ("--port", "--metrics-port", "--drain-timeout", "SPINDLE_PORT", "SPINDLE_MAX_NUM_SEQS"):
        assert flag in serve
    gateway = _cli("gateway", "--help").stdout
    for flag in ("--pods", "--pods-dns", "--api-keys-file", "SPINDLE_API_KEYS_FILE", "--health-interval"):
        assert flag in gateway
    service = _cli("adapter-service", "--help").stdout
    for flag in ("--s3-bucket", "--redis-url", "--pods-dns", "--base-model", "SPINDLE_STAGING_MAX_BYTES"):
        assert flag in service
    chat = _cli("chat", "--help").stdout
    assert "--adapter" in chat and "SPINDLE_API_KEY" in chat and "SPINDLE_GATEWAY" in chat
    no_pods = _cli("gateway", "--allow-unauthenticated")
    assert no_pods.returncode != 0 and "--pods" in no_pods.stderr
