"""Faults on loopback, each bounded in count and time and undone by the test itself: Redis killed and
restarted empty, S3 unreachable, a stalled pod whose callers' deadlines expire, thousands of streams
cancelled at random points. After each: nothing leaked (KV blocks, LoRA slot refcounts, Redis lease
keys), no acknowledged adapter lost, no stream got another's tokens, and serving resumed by itself.
SPINDLE_FAULT_STREAMS sets the number of cancelled streams (default 400; docs/reliability.md
reports a 3,000 run)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import grpc
import pytest

from spindle.v1 import adapters_pb2 as apb
from spindle.v1 import adapters_pb2_grpc, generation_pb2_grpc, model_control_pb2, model_control_pb2_grpc
from spindle.v1 import generation_pb2 as pb
from tests.adapter_helpers import aws_env, s3_server
from tests.conftest import make_engine
from tests.fault_helpers import Outage, RestartableRedis
from tests.service_helpers import (
    collect,
    load,
    spawn,
    spawn_pod,
    stub,
    token_request,
    wait_idle,
    wait_serving,
)

Code = grpc.StatusCode
STREAMS = int(os.environ.get("SPINDLE_FAULT_STREAMS", "400"))
PROMPTS = [[5 + i, 17, 40 + 3 * i, 9, 100 + i] for i in range(6)]
ADAPTERS = [None, "a", "b"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def pod(tiny_llama, lora_dirs, tmp_path_factory):
    service = spawn_pod(
        tiny_llama.name, tmp_path_factory.mktemp("faults"), "pod", "--max-loras", "2",
        "--lora", f"a={lora_dirs['a']}", "--lora", f"b={lora_dirs['b']}", "--max-num-seqs", "32",
    )  # fmt: skip
    yield wait_serving(service)
    assert service.stop() == 0, service.output()


@pytest.fixture(scope="module")
def references(tiny_llama, lora_dirs) -> dict[tuple[int, str | None], list[int]]:
    """Each (prompt, adapter)'s greedy tokens from the engine run directly: the oracle per stream."""
    engine = make_engine(tiny_llama, lora_modules={"a": str(lora_dirs["a"]), "b": str(lora_dirs["b"])})
    keys = [(i, a) for i in range(len(PROMPTS)) for a in ADAPTERS]
    reqs = [
        {"prompt_token_ids": PROMPTS[i], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
         **({"adapter": a} if a else {})}
        for i, a in keys
    ]  # fmt: skip
    return {k: out.token_ids for k, out in zip(keys, engine.generate(reqs), strict=True)}


def _assert_nothing_held(pod) -> None:
    """Every KV block free, nothing running or queued, every LoRA slot refcount back to zero."""
    wait_idle(pod, timeout=60)
    with pod.control_channel() as cc:
        report = model_control_pb2_grpc.ModelControlStub(cc).GetSlots(
            model_control_pb2.GetSlotsRequest(), timeout=10
        )
    assert all(s.refcount == 0 for s in report.slots), report
    assert all(a.refcount == 0 for a in report.adapters), report


def _request(key: tuple[int, str | None], max_tokens: int, rid: str) -> pb.GenerateRequest:
    req = token_request(PROMPTS[key[0]], max_tokens, temperature=0.0)
    req.request_id = rid
    if key[1]:
        req.adapter = key[1]
    return req


async def _one_stream(g, key, rid: str, rng: random.Random, refs, tally: dict[str, int]) -> None:
    """A stream cut at a random point (client cancel, Abort RPC, or none); its tokens must be a
    prefix of its own (prompt, adapter)'s greedy tokens, whoever shared its batches."""
    max_tokens = rng.randint(1, MAX_TOKENS)
    cut_after, how = rng.randint(0, max_tokens), rng.choice(["cancel", "abort", "none"])
    call = g.Generate(_request(key, max_tokens, rid), timeout=120)
    tokens: list[int] = []
    try:
        if how != "none" and cut_after == 0:
            await _cut(g, call, how, rid)
        async for msg in call:
            tokens += list(msg.chunk.token_ids)
            if msg.HasField("final"):
                if msg.final.finish_reason == pb.FINISH_REASON_ABORT:
                    break
                assert msg.final.finish_reason == pb.FINISH_REASON_LENGTH, msg
                assert tokens == refs[key][:max_tokens], (rid, key, tokens)
                tally["finished"] += 1
                return
            if how != "none" and len(tokens) >= cut_after > 0:
                await _cut(g, call, how, rid)
    except grpc.aio.AioRpcError as e:
        assert e.code() in (Code.CANCELLED, Code.NOT_FOUND), (rid, e.code(), e.details())
    except asyncio.CancelledError:
        pass
    assert tokens == refs[key][: len(tokens)], (rid, key, tokens)  # a prefix of its own output
    tally[how] += 1


async def _cut(g, call, how: str, rid: str) -> None:
    if how == "cancel":
        call.cancel()
    else:
        await g.Abort(pb.AbortRequest(request_id=rid), timeout=10)


async def _storm(address: str, n: int, refs, seed: int) -> dict[str, int]:
    rng, tally = random.Random(seed), {"finished": 0, "cancel": 0, "abort": 0, "none": 0}
    keys = list(refs)
    gate = asyncio.Semaphore(32)
    async with grpc.aio.insecure_channel(address) as ch:
        g = generation_pb2_grpc.GenerationStub(ch)

        async def run(i: int) -> None:
            async with gate:
                await _one_stream(g, rng.choice(keys), f"storm-{seed}-{i}", rng, refs, tally)

        await asyncio.wait_for(asyncio.gather(*(run(i) for i in range(n))), timeout=600)
    return tally


def test_thousands_of_streams_cancelled_at_random_points(pod, references):
    started = time.monotonic()
    tally = asyncio.run(_storm(pod.address, STREAMS, references, seed=7))
    elapsed = time.monotonic() - started
    print(f"FAULT cancel storm: {STREAMS} streams in {elapsed:.1f} s: {tally}")
    assert sum(tally.values()) == STREAMS
    _assert_nothing_held(pod)
    with pod.channel() as ch:  # and serving continues, exactly
        tokens, _ = collect(stub(ch).Generate(_request((0, "a"), MAX_TOKENS, "after-storm"), timeout=30))
    assert tokens == references[(0, "a")]


def test_a_stalled_pod_expires_deadlines_and_frees_everything(pod, references):
    """12 long streams with 4 s deadlines are running; the pod is SIGSTOPped for 5 s, so every
    deadline expires while it cannot answer. After SIGCONT it frees the abandoned requests' blocks
    and slots and serves again, unprompted."""
    keys = list(references)
    with pod.channel() as ch:
        g = stub(ch)
        calls = [g.Generate(_request(keys[i % len(keys)], 400, f"slow-{i}"), timeout=4.0) for i in range(12)]
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
        tokens, _ = collect(stub(ch).Generate(_request((1, "b"), MAX_TOKENS, "after-stall"), timeout=30))
    assert tokens == references[(1, "b")]


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
