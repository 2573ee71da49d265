"""A model pod's state, shared by its RPCs: the engine, the requests in flight, the drain.

The engine runs on its own thread (AsyncEngine); everything here runs on the event loop and
reaches the engine only through AsyncEngine's inbox, so a forward pass never blocks an RPC and
no RPC ever touches scheduler state mid-step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from model_service.engine.async_engine import AsyncEngine
from model_service.engine.engine import EngineStats
from model_service.engine.handle import EngineHandle
from model_service.engine.sampling_params import SamplingParams
from model_service.engine.sequence import RequestOutput
from model_service.errors import UnavailableError
from model_service.lora.pool import ACTIVE, AdapterInfo
from model_service.pod.load_stats import LoadStats
from model_service.pod.metrics import PodMetrics, Residency, Snapshot
from model_service.pod.wire import TokenTexts
from spindle.serving import Health, in_daemon_thread
from spindle.v1 import pod_status_pb2

log = logging.getLogger(__name__)

# How long a scrape waits for the event loop (a report itself answers within FRESH_WAIT_S):
# inside Prometheus's default scrape timeout (10 s).
SCRAPE_WAIT_S = 5.0


@dataclass
class InFlight:
    """One Generate call, for load reports, metrics and the queue / prefill / decode spans."""

    request_id: str
    adapter: str | None
    arrival: float  # time.monotonic()
    arrival_ns: int  # time.time_ns(), for span timestamps
    scheduled: float | None = None  # the first step that ran it (end of its queue wait)
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0
    chunks: int = 0
    abort_requested: bool = False  # an Abort came, perhaps before the engine had the request
    resumed: int = 0  # output tokens another pod made (`resume`): replayed here, prefilled not generated
    itl: list[float] = field(default_factory=list)

    def on_output(self, out: RequestOutput) -> None:
        """Note when the engine first ran it, the first time an output says so."""
        if self.scheduled is None:
            self.scheduled = out.first_scheduled_at

    def on_tokens(self, now: float, n: int) -> None:
        if self.first_token is None:
            self.first_token = now
        elif n:
            self.itl.append((now - (self.last_token or now)) / n)
        self.last_token = now
        self.num_tokens += n

    def wall_ns(self, mono: float) -> int:
        return self.arrival_ns + int((mono - self.arrival) * 1e9)


@dataclass
class Gathered:
    """What the engine thread reports at one instant: stats, adapters and their memory, consistent
    with each other."""

    stats: EngineStats
    adapters: list[AdapterInfo]
    memory_used_bytes: int
    memory_capacity_bytes: int

    def residency(self) -> Residency:
        """The adapters by tier; `@active` is on the device when some adapter is active."""
        tiers: dict[str, list[str]] = {"gpu": [], "cpu": [], "disk": []}
        for a in self.adapters:
            tiers[a.tier].append(a.name)
        if any(a.active for a in self.adapters):  # `@active` requests can run here
            tiers["gpu"].append(ACTIVE)
        return Residency(
            sorted(tiers["gpu"]),
            sorted(tiers["cpu"]),
            sorted(tiers["disk"]),
            self.memory_used_bytes,
            self.memory_capacity_bytes,
        )


class ModelPod:
    def __init__(
        self,
        model_name: str,
        drain_timeout: float,
        health: Health | None = None,
        stream_interval: int = 1,
        stall_timeout: float = 120.0,
    ) -> None:
        self.model_name = model_name
        self.drain_timeout = drain_timeout
        self.stream_interval = stream_interval  # tokens a Generate message carries (--stream-interval)
        self.health = health
        self.async_engine: AsyncEngine[EngineHandle] | None = None
        self.engine: EngineHandle | None = None
        self.max_model_len = 0
        self.token_texts = TokenTexts(None)  # logprob tokens' texts, once the engine (its tokenizer) loads
        self.control_port = 0  # reported in PodLoad (the adapter service addresses pods by it)
        self.inflight: dict[str, InFlight] = {}
        self.requests_total = 0
        # Requests the engine accepted, per adapter (GetSlots reports them: the adapter
        # service's popularity signal). Only accepted ones: a name nobody serves adds no entry.
        self.adapter_requests: Counter[str] = Counter()
        self.draining = False
        self.lost: str | None = None  # why the engine can no longer serve (a lost tensor-parallel rank)
        self._health_off: asyncio.Future[None] | None = None
        self.drain_aborted: set[str] = set()
        self.exit_requested = asyncio.Event()
        self.exit_code = 0
        self.metrics = PodMetrics(model_name, self.snapshot_blocking)
        self._watchdog: asyncio.Future[None] | None = None
        self.load_stats = LoadStats(self.gathered, stall_timeout)  # what load reports and scrapes read
        self._loop: asyncio.AbstractEventLoop | None = None  # the pod's (scrapes come on another thread)
        self._closed = False

    # --- lifecycle ----------------------------------------------------------------------------

    async def load(self, build_engine: Callable[[], EngineHandle]) -> None:
        """Build the engine off the event loop, warm it up, then report SERVING."""
        started = time.monotonic()
        engine = await in_daemon_thread(build_engine, "engine-build")  # a stop need not wait for it
        self.engine, self.async_engine = engine, AsyncEngine(engine)
        loop = self._loop = asyncio.get_running_loop()
        engine.on_lost(lambda why: loop.call_soon_threadsafe(self._on_lost, why))
        self.async_engine.on_lost(lambda why: loop.call_soon_threadsafe(self._on_lost, why))
        self.max_model_len, self.token_texts = engine.max_model_len, TokenTexts(engine.tokenizer)
        await self._warm_up(engine.vocab_size)
        await self.load_stats.recent()  # so that no report or scrape waits for a step from now on
        log.info("model %s loaded and warmed in %.1f s", self.model_name, time.monotonic() - started)
        if not self.draining and self.health is not None:
            await self.health.set(True)
        self._watchdog = asyncio.ensure_future(self._watch_for_stalls())

    async def _watch_for_stalls(self) -> None:
        """A step that runs past `--engine-stall-timeout` means a stuck engine thread (a hung
        device, a deadlock), not a busy one: the pod then ends as for a lost device (NOT_SERVING,
        streams UNAVAILABLE so the gateway resumes them elsewhere, exit 1 so Kubernetes restarts
        it). Only load reports noticed before, and the health probes kept answering SERVING."""
        period = min(5.0, self.load_stats.stall_s / 4)
        while self.lost is None and not self._closed:
            await asyncio.sleep(period)
            try:
                await self.load_stats.recent()
            except UnavailableError as e:
                self._on_lost(str(e))

    async def _warm_up(self, vocab: int) -> None:
        """One tiny request through the whole path, so the first real request pays no first-use costs."""
        assert self.async_engine is not None
        ids = [t % vocab for t in (1, 2, 3)]
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        async for _ in self.async_engine.generate(
            f"warmup-{time.monotonic_ns()}", prompt_token_ids=ids, params=params
        ):
            pass

    def _on_lost(self, why: str) -> None:
        """On the event loop: refuse new work at once (set before any later output is read), then
        report NOT_SERVING, fail every open stream as UNAVAILABLE and exit so the pod restarts."""
        if self.lost is not None:
            return
        self.lost = why
        log.error("the engine cannot serve any more: %s", why)
        if self.async_engine is not None:
            self.async_engine.fail_streams(UnavailableError(self.lost_message()))
        if self.health is not None:
            self._health_off = asyncio.ensure_future(self.health.set(False))
        self.request_exit(f"engine lost: {why}", code=1)

    def lost_message(self) -> str:
        return f"model pod cannot serve any more ({self.lost}); retry on another pod"

    @property
    def ready(self) -> bool:
        return self.async_engine is not None and self.health is not None and self.health.serving

    def request_exit(self, why: str, code: int = 0) -> None:
        log.info("shutting down (%s)", why)
        self.exit_code = code
        self.exit_requested.set()

    async def drain(self, timeout: float | None = None) -> tuple[int, int]:
        """Stop admitting; let in-flight requests finish within `timeout`; abort the rest.

        Returns (finished, aborted). Aborted streams end with UNAVAILABLE, so a gateway knows the
        pod, not the request, was at fault. One-way: a drained pod stays NOT_SERVING.
        """
        timeout = self.drain_timeout if timeout is None else timeout
        self.draining = True
        if self.health is not None:
            await self.health.set(False)
        at_start = len(self.inflight)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.inflight and loop.time() < deadline:
            await asyncio.sleep(0.02)
        left = list(self.inflight)
        for rid in left:
            self.drain_aborted.add(rid)
            if self.async_engine is not None:
                self.async_engine.abort(rid)
        give_up = loop.time() + 5.0
        while self.inflight and loop.time() < give_up:
            await asyncio.sleep(0.02)
        log.info("drained: %d finished, %d aborted", at_start - len(left), len(left))
        return at_start - len(left), len(left)

    def close(self) -> None:
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        self.metrics.stop()
        if self.async_engine is not None:
            self.async_engine.shutdown()

    # --- requests ------------------------------------------------------------------------------

    def begin(self, request_id: str, adapter: str | None, resumed: int = 0) -> InFlight:
        req = InFlight(request_id, adapter, time.monotonic(), time.time_ns(), resumed=resumed)
        self.inflight[request_id] = req
        self.requests_total += 1
        return req

    def accepted(self, req: InFlight) -> None:
        """The engine took the request (its first output came): count it for its adapter."""
        if req.adapter is not None:
            self.adapter_requests[req.adapter] += 1

    def end(self, req: InFlight) -> None:
        self.inflight.pop(req.request_id, None)
        self.drain_aborted.discard(req.request_id)

    # --- load ------------------------------------------------------------------------------------

    @staticmethod
    def _gather(engine: EngineHandle) -> Gathered:
        """On the engine thread, between steps (the pool's counts do not move under it)."""
        memory = engine.adapter_memory
        return Gathered(
            engine.stats(), engine.list_adapters(), memory.memory_used_bytes, memory.memory_capacity_bytes
        )

    def _max_adapters(self) -> int:
        return self.engine.config.max_loras if self.engine is not None else 0

    def _adapter_split(self) -> tuple[list[str], list[str]]:
        """Adapters of in-flight requests that have started running, and of those still queued."""
        running, waiting = set(), set()
        for req in list(self.inflight.values()):
            if req.adapter is not None:
                started = req.first_token is not None or req.scheduled is not None
                (running if started else waiting).add(req.adapter)
        return sorted(running), sorted(waiting)

    def snapshot_blocking(self) -> Snapshot | None:
        """For the metrics thread: what load reports read (`LoadStats`), on the pod's event loop.
        A scrape used to wait for the engine thread to finish its step: a long prompt's prefill
        on a slow device (48 s) outlasted Prometheus's scrape timeout, and a stuck engine held
        every scrape's thread. Raises UnavailableError past `--engine-stall-timeout`."""
        loop = self._loop
        if self.async_engine is None or self._closed or loop is None:
            return None
        if _on(loop):
            raise RuntimeError("a scrape on the pod's event loop would wait for itself: scrape from a thread")
        return asyncio.run_coroutine_threadsafe(self._snapshot(), loop).result(timeout=SCRAPE_WAIT_S)

    async def _snapshot(self) -> Snapshot:
        now = await self.load_stats.recent()
        running, waiting = self._adapter_split()
        return Snapshot(
            stats=now.stats,
            max_adapters=self._max_adapters(),
            running_adapters=running,
            waiting_adapters=waiting,
            residency=now.residency(),
        )

    async def adapters(self) -> list[AdapterInfo]:
        return (await self.gathered()).adapters if self.async_engine is not None else []

    async def gathered(self) -> Gathered:
        """The adapters, their memory and the engine's stats, at one instant (engine loaded)."""
        assert self.async_engine is not None
        return await asyncio.to_thread(self.async_engine.call, self._gather)

    async def load_report(self) -> pod_status_pb2.PodLoad:
        """The load the gateway routes by: the engine's stats of the last step boundary (at most one
        step old, `LoadStats`) beside the requests in flight now."""
        assert self.async_engine is not None
        now = await self.load_stats.recent()
        stats, where = now.stats, now.residency()
        _, waiting = self._adapter_split()
        return pod_status_pb2.PodLoad(
            model=self.model_name,
            num_waiting=stats.num_waiting,
            num_running=stats.num_running,
            num_swapped=stats.num_swapped,
            kv_usage=stats.kv_usage,
            kv_blocks_total=stats.kv_blocks_total,
            kv_blocks_free=stats.kv_blocks_free,
            prefix_cache_hit_rate=stats.prefix_cache_hit_rate,
            resident_adapters=where.device,
            waiting_adapters=waiting,
            max_adapters=self._max_adapters(),
            draining=self.draining,
            requests_total=self.requests_total,
            requests_in_flight=len(self.inflight),
            available_adapters=sorted({*where.device, *where.host, *where.disk}),
            control_port=self.control_port,
            state_slots_total=stats.state_slots_total,
            state_slots_free=stats.state_slots_free,
            host_adapters=where.host,
            disk_adapters=where.disk,
            adapter_memory_used_bytes=where.memory_used_bytes,
            adapter_memory_capacity_bytes=where.memory_capacity_bytes,
            max_model_len=self.max_model_len,
        )


def _on(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether this thread is running `loop`."""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
