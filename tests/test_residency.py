"""Residency for the fleet: what a pod reports of its adapters' tiers and memory (PodLoad and
Prometheus), and how the gateway scores pods on it."""

from __future__ import annotations

import asyncio

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from bench.fake_engine import FakeFastEngine
from model_service.engine.engine import AdapterMemory, MemoryCount
from model_service.lora.pool import AdapterInfo
from model_service.pod.state import ModelPod


class _TieredEngine(FakeFastEngine):
    """The fake engine with adapters in every tier and a byte-counted pool (as LoraPool's
    `memory_used_bytes` / `memory_capacity_bytes` will be)."""

    def __init__(self) -> None:
        super().__init__(0.0, adapters=("dev", "host", "disk"))

    def list_adapters(self) -> list[AdapterInfo]:
        return [
            AdapterInfo("dev", 1, "gpu", 0, 0, False, active=True),
            AdapterInfo("host", 2, "cpu", None, 0, False),
            AdapterInfo("disk", 3, "disk", None, 0, False),
        ]

    @property
    def adapter_memory(self) -> AdapterMemory:
        return MemoryCount(memory_used_bytes=20 << 20, memory_capacity_bytes=512 << 20)


def _samples(pod: ModelPod) -> dict[str, list]:
    """A scrape, from a thread other than the pod's event loop (as the metrics server's)."""
    text = generate_latest(pod.metrics.registry).decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_a_pod_reports_each_tier_and_its_adapter_memory():
    async def go() -> tuple:
        pod = ModelPod("m", drain_timeout=1.0)
        await pod.load(_TieredEngine)
        try:
            pod.begin("r1", "host")  # queued, not yet run: a waiting adapter
            running = pod.begin("r2", "dev")
            running.scheduled = 1.0  # the engine ran it: a running adapter
            pod.accepted(running)
            pod.begin("r3", "nobody-serves-this")  # refused by the engine: not counted
            return await pod.load_report(), await asyncio.to_thread(_samples, pod), pod.adapter_requests
        finally:
            pod.close()

    load, metrics, counts = asyncio.run(go())
    assert list(load.resident_adapters) == ["@active", "dev"]
    assert (list(load.host_adapters), list(load.disk_adapters)) == (["host"], ["disk"])
    assert list(load.available_adapters) == ["@active", "dev", "disk", "host"]
    assert (load.adapter_memory_used_bytes, load.adapter_memory_capacity_bytes) == (20 << 20, 512 << 20)
    assert dict(counts) == {"dev": 1}  # what GetSlots reports as each adapter's requests_total

    [info] = metrics["vllm:lora_requests_info"]  # vLLM's labels and value, no model label
    waiting = "host,nobody-serves-this"
    assert info.labels == {"max_lora": "3", "waiting_lora_adapters": waiting, "running_lora_adapters": "dev"}
    assert info.value > 1e9  # the time of the report
    tiers = {s.labels["tier"]: s.value for s in metrics["spindle:lora_resident_adapters"]}
    assert tiers == {"device": 1, "host": 1, "disk": 1}  # `@active` is a name, not an adapter
    assert metrics["spindle:lora_memory_used_bytes"][0].value == 20 << 20
    assert metrics["spindle:lora_memory_capacity_bytes"][0].value == 512 << 20


def test_affinity_prefers_the_device_then_host_then_disk_then_memory_left():
    from gateway import router

    has = {"x", "y"}

    def pod(address: str, **kw) -> router.Candidate:
        return router.Candidate(address, available_adapters=has, max_adapters=4, **kw)

    device = pod("device", resident_adapters={"x"}, memory_used_bytes=90, memory_capacity_bytes=100)
    host_full = pod("host-full", host_adapters={"x"}, memory_used_bytes=99, memory_capacity_bytes=100)
    host_room = pod("host-room", host_adapters={"x"}, memory_used_bytes=10, memory_capacity_bytes=100)
    disk_room = pod("disk-room", memory_used_bytes=0, memory_capacity_bytes=100)
    disk_less = pod("disk-less", memory_used_bytes=60, memory_capacity_bytes=100)
    slots = pod("slots", resident_adapters={"y", "@active"})  # no byte counts: 1 of 4 slots used
    waiting = pod("waiting", waiting_adapters={"x"}, memory_used_bytes=100, memory_capacity_bytes=100)
    full = pod("full", memory_used_bytes=100, memory_capacity_bytes=100)
    ordered = [device, host_room, host_full, disk_room, slots, disk_less, waiting, full]
    scores = [router.adapter_score(p, "x") for p in ordered]
    assert scores == sorted(scores, reverse=True) and len(set(scores)) == len(scores), scores
    assert scores[0] == 1.0 and 0.8 < scores[2] < scores[1] <= 0.9 and 0.7 < scores[5] < scores[3] <= 0.8
    assert scores[4] == 0.7 + 0.1 * 0.75 and scores[6:] == [0.6, 0.0]
    # all else equal, the router takes the best of them
    assert router.choose(list(reversed(ordered)), "x", {}) == "device"
    assert router.choose([disk_room, host_full], "x", {}) == "host-full"


def test_the_gateway_reads_the_tiers_and_memory_from_the_load_report():
    from gateway.pods import Pod
    from spindle.v1 import pod_status_pb2

    async def go() -> object:
        pod = Pod("a:1", [])
        pod.load = pod_status_pb2.PodLoad(
            resident_adapters=["d"], host_adapters=["h"], disk_adapters=["k"],
            available_adapters=["d", "h", "k"], adapter_memory_used_bytes=5, adapter_memory_capacity_bytes=8,
        )  # fmt: skip
        try:
            return pod.candidate()
        finally:
            await pod.close()

    c = asyncio.run(go())
    assert (c.resident_adapters, c.host_adapters, c.available_adapters) == ({"d"}, {"h"}, {"d", "h", "k"})
    assert (c.memory_used_bytes, c.memory_capacity_bytes, c.memory_left()) == (5, 8, 3 / 8)
