"""A pod that dies mid-stream costs the caller nothing: the gateway in front of two SmolLM2 pods
resumes the stream on the other pod, and the caller gets exactly the tokens, text (stop strings
hold some back), finish reason and usage of an uninterrupted run, greedy and seeded-sampled."""

from __future__ import annotations

import time

import pytest

from spindle.v1 import generation_pb2 as pb
from tests.service_helpers import start_cluster, stop_cluster, stub
from tests.test_gateway import _generate, _md, _served
from tests.test_gateway_failover import _streaming_pod

pytestmark = pytest.mark.slow  # two SmolLM2 pods take ~20-40 s to start on 2 shared cores

PROMPT = "Write a short story about a lighthouse keeper and a storm:"


@pytest.fixture(scope="module")
def smol_cluster(tmp_path_factory):
    pods, gateway = start_cluster("smollm2", tmp_path_factory.mktemp("smol"))
    yield pods, gateway
    stop_cluster(pods, gateway)


def _request(**sampling: float) -> pb.GenerateRequest:
    req = pb.GenerateRequest(text=PROMPT, max_tokens=32, stop=["\n\n\n\n", "THE END"])
    req.sampling.ignore_eos = True
    for k, v in sampling.items():
        setattr(req.sampling, k, v)
    return req


def _text(msgs: list[pb.GenerateResponse]) -> str:
    return "".join(m.chunk.text for m in msgs if m.HasField("chunk"))


def test_streams_cut_by_a_pod_kill_equal_uninterrupted_runs(smol_cluster):
    pods, gateway = smol_cluster
    greedy, seeded = _request(temperature=0.0, repetition_penalty=1.2), _request(temperature=0.8, top_p=0.95)
    seeded.seed = 2024
    expected = [_generate(gateway, r, timeout=60) for r in (greedy, seeded)]
    with gateway.channel() as ch:
        before = _served(pods)
        first = stub(ch).Generate(greedy, metadata=_md(), timeout=60)
        got = [[next(first)], []]
        greedy_pod = _streaming_pod(pods, before)
        time.sleep(0.6)  # load polls: the report counts it, so the shared prefix decides the pod
        mid = _served(pods)
        second = stub(ch).Generate(seeded, metadata=_md(), timeout=60)
        got[1] += [next(second) for _ in range(3)]
        victim = _streaming_pod(pods, mid)
        pods[victim].proc.kill()
        got[0] += list(first)
        got[1] += list(second)
    for msgs, (tokens, want) in zip(got, expected, strict=True):
        assert [t for m in msgs if m.HasField("chunk") for t in m.chunk.token_ids] == tokens
        assert _text(msgs) == _text(want) and _text(want)
        assert msgs[-1].final == want[-1].final and want[-1].final.usage.completion_tokens == 32
    assert gateway.output().count("resuming") == (2 if greedy_pod == victim else 1)
