"""What a platform team's Prometheus and OpenTelemetry see of requests that do not end well: a
caller that cancels, a deadline that passes mid-stream, a scrape during a long step.

On the fake engine (bench/fake_engine.py: one token a step, each step sleeps), so a stream is
still running when its caller gives up, however fast the machine.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from bench.fake_engine import FakeFastEngine
from model_service.pod import server as pod_server
from model_service.pod.state import ModelPod
from spindle.v1 import generation_pb2 as pb
from spindle.v1 import generation_pb2_grpc

GENERATE = "/spindle.v1.Generation/Generate"
STEP_S = 0.005


@asynccontextmanager
async def _fake_pod(provider: TracerProvider | None = None) -> AsyncIterator[tuple[ModelPod, int]]:
    pod = ModelPod("fake", drain_timeout=1.0)
    servers = await pod_server.start(pod, "127.0.0.1", 0, 0, provider)
    try:
        await pod.load(lambda: FakeFastEngine(STEP_S))
        yield pod, servers.port
    finally:
        await servers.stop(0)
        pod.close()


def _request(prompt_len: int, max_tokens: int) -> pb.GenerateRequest:
    ids = pb.TokenIds(ids=list(range(1, prompt_len + 1)))
    return pb.GenerateRequest(token_ids=ids, max_tokens=max_tokens)


async def _three_endings(channel: grpc.aio.Channel) -> int:
    """One request to its end (3 prompt tokens, 5 generated), one cancelled after 3 messages (4
    prompt tokens), one past its deadline mid-stream (5 prompt tokens); the tokens received."""
    stub = generation_pb2_grpc.GenerationStub(channel)
    received = sum([len(m.chunk.token_ids) async for m in stub.Generate(_request(3, 5), timeout=30)])
    call = stub.Generate(_request(4, 100_000), timeout=30)
    async for m in call:
        received += len(m.chunk.token_ids)
        if received >= 5 + 3:
            call.cancel()
            break
    late = stub.Generate(_request(5, 100_000), timeout=0.3)
    try:
        async for m in late:
            received += len(m.chunk.token_ids)
    except grpc.aio.AioRpcError as e:
        assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    return received


def test_cancelled_and_timed_out_streams_are_counted_in_the_pods_metrics():
    """Only a request that reached its final message was counted: a stream its caller cancelled,
    or whose deadline passed, added nothing to `vllm:generation_tokens_total` (the work was done),
    `vllm:request_success_total{finished_reason="abort"}` or the latency histograms, so
    throughput and request-rate dashboards undercounted a pod whose callers time out."""

    async def go() -> tuple[int, dict[str, list]]:
        async with _fake_pod() as (pod, port), grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            received = await _three_endings(ch)
            for _ in range(200):  # the aborted streams' handlers finish as their cancellation lands
                if not pod.inflight:
                    break
                await asyncio.sleep(0.01)
            text = (await asyncio.to_thread(generate_latest, pod.metrics.registry)).decode()
        return received, _strictly_parsed(text)

    received, metrics = asyncio.run(go())
    assert _value(metrics, "vllm:prompt_tokens_total") == 3 + 4 + 5
    assert _value(metrics, "vllm:generation_tokens_total") >= received
    reasons = {s.labels["finished_reason"]: s.value for s in metrics["vllm:request_success_total"]}
    assert reasons == {"length": 1, "abort": 2}
    assert _value(metrics, "vllm:e2e_request_latency_seconds_count") == 3
    assert _value(metrics, "vllm:time_to_first_token_seconds_count") == 3
    assert _value(metrics, "vllm:num_requests_running") == 0


def _value(metrics: dict[str, list], name: str) -> float:
    [sample] = metrics[name]
    return sample.value


def _strictly_parsed(text: str) -> dict[str, list]:
    """The samples by name, once the text passes the exposition format's rules a scraper relies
    on: HELP and TYPE once per family, counters' samples end `_total`, histogram buckets are
    cumulative up to `+Inf` which equals `_count`, no series twice."""
    families = list(text_string_to_metric_families(text))
    for kind in ("HELP", "TYPE"):
        named = re.findall(rf"^# {kind} (\S+)", text, re.M)
        assert len(named) == len(set(named)) == len(families), kind
    series: set[tuple] = set()
    samples: dict[str, list] = {}
    for f in families:
        for s in f.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in series, key
            series.add(key)
            samples.setdefault(s.name, []).append(s)
            if f.type == "counter":
                assert s.name.endswith(("_total", "_created")), s.name
        if f.type == "histogram":
            _check_histogram(f)
    return samples


def _check_histogram(family) -> None:
    by_labels: dict[tuple, dict[str, list]] = {}
    for s in family.samples:
        labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
        by_labels.setdefault(labels, {}).setdefault(s.name.rsplit("_", 1)[-1], []).append(s)
    for parts in by_labels.values():
        buckets = [(float(s.labels["le"]), s.value) for s in parts["bucket"]]
        assert buckets == sorted(buckets) and buckets[-1][0] == float("inf"), family.name
        [count] = parts["count"]
        assert buckets[-1][1] == count.value and "sum" in parts, family.name
