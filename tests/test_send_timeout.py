"""--send-timeout: a stream whose client reads nothing that long is ended and everything of its
request released; a client that keeps reading, however slowly, is not cut (spindle/send_timeout.py,
and the HTTP front's event streams)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
from opentelemetry.trace import get_tracer

from spindle import serving
from spindle.openai_api.server import OpenAIServer
from spindle.v1 import generation_pb2 as pb
from spindle.v1 import generation_pb2_grpc, pod_status_pb2, pod_status_pb2_grpc
from tests.service_helpers import gateway_in_process, pod_in_process, token_request

# The client's stream window stays gRPC's 64 KB (no BDP growth to megabytes): a client that reads
# nothing holds the server's sends after 64 KB, not after seconds of a tiny model's output.
WINDOW_64KB = [("grpc.http2.bdp_probe", 0)]
KEYS = "single key-single * concurrency=1\n"


async def _until(done: Callable[[], Awaitable[bool]], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not await done():
        assert time.monotonic() < deadline, "not released in time"
        await asyncio.sleep(0.05)


def _long_request() -> pb.GenerateRequest:
    request = token_request([5, 6, 7], 480)
    request.logprobs = 20  # ~330 bytes a token: 64 KB in ~200 tokens
    return request


@pytest.mark.parametrize("edge", ["pod", "gateway"])
def test_a_grpc_client_that_reads_nothing_is_ended_and_its_request_released(edge, tiny_llama, tmp_path):
    """A client that keeps its connection but reads nothing held its handler, its in-flight
    entries, its key's stream slot and a place in the pod's `requests_in_flight` for as long as it
    lived. Now the edge it talks to (the pod, or the gateway in front) ends the stream after
    --send-timeout: everything released, the request cancelled, and the client, reading at last,
    gets what was already on its way and DEADLINE_EXCEEDED saying why (counted so, where it was
    counted CANCELLED, as a client that left)."""
    (tmp_path / "keys").write_text(KEYS)

    async def run() -> None:
        pod_timeout = 0.5 if edge == "pod" else 30.0  # the gateway's is the shorter, as deployed
        async with (
            pod_in_process(tiny_llama, "tiny", send_timeout=pod_timeout) as pod,
            contextlib.AsyncExitStack() as stack,
        ):
            port, metadata, gateway = pod.port, (), None
            if edge == "gateway":
                keys = ["--api-keys-file", str(tmp_path / "keys")]
                flags = ["--pods", f"127.0.0.1:{pod.port}", *keys, "--send-timeout", "0.5"]
                gateway = await stack.enter_async_context(gateway_in_process(flags))
                port, metadata = gateway.port, (("authorization", "Bearer key-single"),)
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=WINDOW_64KB)
            pod_channel = grpc.aio.insecure_channel(f"127.0.0.1:{pod.port}")
            for c in (channel, pod_channel):
                await stack.enter_async_context(c)
            status = pod_status_pb2_grpc.PodStatusStub(pod_channel)

            async def released() -> bool:
                load = await status.GetLoad(pod_status_pb2.GetLoadRequest(), timeout=5)
                pod_idle = load.requests_in_flight == load.num_running == load.num_waiting == 0
                if gateway is None:
                    return pod_idle
                return pod_idle and not gateway.inflight and gateway.limits.open_streams("single") == 0

            call = generation_pb2_grpc.GenerationStub(channel).Generate(
                _long_request(), metadata=metadata, timeout=60
            )
            await call.initial_metadata()  # the request is in flight: nothing read from here
            assert not await released()
            await _until(released)
            tokens = 0
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                async for message in call:
                    tokens += len(message.chunk.token_ids)
            assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "read nothing of this stream for 0.5 s" in ended.value.details()
            assert 0 < tokens < 480  # cut short: its request was cancelled
            if gateway is not None:  # counted as the client saw it, not as a client that left
                labels = {"method": "Generate", "model": "tiny", "code": "DEADLINE_EXCEEDED"}
                counted = gateway.metrics.registry.get_sample_value("spindle_gateway_requests_total", labels)
                assert counted == 1

    asyncio.run(run())


class _Instant:
    """A response stream of `count` 1 KB messages as fast as they go out, noting the longest any
    send held it (the reader's flow control) and when it was closed."""

    def __init__(self, count: int) -> None:
        self.count, self.longest, self.closed = count, 0.0, asyncio.Event()

    async def stream(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        try:
            for _ in range(self.count):
                sent = time.monotonic()
                yield b"x" * 1024
                self.longest = max(self.longest, time.monotonic() - sent)
        finally:
            self.closed.set()


def test_a_slow_reader_that_keeps_reading_is_not_cut():
    """The timeout bounds each send, not the stream: a reader taking 32 KB, then nothing for
    0.15 s, again and again (a send held up to two pauses: gRPC's window opens in steps; the
    stream more than twice the timeout) reads it all."""

    async def run() -> tuple[int, float, float]:
        instant = _Instant(400)
        server = serving.make_server((), send_timeout=0.75)
        handler = grpc.unary_stream_rpc_method_handler(instant.stream)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.Out", {"Out": handler}),))
        port = serving.bind(server, "127.0.0.1", 0)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=WINDOW_64KB) as channel:
                start, read = time.monotonic(), 0
                async for _ in channel.unary_stream("/t.Out/Out")(b"", timeout=30):
                    read += 1
                    if read % 32 == 0:
                        await asyncio.sleep(0.15)
                return read, time.monotonic() - start, instant.longest
        finally:
            await server.stop(0)

    read, took, longest = asyncio.run(run())
    assert read == 400 and took > 1.5
    assert longest > 0.1  # the sends did wait on the reader


class _Endless:
    """A Generation servicer whose stream never ends, 16 KB of text a message."""

    def __init__(self) -> None:
        self.closed = asyncio.Event()

    async def Generate(self, request: pb.GenerateRequest, context: Any) -> AsyncIterator[pb.GenerateResponse]:
        try:
            while True:
                yield pb.GenerateResponse(chunk=pb.Chunk(text="x" * 16384))
        finally:
            self.closed.set()


def test_an_http_client_that_reads_nothing_of_its_event_stream_is_disconnected():
    """The same over server-sent events: the connection is closed once the client read nothing
    for --send-timeout, and the stream behind it closed (the request cancelled)."""

    async def run() -> tuple[bytes, float]:
        servicer = _Endless()
        server = OpenAIServer(servicer, lambda: ("m",), lambda: True, get_tracer(__name__), send_timeout=0.5)
        port = await server.start("127.0.0.1", 0)
        loop = asyncio.get_running_loop()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, ("127.0.0.1", port))
            body = b'{"model": "m", "prompt": "hi", "stream": true}'
            head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            await loop.sock_sendall(sock, f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
            start = time.monotonic()
            await asyncio.wait_for(servicer.closed.wait(), 10)
            took, received = time.monotonic() - start, b""
            with contextlib.suppress(ConnectionResetError):
                while chunk := await asyncio.wait_for(loop.sock_recv(sock, 1 << 16), 10):
                    received += chunk
            return received, took
        finally:
            sock.close()
            await server.stop()

    received, took = asyncio.run(run())
    assert received.startswith(b"HTTP/1.1 200") and b"data: " in received
    assert b"[DONE]" not in received and took >= 0.5
