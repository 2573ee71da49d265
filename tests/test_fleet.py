"""The fleet simulation (bench/fleet.py), small: the real gateway, adapter service and Redis in
front of 16 fake pods whose adapters take memory and load time, under Zipf traffic."""

from __future__ import annotations

import asyncio
import json

import pytest

from bench.fake_lora import AdapterTiers, Known, Speeds
from bench.fleet import FleetConfig, simulate


def test_tiers_load_in_proportion_to_bytes_and_evict_the_least_recently_used_idle():
    tiers = AdapterTiers(capacity_bytes=100, max_host=1, max_slots=8, speeds=Speeds(100.0, 50.0))
    for i, name in enumerate(("a", "b", "c")):
        tiers.register(name, Known(i, 8, name, 40))  # 40 bytes each: two fit
    assert list(tiers.host) == ["c"]  # one host copy: the last registered
    assert tiers.load("c", now=0.0).ready_at == 0.4  # from host memory: a copy
    assert tiers.hold("a", now=0.0) and tiers.device["a"].ready_at == 0.8 + 0.4  # from disk: a parse first
    assert tiers.load("b", now=0.0) is None  # c is still loading, a is held: no room
    assert tiers.load("b", now=0.5).ready_at == pytest.approx(1.7) and tiers.evictions == 1  # c idle
    assert not tiers.ready("a", 1.19) and tiers.ready("a", 1.21) and tiers.memory_used_bytes == 80
    tiers.release("a")
    tiers.load("c", now=2.0)  # a and b idle: a was used least recently
    assert (list(tiers.device), tiers.evictions, tiers.loads) == (["b", "c"], 2, 4)
    assert {a.name: a.tier for a in tiers.report()} == {"a": "disk", "b": "gpu", "c": "gpu"}


def test_a_small_fleet_serves_zipf_traffic_without_a_failure(tmp_path):
    """16 pods, 300 adapters, 900 requests: every request succeeds, most find their adapter
    resident, the head is replicated and the tail spread evenly."""
    lines: list[dict] = []
    cfg = FleetConfig(adapters=300, requests=900, concurrency=16, report_every=300, device_mib=256)
    summary = asyncio.run(simulate(cfg, tmp_path, lines.append))
    json.dumps(lines)  # JSON lines, as the bench prints them
    windows = [x for x in lines if "window_end" in x]
    assert [w["window_end"] for w in windows] == [300, 600, 900] and lines[-1] is summary
    assert summary["requests"] == 900 and summary["failed"] == 0, [x for x in lines if "failed" in x]
    assert summary["warm_hit_ratio"] > 0.5 and 0 < summary["hit_ratio"] <= 1
    assert summary["loads_per_s"] > 0 and summary["placements"] >= summary["first"] > 0
    assert summary["replicas_of_top"][0] >= 2  # the most popular adapter is on several pods
    per_pod = summary["adapters_per_pod"]
    assert per_pod["max"] - per_pod["min"] <= 3  # the tail is spread: each pod about as many
