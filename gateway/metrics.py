"""Prometheus metrics of the gateway: the front door platform teams alert on.

What a caller saw (requests by method, model and gRPC status; latency and time to first token),
what the gateway did about pod failures (retries, resumes, ejections) and what it refused (rate
and stream limits, priority). Pod state is read from the pool at scrape time, as the model
pod's engine gauges are. Labels are bounded: a model label is a base model the fleet reports
(else `other`), a pod label an address discovery gave; request ids, API key names and adapter
names are never labels. One registry per gateway, so several can share a process in tests.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.pods import PodPool
from spindle import serving
from spindle.openai_api.context import Refused
from spindle.traced_streams import cancelled_code

# Time to first token: a queue-free prefill is tens of ms, a long prompt or a queue seconds to
# minutes (the tail is the pods' and vLLM's: past the last finite bound, `histogram_quantile`
# answers that bound).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 60.0, 160.0, 640.0,
                2560.0)  # fmt: skip
# A whole generation: seconds to minutes (long outputs, slow CPU pods).
REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1920.0, 7680.0)
OTHER = "other"  # a model label for a name no pod serves (what a caller typed is unbounded)
R = TypeVar("R")


class _PodCollector(Collector):
    """Each pod's state now, and the pool's ejections so far (counted in PodPool.eject)."""

    def __init__(self, pool: PodPool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        now = time.monotonic()
        healthy = GaugeMetricFamily(
            "spindle_gateway_pod_healthy", "1 while the pod is in rotation, 0 while ejected.", labels=["pod"]
        )
        held_out = GaugeMetricFamily(
            "spindle_gateway_pod_outlier_ejected",
            "1 while the pod sits out an outlier ejection (no health check readmits it yet).",
            labels=["pod"],
        )
        streams = GaugeMetricFamily(
            "spindle_gateway_pod_streams", "Generate streams this gateway has open to it.", labels=["pod"]
        )
        # Scrapes run on the metrics thread: copy what the event loop changes in one step (the GIL).
        for address, pod in sorted(list(self.pool.pods.items())):
            healthy.add_metric([address], 1.0 if pod.healthy else 0.0)
            held_out.add_metric([address], 1.0 if pod.ejected_until > now else 0.0)
            streams.add_metric([address], pod.in_flight)
        ejections = CounterMetricFamily(
            "spindle_gateway_pod_ejections",
            "Pods taken out of rotation, by reason: unavailable (a request found it UNAVAILABLE), "
            "outlier (server errors in a row), health_check (failed checks), not_serving.",
            labels=["reason"],
        )
        for reason, count in sorted(list(self.pool.ejections.items())):
            ejections.add_metric([reason], count)
        yield from (healthy, held_out, streams, ejections)


class GatewayMetrics:
    """The gateway's registry and the instruments its servicer updates."""

    def __init__(self, pool: PodPool) -> None:
        self.pool = pool
        self.registry = r = CollectorRegistry()
        r.register(_PodCollector(pool))
        self.requests = Counter(
            "spindle_gateway_requests",
            "Calls answered, by method, model (a served base model, '' when unnamed, else 'other') and "
            "gRPC status code (HTTP calls counted as the Generate / ListModels calls they make).",
            ["method", "model", "code"],
            registry=r,
        )
        self.latency = Histogram(
            "spindle_gateway_request_duration_seconds",
            "Generate calls that ended OK: arrival to the last message relayed.",
            ["model"],
            registry=r,
            buckets=REQUEST_BUCKETS,
        )
        self.ttft = Histogram(
            "spindle_gateway_time_to_first_token_seconds",
            "Generate calls: arrival to the first message relayed (placement, queueing and prefill).",
            ["model"],
            registry=r,
            buckets=TTFT_BUCKETS,
        )
        self.streams = Gauge("spindle_gateway_streams_in_flight", "Generate calls open now.", registry=r)
        self.retries = Counter(
            "spindle_gateway_retries",
            "Requests sent to another pod after one failed before the first token.",
            registry=r,
        )
        self.resumes = Counter(
            "spindle_gateway_resumes",
            "Streams resumed on another pod after one failed mid-stream (failovers past the first token).",
            registry=r,
        )
        self.refusals = Counter(
            "spindle_gateway_refusals",
            "Requests the gateway refused by its own rules, by reason: rate_limit, streams (the key's "
            "concurrency), priority, adapter (not allowed for the key), draining.",
            ["reason"],
            registry=r,
        )
        self.http_requests = Counter(
            "spindle_gateway_http_requests",
            "OpenAI-compatible HTTP requests, by method, route template ('unmatched' for none) and status.",
            ["method", "route", "status"],
            registry=r,
        )
        self._server: Any = None
        self.port = 0  # set once serving

    def model_label(self, model: str | None) -> str:
        """A request's model as a bounded label: unnamed is the only base model when there is one."""
        served = self.pool.base_models()
        if not model:
            return next(iter(served)) if len(served) == 1 else ""
        return model if model in served else OTHER

    def failover(self, resumed: bool) -> None:
        (self.resumes if resumed else self.retries).inc()

    def http_request(self, method: str, route: str, status: int) -> None:
        self.http_requests.labels(method, route, str(status)).inc()

    def serve(self, host: str, port: int) -> int:
        """Expose /metrics over HTTP; returns the port."""
        self._server = serving.serve_metrics(host, port, self.registry)
        self.port = self._server.server_port
        return self.port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def status_code(context: Any, error: BaseException | None) -> str:
    """The status a call ended with: OK, what the servicer aborted with (a gRPC context keeps it;
    over HTTP the Refused carries it), CANCELLED when the caller left, DEADLINE_EXCEEDED when its
    deadline passed (the caller's status: counted CANCELLED, a deadline alert saw none), else UNKNOWN."""
    if error is None:
        return grpc.StatusCode.OK.name
    if isinstance(error, Refused):
        return error.code.name
    if isinstance(error, (asyncio.CancelledError, GeneratorExit)):
        return cancelled_code(context).name  # a passed deadline ends a call by a cancel too
    code = context.code() if callable(getattr(context, "code", None)) else None
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(error, grpc.aio.AioRpcError):
        return error.code().name
    return grpc.StatusCode.UNKNOWN.name


def counted(method: str) -> Callable[[Callable[..., Awaitable[R]]], Callable[..., Awaitable[R]]]:
    """Count a unary handler's calls in `self.metrics.requests` by its outcome (no model label)."""

    def decorate(handler: Callable[..., Awaitable[R]]) -> Callable[..., Awaitable[R]]:
        @functools.wraps(handler)
        async def wrapper(self: Any, request: Any, context: Any) -> R:
            error: BaseException | None = None
            try:
                return await handler(self, request, context)
            except BaseException as e:
                error = e
                raise
            finally:
                self.metrics.requests.labels(method, "", status_code(context, error)).inc()

        return wrapper

    return decorate
