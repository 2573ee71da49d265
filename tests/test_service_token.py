"""The service token guard on every call shape, its rotation, and what it leaves open."""

from __future__ import annotations

import asyncio
import os
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from spindle import serving
from spindle.service_token import DRAIN_S, RequireToken, ServiceToken, send_token

Code = grpc.StatusCode


async def _unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return b"ok:" + request


async def _unary_stream(request: bytes, context: grpc.aio.ServicerContext):
    yield b"ok:" + request


async def _stream_unary(requests, context: grpc.aio.ServicerContext) -> bytes:
    return b"ok:" + b"".join([r async for r in requests])


async def _stream_stream(requests, context: grpc.aio.ServicerContext):
    async for r in requests:
        yield b"ok:" + r


SHAPES = {
    "UnaryUnary": grpc.unary_unary_rpc_method_handler(_unary),
    "UnaryStream": grpc.unary_stream_rpc_method_handler(_unary_stream),
    "StreamUnary": grpc.stream_unary_rpc_method_handler(_stream_unary),
    "StreamStream": grpc.stream_stream_rpc_method_handler(_stream_stream),
}


async def _call(channel: grpc.aio.Channel, shape: str) -> bytes | Code:
    """Every shape, with bytes in and out; the status code when refused."""
    method = f"/test.Control/{shape}"
    try:
        if shape == "UnaryUnary":
            return await channel.unary_unary(method)(b"x", timeout=5)
        if shape == "UnaryStream":
            return b"".join([r async for r in channel.unary_stream(method)(b"x", timeout=5)])
        if shape == "StreamUnary":
            return await channel.stream_unary(method)(iter([b"x"]), timeout=5)
        return b"".join([r async for r in channel.stream_stream(method)(iter([b"x"]), timeout=5)])
    except grpc.aio.AioRpcError as e:
        assert e.code() != Code.UNAUTHENTICATED or "token" in e.details()
        return e.code()


def test_every_call_shape_needs_the_token_which_may_rotate_and_health_stays_open(tmp_path):
    path = tmp_path / "token"
    path.write_text("first-token\n")
    token = ServiceToken(str(path))

    async def run() -> None:
        server = serving.make_server([RequireToken(token, ["test.Control"], "test server")])
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Control", SHAPES)])
        health = serving.Health(server, ())
        port = serving.bind(server, "127.0.0.1", 0)
        await server.start()
        await health.set(True)
        target = f"127.0.0.1:{port}"
        try:
            async with grpc.aio.insecure_channel(target) as bare:
                for shape in SHAPES:
                    assert await _call(bare, shape) == Code.UNAUTHENTICATED, shape
                reply = await health_pb2_grpc.HealthStub(bare).Check(health_pb2.HealthCheckRequest())
                assert reply.status == serving.SERVING  # answered without a token
            mine = ServiceToken(str(path))  # the caller's view of the same Secret
            async with grpc.aio.insecure_channel(target, interceptors=send_token(mine)) as ch:
                for shape in SHAPES:
                    assert await _call(ch, shape) == b"ok:x", shape
                stale = tmp_path / "stale"
                stale.write_text("first-token")
                old = ServiceToken(str(stale))
                (tmp_path / "next").write_text("second-token")
                os.replace(tmp_path / "next", path)  # a Secret update: both sides read the new one
                for shape in SHAPES:
                    assert await _call(ch, shape) == b"ok:x", shape
            async with grpc.aio.insecure_channel(target, interceptors=send_token(old)) as ch:
                assert await _call(ch, "UnaryUnary") == Code.UNAUTHENTICATED  # the old token is refused
        finally:
            await server.stop(0)

    asyncio.run(run())


def test_a_refused_stream_that_never_ends_is_refused_after_the_drain_bound(tmp_path):
    """A refused call's requests are read to their end before the refusal (ending a stream-stream
    call its client still wrote came back INTERNAL about once in a hundred on a loaded host), but
    no longer than `DRAIN_S`: a client that never half-closes is refused all the same."""
    path = tmp_path / "token"
    path.write_text("the-token")

    async def run() -> None:
        server = serving.make_server([RequireToken(ServiceToken(str(path)), ["test.Control"], "test server")])
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Control", SHAPES)])
        port = serving.bind(server, "127.0.0.1", 0)
        await server.start()

        async def endless():
            while True:
                yield b"x"
                await asyncio.sleep(0.05)

        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as bare:
                call = bare.stream_stream("/test.Control/StreamStream")(endless(), timeout=10)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    [r async for r in call]
                assert refused.value.code() == Code.UNAUTHENTICATED
        finally:
            await server.stop(0)

    started = time.monotonic()
    asyncio.run(run())
    assert time.monotonic() - started < 5 * DRAIN_S


def test_an_empty_or_missing_token_file_is_refused(tmp_path):
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        ServiceToken(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="cannot read"):
        ServiceToken(str(tmp_path / "missing"))


def test_a_rotation_may_overlap_as_the_file_holds_the_new_token_beside_the_old(tmp_path):
    """A Secret update reaches each pod's files at its own time: while some send the old token and
    some the new, both must be accepted. A two-line file was one token with a newline in it."""
    path = tmp_path / "token"
    path.write_text("old-token\n")
    token = ServiceToken(str(path))
    assert token.value() == b"old-token" and token.matches("old-token")
    (tmp_path / "next").write_text("old-token\nnew-token\n")  # step 1: the new one accepted too
    os.replace(tmp_path / "next", path)
    assert token.value() == b"old-token"
    assert token.matches("old-token") and token.matches("new-token") and not token.matches("other")
    (tmp_path / "next").write_text("new-token\n\nold-token\n")  # step 2: the new one sent
    os.replace(tmp_path / "next", path)
    assert token.value() == b"new-token" and token.matches("old-token")
    (tmp_path / "next").write_text("new-token\n")  # step 3: the old one dropped
    os.replace(tmp_path / "next", path)
    assert token.matches("new-token") and not token.matches("old-token")
    assert not token.matches("new-token\nold-token") and not token.matches("")
