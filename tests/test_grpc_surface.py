"""The gRPC surface as clients outside the project use it, on the servers every service builds
(spindle/serving.py): keepalive pings, server reflection, health per port. Real sockets, no model."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2 as rpb

from spindle import serving
from spindle.v1 import generation_pb2
from tests import raw_http2
from tests.service_helpers import free_port

SILENT = "/test.Silent/Wait"


@contextlib.asynccontextmanager
async def _silent_server(silence: float) -> AsyncIterator[str]:
    """A server from `serving.make_server` whose one method answers after `silence` seconds with
    nothing sent before (a long prefill, a queued request): yields its address."""

    async def wait(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await asyncio.sleep(silence)
        return b""

    server = serving.make_server()
    handler = grpc.unary_unary_rpc_method_handler(wait)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Silent", {"Wait": handler}),))
    port = serving.bind(server, "127.0.0.1", 0)
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


def test_keepalive_pings_at_the_floor_keep_silent_streams_and_idle_connections(monkeypatch):
    """gRPC's server default took the third ping within 5 minutes without data for abuse: a client
    pinging every 10-30 s (grpc-go, grpc-java, Envoy) got GOAWAY too_many_pings, and every stream on
    the connection died, once a stream was silent ~30 s; an idle connection's pings, at once.
    (The floor is lowered here only to keep the test short; pings 3x as fast stay refused.)"""
    floor = 0.25
    monkeypatch.setattr(serving, "KEEPALIVE_MIN_PING_S", floor)

    async def go() -> None:
        async with _silent_server(silence=10 * floor) as address:
            during_call = asyncio.to_thread(raw_http2.pinging, address, 2 * floor, 12 * floor, SILENT)
            idle = asyncio.to_thread(raw_http2.pinging, address, 2 * floor, 8 * floor)
            flood = asyncio.to_thread(raw_http2.pinging, address, floor / 3, 8 * floor)
            assert await asyncio.gather(during_call, idle, flood) == [
                "ended",
                "open",
                "GOAWAY <ErrorCodes.ENHANCE_YOUR_CALM: 11> b'too_many_pings'",
            ]

    asyncio.run(go())


def test_a_client_that_stops_answering_pings_is_cut_off_and_its_stream_cancelled(monkeypatch):
    """gRPC's server keepalive waited 2 hours: a caller hung or cut off without a FIN (a stopped
    process, a partition) held its stream, and the request ran on in the engine with its KV
    blocks (a hung process's: for good). (Times lowered here to keep the test short.)"""
    monkeypatch.setattr(serving, "KEEPALIVE_TIME_S", 0.3)
    monkeypatch.setattr(serving, "KEEPALIVE_TIMEOUT_S", 0.3)

    async def go() -> None:
        cancelled = asyncio.Event()

        async def tokens(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            try:
                while True:
                    yield b"token"
                    await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                cancelled.set()
                raise

        server = serving.make_server()
        handler = grpc.unary_stream_rpc_method_handler(tokens)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("test.Tokens", {"Get": handler}),)
        )
        port = serving.bind(server, "127.0.0.1", 0)
        await server.start()
        try:
            hung = asyncio.to_thread(
                raw_http2.unresponsive, f"127.0.0.1:{port}", "/test.Tokens/Get", b"", 1.5
            )
            await asyncio.gather(asyncio.wait_for(cancelled.wait(), 1.4), hung)
        finally:
            await server.stop(0)

    asyncio.run(go())


def test_reflection_answers_v1_as_well_as_v1alpha():
    """grpcio-reflection serves only v1alpha: a client asking `grpc.reflection.v1` (grpc_cli,
    tools following grpc-java's deprecation of v1alpha) got UNIMPLEMENTED. Both are answered
    now, each describing the services, v1 itself included (grpcurl's `describe` of every one)."""
    generation = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name

    async def ask(channel: grpc.aio.Channel, version: str, *requests: rpb.ServerReflectionRequest) -> list:
        call = channel.stream_stream(
            f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
            request_serializer=rpb.ServerReflectionRequest.SerializeToString,  # v1's wire format too
            response_deserializer=rpb.ServerReflectionResponse.FromString,
        )
        return [r async for r in call(iter(requests))]

    async def go() -> None:
        server = serving.make_server()
        serving.enable_reflection(server, [generation])
        port = serving.bind(server, "127.0.0.1", 0)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                for version in ("v1", "v1alpha"):
                    listed, *files = await ask(
                        channel,
                        version,
                        rpb.ServerReflectionRequest(list_services=""),
                        *(rpb.ServerReflectionRequest(file_containing_symbol=s) for s in (generation, V1)),
                    )
                    names = {s.name for s in listed.list_services_response.service}
                    assert {generation, V1, "grpc.reflection.v1alpha.ServerReflection"} <= names
                    described = [
                        descriptor_pb2.FileDescriptorProto.FromString(
                            f.file_descriptor_response.file_descriptor_proto[0]
                        )
                        for f in files
                    ]
                    assert [(d.package, d.service[0].name) for d in described] == [
                        ("spindle.v1", "Generation"),
                        ("grpc.reflection.v1", "ServerReflection"),
                    ]
        finally:
            await server.stop(0)

    asyncio.run(go())


def test_health_knows_each_ports_services_from_the_start():
    """A named service was unknown until the first `set`: a Watch begun while a pod loaded (grpc's
    client-side health checking) got SERVICE_UNKNOWN and never SERVING, and Check said NOT_FOUND.
    And every port said SERVING for every service of the process: a pod's control port for
    Generation, which it answers UNIMPLEMENTED. The protocol's List was UNIMPLEMENTED."""

    async def go() -> None:
        main, control = serving.make_server(), serving.make_server()
        health = serving.Health(main, ["a.Main"])
        health.also_on(control, ["a.Control"])
        ports = [serving.bind(s, "127.0.0.1", 0) for s in (main, control)]
        await asyncio.gather(main.start(), control.start())
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{p}") for p in ports]
        try:
            stubs = [health_pb2_grpc.HealthStub(c) for c in channels]
            watch = stubs[0].Watch(health_pb2.HealthCheckRequest(service="a.Main"))
            assert (await watch.read()).status == serving.NOT_SERVING
            check = await stubs[1].Check(health_pb2.HealthCheckRequest(service="a.Control"))
            assert check.status == serving.NOT_SERVING
            await health.set(True)
            assert (await watch.read()).status == serving.SERVING
            for stub, other in zip(stubs, ["a.Control", "a.Main"], strict=True):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Check(health_pb2.HealthCheckRequest(service=other))
                assert e.value.code() == grpc.StatusCode.NOT_FOUND
                assert (await stub.Check(health_pb2.HealthCheckRequest())).status == serving.SERVING
            listed = await stubs[1].List(health_pb2.HealthListRequest())  # it was UNIMPLEMENTED
            assert {k: v.status for k, v in listed.statuses.items()} == {
                "": serving.SERVING,
                "a.Control": serving.SERVING,
            }
            watch.cancel()
            probes = free_port()  # the plaintext --health-port (Kubernetes' probes): every service
            await health.serve_plaintext("127.0.0.1", probes)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{probes}") as channel:
                listed = await health_pb2_grpc.HealthStub(channel).List(health_pb2.HealthListRequest())
                assert {k: v.status for k, v in listed.statuses.items()} == dict.fromkeys(
                    ["", "a.Main", "a.Control"], serving.SERVING
                )
        finally:
            await asyncio.gather(*(c.close() for c in channels))
            await asyncio.gather(main.stop(0), control.stop(0), health.stop())

    asyncio.run(go())


V1 = "grpc.reflection.v1.ServerReflection"
