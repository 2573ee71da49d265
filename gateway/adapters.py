"""The gateway's side of the adapter service: placement on demand, the catalog, the admin API.

- place: a request for a registered adapter that no ready pod holds asks the service to place
  it, waits (bounded by --placement-timeout and the request's deadline), and is then routed.
  Concurrent requests for one adapter share one placement call, which runs to its end even if
  the request that started it goes away: a request is never failed for another's placement.
- catalog: the registered adapters (refreshed with every pod poll), so ListModels shows them
  all, placed or not, and a deleted adapter is refused even while a pod still has its files.
  A name not in it is looked up again (one catalog fetch shared by every caller waiting; such
  fetches draw on a bucket of MISS_FETCH_BURST, refilled one every MISS_REFETCH_S) and, still
  unknown, remembered as a miss for MISS_TTL_S in a cache of at most MISS_CACHE names: requests
  for random names (a buggy or hostile client) cost the adapter service at most one catalog a
  second after the burst, not one each, while a name registered a moment ago elsewhere is
  fetched at its first request. A Register or Import through this gateway forgets the miss and
  refetches at once; a name that missed is served after the next pod poll (--health-interval)
  or at most MISS_TTL_S + MISS_REFETCH_S later.
- admin: spindle.v1.Adapters forwarded unchanged for callers whose API key has the admin scope.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import grpc

from gateway.auth import Caller
from gateway.limits import TokenBucket
from gateway.pods import CHANNEL_OPTIONS, Pod
from spindle.grpc_status import abort
from spindle.security import PLAINTEXT, Security
from spindle.v1 import adapters_pb2 as apb
from spindle.v1 import adapters_pb2_grpc

log = logging.getLogger("spindle.gateway")
Code = grpc.StatusCode
MISS_TTL_S = 5.0  # how long an unknown name is answered NOT_FOUND without asking the service
MISS_REFETCH_S = 1.0  # one catalog fetch caused by unknown names a second, past the burst
MISS_FETCH_BURST = 5.0  # such fetches allowed at once (a quiet gateway answers a new name at once)
MISS_CACHE = 4096  # names remembered as unknown, the oldest forgotten first (memory is bounded)


class AdapterDirectory:
    def __init__(
        self,
        target: str,
        interceptors: Iterable[Any] = (),
        placement_timeout: float = 60.0,
        security: Security = PLAINTEXT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.target = target
        options = [*CHANNEL_OPTIONS, ("grpc.max_send_message_length", 64 << 20)]  # reconnect fast, too
        self.channel = security.dial(target, options, interceptors, control=True)
        self.adapters = adapters_pb2_grpc.AdaptersStub(self.channel)
        self.placement = adapters_pb2_grpc.PlacementStub(self.channel)
        self.placement_timeout = placement_timeout
        self.catalog: dict[str, apb.CatalogEntry] | None = None  # None: never fetched
        self._placing: dict[str, asyncio.Task] = {}
        # Requests for names not in the catalog (or before it was ever fetched) share one fetch:
        # with 10,000 adapters, one each was a storm the service could not answer in time.
        self._fetching: asyncio.Future[bool] | None = None
        self.clock = clock
        self._misses: OrderedDict[str, float] = OrderedDict()  # name -> when it stops being a miss
        self._miss_fetches = TokenBucket(1 / MISS_REFETCH_S, MISS_FETCH_BURST, MISS_FETCH_BURST, clock())

    async def refresh(self) -> bool:
        try:
            reply = await self.placement.Catalog(apb.CatalogRequest(), timeout=2.0)
        except grpc.aio.AioRpcError as e:
            log.warning("adapter service %s: catalog not refreshed: %s", self.target, e.code().name)
            return False
        self.catalog = {e.name: e for e in reply.adapters}
        return True

    async def registered(self, name: str) -> bool:
        """Whether the service knows `name`: asks again before saying no, unless `name` was
        unknown less than MISS_TTL_S ago or the miss fetches' bucket is empty (True if the
        service never answered)."""
        if self.catalog is not None and name in self.catalog:
            return True
        if self._missed(name):
            return False
        await self._fetch_for_miss()
        if self.catalog is None or name in self.catalog:
            return True
        self._remember_miss(name)
        return False

    async def _fetch_for_miss(self) -> None:
        """Wait for the catalog fetch in flight, or start one if the bucket has a token. The fetch
        is shared: a caller that goes away does not cancel it."""
        if self._fetching is None:
            if self._miss_fetches.take(self.clock()) > 0:
                return
            self._fetching = asyncio.ensure_future(self.refresh())
            self._fetching.add_done_callback(self._fetched)
        await asyncio.shield(self._fetching)

    def _fetched(self, _: asyncio.Future[bool]) -> None:
        self._fetching = None

    def _missed(self, name: str) -> bool:
        until = self._misses.get(name)
        if until is not None and until <= self.clock():
            del self._misses[name]
            return False
        return until is not None

    def _remember_miss(self, name: str) -> None:
        self._misses[name] = self.clock() + MISS_TTL_S
        self._misses.move_to_end(name)
        while len(self._misses) > MISS_CACHE:
            self._misses.popitem(last=False)

    async def registered_now(self, name: str) -> None:
        """`name` was just registered through this gateway: serve it at once (its miss forgotten,
        the catalog fetched again)."""
        self._misses.pop(name, None)
        await self.refresh()

    async def place(self, name: str, pods: list[Pod], timeout: float | None) -> apb.PlaceResponse:
        task = self._placing.get(name)
        if task is None:
            hints = [_hint(p) for p in pods]
            task = asyncio.create_task(self._place(apb.PlaceRequest(adapter=name, pods=hints)))
            self._placing[name] = task
            task.add_done_callback(lambda _: self._placing.pop(name, None))
        limit = self.placement_timeout if timeout is None else min(timeout, self.placement_timeout)
        return await asyncio.wait_for(asyncio.shield(task), limit)

    async def _place(self, request: apb.PlaceRequest) -> apb.PlaceResponse:
        return await self.placement.Place(request, timeout=self.placement_timeout)

    async def close(self) -> None:
        await self.channel.close()


def _lost_refusal(e: grpc.aio.AioRpcError) -> bool:
    """grpc.aio's streaming client, when the server answers before the last message went out (the
    adapter service refuses a bad upload at once), may fail the next send and report INTERNAL
    "Internal error from Core" in place of the server's status (grpc/aio/_call.py `_write`:
    `set_internal_error`). Only a refusal ends an upload early, so it is the caller's bad input.
    The service reads up to 64 MB of a refused upload before answering, so this is left for
    clients that keep sending past that."""
    return e.code() == Code.INTERNAL and "SendMessageOperation" in (e.debug_error_string() or "")


def _hint(pod: Pod) -> apb.PodHint:
    """The pod by its control address (its host and reported control port), with its load."""
    load = pod.load
    if load is None:
        return apb.PodHint(address=pod.address)
    host = pod.address.rpartition(":")[0]
    return apb.PodHint(
        address=f"{host}:{load.control_port}" if load.control_port else pod.address,
        num_waiting=load.num_waiting,
        kv_usage=load.kv_usage,
        resident_adapters=len(load.resident_adapters),
        max_adapters=load.max_adapters,
    )


class AdminProxy(adapters_pb2_grpc.AdaptersServicer):
    """The admin API through the gateway: authenticated here, answered by the adapter service."""

    def __init__(
        self,
        directory: AdapterDirectory | None,
        caller: Callable[[grpc.aio.ServicerContext], Awaitable[Caller]],
    ) -> None:
        self.directory, self.caller = directory, caller

    async def _admin(self, context: grpc.aio.ServicerContext) -> adapters_pb2_grpc.AdaptersStub:
        caller = await self.caller(context)
        if not caller.admin:
            await abort(
                context,
                Code.PERMISSION_DENIED,
                f"API key {caller.name!r} has no admin scope (see gateway/auth.py)",
            )
        if self.directory is None:
            await abort(
                context, Code.UNIMPLEMENTED, "this gateway has no adapter service (--adapter-service)"
            )
        return self.directory.adapters

    async def _forward(self, context: grpc.aio.ServicerContext, method: str, request: Any) -> Any:
        stub = await self._admin(context)
        try:
            return await getattr(stub, method)(request, timeout=context.time_remaining())
        except grpc.aio.AioRpcError as e:
            if _lost_refusal(e):
                await abort(
                    context,
                    Code.INVALID_ARGUMENT,
                    "the adapter service refused the upload before it ended (its reason was lost in "
                    "transit; the service's log has it): check the header (name, config, size, sha256)",
                )
            await abort(context, e.code(), e.details() or "adapter service error")

    async def Register(self, request_iterator: AsyncIterator[apb.RegisterChunk], context: Any) -> apb.Adapter:
        reply = await self._forward(context, "Register", request_iterator)
        await self.directory.registered_now(reply.name)
        return reply

    async def Import(self, request: apb.ImportRequest, context: Any) -> apb.Adapter:
        reply = await self._forward(context, "Import", request)
        await self.directory.registered_now(reply.name)
        return reply

    async def Get(self, request: apb.GetAdapterRequest, context: Any) -> apb.Adapter:
        return await self._forward(context, "Get", request)

    async def List(self, request: apb.ListAdaptersRequest, context: Any) -> apb.ListAdaptersResponse:
        return await self._forward(context, "List", request)

    async def Delete(self, request: apb.DeleteAdapterRequest, context: Any) -> apb.DeleteAdapterResponse:
        reply = await self._forward(context, "Delete", request)
        await self.directory.refresh()  # refused here at once (other gateways: at their next poll)
        return reply

    async def Pin(self, request: apb.PinAdapterRequest, context: Any) -> apb.Adapter:
        return await self._forward(context, "Pin", request)
