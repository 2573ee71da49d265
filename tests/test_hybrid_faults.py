"""The cancel storm (tests/storm_helpers.py) against a pod serving a recurrent hybrid (the tiny
Qwen3-Next of tests/hybrid_models.py), over real gRPC: greedy and beam-search streams cut at random
points, with prefix caching (state snapshots at block boundaries), n-gram speculation (verify
checkpoints) and preemption (a KV pool too small for every beam) all on. Afterwards every KV block
and every recurrent-state slot is free (PodLoad's counters), nothing runs, and every stream's tokens
equal (finished) or are a prefix of (cut) the engine's uninterrupted output for its key.
SPINDLE_FAULT_STREAMS sets the number of streams (default 300; docs/reliability.md reports more)."""

from __future__ import annotations

import asyncio
import os
import time
from urllib.request import urlopen

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from model_service.models.loader import load_model
from tests.conftest import make_engine
from tests.hybrid_models import make_tiny_hybrid
from tests.service_helpers import collect, free_port, load, spawn_pod, stub, wait_idle, wait_serving
from tests.storm_helpers import Key, Storm, reference_tokens, request, run_storm

STREAMS = int(os.environ.get("SPINDLE_FAULT_STREAMS", "300"))
SHARED = (11, 40, 7, 93, 150, 21, 64, 5)  # two 4-token blocks every prompt shares
PROMPTS = [SHARED + (30 + i, 200 + 7 * i, 9 + i)[: 1 + i % 3] + (17,) * (i % 4) for i in range(6)]
MAX_TOKENS = 10
KEYS = [Key(p) for p in PROMPTS] + [Key(p, None, 2 + i % 3) for i, p in enumerate(PROMPTS)]
SPEC = '{"method": "ngram", "num_speculative_tokens": 2}'
_PATHS = (  # counters that show the storm took each path that moves state slots
    "vllm:prefix_cache_hits_total",  # resumed from a cached state snapshot
    "vllm:num_preemptions_total",  # state freed (recompute) or swapped out and back
    "vllm:spec_decode_num_draft_tokens_total",  # verify checkpoints, rolled back on rejection
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_hybrid(tmp_path_factory.mktemp("hybrid_faults") / "ckpt", seed=0)


@pytest.fixture(scope="module")
def pod(checkpoint, tmp_path_factory):
    metrics = free_port()
    service = spawn_pod(
        str(checkpoint), tmp_path_factory.mktemp("hybrid_pod"), "pod", "--block-size", "4",
        "--max-num-seqs", "16", "--num-kv-blocks", "24", "--speculative-config", SPEC,
        "--metrics-port", str(metrics),
    )  # fmt: skip
    service.metrics_url = f"http://127.0.0.1:{metrics}/metrics"
    yield wait_serving(service)
    assert service.stop() == 0, service.output()


def _counters(url: str) -> dict[str, float]:
    text = urlopen(url, timeout=5).read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


@pytest.fixture(scope="module")
def references(checkpoint) -> dict[Key, list[int]]:
    """Each key's output from a plain engine (no speculation, no prefix cache) run directly."""
    loaded = load_model(str(checkpoint), torch.float32, torch.device("cpu"))
    engine = make_engine(loaded, block_size=4, enable_prefix_caching=False)
    return reference_tokens(engine, KEYS, MAX_TOKENS)


def test_a_hybrid_pod_under_a_cancel_storm_leaks_no_state_slot(pod, references):
    assert load(pod).state_slots_total > 0  # the counters below are the recurrent model's
    storm, started = Storm(references, MAX_TOKENS, concurrency=16), time.monotonic()
    tally = asyncio.run(run_storm(pod.address, STREAMS, storm, seed=3))
    elapsed = time.monotonic() - started
    report = wait_idle(pod, timeout=60)  # every KV block and state slot free, nothing running
    seen = {k: v for k, v in _counters(pod.metrics_url).items() if k in _PATHS}
    print(f"FAULT hybrid cancel storm: {STREAMS} streams in {elapsed:.1f} s: {dict(tally)}; {seen}; "
          f"state slots {report.state_slots_free}/{report.state_slots_total} free")  # fmt: skip
    assert sum(tally.values()) == STREAMS
    assert tally["greedy finished"] and tally["beam finished"], tally
    assert all(seen.get(name) for name in _PATHS), seen  # each state-slot path was taken
    with pod.channel() as ch:  # and serving continues, exactly
        tokens, _ = collect(stub(ch).Generate(request(KEYS[0], MAX_TOKENS, "after-storm"), timeout=30))
    assert tokens == references[KEYS[0]]
