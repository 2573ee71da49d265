"""Pod failures behind the gateway: a pod killed mid-stream (the stream resumes on another pod), a
pod that stops answering health checks, a pod that refuses before the first token. The cluster is
the session's `tiny_cluster`, shared with test_gateway.py: each test that breaks a pod leaves it
whole again."""

from __future__ import annotations

import os
import signal
import time

import grpc

from spindle.v1 import generation_pb2 as pb
from spindle.v1 import model_control_pb2, model_control_pb2_grpc
from tests.service_helpers import KEYS, load, spawn, spawn_pod, stub, token_request, wait_serving
from tests.test_gateway import _generate, _md, _served

Code = grpc.StatusCode


def _ejections(gateway, pod) -> int:
    return gateway.output().count("ejecting model pod " + pod.address)


def test_unhealthy_pod_is_ejected_and_comes_back(tiny_cluster):
    pods, gateway = tiny_cluster
    a, b = pods
    ejected = _ejections(gateway, a)
    os.kill(a.proc.pid, signal.SIGSTOP)  # alive but silent: health checks time out
    try:
        deadline = time.monotonic() + 10
        while _ejections(gateway, a) == ejected:
            assert time.monotonic() < deadline, gateway.output()
            time.sleep(0.05)
        before = load(b).requests_total
        for i in range(4):  # a request routed to the frozen pod would time out
            _generate(gateway, token_request([20 + i, 21, 22], 2), timeout=5)
        assert load(b).requests_total - before == 4
    finally:
        os.kill(a.proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 10
    before = load(a).requests_total
    while load(a).requests_total == before:  # back in rotation: ties go to it about half the time
        assert time.monotonic() < deadline, gateway.output()
        _generate(gateway, token_request([30, 31, int(time.monotonic() * 1000) % 300], 2), timeout=5)


def _streaming_pod(pods, before: list[int]) -> int:
    """The index of the pod that took the one request sent since `before` (requests_total)."""
    return next(i for i, p in enumerate(pods) if load(p).requests_total > before[i])


def _killed_mid_stream(gateway, pods, req: pb.GenerateRequest) -> tuple[list, int]:
    """Start `req`, kill its pod after the first messages; all the caller gets, and the victim."""
    with gateway.channel() as ch:
        before = _served(pods)
        stream = stub(ch).Generate(req, metadata=_md(), timeout=30)
        got = [next(stream) for _ in range(3)]
        victim = _streaming_pod(pods, before)
        pods[victim].proc.kill()
        got += list(stream)
    return got, victim


def test_a_pod_killed_mid_stream_is_resumed_elsewhere_and_readmitted_when_back(
    tiny_cluster, tiny_llama, tmp_path
):
    pods, gateway = tiny_cluster
    greedy = token_request([7, 7, 7], 300, temperature=0.0, repetition_penalty=1.2)
    seeded = token_request([7, 7, 7], 300, temperature=0.9, top_k=50, frequency_penalty=0.3)
    seeded.seed = 1234
    expected = {id(r): _generate(gateway, r, timeout=30) for r in (greedy, seeded)}
    resumed = gateway.output().count("resuming")
    for n, req in enumerate((greedy, seeded)):
        ejected = [_ejections(gateway, p) for p in pods]
        msgs, victim = _killed_mid_stream(gateway, pods, req)
        want_tokens, want_msgs = expected[id(req)]
        assert [t for m in msgs if m.HasField("chunk") for t in m.chunk.token_ids] == want_tokens
        assert [m.WhichOneof("kind") for m in msgs].count("final") == 1
        assert msgs[-1].final == want_msgs[-1].final  # finish reason, usage: 3 prompt, 300 completion
        assert gateway.output().count("resuming") == resumed + n + 1
        assert _ejections(gateway, pods[victim]) > ejected[victim]
        _restart(pods, victim, gateway, tiny_llama, tmp_path / f"back{n}")


def _restart(pods, i: int, gateway, tiny_llama, log_dir) -> None:
    """Pod `i` (stopped, or killed) starts again where it was, and `gateway` takes it into
    rotation again."""
    pods[i].stop()
    healthy = gateway.output().count(f"model pod {pods[i].address} is healthy")
    port = int(pods[i].address.rsplit(":", 1)[1])
    log_dir.mkdir()
    pods[i] = wait_serving(spawn_pod(tiny_llama.name, log_dir, "pod", port=port))
    deadline = time.monotonic() + 10
    while gateway.output().count(f"model pod {pods[i].address} is healthy") == healthy:
        assert time.monotonic() < deadline, gateway.output()
        time.sleep(0.05)


def test_a_pod_refusing_before_the_first_token_is_retried_elsewhere(tiny_cluster, tiny_llama, tmp_path):
    """A gateway of its own in front of the module's pods, polling their health a minute apart: it
    learns of the drain by trying. It starts once both pods serve, so its first poll finds them
    healthy; the drained pod is restarted afterwards for the module's gateway."""
    pods, module_gateway = tiny_cluster
    (tmp_path / "keys").write_text(KEYS)
    pods_flag = ",".join(p.address for p in pods)
    flags = ["--pods", pods_flag, "--api-keys-file", str(tmp_path / "keys"), "--health-interval", "60"]
    gateway = wait_serving(spawn("gateway", flags, tmp_path, "gateway"))
    try:
        deadline = time.monotonic() + 10
        while gateway.output().count("is healthy") < 2:
            assert time.monotonic() < deadline, gateway.output()
            time.sleep(0.05)
        shared = [10 + i % 200 for i in range(160)]
        before = _served(pods)
        _generate(gateway, token_request(shared, 2))
        warm = [a - b for a, b in zip(_served(pods), before, strict=True)].index(1)
        drained, other = pods[warm], pods[1 - warm]
        with drained.control_channel() as ch:  # the pod the prefix points to now refuses new requests
            reply = model_control_pb2_grpc.ModelControlStub(ch).Drain(
                model_control_pb2.DrainRequest(), timeout=10
            )
        assert (reply.finished, reply.aborted) == (0, 0)
        before = _served(pods)
        for i in range(3):
            assert len(_generate(gateway, token_request([*shared, 250 + i], 2), timeout=10)[0]) == 2
        assert load(other).requests_total - before[1 - warm] == 3
        assert load(drained).requests_total == before[warm]
        assert "retrying" in gateway.output()
    finally:
        gateway.stop()
    _restart(pods, warm, module_gateway, tiny_llama, tmp_path / "restarted")
