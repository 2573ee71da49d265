"""The gateway's catalog of registered adapters under requests for names nobody registered: the
real adapter service (in memory) on a real gRPC server, the gateway's directory, request check
and admin proxy in process."""

from __future__ import annotations

import asyncio
import hashlib
import random
import string
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from adapter_service import base_model
from adapter_service.controller import Controller
from adapter_service.registry import MemoryRegistry
from adapter_service.server import AdaptersService, PlacementService
from adapter_service.store import LocalStore
from gateway import adapters
from gateway.adapters import AdapterDirectory, AdminProxy
from gateway.auth import ANONYMOUS
from gateway.pods import PodPool, static_discovery
from gateway.server import GatewayService
from spindle.openai_api.context import HttpCallContext, Refused
from spindle.v1 import adapters_pb2 as apb
from spindle.v1 import adapters_pb2_grpc
from spindle.v1 import generation_pb2 as pb
from tests.adapter_helpers import lora_dirs  # noqa: F401 (a fixture)


class _CountedPlacement(PlacementService):
    def __init__(self, controller: Controller) -> None:
        super().__init__(controller)
        self.catalogs = 0

    async def Catalog(
        self, request: apb.CatalogRequest, context: grpc.aio.ServicerContext
    ) -> apb.CatalogResponse:
        self.catalogs += 1
        await asyncio.sleep(0.01)  # a round trip: concurrent misses arrive while it runs
        return await super().Catalog(request, context)


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def _chunks(name: str, directory: Path) -> AsyncIterator[apb.RegisterChunk]:
    weights = (directory / "adapter_model.safetensors").read_bytes()
    config = (directory / "adapter_config.json").read_bytes()
    sha = hashlib.sha256(weights).hexdigest()
    yield apb.RegisterChunk(
        header=apb.RegisterHeader(name=name, config_json=config, total_bytes=len(weights), sha256=sha)
    )
    yield apb.RegisterChunk(data=weights)


async def _not_found(gateway: GatewayService, name: str) -> str:
    request = pb.GenerateRequest(text="hi", adapter=name)
    with pytest.raises(Refused) as e:
        await gateway._admissible(request, HttpCallContext({}))
    assert e.value.code == grpc.StatusCode.NOT_FOUND, e.value.details
    return e.value.details


def test_unknown_adapter_names_cost_a_bounded_number_of_catalog_fetches(tmp_path, tiny_llama, lora_dirs):  # noqa: F811
    """400 requests for 200 random names nobody registered (a buggy or hostile client) each made
    the gateway fetch the whole catalog from the adapter service again (400 fetches). Misses are
    now remembered a while (bounded), concurrent ones share one fetch, and fetches for misses
    draw on a small bucket refilled one every MISS_REFETCH_S. A name registered through the
    gateway after its miss is served at once; one registered elsewhere once its miss expired,
    or at its first request if it never missed (an Import straight to the service, then a
    request through the gateway)."""

    async def go() -> None:
        store = LocalStore(tmp_path / "store")
        controller = Controller(
            MemoryRegistry(), store, discover=lambda: asyncio.sleep(0, []), advertise="x:1"
        )
        placement = _CountedPlacement(controller)
        server = grpc.aio.server()
        service = AdaptersService(
            controller, base_model.load(tiny_llama.name), max_rank=64, max_adapter_bytes=1 << 24
        )
        adapters_pb2_grpc.add_AdaptersServicer_to_server(service, server)
        adapters_pb2_grpc.add_PlacementServicer_to_server(placement, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        clock = _Clock()
        directory = AdapterDirectory(f"127.0.0.1:{port}", clock=clock)
        pool = PodPool(static_discovery([]))
        gateway = GatewayService(pool, None, directory=directory)
        admin = AdminProxy(directory, lambda _: asyncio.sleep(0, ANONYMOUS))
        rng = random.Random(7)
        names = ["".join(rng.choices(string.ascii_lowercase, k=12)) for _ in range(200)]
        for burst in range(4):  # concurrent bursts, time passing between them
            messages = await asyncio.gather(
                *(_not_found(gateway, n) for n in names[burst * 50 : burst * 50 + 50])
            )
            messages += await asyncio.gather(
                *(_not_found(gateway, n) for n in names[burst * 50 : burst * 50 + 50])
            )
            assert all("is not registered" in m and "check the name" in m for m in messages)
            clock.now += 0.3
        for name in names[:40]:  # one after another, no time passing: the bucket is spent
            await _not_found(gateway, name + "x")
        allowed = adapters.MISS_FETCH_BURST + 1.2 / adapters.MISS_REFETCH_S
        assert 1 <= placement.catalogs <= allowed, placement.catalogs
        fetched = placement.catalogs
        for _ in range(5):  # one name again and again: remembered, not fetched
            await _not_found(gateway, names[0])
        assert placement.catalogs == fetched
        await admin.Register(_chunks(names[0], lora_dirs["a"]), HttpCallContext({}))
        assert await directory.registered(names[0])  # registered through the gateway: at once
        await service.Register(_chunks(names[1], lora_dirs["b"]), HttpCallContext({}))  # elsewhere
        await _not_found(gateway, names[1])  # still a remembered miss
        clock.now += adapters.MISS_TTL_S + adapters.MISS_REFETCH_S
        assert await directory.registered(names[1])
        clock.now += adapters.MISS_FETCH_BURST * adapters.MISS_REFETCH_S  # a quiet while
        await directory.refresh()  # the pod poll's routine fetch, just before
        await service.Register(_chunks("fresh", lora_dirs["b"]), HttpCallContext({}))  # elsewhere
        assert await directory.registered("fresh")  # never missed: fetched at its first request
        for i in range(adapters.MISS_CACHE + 10):  # the misses remembered are bounded
            directory._remember_miss(f"m{i}")
        assert len(directory._misses) == adapters.MISS_CACHE
        await directory.close()
        await pool.close()
        await server.stop(None)

    asyncio.run(go())
