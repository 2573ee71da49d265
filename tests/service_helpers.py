"""Real service processes on loopback for the service tests: start, wait for SERVING, stop."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from spindle.v1 import generation_pb2 as pb
from spindle.v1 import generation_pb2_grpc, pod_status_pb2, pod_status_pb2_grpc
from tests.zygote import Forked, fork_pod

ROOT = Path(__file__).resolve().parents[1]
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING


_handed_out: set[int] = set()


def free_port() -> int:
    """A port nothing listens on now and that this process has not handed out before. A port is
    picked here and bound later, by a child process; the OS may offer it again in between, and
    once gave a fixture's adapter service the same port for gRPC and for metrics ("Address
    already in use" at its start)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


@dataclass
class Service:
    proc: subprocess.Popen | Forked
    address: str
    log: Path
    statuses: list[int] = field(default_factory=list)  # health statuses seen while waiting
    control_address: str = ""  # a model pod's ModelControl port

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address)

    def control_channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.control_address)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        """Signal, then `wait`."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.wait(timeout)

    def wait(self, timeout: float = 30) -> int:
        """Wait for the exit, and kill what did not exit in `timeout`, its threads' stacks dumped
        into its log first (SIGUSR1: `serving.setup_logging`), so a hung shutdown says where."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
            self.proc.kill()
            return self.proc.wait()

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def spawn(
    command: str,
    args: list[str],
    log_dir: Path,
    name: str,
    env: dict[str, str] | None = None,
    port: int | None = None,
) -> Service:
    port = port or free_port()
    log = log_dir / f"{name}.log"
    # tracing on (the default), nothing exported; no OpenAI HTTP port unless a test asks (they
    # would all want the default one)
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "SPINDLE_HTTP_PORT": "0", **(env or {})}
    cmd = [
        sys.executable,
        "-m",
        "spindle.cli",
        command,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *args,
    ]
    if command == "serve" and os.environ.get("SPINDLE_TEST_FORK", "1") != "0":
        proc = fork_pod(cmd[3:], env, log)  # the same command, without ~6 s of imports (tests/zygote.py)
    else:
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    return Service(proc, f"127.0.0.1:{port}", log)


def spawn_pod(model: str, log_dir: Path, name: str = "pod", *extra: str, port: int | None = None) -> Service:
    """A model pod; `port` to restart one where its gateway knows it."""
    control = free_port()
    args = ["--model", model, "--metrics-port", "0", "--num-kv-blocks", "64", "--control-port", str(control)]
    service = spawn("serve", [*args, *extra], log_dir, name, port=port)
    service.control_address = f"127.0.0.1:{control}"
    return service


def wait_serving(service: Service, timeout: float = 120.0) -> Service:
    deadline = time.monotonic() + timeout
    with service.channel() as ch:
        health = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if service.proc.poll() is not None:
                raise RuntimeError(f"{service.address} exited {service.proc.returncode}:\n{service.output()}")
            try:
                status = health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                service.statuses.append(status)
                if status == SERVING:
                    return service
            except grpc.RpcError:
                pass
            time.sleep(0.05)
    raise TimeoutError(f"{service.address} not SERVING after {timeout} s:\n{service.output()}")


KEYS = """# name key adapters
alice  key-alice  *
bob    key-bob    -
carol  key-carol  sql-lora
"""
FAST_HEALTH = ["--health-interval", "0.2", "--health-timeout", "0.5", "--failure-threshold", "2"]


def start_cluster(model: str, tmp: Path) -> tuple[list[Service], Service]:
    """Two pods of `model` and a gateway in front of them (KEYS, health polled fast), once the
    gateway has seen both pods healthy."""
    pods = [spawn_pod(model, tmp, f"pod{i}") for i in range(2)]
    keys = tmp / "keys"
    keys.write_text(KEYS)
    pods_flag = ",".join(p.address for p in pods)
    gateway = spawn(
        "gateway", ["--pods", pods_flag, "--api-keys-file", str(keys), *FAST_HEALTH], tmp, "gateway"
    )
    for p in pods:
        wait_serving(p)
    wait_serving(gateway)
    deadline = time.monotonic() + 10  # until the gateway has seen both pods healthy
    while gateway.output().count("is healthy") < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    return pods, gateway


def stop_all(services: Iterable[Service]) -> None:
    """SIGTERM to every one at once, then wait for each: a service takes a second or more to exit
    (its drain, its servers' grace), and they need not wait for one another."""
    services = list(services)
    for s in services:
        if s.proc.poll() is None:
            s.proc.send_signal(signal.SIGTERM)
    for s in services:
        s.wait()


def stop_cluster(pods: list[Service], gateway: Service) -> None:
    """The gateway, then every pod at once."""
    for s in (gateway, *pods):
        if s.proc.poll() is None:
            os.kill(s.proc.pid, signal.SIGCONT)  # a test may have frozen it
    gateway.stop()
    stop_all(pods)


@pytest.fixture(scope="session")
def tiny_cluster(tiny_llama, tmp_path_factory):
    """`start_cluster` on the tiny Llama, shared by test_gateway.py and test_gateway_failover.py
    (one xdist worker runs both: tests/xdist_scheduling.py): three processes cost seconds of two
    shared cores to start. A test that breaks a pod leaves the cluster whole again (a frozen pod
    thawed and back in rotation, a killed one restarted on its port and healthy)."""
    pods, gateway = start_cluster(tiny_llama.name, tmp_path_factory.mktemp("cluster"))
    yield pods, gateway
    stop_cluster(pods, gateway)


def load(service: Service) -> pod_status_pb2.PodLoad:
    with service.channel() as ch:
        return pod_status_pb2_grpc.PodStatusStub(ch).GetLoad(pod_status_pb2.GetLoadRequest(), timeout=5)


def wait_idle(service: Service, timeout: float = 10.0) -> pod_status_pb2.PodLoad:
    """Until the pod runs nothing and every KV block and recurrent-state slot is free again (the
    engine freed everything)."""
    deadline = time.monotonic() + timeout
    while True:
        rep = load(service)
        idle = rep.num_running == 0 and rep.num_waiting == 0 and rep.requests_in_flight == 0
        free = rep.kv_blocks_free == rep.kv_blocks_total and rep.state_slots_free == rep.state_slots_total
        if idle and free:
            return rep
        if time.monotonic() > deadline:
            raise AssertionError(f"pod {service.address} not idle: {rep}")
        time.sleep(0.05)


def token_request(ids: list[int], max_tokens: int, **sampling: object) -> pb.GenerateRequest:
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), max_tokens=max_tokens)
    req.sampling.ignore_eos = True
    for k, v in sampling.items():
        setattr(req.sampling, k, v)
    return req


def stub(channel: grpc.Channel) -> generation_pb2_grpc.GenerationStub:
    return generation_pb2_grpc.GenerationStub(channel)


def collect(responses) -> tuple[list[int], list[pb.GenerateResponse]]:
    """All token ids of a stream, and its messages."""
    msgs = list(responses)
    return [t for m in msgs if m.HasField("chunk") for t in m.chunk.token_ids], msgs


@contextlib.asynccontextmanager
async def pod_in_process(
    loaded: Any,
    name: str,
    provider: Any = None,
    security: Any = None,
    send_timeout: float = 0.0,
    **engine: Any,
) -> AsyncIterator[Any]:
    """A model pod in the caller's event loop on `loaded` weights (loaded and SERVING): yields its
    PodServers (`.port`, `.control_port`), its streams ended after `send_timeout` seconds of a
    client reading nothing (0: never). For tests that need to see inside (spans, logs)."""
    from model_service.engine.config import EngineConfig
    from model_service.engine.engine import Engine
    from model_service.pod import server as pod_server
    from model_service.pod.state import ModelPod
    from spindle.security import PLAINTEXT

    pod = ModelPod(name, drain_timeout=1.0)
    servers = await pod_server.start(
        pod, "127.0.0.1", 0, 0, provider, None, security or PLAINTEXT, send_timeout=send_timeout
    )
    try:
        config = EngineConfig(model=loaded.name, device="cpu", dtype="float32", num_kv_blocks=64, **engine)
        await pod.load(lambda: Engine(config, loaded=loaded))
        yield servers
    finally:
        await servers.stop(0)
        pod.close()


@contextlib.asynccontextmanager
async def gateway_in_process(flags: list[str], provider: Any = None) -> AsyncIterator[Any]:
    """`spindle gateway FLAGS` in the caller's event loop on a free port, once a pod is healthy:
    yields the GatewayService (`.port`, `.limits`, `.pool`)."""
    import argparse

    from gateway import server as gateway_server

    parser = gateway_server.build_parser(argparse.ArgumentParser())
    args = parser.parse_args(
        ["--host", "127.0.0.1", "--port", "0", "--http-port", "0", "--health-interval", "0.1", *flags]
    )
    gateway, server, health = await gateway_server.start(args, provider)
    try:
        while not gateway.pool.healthy():
            await asyncio.sleep(0.02)
        yield gateway
    finally:
        await gateway_server.shutdown(gateway, server, health, 1.0)


@contextlib.asynccontextmanager
async def openai_client_of(
    servicer: Any,
    model: str,
    tool_parser: str = "none",
    reasoning_parser: str = "none",
    reasoning_key: bytes | None = None,
    store: Any = None,
    admit: Any = None,
) -> AsyncIterator[Any]:
    """The OpenAI HTTP API over a Generation `servicer` (a scripted model, or a real one), in this
    process, serving `model`, and an `openai` SDK client of it (no retries: a test sees each
    answer as it is); `reasoning_key`: its --reasoning-key-file key; `store`: where it keeps
    Responses API responses (None: none is; closed with the server); `admit`: the server's
    (whose stored responses a caller sees)."""
    import openai
    from opentelemetry.trace import get_tracer

    from spindle.openai_api.server import OpenAIServer

    server = OpenAIServer(
        servicer,
        lambda: (model,),
        lambda: True,
        get_tracer(__name__),
        tool_parser,
        reasoning_parser,
        reasoning_key,
        store=store,
        admit=admit,
    )
    port = await server.start("127.0.0.1", 0)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    try:
        yield client
    finally:
        await client.close()
        await server.stop()
