"""TLS and mutual TLS on a real loopback gRPC server, with certificates made in the test."""

from __future__ import annotations

import asyncio
import os
import ssl
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace

from spindle import serving, tls_channel
from spindle.openai_api.server import OpenAIServer
from spindle.tls import TlsConfig
from spindle.tls_channel import aio_channel
from tests.certs import authority, leaf


def _files(tmp: Path, require_client_cert: bool = False) -> tuple[TlsConfig, object]:
    ca = authority()
    (tmp / "ca.crt").write_bytes(ca.pem())
    crt, key = leaf(ca, "spindle-test", tmp, "server")
    tls = TlsConfig(str(crt), str(key), str(tmp / "ca.crt"), require_client_cert=require_client_cert)
    return tls.check(), ca


async def _server(tls: TlsConfig, port: int = 0) -> tuple[grpc.aio.Server, str]:
    server = serving.make_server()
    health = serving.Health(server, ())
    port = serving.bind(server, "127.0.0.1", port, tls)
    await server.start()
    await health.set(True)
    return server, f"127.0.0.1:{port}"


async def _check(target: str, tls: TlsConfig) -> grpc.StatusCode:
    """OK when a health check gets through, else the status the client saw."""
    async with aio_channel(target, tls) as channel:
        try:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
            return grpc.StatusCode.OK
        except grpc.aio.AioRpcError as e:
            return e.code()


def _client(tmp: Path, ca_pem: bytes, with_cert_from: object = None, name: str = "client") -> TlsConfig:
    (tmp / f"{name}-ca.crt").write_bytes(ca_pem)
    if with_cert_from is None:
        return TlsConfig(ca_file=str(tmp / f"{name}-ca.crt"))
    crt, key = leaf(with_cert_from, "spindle-client", tmp, name)
    return TlsConfig(str(crt), str(key), str(tmp / f"{name}-ca.crt"))


def test_tls_serves_and_a_plaintext_client_is_refused(tmp_path):
    async def run() -> None:
        tls, ca = _files(tmp_path)
        server, target = await _server(tls)
        try:
            assert await _check(target, _client(tmp_path, ca.pem())) == grpc.StatusCode.OK
            assert await _check(target, TlsConfig()) == grpc.StatusCode.UNAVAILABLE  # plaintext
            stranger = authority("another-ca")  # a server this client cannot verify
            assert await _check(target, _client(tmp_path, stranger.pem(), name="s")) != grpc.StatusCode.OK
        finally:
            await server.stop(0)

    asyncio.run(run())


def test_mutual_tls_refuses_clients_without_a_certificate_of_the_ca(tmp_path):
    async def run() -> None:
        tls, ca = _files(tmp_path, require_client_cert=True)
        server, target = await _server(tls)
        try:
            assert await _check(target, _client(tmp_path, ca.pem(), ca, "ok")) == grpc.StatusCode.OK
            no_cert = _client(tmp_path, ca.pem(), name="nocert")
            assert await _check(target, no_cert) == grpc.StatusCode.UNAVAILABLE
            other = authority("another-ca")
            forged = _client(tmp_path, ca.pem(), other, "forged")
            assert await _check(target, forged) == grpc.StatusCode.UNAVAILABLE
        finally:
            await server.stop(0)

    asyncio.run(run())


def _replace(src: Path, dst: Path) -> None:
    os.replace(src, dst)  # as a Secret update does: new files, swapped in at once


def test_rotated_certificate_files_are_served_without_a_restart(tmp_path):
    async def run() -> None:
        tls, old_ca = _files(tmp_path)
        server, target = await _server(tls)
        trusts_old = _client(tmp_path, old_ca.pem(), name="old")
        new_ca = authority("rotated-ca")
        trusts_new = _client(tmp_path, new_ca.pem(), name="new")
        try:
            assert await _check(target, trusts_old) == grpc.StatusCode.OK
            assert await _check(target, trusts_new) != grpc.StatusCode.OK
            crt, key = leaf(new_ca, "spindle-test", tmp_path, "rotated")
            _replace(crt, Path(tls.cert_file))  # half-way: the new certificate with the old key
            assert await _check(target, trusts_old) == grpc.StatusCode.OK  # the old pair is kept
            _replace(key, Path(tls.key_file))
            assert await _check(target, trusts_new) == grpc.StatusCode.OK
            assert await _check(target, trusts_old) != grpc.StatusCode.OK
        finally:
            await server.stop(0)

    asyncio.run(run())


def test_the_http_port_serves_tls_and_follows_rotated_files(tmp_path):
    """The OpenAI HTTP port (its /health; no servicer is needed for it): HTTPS with client
    certificates when required, and rotated files served without a restart, as the gRPC ports."""

    async def get(port: int, client: TlsConfig) -> int | str:
        context = ssl.create_default_context(cafile=client.ca_file)
        if client.cert_file:
            context.load_cert_chain(client.cert_file, client.key_file)
        try:
            async with httpx.AsyncClient(verify=context) as http:  # a new connection, a new handshake
                return (await http.get(f"https://127.0.0.1:{port}/health", timeout=3)).status_code
        except httpx.HTTPError as e:
            return type(e).__name__

    async def run() -> None:
        tls, old_ca = _files(tmp_path, require_client_cert=True)
        server = OpenAIServer(None, tuple, lambda: True, trace.NoOpTracer())
        port = await server.start("127.0.0.1", 0, tls)
        new_ca = authority("rotated-ca")
        trusts_old, trusts_new = (
            _client(tmp_path, old_ca.pem(), old_ca, "old"),
            _client(tmp_path, new_ca.pem(), old_ca, "new"),
        )
        try:
            assert await get(port, trusts_old) == 200
            assert await get(port, _client(tmp_path, old_ca.pem(), name="nocert")) != 200  # mutual TLS
            assert await get(port, trusts_new) != 200
            crt, key = leaf(new_ca, "spindle-test", tmp_path, "rotated")
            _replace(crt, Path(tls.cert_file))  # half-way: the new certificate with the old key
            assert await get(port, trusts_old) == 200  # the old pair is kept
            _replace(key, Path(tls.key_file))
            assert await get(port, trusts_new) == 200
            assert await get(port, trusts_old) != 200
        finally:
            await server.stop()

    asyncio.run(run())


def test_contradictory_settings_are_refused_with_the_flag_to_fix(tmp_path):
    with pytest.raises(ValueError, match="--tls-key-file"):
        TlsConfig(cert_file="a.crt").check()
    with pytest.raises(ValueError, match="--tls-ca-file"):
        TlsConfig("a.crt", "a.key", require_client_cert=True).check()
    with pytest.raises(ValueError, match="does not exist"):
        TlsConfig(ca_file=str(tmp_path / "missing.crt")).check()
    # Files there but unusable were tracebacks from the first server or channel that loaded them.
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(ValueError, match="is not the key of --tls-cert-file"):
        TlsConfig(str(junk), str(junk)).check()
    with pytest.raises(ValueError, match=r"--tls-ca-file .* holds no usable CA certificate"):
        TlsConfig(ca_file=str(junk)).check()
    tls, _ = _files(tmp_path)
    (tmp_path / "other").mkdir()
    other, _ = _files(tmp_path / "other")
    with pytest.raises(ValueError, match="is not the key of"):  # a key of another certificate
        TlsConfig(tls.cert_file, other.key_file).check()


def test_a_client_channel_follows_its_rotated_files(tmp_path, monkeypatch):
    """The server is replaced by one that trusts only a new CA; the client's files are rotated to a
    certificate of that CA. The same channel object gets through: it was made again."""
    monkeypatch.setattr(tls_channel, "CHECK_EVERY", 0.0)

    async def run() -> None:
        tls, old_ca = _files(tmp_path, require_client_cert=True)
        client = _client(tmp_path, old_ca.pem(), old_ca, "client")
        server, target = await _server(tls)
        port = int(target.rsplit(":", 1)[1])
        channel = aio_channel(target, client)
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=3)
            await server.stop(0)
            new_ca = authority("rotated-ca")
            (tmp_path / "ca.crt").write_bytes(new_ca.pem())  # the server trusts only the new CA,
            crt, key = leaf(new_ca, "spindle-test", tmp_path, "server")  # and serves its certificate
            server, target = await _server(TlsConfig(str(crt), str(key), tls.ca_file, True), port)
            crt, key = leaf(new_ca, "spindle-client", tmp_path, "rotated-client")
            _replace(crt, Path(client.cert_file))
            _replace(key, Path(client.key_file))
            (tmp_path / "client-ca.crt").write_bytes(new_ca.pem())
            reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await channel.close()
            await server.stop(0)

    asyncio.run(run())
