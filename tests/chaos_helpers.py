"""For the chaos test of the adapter manager (tests/test_adapter_service.py): versions of two
adapters to register, clients that retry until acknowledged, a record of what they saw and of
the faults' windows, and readers of what S3, Redis and the pods hold afterwards."""

from __future__ import annotations

import hashlib
import json
import re
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from adapter_service.client import AdaptersClient
from spindle.v1 import model_control_pb2 as mc
from spindle.v1 import model_control_pb2_grpc
from tests.service_helpers import Service

Code = grpc.StatusCode
SLACK = 1.5  # the gateway's hop and a loaded machine, on top of the bound
CLIENT_TIMEOUT = 10.0  # longer than the bound: a call that hits it was not bounded by the service
GRACE = 3.0  # failures this long after a fault ended still belong to it
NAMES = {"alpha": "a", "beta": "b"}  # adapter -> the lora_dirs adapter its versions are made from
VERSIONS = 40  # weights prepared per name (more than a run registers)


def variants(lora_dirs: dict[str, Path], root: Path) -> dict[str, list[Path]]:
    """VERSIONS distinct weights per name: the source adapter's lora_B scaled by 1 + i/20."""
    from safetensors.numpy import load_file, save_file

    out: dict[str, list[Path]] = {}
    for name, source in NAMES.items():
        tensors = load_file(str(lora_dirs[source] / "adapter_model.safetensors"))
        out[name] = []
        for i in range(VERSIONS):
            d = root / f"{name}-{i}"
            d.mkdir()
            (d / "adapter_config.json").write_bytes((lora_dirs[source] / "adapter_config.json").read_bytes())
            scaled = {k: v * (1 + i / 20) if "lora_B" in k else v for k, v in tensors.items()}
            save_file(scaled, str(d / "adapter_model.safetensors"))
            out[name].append(d)
    return out


def sha256_of(d: Path) -> str:
    return hashlib.sha256((d / "adapter_model.safetensors").read_bytes()).hexdigest()


@dataclass
class Log:
    """What the clients saw and when; the faults' windows."""

    started: float = field(default_factory=time.monotonic)
    acked: list[tuple[str, int, str, float]] = field(default_factory=list)  # name, version, sha, when
    # op, start, end, code, details
    failures: list[tuple[str, float, float, str, str]] = field(default_factory=list)
    faults: dict[str, tuple[float, float]] = field(default_factory=dict)
    counts: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fail(self, op: str, start: float, e: grpc.RpcError) -> None:
        with self.lock:
            self.failures.append((op, start, time.monotonic(), e.code().name, e.details() or ""))

    def fault_of(self, start: float, end: float) -> str | None:
        """The latest fault that began before the call ended and ended at most GRACE before it began."""
        during = [(a, name) for name, (a, b) in self.faults.items() if a <= end and start <= b + GRACE]
        return max(during)[1] if during else None

    def first_ack_after(self, t: float) -> float:
        return min((when for *_, when in self.acked if when > t), default=float("inf")) - t

    def last_refusals(self, n: int = 8) -> list[tuple[float, str, str]]:
        """The last `n` refusals (seconds into the run when the call began, code, text): what a
        failed wait for an acknowledgement prints, to say which lease or backend refused."""
        with self.lock:
            return [
                (round(a - self.started, 2), code, text[:120]) for _, a, _, code, text in self.failures[-n:]
            ]


def diagnosis(log: Log, services: list[Service], lines: int = 20) -> str:
    """What a failed wait prints: the last refusals and each service's last log lines, then the
    frames of our code and of s3transfer in its threads' stacks (dumped at SIGUSR1), so a
    registration stuck under its lease says where (CI keeps no service logs)."""
    for s in services:
        if s.proc.poll() is None:
            s.proc.send_signal(signal.SIGUSR1)
    time.sleep(0.5)
    out = [repr(log.last_refusals())]
    for s in services:
        text = s.output().splitlines()
        logged = [t for t in text if not t.startswith(("  File", "Thread", "Current thread"))]
        ours = ("adapter_service", "s3transfer")
        frames = [t.strip() for t in text if t.startswith("  File") and any(w in t for w in ours)]
        out += [f"--- {s.log.name}", *logged[-lines:], *dict.fromkeys(frames)]
    return "\n".join(out)


def register_until_acked(c: AdaptersClient, name: str, d: Path, log: Log) -> None:
    """Register `d` under `name`, retrying any refusal (for up to 30 s) until acknowledged; every
    refusal is logged (the test sorts them into expected and not). A retry that answers
    ALREADY_EXISTS is the acknowledgement of an earlier attempt that was stored."""
    sha, retry, began = sha256_of(d), False, time.monotonic()
    while True:
        start = time.monotonic()
        try:
            a = c.register(name, d, timeout=CLIENT_TIMEOUT)
            with log.lock:
                log.acked.append((name, a.version, a.sha256, time.monotonic()))
                log.counts["acknowledged"] += 1
            return
        except grpc.RpcError as e:
            version = re.search(r"version (\d+) has these weights already", e.details() or "")
            if e.code() == Code.ALREADY_EXISTS and retry and version:
                with log.lock:
                    log.acked.append((name, int(version.group(1)), sha, time.monotonic()))
                    log.counts["acknowledged on a retry (ALREADY_EXISTS)"] += 1
                return
            log.fail("register", start, e)
        retry = True
        if time.monotonic() - began > 30:
            return  # the unexpected failures above fail the test
        time.sleep(0.2)


def health(service: Service) -> int:
    with service.channel() as ch:
        try:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=0.5).status
        except grpc.RpcError:
            return -1


def until(what, timeout: float = 15.0, step: float = 0.05, why=None) -> float:
    """Seconds until `what()` is true; past `timeout`, an assertion that says `why()` too."""
    start = time.monotonic()
    while not what():
        assert time.monotonic() - start < timeout, f"not within {timeout} s: {what}; {why() if why else ''}"
        time.sleep(step)
    return time.monotonic() - start


def stored_versions(s3) -> dict[tuple[str, int], str]:
    """(name, version) -> sha256 of every committed version in S3 (those with a meta.json)."""
    client = s3.client()
    out = {}
    for key in s3.keys("adapters/"):
        if key.endswith("/meta.json"):
            meta = json.loads(client.get_object(Bucket=s3.bucket, Key=key)["Body"].read())
            out[(meta["name"], meta["version"])] = meta["sha256"]
    return out


def indexed_versions(url: str) -> dict[str, tuple[int, str]]:
    import redis

    index = redis.Redis.from_url(url).hgetall("spindle:adapters:index")
    return {k.decode(): (json.loads(v)["version"], json.loads(v)["sha256"]) for k, v in index.items()}


def held(pod: Service) -> dict[str, str]:
    with pod.control_channel() as ch:
        report = model_control_pb2_grpc.ModelControlStub(ch).GetSlots(mc.GetSlotsRequest(), timeout=5)
    return {a.name: a.sha256 for a in report.adapters}
