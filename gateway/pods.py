"""The model pods behind the gateway: discovery, health, load, ejection.

Pods come from a static list or from the DNS name of a Kubernetes headless Service (one A/AAAA
record per ready pod), re-resolved periodically. Every `interval` seconds each pod gets a
`grpc.health.v1` check and a PodStatus.GetLoad; the load feeds the router. A pod that answers
NOT_SERVING (loading, draining) leaves the rotation at once; one that fails `failure_threshold`
checks in a row (timeouts, refused connections) is ejected; a request that finds a pod
UNAVAILABLE ejects it on the spot. Any ejected pod returns after one good check, but one ejected
as an outlier (`PodPool.record`: requests failing in a row while its checks pass) stays out for
its ejection time first.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.router import Candidate
from spindle import flagtypes
from spindle.client import TARGET_SCHEMES
from spindle.coalesce import Coalesced
from spindle.errors import ConfigError
from spindle.security import PLAINTEXT, Security
from spindle.serving import host_port
from spindle.v1 import generation_pb2, generation_pb2_grpc, pod_status_pb2, pod_status_pb2_grpc

log = logging.getLogger(__name__)

CHANNEL_OPTIONS = [
    # Reconnect quickly after a pod restarts (the default backoff grows to two minutes).
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    # Notice a peer that vanished without closing the connection.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.max_receive_message_length", 64 << 20),
]
RETIRE_POLL_S = 0.1  # how often a pod gone from discovery looks for its last stream's end
# A pod's own failure, not the request's (UNAVAILABLE ejects at once; the rest are the caller's).
SERVER_ERRORS = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS})
MAX_EJECTION_FACTOR = 10  # an outlier's n-th ejection in a row lasts n times the base, up to this


class Pod:
    def __init__(self, address: str, interceptors: Iterable[Any], security: Security = PLAINTEXT) -> None:
        self.address = address
        self.channel = security.dial(address, CHANNEL_OPTIONS, interceptors)
        self.generation = generation_pb2_grpc.GenerationStub(self.channel)
        # Generate's replies stay serialized: the gateway relays them as they came, and traces the
        # call itself (gateway/relay.py): an interceptor would wrap every message of the stream.
        # Same target and options: gRPC shares the connection with `channel`.
        self.relay_channel = security.dial(address, CHANNEL_OPTIONS)
        self.generate_raw = self.relay_channel.unary_stream(
            "/spindle.v1.Generation/Generate",
            request_serializer=generation_pb2.GenerateRequest.SerializeToString,
            response_deserializer=None,
        )
        self.status = pod_status_pb2_grpc.PodStatusStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.healthy = False
        self.failures = 0
        self.last_error = ""
        self.load: pod_status_pb2.PodLoad | None = None
        self._candidate: tuple[pod_status_pb2.PodLoad | None, Candidate] | None = None  # of `load`
        self.in_flight = 0  # streams this gateway has open to the pod
        self.errors_in_a_row = 0  # requests the pod failed with a server error since its last success
        self.ejections = 0  # outlier ejections since its last success
        self.ejected_until = 0.0  # time.monotonic() before which no health check readmits it
        self.in_flight_at_report = 0  # ... when its last load report was asked for

    async def close(self) -> None:
        await asyncio.gather(self.channel.close(), self.relay_channel.close())

    async def close_when_idle(self) -> None:
        """Close once no stream of this gateway is open here. For a pod gone from discovery (a
        terminating Kubernetes pod leaves its Service at once, then drains): closing its channels
        at once cancelled its streams under the gateway, and their callers hung until their
        deadlines. Its streams end by themselves: finished, or failed over when it stops."""
        while self.in_flight:
            await asyncio.sleep(RETIRE_POLL_S)
        await self.close()

    def holds(self, prompt_tokens: int, known: bool = False) -> bool:
        """Whether the pod's context holds a prompt of `prompt_tokens` and a token of output; a pod
        that does not report its context counts as holding it, unless `known` asks for a report."""
        context = self.load.max_model_len if self.load is not None else 0
        return prompt_tokens < context if context or known else True

    def serves(self, model: str) -> bool:
        """Whether the pod's last load report named `model` as its base model."""
        return self.load is not None and self.load.model == model

    @contextlib.contextmanager
    def streaming(self) -> Iterator[None]:
        """Count a stream as open to this pod while the block runs (the router scores with it)."""
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1

    def candidate(self) -> Candidate:
        """What the router needs of this pod: its last report (its adapter sets built once per
        report: a pod may list hundreds of adapters, and every request asks) and the streams
        opened since, less those ended since."""
        if self._candidate is None or self._candidate[0] is not self.load:
            load = self.load or pod_status_pb2.PodLoad()
            reported = Candidate(
                address=self.address,
                num_waiting=load.num_waiting,
                in_flight=load.requests_in_flight,
                kv_usage=load.kv_usage,
                resident_adapters=set(load.resident_adapters),
                waiting_adapters=set(load.waiting_adapters),
                max_adapters=load.max_adapters,
                available_adapters=set(load.available_adapters),
                host_adapters=set(load.host_adapters),
                memory_used_bytes=load.adapter_memory_used_bytes,
                memory_capacity_bytes=load.adapter_memory_capacity_bytes,
            )
            self._candidate = (self.load, reported)
        return dataclasses.replace(self._candidate[1], unreported=self.in_flight - self.in_flight_at_report)


def static_discovery(addresses: list[str]) -> Callable[[], Awaitable[list[str]]]:
    """A fixed list of pods (`--pods`). Each must be HOST:PORT: `--pods notaport` was taken, and the
    gateway health-checked a pod at an address gRPC read as port 443 forever, serving nothing."""
    for address in addresses:
        _split_host_port(address, "--pods")

    async def discover() -> list[str]:
        return list(addresses)

    return discover


def dns_discovery(target: str) -> Callable[[], Awaitable[list[str]]]:
    """`name:port` of a headless Service: every address it resolves to is a pod, of one family
    (IPv4 where there is any, else IPv6). A dual-stack Service, or `localhost`, resolves to an
    address of each family for every pod: taking both counted each pod twice."""
    host, port = _split_host_port(target, "--pods-dns")

    async def discover() -> list[str]:
        infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        ipv4 = [i[4][0] for i in infos if i[0] == socket.AF_INET]
        return sorted({host_port(address, port) for address in ipv4 or [i[4][0] for i in infos]})

    return discover


def check_target(target: str, flag: str) -> None:
    """Refuse a target this service would dial forever without reaching (ConfigError naming
    `flag`): gRPC's own schemes are taken as given (`ipv4:A:P,B:P` for several replicas), anything
    else must be HOST:PORT."""
    if not target.startswith(TARGET_SCHEMES):
        _split_host_port(target, flag)


def _split_host_port(address: str, flag: str) -> tuple[str, int]:
    """HOST (an IPv6 one without its brackets, as a resolver wants it) and PORT of `address`, or
    ConfigError naming `flag`: flagtypes.host_and_port."""
    try:
        return flagtypes.host_and_port(address)
    except ValueError as e:
        hint = "an IPv6 host in brackets: [::1]:PORT"
        raise ConfigError(f"{flag} wants HOST:PORT, got {address!r} ({hint})") from e


class PodPool:
    def __init__(
        self,
        discover: Callable[[], Awaitable[list[str]]],
        *,
        interval: float = 1.0,
        timeout: float = 1.0,
        failure_threshold: int = 2,
        discovery_interval: float = 5.0,
        interceptors: Iterable[Any] = (),
        on_change: Callable[[], Awaitable[None]] | None = None,
        on_eject: Callable[[str], None] | None = None,
        security: Security = PLAINTEXT,
        outlier_errors: int = 5,
        outlier_ejection: float = 30.0,
    ) -> None:
        self.discover = discover
        self.interval, self.timeout = interval, timeout
        self.failure_threshold = failure_threshold
        self.outlier_errors, self.outlier_ejection = outlier_errors, outlier_ejection
        self.discovery_interval = discovery_interval
        self.interceptors, self.security = list(interceptors), security
        self.on_change, self.on_eject = on_change, on_eject
        self.pods: dict[str, Pod] = {}
        self.ejections: collections.Counter[str] = collections.Counter()  # by reason, for /metrics
        self._last_discovery = float("-inf")
        self._task: asyncio.Task | None = None
        self._retiring: dict[Pod, asyncio.Task[None]] = {}  # gone from discovery, streams still open
        # After a placement: every pod's load again, concurrent placements sharing one poll.
        self.poll_now = Coalesced(self._check_all)

    def healthy(self, exclude: Iterable[str] = (), model: str | None = None) -> list[Pod]:
        """The pods in rotation, but those in `exclude`; with `model`, only those serving it."""
        skip = set(exclude)
        return [
            p
            for p in self.pods.values()
            if p.healthy and p.address not in skip and (model is None or p.serves(model))
        ]

    def base_models(self) -> set[str]:
        """The base models the pods reported serving (an HTTP request's `model` is one of these or
        an adapter's name)."""
        return {p.load.model for p in self.pods.values() if p.load is not None and p.load.model}

    def eject(self, pod: Pod, why: str, reason: str = "unavailable") -> None:
        """Take `pod` out of rotation; `reason` (a short fixed word) counts it in /metrics."""
        was_healthy = pod.healthy
        pod.healthy, pod.last_error = False, why
        pod.failures = max(pod.failures, self.failure_threshold)
        if was_healthy:
            self.ejections[reason] += 1
            log.warning("ejecting model pod %s: %s", pod.address, why)
            if self.on_eject is not None:
                self.on_eject(pod.address)

    def record(self, pod: Pod, code: grpc.StatusCode) -> None:
        """A request's outcome on `pod`, for outlier detection (Envoy's consecutive 5xx). A pod
        that passes its checks but fails every request with a server error stayed in rotation
        for good, and drew more than its share: failing fast, it looked the least loaded.
        `outlier_errors` such failures in a row eject it for `outlier_ejection` s times its
        ejections in a row; a success resets both. The last pod in rotation of its model stays:
        when every pod fails, the requests are the likelier cause."""
        if code not in SERVER_ERRORS:
            pod.errors_in_a_row = 0
            if code == grpc.StatusCode.OK:
                pod.ejections = 0
            return
        pod.errors_in_a_row += 1
        if self.outlier_errors <= 0 or pod.errors_in_a_row < self.outlier_errors or not pod.healthy:
            return
        if not self.healthy(exclude=[pod.address], model=pod.load.model if pod.load else None):
            return
        pod.ejections += 1
        seconds = self.outlier_ejection * min(pod.ejections, MAX_EJECTION_FACTOR)
        pod.ejected_until = time.monotonic() + seconds
        self.eject(
            pod,
            f"{pod.errors_in_a_row} requests in a row failed ({code.name}); out for {seconds:g} s",
            "outlier",
        )
        pod.errors_in_a_row = 0

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for task in self._retiring.values():
            task.cancel()
        pods = [*self.pods.values(), *self._retiring]
        await asyncio.gather(*(p.close() for p in pods), return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.refresh()
            except Exception:  # the loop must outlive any one bad refresh
                log.exception("pod refresh failed")

    async def refresh(self) -> None:
        if time.monotonic() - self._last_discovery >= self.discovery_interval:
            await self._rediscover()
        await self._check_all()
        if self.on_change is not None:
            await self.on_change()

    async def _rediscover(self) -> None:
        try:
            addresses = set(await self.discover())
        except OSError as e:
            log.warning("pod discovery failed, keeping %d known pods: %s", len(self.pods), e)
            return
        self._last_discovery = time.monotonic()
        for address in addresses - self.pods.keys():
            log.info("discovered model pod %s", address)
            self.pods[address] = Pod(address, self.interceptors, self.security)
        for address in self.pods.keys() - addresses:
            log.info("model pod %s is gone from discovery", address)
            pod = self.pods.pop(address)
            if self.on_eject is not None:
                self.on_eject(address)
            self._retire(pod)

    def _retire(self, pod: Pod) -> None:
        task = asyncio.create_task(pod.close_when_idle())
        self._retiring[pod] = task
        task.add_done_callback(lambda _: self._retiring.pop(pod, None))

    async def recheck(self, pod: Pod) -> None:
        """Check one pod now (its health and load report), as the periodic poll would."""
        await self._check(pod)

    async def _check_all(self) -> None:
        await asyncio.gather(*(self._check(p) for p in list(self.pods.values())))

    async def _check(self, pod: Pod) -> None:
        try:
            reply = await pod.health.Check(
                health_pb2.HealthCheckRequest(service="spindle.v1.Generation"), timeout=self.timeout
            )
            if reply.status != health_pb2.HealthCheckResponse.SERVING:
                self.eject(pod, "health check says NOT_SERVING", "not_serving")
                return
            in_flight = pod.in_flight  # what the report will count (at most)
            load = await pod.status.GetLoad(pod_status_pb2.GetLoadRequest(), timeout=self.timeout)
        except grpc.aio.AioRpcError as e:
            pod.failures += 1
            pod.last_error = f"{e.code().name}: {e.details()}"
            if pod.failures >= self.failure_threshold:
                self.eject(pod, f"{pod.failures} failed checks, last: {pod.last_error}", "health_check")
            return
        if _restarted(pod.load, load):
            log.info("model pod %s restarted (serving %s)", pod.address, load.model)
            if self.on_eject is not None:  # its caches are empty: forget what was sent there
                self.on_eject(pod.address)
        pod.load, pod.in_flight_at_report, pod.failures = load, in_flight, 0
        if not pod.healthy and time.monotonic() >= pod.ejected_until:
            log.info("model pod %s is healthy", pod.address)
            pod.healthy = True


def _restarted(before: pod_status_pb2.PodLoad | None, now: pod_status_pb2.PodLoad) -> bool:
    """Whether a pod's report shows another process than its last one on the same address
    (another model, or its request counter gone back): a restart the checks did not see fail
    (one shorter than `failure_threshold` polls)."""
    return before is not None and (now.model != before.model or now.requests_total < before.requests_total)
