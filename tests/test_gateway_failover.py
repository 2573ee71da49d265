"""Pod failures behind the gateway: a pod killed mid-stream, a pod that stops answering health checks."""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest

from spindle.v1 import model_control_pb2, model_control_pb2_grpc
from tests.service_helpers import load, stub, token_request
from tests.test_gateway import FAST_HEALTH, _cluster, _generate, _long, _md, _served

Code = grpc.StatusCode


@pytest.fixture
def cluster(tiny_llama, tmp_path, request):
    pods, gateway = _cluster(tiny_llama.name, tmp_path, getattr(request, "param", FAST_HEALTH))
    yield pods, gateway
    for s in (gateway, *pods):
        if s.proc.poll() is None:
            os.kill(s.proc.pid, signal.SIGCONT)
        s.stop()


def test_unhealthy_pod_is_ejected_and_comes_back(cluster):
    pods, gateway = cluster
    a, b = pods
    os.kill(a.proc.pid, signal.SIGSTOP)  # alive but silent: health checks time out
    try:
        deadline = time.monotonic() + 10
        while "ejecting model pod " + a.address not in gateway.output():
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


def test_pod_killed_mid_stream_gives_unavailable_and_traffic_moves_on(cluster):
    pods, gateway = cluster
    with gateway.channel() as ch:
        before = _served(pods)
        stream = stub(ch).Generate(_long("doomed"), metadata=_md(), timeout=30)
        next(stream)
        victim = next(i for i, p in enumerate(pods) if load(p).requests_total > before[i])
        pods[victim].proc.kill()
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            list(stream)
        assert time.monotonic() - started < 2.0
        assert e.value.code() == Code.UNAVAILABLE and "not retried" in e.value.details()
    survivor = pods[1 - victim]
    before = load(survivor).requests_total
    for i in range(3):
        assert len(_generate(gateway, token_request([40 + i, 41], 3), timeout=5)[0]) == 3
    assert load(survivor).requests_total - before == 3


@pytest.mark.parametrize("cluster", [["--health-interval", "60"]], indirect=True)
def test_a_pod_refusing_before_the_first_token_is_retried_elsewhere(cluster):
    pods, gateway = cluster  # health polls are a minute apart: the gateway learns of the drain by trying
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
