"""Prometheus metrics of a model pod, under vLLM's names where vLLM has one.

Kubernetes inference gateways (Gateway API Inference Extension, llm-d) scrape model servers for
`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` and `vllm:lora_requests_info` by
default, so using those names lets them route to Spindle pods unconfigured. Metrics vLLM lacks
are `spindle:*`. Engine gauges are read at scrape time (a snapshot taken on the engine thread);
latency histograms are observed by the Generate handler.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from model_service.engine.engine import EngineStats
from model_service.lora.pool import ACTIVE
from spindle import serving

log = logging.getLogger(__name__)

# The tails are vLLM's (vllm/v1/metrics/loggers.py), which dashboards and alerts on these names
# assume: `histogram_quantile` reads a latency past the last finite bound as that bound (a
# 5-minute queue as 20 s when TTFT stopped there, a 30-minute answer as 120 s).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                  40.0, 80.0)  # fmt: skip
_REQUEST_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


@dataclass
class Residency:
    """Where the pod's adapters are (names, sorted) and the device memory they take."""

    device: list[str] = field(default_factory=list)  # a request for one runs at once
    host: list[str] = field(default_factory=list)  # a load is a copy to the device
    disk: list[str] = field(default_factory=list)  # a load parses the files first
    memory_used_bytes: int = 0
    memory_capacity_bytes: int = 0  # 0: the pool counts slots, not bytes


@dataclass
class Snapshot:
    """What the engine reports at one instant (its stats gathered on the engine thread)."""

    stats: EngineStats
    max_adapters: int
    running_adapters: list[str] = field(default_factory=list)
    waiting_adapters: list[str] = field(default_factory=list)
    residency: Residency = field(default_factory=Residency)


class _EngineCollector(Collector):
    def __init__(self, model: str, snapshot: Callable[[], Snapshot | None]) -> None:
        self.model, self.snapshot = model, snapshot

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        try:
            s = self.snapshot()
        except Exception:  # a scrape must not fail because the engine is busy shutting down
            log.exception("metrics snapshot failed")
            return
        if s is None:  # the model is still loading
            return
        st = s.stats
        labels, values = ["model_name"], [self.model]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return _gauge(name, doc, labels, values, value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            return c

        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", st.num_waiting)
        yield gauge("vllm:num_requests_running", "Sequences in the running batch.", st.num_running)
        yield gauge("vllm:num_requests_swapped", "Sequences swapped out to host memory.", st.num_swapped)
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).", st.kv_usage)
        yield gauge(
            "vllm:gpu_cache_usage_perc", "Same as vllm:kv_cache_usage_perc (older name).", st.kv_usage
        )
        yield counter(
            "vllm:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            st.prefix_cache_query_tokens,
        )
        yield counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", st.prefix_cache_hit_tokens
        )
        yield counter("vllm:num_preemptions", "Sequences preempted (swap or recompute).", st.num_preemptions)
        yield counter(
            "spindle:lora_adapter_drains",
            "Resident adapters drained (new requests held back) so that a starving adapter could load.",
            st.adapter_drains,
        )
        yield counter("spindle:lora_loads", "Adapters made resident on the device.", st.adapter_loads)
        yield counter(
            "spindle:lora_load_seconds",
            "Engine-thread seconds spent making adapters resident (every step waits for them).",
            st.adapter_load_seconds,
        )
        yield counter(
            "spindle:lora_evictions", "Idle adapters evicted from the device for room.", st.adapter_evictions
        )
        yield counter(
            "vllm:spec_decode_num_draft_tokens", "Speculative tokens proposed.", st.spec_proposed_tokens
        )
        yield counter(
            "vllm:spec_decode_num_accepted_tokens", "Speculative tokens accepted.", st.spec_accepted_tokens
        )
        yield counter("vllm:spec_decode_num_drafts", "Speculative verify runs.", st.spec_drafts)
        yield _accepted_per_position(st.spec_accepted_per_position, labels, values)
        yield _lora_requests_info(s)
        yield from _residency(s.residency, labels, values)


def _accepted_per_position(
    accepted: tuple[int, ...], labels: list[str], values: list[str]
) -> CounterMetricFamily:
    """vLLM's `vllm:spec_decode_num_accepted_tokens_per_pos`: accepted proposals by their position
    in the verify run (0 the first), which with `vllm:spec_decode_num_drafts` gives the
    acceptance rate at each position; no samples without speculation."""
    c = CounterMetricFamily(
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "Speculative tokens accepted, by draft position.",
        labels=[*labels, "position"],
    )
    for position, n in enumerate(accepted):
        c.add_metric([*values, str(position)], n)
    return c


def _lora_requests_info(s: Snapshot) -> GaugeMetricFamily:
    """vLLM's `vllm:lora_requests_info` as vLLM defines it (vllm/v1/metrics/loggers.py): a gauge
    whose value is the time of the report, labelled max_lora and the comma-joined adapters of
    waiting and of running requests, and no model label. The Inference Extension's LoRA
    affinity scorer reads it as is."""
    info = GaugeMetricFamily(
        "vllm:lora_requests_info",
        "Running stats on lora requests.",
        labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
    )
    info.add_metric(
        [str(s.max_adapters), ",".join(s.waiting_adapters), ",".join(s.running_adapters)], time.time()
    )
    return info


def _residency(r: Residency, labels: list[str], values: list[str]) -> Iterator[GaugeMetricFamily]:
    """Adapters per tier and the device memory they take: what vLLM has no metric for."""
    tiers = GaugeMetricFamily(
        "spindle:lora_resident_adapters",
        "Adapters this pod holds, by tier: device (runs at once), host (a copy away), disk (a parse away).",
        labels=[*labels, "tier"],
    )
    for tier, names in (("device", r.device), ("host", r.host), ("disk", r.disk)):
        tiers.add_metric([*values, tier], len([n for n in names if n != ACTIVE]))
    yield tiers
    yield _gauge(
        "spindle:lora_memory_used_bytes", "Device memory adapter weights take now.", labels, values,
        r.memory_used_bytes,
    )  # fmt: skip
    yield _gauge(
        "spindle:lora_memory_capacity_bytes",
        "Device memory adapter weights may take (0: counted in slots, not bytes).",
        labels, values, r.memory_capacity_bytes,
    )  # fmt: skip


def _gauge(name: str, doc: str, labels: list[str], values: list[str], value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=labels)
    g.add_metric(values, value)
    return g


class PodMetrics:
    """One registry per pod (not the process-global one), so several pods can share a process in tests."""

    def __init__(self, model: str, snapshot: Callable[[], Snapshot | None]) -> None:
        self.model = model
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(model, snapshot))
        r, lbl = self.registry, ["model_name"]

        def hist(name: str, doc: str, buckets: tuple[float, ...] = _REQUEST_BUCKETS) -> Histogram:
            return Histogram(name, doc, lbl, registry=r, buckets=buckets).labels(model)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between output tokens.", _TOKEN_BUCKETS)
        self.tpot = hist(
            "vllm:time_per_output_token_seconds", "Time per output token (older name).", _TOKEN_BUCKETS
        )
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Arrival to last token.")
        self.queue = hist("vllm:request_queue_time_seconds", "Arrival to the first step that ran it.")
        self.prefill = hist("vllm:request_prefill_time_seconds", "First step to first token.")
        self.decode = hist("vllm:request_decode_time_seconds", "First token to last token.")
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens.", lbl, registry=r).labels(model)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Generated tokens.", lbl, registry=r
        ).labels(model)
        self.finished = Counter(
            "vllm:request_success", "Finished requests by reason.", [*lbl, "finished_reason"], registry=r
        )
        self._server = None

    def serve(self, host: str, port: int) -> int:
        """Expose /metrics over HTTP; returns the port."""
        self._server = serving.serve_metrics(host, port, self.registry)
        return self._server.server_port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
