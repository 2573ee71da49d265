"""The controller: keeps the cluster's view of the pods, places adapters, rotates and cools them.

It talks to pods only over ModelControl; every weight change is one control op, which the pod
runs at a quiescent point. It polls each pod's GetSlots every `poll_interval` seconds: a good poll
renews the pod's leases in the registry (a pod that stops answering lets them lapse), feeds the
adapters' popularity (popularity.py: the pods count each adapter's requests) and the policy
(placement.py), and notices a registry that lost its index (then rebuilt from the store).

Placement of one adapter is single-flight: concurrent requests for it share one placement task,
which runs to its end even when the request that started it is cancelled; across replicas of
the service, the adapter's `place:NAME` lease lets one of them place it and the others answer
with its choice (adapter_service/leases.py). Every replica polls every pod (its leases, the
catalog); only the replica holding the `leader` lease runs the policy (spread, cool, and
rotating a pod a registration left on an old version). Control calls are
retried with backoff only when the pod was unreachable; a refusal (FAILED_PRECONDITION: the slot
is in use or pinned) is counted and respected, never retried blindly.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc
from opentelemetry import trace

from adapter_service import metrics
from adapter_service.deadlines import Bounds
from adapter_service.leases import Leases
from adapter_service.placement import (
    Knobs,
    PodView,
    choose_peer,
    choose_target,
    match_hints,
    replicas_for,
    to_cool,
    to_spread,
)
from adapter_service.popularity import Popularity
from adapter_service.registry import Registry, cancel_and_wait
from adapter_service.store import Store, Version
from gateway.pods import CHANNEL_OPTIONS  # quick reconnects, keepalive: the same needs as the gateway's
from spindle.coalesce import Coalesced
from spindle.security import PLAINTEXT, Security
from spindle.v1 import adapters_pb2 as apb
from spindle.v1 import model_control_pb2 as mc
from spindle.v1 import model_control_pb2_grpc

log = logging.getLogger("spindle.adapters")
Code = grpc.StatusCode


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class PlacementError(Exception):
    """Placement could not be done; `code` is the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Pod:
    def __init__(self, address: str, interceptors: Iterable[Any], security: Security = PLAINTEXT) -> None:
        self.view = PodView(address)
        self.channel = security.dial(address, CHANNEL_OPTIONS, interceptors, control=True)
        self.control = model_control_pb2_grpc.ModelControlStub(self.channel)


class Controller:
    def __init__(
        self,
        registry: Registry,
        store: Store,
        discover: Callable[[], Awaitable[list[str]]],
        advertise: str,
        *,
        knobs: Knobs | None = None,
        poll_interval: float = 2.0,
        lease_ttl: float = 10.0,
        staging_max_bytes: int = 256 << 20,
        control_timeout: float = 60.0,
        interceptors: Iterable[Any] = (),
        tracer: trace.Tracer | None = None,
        security: Security = PLAINTEXT,
        bounds: Bounds | None = None,
        leases: Leases | None = None,
    ) -> None:
        """`leases`: this replica's (by default a new owner on `registry`, renewed every
        `lease_ttl` / 3 s); `bounds`: the RPCs' (the service's handlers read them here)."""
        self.registry, self.store, self.discover = registry, store, discover
        self.advertise = advertise  # how pods reach this service's FetchAdapterWeights
        self.knobs = knobs or Knobs()
        self.poll_interval, self.lease_ttl = poll_interval, lease_ttl
        self.staging_max_bytes, self.control_timeout = staging_max_bytes, control_timeout
        self.interceptors, self.security = list(interceptors), security
        self.tracer = tracer or trace.NoOpTracer()
        self.bounds = bounds or Bounds()
        self.leases = leases or Leases(registry, ttl=lease_ttl)
        self._stale_since: dict[tuple[str, str], float] = {}  # (pod, name) on an old version since
        self.pods: dict[str, Pod] = {}
        self.idle_since: dict[tuple[str, str], float] = {}
        self.popularity = Popularity(self.knobs.popularity_half_life)
        self._renewed: dict[str, dict[str, tuple[tuple, float]]] = {}  # pod -> name -> (lease, when)
        self._placing: dict[str, asyncio.Task] = {}
        self._task: asyncio.Task | None = None
        self._last_poll = float("-inf")
        self._latest: tuple[str | None, dict[str, Version]] = (None, {})  # (generation, index)
        # A placement's fresh view of the pods: concurrent placements share one poll round.
        self._refresh_now = Coalesced(lambda: self.refresh(policy=False))
        self._building = asyncio.Lock()  # one rebuild of the index at a time (ensure_built)

    # --- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """First view of the pods, then the poll loop; Redis or S3 still down is retried there."""
        try:
            await self.ensure_built()
            await self.refresh(policy=False)
        except Exception as e:  # e.g. Redis not up yet: stay NOT_SERVING and keep trying
            log.warning("storage or registry not reachable yet (%s); retrying", e)
        self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
        for t in self._placing.values():
            t.cancel()
        await asyncio.gather(*(p.channel.close() for p in self.pods.values()), return_exceptions=True)
        await self.registry.close()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval)
            try:
                await self.ensure_built()
                await self.refresh()
            except Exception as e:  # the loop must outlive one bad round (Redis or S3 blips)
                log.warning("adapter controller round failed: %s: %s", type(e).__name__, e)

    async def ensure_built(self) -> bool:
        """Rebuild the registry index from the store when it has none (new or flushed Redis);
        whether it had none (the caller reads the index again). Concurrent callers share one
        rebuild: after a flush every lookup that missed rebuilt the whole index itself, each a
        listing and a read per adapter (8 at once under 2,000 adapters: 56 s)."""
        if await self.registry.is_built():
            return False
        async with self._building:
            if not await self.registry.is_built():
                await self._rebuild()
        return True

    async def _rebuild(self) -> None:
        latest = await self.store.versions(latest=True)
        await self.registry.rebuild(latest)
        log.warning("registry index rebuilt from storage: %d adapters", len(latest))
        metrics.REBUILDS.inc()

    async def lookup(self, name: str) -> Version | None:
        v = await self.registry.get(name)
        if v is None and await self.ensure_built():
            v = await self.registry.get(name)
        return v

    # --- the pods' view --------------------------------------------------------------------------

    async def refresh(self, policy: bool = True, wait: bool = False) -> None:
        """`wait`: give each pod the poll's timeout to connect, for a channel still in backoff."""
        addresses = set(await self.discover())
        for address in addresses - self.pods.keys():
            self.pods[address] = Pod(address, self.interceptors, self.security)
        for address in self.pods.keys() - addresses:
            await self.pods.pop(address).channel.close()
            self.popularity.forget_pod(address)
            self._renewed.pop(address, None)
        latest = await self.latest()
        metrics.REGISTERED.set(len(latest))
        await asyncio.gather(*(self._poll(p, latest, wait) for p in list(self.pods.values())))
        self._last_poll = time.monotonic()
        self.popularity.decay(self._last_poll)
        if policy:
            leading = await self.leases.lead(max(3 * self.poll_interval, self.lease_ttl))
            metrics.LEADER.set(int(leading))
            if leading:
                await self._apply_policy(latest)

    async def _poll(self, pod: Pod, latest: dict[str, Version] | None = None, wait: bool = False) -> None:
        """GetSlots, and a lease for each registered adapter it holds (`latest`: the index, if read)."""
        try:
            report = await pod.control.GetSlots(mc.GetSlotsRequest(), timeout=2.0, wait_for_ready=wait)
        except grpc.aio.AioRpcError as e:
            if pod.view.ok:
                log.warning("pod %s stopped answering: %s", pod.view.address, e.code().name)
            pod.view.ok = False
            return
        view = pod.view
        view.ok, view.slots = True, list(report.slots)
        view.adapters = {a.name: a for a in report.adapters}
        self.popularity.observe(view.address, {a.name: a.requests_total for a in report.adapters})
        if latest is None:  # one round trip for all of them (a pod may hold hundreds)
            latest = await self.registry.get_many([a.name for a in report.adapters])
        infos = {}
        for a in report.adapters:
            v = latest.get(a.name)
            if v is None:
                continue
            infos[a.name] = {
                "tier": int(a.tier),
                "version": v.version if a.sha256 == v.sha256 else 0,
                "refcount": a.refcount,
                "sha256": a.sha256,
            }
        await self.registry.lease_many(view.address, self._due(view.address, infos), self.lease_ttl)

    def _due(self, pod: str, infos: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """The leases to write after a poll: those whose tier, version or weights changed, and
        those last renewed a third of their TTL ago. A pod holding hundreds of adapters, polled
        every `poll_interval`, wrote every one of them each time; the refcount a lease shows
        (Get's placements) may now be that much older."""
        now, before = time.monotonic(), self._renewed.get(pod, {})
        renewed, due = {}, {}
        for name, info in infos.items():
            lease = (info["tier"], info["version"], info["sha256"])
            last = before.get(name)
            if last is None or last[0] != lease or now - last[1] >= self.lease_ttl / 3:
                due[name], last = info, (lease, now)
            renewed[name] = last
        self._renewed[pod] = renewed
        return due

    def views(self) -> list[PodView]:
        return [p.view for p in self.pods.values()]

    def holders(self, latest: dict[str, Version]) -> dict[str, list[str]]:
        """The reachable pods that hold each adapter's latest version, as last polled (sorted).
        What the leases say too, without reading them: every replica of the service polls every
        pod, and the gateway asks for all of it every poll (with 10,000 adapters, reading the
        leases made most of the catalog's cost)."""
        out: dict[str, list[str]] = {}
        for view in sorted(self.views(), key=lambda v: v.address):
            for name, a in view.adapters.items() if view.ok else ():
                v = latest.get(name)
                if v is not None and a.sha256 == v.sha256:
                    out.setdefault(name, []).append(view.address)
        return out

    async def placements(self, names: list[str]) -> dict[str, list[apb.PodPlacement]]:
        """Each name's live leases, by pod: one registry round trip for all of them (one name,
        as Get asks: `leases`, which also drops its expired ones)."""
        if len(names) == 1:
            by_name = {names[0]: await self.registry.leases(names[0])}
        else:
            by_name = await self.registry.leases_of(names)
        return {
            name: [
                apb.PodPlacement(pod=pod, tier=i["tier"], version=i["version"], refcount=i["refcount"])
                for pod, i in sorted(leases.items())
            ]
            for name, leases in by_name.items()
        }

    # --- control ops -----------------------------------------------------------------------------

    async def _control(self, pod: Pod, method: str, request: Any, attempts: int = 3) -> Any:
        """One control op; retried with backoff only while the pod is unreachable."""
        delay = 0.2
        for attempt in range(1, attempts + 1):
            try:
                reply = await getattr(pod.control, method)(request, timeout=self.control_timeout)
                metrics.CONTROL_OPS.labels(method, "OK").inc()
                return reply
            except grpc.aio.AioRpcError as e:
                metrics.CONTROL_OPS.labels(method, e.code().name).inc()
                if e.code() != Code.UNAVAILABLE or attempt == attempts:
                    raise
                await asyncio.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    # --- weights ---------------------------------------------------------------------------------

    async def weights(self, name: str) -> tuple[bytes, bytes, Version, str]:
        """The latest version's (config, weights), and where they came from: staging or storage.
        Both copies are checked against the registered sha256 before they go out: a corrupted
        staged copy was sent to every pod that asked, each refused it (DATA_LOSS), and the
        adapter could not be placed anywhere until staging happened to drop it. Now it is
        replaced from storage; a corrupted stored copy is refused with what to do."""
        v = await self.lookup(name)
        if v is None:
            raise PlacementError(Code.NOT_FOUND, f"adapter {name!r} is not registered")
        staged = await self.registry.staged(v.sha256)
        config = await self.registry.staged(f"config:{v.sha256}")
        if staged is not None and config is not None:
            got = await asyncio.to_thread(_sha256, staged)
            if got == v.sha256:
                return config, staged, v, "staging"
            log.error(
                "staged copy of %s v%d has sha256 %s, not %s: replaced from storage",
                *(v.name, v.version, got, v.sha256),
            )
        config, data = await self.store.read(v.name, v.version)
        got = await asyncio.to_thread(_sha256, data)
        if got != v.sha256:
            raise PlacementError(
                Code.DATA_LOSS,
                f"the stored weights of adapter {v.name!r} version {v.version} have sha256 {got}, "
                f"registered as {v.sha256}: corrupted in storage; register the adapter again",
            )
        await self.stage(v.sha256, config, data)
        return config, data, v, "storage"

    async def stage(self, sha256: str, config: bytes, data: bytes) -> None:
        await self.registry.stage(f"config:{sha256}", config, self.staging_max_bytes)
        await self.registry.stage(sha256, data, self.staging_max_bytes)

    # --- placement ---------------------------------------------------------------------------------

    async def place(self, name: str, hints: list[apb.PodHint]) -> apb.PlaceResponse:
        """Single-flight: a request joining a placement in progress waits for that one."""
        task = self._placing.get(name)
        if task is None:
            task = asyncio.create_task(self._place(name, hints))
            self._placing[name] = task
            task.add_done_callback(lambda _: self._placing.pop(name, None))
        return await asyncio.shield(task)

    async def _place(
        self, name: str, hints: list[apb.PodHint], exclude: set[str] | None = None, hot: bool = False
    ) -> apb.PlaceResponse:
        """`hot`: a replica of a popular adapter (its pod is chosen by load; see placement.py)."""
        started = time.monotonic()
        with self.tracer.start_as_current_span("spindle.adapter.place") as span:
            span.set_attribute("spindle.adapter", name)
            v = await self.lookup(name)
            if v is None:
                raise PlacementError(Code.NOT_FOUND, f"adapter {name!r} is not registered")
            span.set_attribute("spindle.adapter.version", v.version)
            if not any(w.ok for w in self.views()):  # one may have come up since: wait for it
                await self.refresh(policy=False, wait=True)
            elif time.monotonic() - self._last_poll > self.poll_interval / 2:
                await self._refresh_now()
            views = [w for w in self.views() if w.address not in (exclude or set())]
            routable = match_hints(views, hints)
            holders = self._holders_of(views, v, routable)
            if not holders or exclude:
                async with self.leases.hold(f"place:{name}", f"another replica's placement of {name!r}"):
                    # Another replica may have placed it while this one waited for the lease.
                    await self._refresh_now()
                    views = [w for w in self.views() if w.address not in (exclude or set())]
                    if not exclude and (holders := self._holders_of(views, v, routable)):
                        span.set_attribute("spindle.placement.source", "resident")
                        return apb.PlaceResponse(pods=holders, source="resident", version=v.version)
                    return await self._place_on_a_pod(name, v, views, routable, hot, started, span)
            span.set_attribute("spindle.placement.source", "resident")
            return apb.PlaceResponse(pods=holders, source="resident", version=v.version)

    @staticmethod
    def _holders_of(views: list[PodView], v: Version, routable: dict[str, Any] | None) -> list[str]:
        """The reachable pods holding `v`'s weights, among those the gateway can route to if it said."""
        return [
            w.address
            for w in views
            if w.ok and w.holds(v.name, v.sha256) and (routable is None or w.address in routable)
        ]

    async def _place_on_a_pod(
        self,
        name: str,
        v: Version,
        views: list[PodView],
        routable: dict[str, Any] | None,
        hot: bool,
        started: float,
        span: trace.Span,
    ) -> apb.PlaceResponse:
        """Choose a pod, bring the weights, load a slot: under the adapter's placement lease."""
        hot = hot or replicas_for(self.popularity.share(name), self.knobs) > 1
        for attempt in (1, 2):  # a pod that fails mid-placement is skipped once for another
            target = choose_target(views, name, v.sha256, routable, hot)
            if target is None:
                reachable = sum(w.ok for w in views)
                raise PlacementError(
                    Code.UNAVAILABLE,
                    f"no model pod can take adapter {name!r} now ({reachable} of {len(views)} reachable)",
                )
            span.set_attribute("spindle.pod", target.address)
            target.placing += 1  # counted by concurrent placements until polled as held
            try:
                source = await self._copy(self.pods[target.address], v, views)
                await self._load(self.pods[target.address], name)
                await self._poll(self.pods[target.address])
                break
            except PlacementError as e:
                if e.code != Code.UNAVAILABLE or attempt == 2:
                    raise
                log.warning("placing %s on %s failed (%s); trying another pod", name, target.address, e)
                target.ok = False
            finally:
                target.placing -= 1
        if v.pinned:
            await self.pin(name, True, [self.pods[target.address]])
        metrics.PLACEMENTS.labels(source).inc()
        metrics.PLACE_SECONDS.labels(source).observe(time.monotonic() - started)
        span.set_attribute("spindle.placement.source", source)
        log.info("placed %s v%d on %s from %s", name, v.version, target.address, source)
        return apb.PlaceResponse(pods=[target.address], source=source, version=v.version)

    async def _copy(self, target: Pod, v: Version, views: list[PodView]) -> str:
        """Bring the weights to `target`: from a peer pod if one has them, else through the service."""
        peer = choose_peer(views, v.name, v.sha256, exclude=target.view.address)
        if peer is not None:
            try:
                await self._control(
                    target,
                    "PromoteFromPeer",
                    mc.PromoteFromPeerRequest(name=v.name, peer=peer.address, sha256=v.sha256),
                )
                return "peer"
            except grpc.aio.AioRpcError as e:
                if e.code() not in (Code.UNAVAILABLE, Code.NOT_FOUND, Code.DATA_LOSS):
                    raise PlacementError(e.code(), f"pod {target.view.address}: {e.details()}") from e
                log.info(
                    "peer %s could not give %s (%s); sending it from the service",
                    peer.address,
                    v.name,
                    e.code().name,
                )
        staged = await self.registry.is_staged(v.sha256)
        try:
            await self._control(
                target,
                "PromoteFromPeer",
                mc.PromoteFromPeerRequest(name=v.name, peer=self.advertise, sha256=v.sha256),
            )
        except grpc.aio.AioRpcError as e:
            raise PlacementError(
                Code.UNAVAILABLE if e.code() == Code.UNAVAILABLE else e.code(),
                f"pod {target.view.address} could not take adapter {v.name!r}: {e.details()}",
            ) from e
        return "staging" if staged else "storage"

    async def _load(self, pod: Pod, name: str) -> None:
        """Into a device slot now, if one is free or idle; a busy pod promotes on demand instead."""
        try:
            await self._control(pod, "LoadAdapter", mc.LoadAdapterRequest(name=name))
        except grpc.aio.AioRpcError as e:
            if e.code() != Code.FAILED_PRECONDITION:
                raise PlacementError(e.code(), f"pod {pod.view.address}: {e.details()}") from e
            metrics.REFUSALS.labels("LoadAdapter").inc()
            log.info("pod %s has no idle slot for %s; it stays in host memory", pod.view.address, name)

    # --- versions, deletion, pins ----------------------------------------------------------------

    async def rotate(self, v: Version) -> list[str]:
        """Point every pod that holds the name at the new version (in-flight requests keep the old).
        Skipped when a newer version was registered since (its registration rotates); a pod this
        misses (a replica died first, the pod did not answer) is rotated by the leader's policy."""
        await self.refresh(policy=False)
        latest = await self.lookup(v.name)
        if latest is None or latest.version != v.version:
            return []
        holders = [
            p
            for p in self.pods.values()
            if p.view.ok and v.name in p.view.adapters and p.view.adapters[v.name].sha256 != v.sha256
        ]
        done = []
        for pod in holders:
            if await self._rotate_one(pod, v):
                done.append(pod.view.address)
        for pod in holders:
            await self._poll(pod)
        return done

    async def _rotate_one(self, pod: Pod, v: Version) -> bool:
        with self.tracer.start_as_current_span("spindle.adapter.rotate") as span:
            span.set_attribute("spindle.pod", pod.view.address)
            try:
                await self._control(
                    pod, "Rotate", mc.RotateRequest(name=v.name, peer=self.advertise, sha256=v.sha256)
                )
            except grpc.aio.AioRpcError as e:
                log.warning("rotating %s on %s failed: %s", v.name, pod.view.address, e.details())
                return False
        if v.pinned:
            await self._pin_new_version(pod, v.name)
        return True

    async def _pin_new_version(self, pod: Pod, name: str) -> None:
        """A pinned adapter's pin was its old version's slot, which the rotation retired: load
        the new version and pin it, or the adapter lost its pin with every update."""
        try:
            await self._load(pod, name)
        except PlacementError as e:  # rotated all the same; Pin (or the next placement) pins it
            log.warning("pinning the new version of %s on %s failed: %s", name, pod.view.address, e)
            return
        await self.pin(name, True, [pod])

    async def _rotate_stale(self, latest: dict[str, Version], now: float) -> None:
        """Rotate pods that have held an old version of an adapter for a lease TTL: longer than a
        registration's own rotation takes, so the two do not both load the new weights."""
        stale = {
            (pod.view.address, name)
            for pod in self.pods.values()
            if pod.view.ok
            for name, a in pod.view.adapters.items()
            if name in latest and a.sha256 != latest[name].sha256
        }
        self._stale_since = {key: self._stale_since.get(key, now) for key in stale}
        for (address, name), since in list(self._stale_since.items()):
            if now - since >= self.lease_ttl and address in self.pods:
                log.info("pod %s still holds an old version of %s: rotating it", address, name)
                if await self._rotate_one(self.pods[address], latest[name]):
                    metrics.ROTATED_LATE.inc()
                    del self._stale_since[(address, name)]

    async def evict_everywhere(self, name: str) -> None:
        await self.refresh(policy=False)
        for pod in [p for p in self.pods.values() if p.view.ok and name in p.view.adapters]:
            with contextlib.suppress(grpc.aio.AioRpcError):  # not resident: nothing pinned
                await self._control(pod, "Pin", mc.PinRequest(name=name, pinned=False))
            try:
                await self._control(pod, "Evict", mc.EvictRequest(name=name, from_disk=True))
            except grpc.aio.AioRpcError as e:
                metrics.REFUSALS.labels("Evict").inc()
                log.info("pod %s kept %s: %s", pod.view.address, name, e.details())

    async def pin(self, name: str, pinned: bool, pods: list[Pod] | None = None) -> None:
        """Pin (or unpin) the adapter's device slots on `pods` (default: every pod), as last polled."""
        for pod in [p for p in (pods or self.pods.values()) if p.view.ok]:
            await self._poll(pod)
            a = pod.view.adapters.get(name)
            if a is not None and a.tier == mc.TIER_DEVICE:
                try:
                    await self._control(pod, "Pin", mc.PinRequest(name=name, pinned=pinned))
                except grpc.aio.AioRpcError as e:
                    log.info("pin %s on %s: %s", name, pod.view.address, e.details())

    # --- policy ----------------------------------------------------------------------------------

    async def latest(self) -> dict[str, Version]:
        """Every registered adapter's latest version: read again only when the index changed
        (its generation); callers must not change what they get."""
        generation = await self.registry.generation()
        if generation is not None and generation == self._latest[0]:
            return self._latest[1]
        out, after = {}, ""
        while page := await self.registry.page(after, 500):
            out.update((v.name, v) for v in page)
            after = page[-1].name
        self._latest = (generation, out)
        return out

    async def _apply_policy(self, latest: dict[str, Version]) -> None:
        await self._rotate_stale(latest, time.monotonic())
        views, shares = self.views(), self.popularity.shares()
        metrics.HOT.set(sum(replicas_for(share, self.knobs) > 1 for share in shares.values()))
        for name in to_spread(views, {n: v.sha256 for n, v in latest.items()}, shares, self.knobs):
            holders = {w.address for w in views if w.holds(name, latest[name].sha256)}
            try:
                await self._place(name, [], exclude=holders, hot=True)
                metrics.SPREADS.inc()
            except PlacementError as e:
                log.info("not spreading %s: %s", name, e)
        pinned = {n for n, v in latest.items() if v.pinned}
        for ev in to_cool(views, self.idle_since, pinned, time.monotonic(), self.knobs):
            pod = self.pods.get(ev.pod)
            if pod is None:
                continue
            try:
                await self._control(pod, "Evict", ev.request(), attempts=1)
                metrics.COOLED.labels(ev.leaves).inc()
            except grpc.aio.AioRpcError as e:
                metrics.REFUSALS.labels("Evict").inc()  # in use since the poll: the pod said no
                log.debug("pod %s refused to cool %s: %s", ev.pod, ev.name, e.details())
