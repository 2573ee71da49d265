"""The adapter manager under chaos, on real parts (CPU): Redis, moto's S3 server, two model pods
(tiny random Llama), two adapter-service replicas and the gateway, all processes on loopback.

Three clients register new versions of two adapters through the gateway (each call retried until
acknowledged, as a careful client does), and a fourth generates with them, while the test kills
one replica (SIGKILL, then restarts it on its port), kills Redis and restarts it empty, and
freezes S3 (SIGSTOP) for a while. Afterwards: every acknowledged version is in S3 with its
sha256, the registry's index holds each name's latest, versions are dense and unique per name,
every pod holding an adapter holds its latest version and serves it token for token, nothing
failed outside a fault's window, and every failed call returned within the service's bound.
Prints the counts and the recovery times (docs/reliability.md, "The adapter manager").
"""

from __future__ import annotations

import contextlib
import json
import os
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
from tests.adapter_helpers import aws_env, s3_server
from tests.conftest import make_engine
from tests.fault_helpers import RestartableRedis
from tests.service_helpers import (
    NOT_SERVING,
    SERVING,
    Service,
    collect,
    free_port,
    spawn,
    spawn_pod,
    stub,
    token_request,
    wait_serving,
)

Code = grpc.StatusCode
RPC_BOUND = 3.0  # the replicas' --rpc-timeout
SLACK = 1.5  # the gateway's hop and a loaded machine, on top of the bound
CLIENT_TIMEOUT = 10.0  # longer than the bound: a call that hits it was not bounded by the service
GRACE = 3.0  # failures this long after a fault ended still belong to it
NAMES = {"alpha": "a", "beta": "b"}  # adapter -> the lora_dirs adapter its versions are made from
VERSIONS = 40  # weights prepared per name (more than a run registers)
PROMPT = [5, 6, 7, 8, 9]
KEYS = "admin key-admin * admin\nuser key-user *\n"


def _variants(lora_dirs: dict[str, Path], root: Path) -> dict[str, list[Path]]:
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


def _sha(d: Path) -> str:
    import hashlib

    return hashlib.sha256((d / "adapter_model.safetensors").read_bytes()).hexdigest()


@dataclass
class Log:
    """What the clients saw and when; the faults' windows."""

    started: float = field(default_factory=time.monotonic)
    acked: list[tuple[str, int, str, float]] = field(default_factory=list)  # name, version, sha, when
    failures: list[tuple[str, float, float, str, str]] = field(
        default_factory=list
    )  # op, start, end, code, text
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


def _register_until_acked(c: AdaptersClient, name: str, d: Path, log: Log, stop: threading.Event) -> None:
    """Register `d` under `name`, retrying refusals a fault explains, until acknowledged. A retry
    that answers ALREADY_EXISTS is the acknowledgement of an earlier attempt that was stored."""
    sha, retry, began = _sha(d), False, time.monotonic()
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


def _generate(gateway: Service, adapter: str, n: int = 8) -> list[int]:
    req = token_request(PROMPT, n, temperature=0.0)
    req.adapter = adapter
    with gateway.channel() as ch:
        return collect(stub(ch).Generate(req, timeout=30, metadata=(("authorization", "Bearer key-user"),)))[
            0
        ]


def _health(service: Service) -> int:
    with service.channel() as ch:
        try:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=0.5).status
        except grpc.RpcError:
            return -1


def _until(what, timeout: float = 15.0, step: float = 0.05) -> float:
    """Seconds until `what()` is true."""
    start = time.monotonic()
    while not what():
        assert time.monotonic() - start < timeout, f"not within {timeout} s: {what}"
        time.sleep(step)
    return time.monotonic() - start


def test_registrations_survive_a_killed_replica_a_restarted_redis_and_a_frozen_s3(
    tiny_llama, lora_dirs, tmp_path
):
    print("TIMING start", time.monotonic())
    variants = _variants(lora_dirs, tmp_path)
    by_sha = {_sha(d): d for ds in variants.values() for d in ds}
    redis_proc = RestartableRedis(tmp_path)
    redis_proc.start()
    with contextlib.ExitStack() as stack, s3_server(tmp_path) as s3:
        stack.callback(redis_proc.stop)
        pods = [spawn_pod(tiny_llama.name, tmp_path, f"pod{i}", "--max-loras", "2") for i in range(2)]
        ports = [free_port(), free_port()]
        args = [
            "--pods", ",".join(p.control_address for p in pods), "--redis-url", redis_proc.url,
            "--s3-bucket", s3.bucket, "--s3-endpoint-url", s3.endpoint, "--s3-region", "us-east-1",
            "--base-model", tiny_llama.name, "--metrics-port", "0", "--poll-interval", "0.3",
            "--lease-ttl", "1.5", "--max-adapter-bytes", "2000000", "--max-lora-rank", "16",
            "--rpc-timeout", str(RPC_BOUND), "--s3-connect-timeout", "0.5", "--s3-read-timeout", "1",
            "--s3-max-attempts", "2", "--redis-timeout", "0.5", "--redis-max-attempts", "2",
        ]  # fmt: skip

        def replica(i: int, tag: str = "") -> Service:
            return spawn("adapter-service", args, tmp_path, f"replica{i}{tag}", env=aws_env(), port=ports[i])

        replicas = [replica(0), replica(1)]
        keys = tmp_path / "keys"
        keys.write_text(KEYS)
        targets = ",".join(f"127.0.0.1:{p}" for p in ports)
        gateway = spawn(
            "gateway",
            ["--pods", ",".join(p.address for p in pods), "--api-keys-file", str(keys),
             "--adapter-service", f"ipv4:{targets}", "--health-interval", "0.2"],
            tmp_path, "gateway",
        )  # fmt: skip
        everything = [gateway, *replicas, *pods]
        stack.callback(lambda: [s.stop() for s in everything])
        for s in [*pods, *replicas, gateway]:
            wait_serving(s)
        _until(lambda: gateway.output().count("is healthy") >= 2)
        print("TIMING up", time.monotonic())

        log, stop, taken = Log(), threading.Event(), Counter()
        with AdaptersClient(gateway.address, "key-admin") as c:
            for name in NAMES:
                _register_until_acked(c, name, variants[name][0], log, stop)
                taken[name] = 1
        for name in NAMES:
            _generate(gateway, name)  # placed on a pod: the later versions rotate it there
        pick = threading.Lock()

        def client(k: int) -> None:
            with AdaptersClient(gateway.address, "key-admin") as c:
                i = k
                while not stop.is_set():
                    name = list(NAMES)[i % 2]
                    with pick:
                        n, taken[name] = taken[name], taken[name] + 1
                    if n >= VERSIONS:
                        return
                    _register_until_acked(c, name, variants[name][n], log, stop)
                    i += 1

        def generator() -> None:
            i = 0
            while not stop.is_set():
                start = time.monotonic()
                try:
                    _generate(gateway, list(NAMES)[i % 2])
                    log.counts["generated"] += 1
                except grpc.RpcError as e:
                    log.fail("generate", start, e)
                i += 1
                time.sleep(0.05)

        threads = [threading.Thread(target=client, args=(k,)) for k in range(3)]
        threads.append(threading.Thread(target=generator))
        for t in threads:
            t.start()
        recovery: dict[str, float] = {}
        try:
            time.sleep(1.0)
            killed = time.monotonic()
            replicas[0].stop(signal.SIGKILL)
            _until(lambda: log.first_ack_after(killed) < float("inf"))
            recovery["replica killed: next acknowledged registration"] = log.first_ack_after(killed)
            replicas[0] = replica(0, "-restarted")  # on its port, as Kubernetes restarts it
            everything.append(replicas[0])
            log.faults["replica killed"] = (killed, time.monotonic())
            restarted = threading.Thread(target=wait_serving, args=(replicas[0], 30))
            restarted.start()  # while the next fault runs

            time.sleep(0.5)
            down = time.monotonic()
            redis_proc.kill()
            time.sleep(0.5)
            redis_proc.start()  # same port, empty: the index is rebuilt from S3
            up = time.monotonic()
            log.faults["redis restarted empty"] = (down, up)
            _until(lambda: log.first_ack_after(up) < float("inf"))
            recovery["redis restarted: next acknowledged registration"] = log.first_ack_after(up)
            restarted.join()
            recovery["replica killed: its restart SERVING (with Redis restarted meanwhile)"] = (
                time.monotonic() - killed
            )

            frozen = time.monotonic()
            os.kill(s3.proc.pid, signal.SIGSTOP)
            try:
                recovery["s3 frozen: both replicas NOT_SERVING after"] = _until(
                    lambda: all(_health(r) == NOT_SERVING for r in replicas), timeout=10
                )
                time.sleep(max(0.0, 2.5 - (time.monotonic() - frozen)))
            finally:
                os.kill(s3.proc.pid, signal.SIGCONT)
            thawed = time.monotonic()
            log.faults["s3 frozen (SIGSTOP)"] = (frozen, thawed)
            recovery["s3 thawed: both replicas SERVING after"] = _until(
                lambda: all(_health(r) == SERVING for r in replicas), timeout=10
            )
            _until(lambda: log.first_ack_after(thawed) < float("inf"))
            recovery["s3 thawed: next acknowledged registration"] = log.first_ack_after(thawed)
        finally:
            stop.set()
            for t in threads:
                t.join()

        # --- afterwards ------------------------------------------------------------------------
        print("TIMING chaos done", time.monotonic())
        stored = _stored_versions(s3)
        indexed = _indexed_versions(redis_proc.url)
        acked = {(n, v): sha for n, v, sha, _ in log.acked}
        for name in NAMES:
            numbers = sorted(v for n, v in stored if n == name)
            assert numbers == list(range(1, len(numbers) + 1)), f"{name}: versions not dense: {numbers}"
            top = numbers[-1]
            assert indexed[name] == (top, stored[(name, top)]), (name, indexed[name], top)
        lost = {k: sha for k, sha in acked.items() if stored.get(k) != sha}
        assert not lost, f"acknowledged versions not in S3 as acknowledged: {lost}"
        unacked = {k: sha for k, sha in stored.items() if k not in acked}
        for k, sha in unacked.items():  # indexed, but its answer was lost; the retry made another
            assert sha in set(acked.values()), f"{k} stored, never acknowledged nor retried"

        latest = {name: stored[(name, indexed[name][0])] for name in NAMES}

        def pods_hold_latest() -> bool:
            held = [_held(p) for p in pods]
            return all(h.get(n, latest[n]) == latest[n] for h in held for n in NAMES)

        recovery["after the faults: every holding pod on the latest version"] = _until(pods_hold_latest)
        for name in NAMES:  # every holding pod serves it, whichever the gateway picks
            want = _reference(tiny_llama, by_sha[latest[name]])
            assert _generate(gateway, name) == want and _generate(gateway, name) == want
        import redis

        r = redis.Redis.from_url(redis_proc.url)
        assert all(r.ttl(k) > 0 for k in r.keys("spindle:adapters:lock:*")), "a lease without expiry"

        expected, unexpected = Counter(), []
        for op, start, end, code, text in log.failures:
            fault = log.fault_of(start, end)
            if (
                fault is None
                or end - start > RPC_BOUND + SLACK
                or code not in ("UNAVAILABLE", "DEADLINE_EXCEEDED")
            ):
                unexpected.append((op, round(start - log.started, 2), round(end - start, 2), code, text))
            else:
                expected[f"{op} {code} during {fault}"] += 1
        longest = max((end - start for _, start, end, *_ in log.failures), default=0.0)
        report = {
            "operations": dict(
                log.counts, registrations_in_s3=len(stored), unacknowledged_in_s3=len(unacked)
            ),
            "faults": list(log.faults),
            "failures_expected": dict(expected),
            "failures_unexpected": unexpected,
            "longest_failed_call_s": round(longest, 2),
            "recovery_s": {k: round(v, 2) for k, v in recovery.items()},
            "messages": sorted({f"{code}: {text[:150]}" for _, _, _, code, text in log.failures})[:12],
        }
        print("TIMING checked", time.monotonic())
        print("CHAOS", json.dumps(report, indent=1))
        assert not unexpected, unexpected
        assert log.faults.keys() == {"replica killed", "redis restarted empty", "s3 frozen (SIGSTOP)"}
        assert log.counts["acknowledged"] >= 10 and log.counts["generated"] >= 10


def _stored_versions(s3) -> dict[tuple[str, int], str]:
    """(name, version) -> sha256 of every committed version in S3 (those with a meta.json)."""
    client = s3.client()
    out = {}
    for key in s3.keys("adapters/"):
        if key.endswith("/meta.json"):
            meta = json.loads(client.get_object(Bucket=s3.bucket, Key=key)["Body"].read())
            out[(meta["name"], meta["version"])] = meta["sha256"]
    return out


def _indexed_versions(url: str) -> dict[str, tuple[int, str]]:
    import redis

    index = redis.Redis.from_url(url).hgetall("spindle:adapters:index")
    return {k.decode(): (json.loads(v)["version"], json.loads(v)["sha256"]) for k, v in index.items()}


def _held(pod: Service) -> dict[str, str]:
    with pod.control_channel() as ch:
        report = model_control_pb2_grpc.ModelControlStub(ch).GetSlots(mc.GetSlotsRequest(), timeout=5)
    return {a.name: a.sha256 for a in report.adapters}


def _reference(tiny_llama, directory: Path, n: int = 8) -> list[int]:
    engine = make_engine(tiny_llama, lora_modules={"x": str(directory)})
    req = {"prompt_token_ids": PROMPT, "max_tokens": n, "temperature": 0, "ignore_eos": True, "adapter": "x"}
    return engine.generate([req])[0].token_ids
