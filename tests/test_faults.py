"""Faults on loopback, each bounded in count and time and undone by the test itself: Redis killed and
restarted empty, S3 unreachable, a stalled pod whose callers' deadlines expire, thousands of streams
cancelled at random points (greedy, then greedy and beam search mixed; tests/storm_helpers.py).
After each: nothing leaked (KV blocks, LoRA slot refcounts, Redis lease keys), no acknowledged
adapter lost, no stream got another's tokens, and serving resumed by itself.
SPINDLE_FAULT_STREAMS sets the number of streams of each storm (default 400; docs/reliability.md
reports a 3,000 run)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter

import grpc
import pytest

from spindle.v1 import adapters_pb2 as apb
from spindle.v1 import adapters_pb2_grpc, model_control_pb2, model_control_pb2_grpc
from tests.adapter_helpers import aws_env, s3_server
from tests.conftest import make_engine
from tests.fault_helpers import Outage, RestartableRedis
from tests.service_helpers import (
    collect,
    load,
    spawn,
    spawn_pod,
    stub,
    wait_idle,
    wait_serving,
)
from tests.storm_helpers import Key, Storm, reference_tokens, request, run_storm

Code = grpc.StatusCode
STREAMS = int(os.environ.get("SPINDLE_FAULT_STREAMS", "400"))
PROMPTS = [(5 + i, 17, 40 + 3 * i, 9, 100 + i) for i in range(6)]
ADAPTERS = [None, "a", "b"]
MAX_TOKENS = 12
GREEDY = [Key(p, a) for p in PROMPTS for a in ADAPTERS]
BEAMS = [Key(p, a, 2 + (i + j) % 3) for i, p in enumerate(PROMPTS) for j, a in enumerate(ADAPTERS)]  # 2-4


@pytest.fixture(scope="module")
def pod(tiny_llama, lora_dirs, tmp_path_factory):
    service = spawn_pod(
        tiny_llama.name, tmp_path_factory.mktemp("faults"), "pod", "--max-loras", "2",
        "--lora", f"a={lora_dirs['a']}", "--lora", f"b={lora_dirs['b']}", "--max-num-seqs", "32",
    )  # fmt: skip
    yield wait_serving(service)
    assert service.stop() == 0, service.output()


@pytest.fixture(scope="module")
def references(tiny_llama, lora_dirs) -> dict[Key, list[int]]:
    """Each greedy and beam key's tokens from the engine run directly: the oracle per stream."""
    engine = make_engine(tiny_llama, lora_modules={"a": str(lora_dirs["a"]), "b": str(lora_dirs["b"])})
    return reference_tokens(engine, GREEDY + BEAMS, MAX_TOKENS)


def _assert_nothing_held(pod) -> None:
    """Every KV block free, nothing running or queued, every LoRA slot refcount back to zero."""
    wait_idle(pod, timeout=60)
    with pod.control_channel() as cc:
        report = model_control_pb2_grpc.ModelControlStub(cc).GetSlots(
            model_control_pb2.GetSlotsRequest(), timeout=10
        )
    assert all(s.refcount == 0 for s in report.slots), report
    assert all(a.refcount == 0 for a in report.adapters), report


def _storm_then_exact(pod, references, keys: list[Key], seed: int, what: str) -> Counter[str]:
    """A cancel storm over `keys`, then nothing held and the next request exact."""
    storm = Storm({k: references[k] for k in keys}, MAX_TOKENS)
    started = time.monotonic()
    tally = asyncio.run(run_storm(pod.address, STREAMS, storm, seed=seed))
    print(f"FAULT {what}: {STREAMS} streams in {time.monotonic() - started:.1f} s: {dict(tally)}")
    assert sum(tally.values()) == STREAMS
    _assert_nothing_held(pod)
    with pod.channel() as ch:  # and serving continues, exactly
        tokens, _ = collect(stub(ch).Generate(request(GREEDY[1], MAX_TOKENS, f"after-{seed}"), timeout=30))
    assert tokens == references[GREEDY[1]]
    return tally


def test_thousands_of_streams_cancelled_at_random_points(pod, references):
    _storm_then_exact(pod, references, GREEDY, seed=7, what="cancel storm")


def test_beam_search_in_the_cancel_storm(pod, references):
    """Half the streams are beam requests (2-4 beams, base and adapters) cut at random search
    steps: a finished one is exactly its uninterrupted beam output, a cut one frees every beam's
    forked blocks and adapter references."""
    tally = _storm_then_exact(pod, references, GREEDY + BEAMS, seed=11, what="beam cancel storm")
    assert tally["beam finished"] and tally["beam cancel"] + tally["beam abort"], tally


def test_a_stalled_pod_expires_deadlines_and_frees_everything(pod, references):
    """12 long streams with 4 s deadlines are running; the pod is SIGSTOPped for 5 s, so every
    deadline expires while it cannot answer. After SIGCONT it frees the abandoned requests' blocks
    and slots and serves again, unprompted."""
    with pod.channel() as ch:
        g = stub(ch)
        calls = [g.Generate(request(k, 400, f"slow-{i}"), timeout=4.0) for i, k in enumerate(GREEDY[:12])]
        deadline = time.monotonic() + 3.0
        while load(pod).requests_in_flight < len(calls) and time.monotonic() < deadline:
            time.sleep(0.01)
        pod.proc.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            codes = [_code(c) for c in calls]
        finally:
            time.sleep(max(0.0, stopped + 5.0 - time.monotonic()))
            pod.proc.send_signal(signal.SIGCONT)
    print(f"FAULT stalled pod: {[c.name for c in codes]}")
    assert Code.DEADLINE_EXCEEDED in codes and set(codes) <= {Code.OK, Code.DEADLINE_EXCEEDED}, codes
    _assert_nothing_held(pod)
    with pod.channel() as ch:
        tokens, _ = collect(stub(ch).Generate(request(GREEDY[5], MAX_TOKENS, "after-stall"), timeout=30))
    assert tokens == references[GREEDY[5]]


def _code(call) -> grpc.StatusCode:
    try:
        list(call)
        return Code.OK
    except grpc.RpcError as e:
        return e.code()


# --- the adapter service's backends -------------------------------------------------------------


@pytest.fixture(scope="module")
def backends(tiny_llama, pod, tmp_path_factory):
    """A restartable Redis, moto behind a cuttable proxy, and the adapter service over both."""
    work = tmp_path_factory.mktemp("fault_backends")
    redis_proc = RestartableRedis(work)
    redis_proc.start()
    with s3_server(work) as s3:
        outage = Outage(int(s3.endpoint.rsplit(":", 1)[1]))
        outage.restore()
        args = [
            "--pods", pod.control_address, "--redis-url", redis_proc.url, "--s3-bucket", s3.bucket,
            "--s3-endpoint-url", f"http://127.0.0.1:{outage.port}", "--s3-region", "us-east-1",
            "--base-model", tiny_llama.name, "--metrics-port", "0", "--poll-interval", "0.3",
            "--lease-ttl", "1.5", "--max-adapter-bytes", "2000000", "--max-lora-rank", "16",
        ]  # fmt: skip
        service = spawn("adapter-service", args, work, "svc", env=aws_env())
        wait_serving(service)
        yield {"redis": redis_proc, "s3": s3, "outage": outage, "service": service}
        assert service.stop() == 0, service.output()
        outage.cut()
    redis_proc.stop()


def _until(what, timeout: float = 30.0):
    """Retry `what()` until it stops raising grpc.RpcError UNAVAILABLE (serving resumes by itself)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return what()
        except grpc.RpcError as e:
            if e.code() != Code.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_redis_killed_and_restarted_empty_loses_no_acknowledged_adapter(backends, lora_dirs):
    from adapter_service.client import AdaptersClient

    service, r = backends["service"], backends["redis"]
    with AdaptersClient(service.address) as c:
        acked = {n: c.register(f"redis-{n}", lora_dirs[n]).sha256 for n in ("a", "c")}
        r.kill()
        for call in (
            lambda: c.get("redis-a"),
            lambda: c.list(),
            lambda: c.register("redis-b", lora_dirs["b"]),
        ):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == Code.UNAVAILABLE and "Redis" in e.value.details(), e.value.details()
        started = time.monotonic()
        r.start()  # same port, empty: the index is rebuilt from S3
        for n, sha in acked.items():
            assert _until(lambda n=n: c.get(f"redis-{n}")).sha256 == sha
        print(f"FAULT redis restart: served again {time.monotonic() - started:.2f} s after restart")
        assert c.register("redis-b", lora_dirs["b"]).version == 1  # not acknowledged before: new now
        with service.channel() as ch:
            placed = _until(lambda: adapters_pb2_grpc.PlacementStub(ch).Place(
                apb.PlaceRequest(adapter="redis-a"), timeout=60))  # fmt: skip
        assert placed.pods
    _assert_leases_expire(r.url)


def _assert_leases_expire(url: str) -> None:
    """Every lease key carries a TTL, so a pod that disappears leaves nothing behind."""
    import redis

    client = redis.Redis.from_url(url)
    keys = client.keys("*lease*")
    assert all(client.ttl(k) > 0 for k in keys), {k: client.ttl(k) for k in keys}


def test_s3_unreachable_is_unavailable_then_recovers(backends, lora_dirs):
    from adapter_service.client import AdaptersClient

    service, s3, outage = backends["service"], backends["s3"], backends["outage"]
    with AdaptersClient(service.address) as c:
        kept = c.register("s3-kept", lora_dirs["a"])
        before = s3.keys()
        outage.cut()
        try:
            with pytest.raises(grpc.RpcError) as e:
                c.register("s3-new", lora_dirs["b"], timeout=60)
            assert e.value.code() == Code.UNAVAILABLE and "S3" in e.value.details(), e.value.details()
            assert c.get("s3-kept").sha256 == kept.sha256  # the registry still answers reads
            assert "s3-new" not in {a.name for a in c.list()}  # refused means not registered
        finally:
            outage.restore()
        started = time.monotonic()
        assert s3.keys() == before
        assert _until(lambda: c.register("s3-new", lora_dirs["b"])).version == 1
        print(f"FAULT s3 outage: registering again {time.monotonic() - started:.2f} s after S3 came back")
        assert c.get("s3-kept").sha256 == kept.sha256
