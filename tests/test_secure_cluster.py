"""A cluster with every hop secured: mutual TLS everywhere, the service token on control RPCs,
API keys at the gateway. Pod, adapter service and gateway run in this test's event loop; each
hop is a real loopback gRPC connection with real certificates made here.

The path covered: a client (mTLS, admin key) registers an adapter through the gateway (-> the
adapter service, token), a request for it makes the service place it on the pod (-> the pod's
control port, token; the pod fetches the weights from the service, token), and it is generated.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from adapter_service import server as adapter_server
from adapter_service.client import AdaptersClient
from spindle.security import Security, add_security_args, security_from_args
from spindle.service_token import ServiceToken
from spindle.tls import TlsConfig, sync_channel
from spindle.tls_channel import aio_channel
from spindle.v1 import (
    adapters_pb2,
    adapters_pb2_grpc,
    generation_pb2_grpc,
    model_control_pb2,
    model_control_pb2_grpc,
)
from tests.certs import authority, leaf
from tests.service_helpers import free_port, gateway_in_process, pod_in_process, token_request

Code = grpc.StatusCode
KEYS = "ops key-ops * admin\nuser key-user *\n"


def _secrets(tmp: Path) -> tuple[list[str], TlsConfig]:
    """The flags every service gets, and a client's TLS settings (a certificate of the same CA)."""
    ca = authority()
    (tmp / "ca.crt").write_bytes(ca.pem())
    crt, key = leaf(ca, "spindle", tmp, "service")
    (tmp / "token").write_text("s3rvice-t0ken\n")
    flags = ["--tls-cert-file", str(crt), "--tls-key-file", str(key), "--tls-ca-file", str(tmp / "ca.crt"),
             "--tls-require-client-cert", "--control-token-file", str(tmp / "token")]  # fmt: skip
    client_crt, client_key = leaf(ca, "a-user", tmp, "client")
    return flags, TlsConfig(str(client_crt), str(client_key), str(tmp / "ca.crt"))


async def _code(call) -> Code:
    try:
        await call
        return Code.OK
    except grpc.aio.AioRpcError as e:
        return e.code()


async def _control_checks(control: str, security: Security, client_tls: TlsConfig) -> None:
    """The pod's control port: mTLS alone is not enough, the token is; health stays open."""
    request = model_control_pb2.GetSlotsRequest()
    async with aio_channel(control, client_tls) as ch:  # a user's certificate, no token
        refused = model_control_pb2_grpc.ModelControlStub(ch).GetSlots(request, timeout=5)
        try:
            await refused
            raise AssertionError("GetSlots without the service token was answered")
        except grpc.aio.AioRpcError as e:
            assert e.code() == Code.UNAUTHENTICATED and "x-spindle-service-token" in e.details()
    async with security.dial(control, control=True) as ch:
        allowed = model_control_pb2_grpc.ModelControlStub(ch).GetSlots(request, timeout=5)
        assert await _code(allowed) == Code.OK
    async with aio_channel(control, TlsConfig()) as ch:  # plaintext
        plain = model_control_pb2_grpc.ModelControlStub(ch).GetSlots(request, timeout=5)
        assert await _code(plain) == Code.UNAVAILABLE


def _admin_checks(gateway: str, service: str, client_tls: TlsConfig, token: bytes, adapter: Path) -> None:
    with AdaptersClient(gateway, "key-ops", client_tls) as admin:
        admin.register("secured", adapter)
    with AdaptersClient(gateway, "key-user", client_tls) as user:
        try:
            user.list()
            raise AssertionError("a key without the admin scope listed adapters")
        except grpc.RpcError as e:
            assert e.code() == Code.PERMISSION_DENIED
    with AdaptersClient(service, None, client_tls) as direct:  # the service itself: the token or nothing
        try:
            direct.list()
            raise AssertionError("the adapter service answered without the service token")
        except grpc.RpcError as e:
            assert e.code() == Code.UNAUTHENTICATED
    with AdaptersClient(service, None, client_tls, token) as direct:
        assert [a.name for a in direct.list()] == ["secured"]


@contextlib.asynccontextmanager
async def _adapter_service(pod_control: str, base: str, tmp: Path, flags: list[str]) -> AsyncIterator[str]:
    """The adapter service in this event loop; yields its address."""
    service_args = adapter_server.build_parser(argparse.ArgumentParser()).parse_args(
        ["--host", "127.0.0.1", "--port", "0", "--pods", pod_control, "--base-model", base,
         "--storage-dir", str(tmp / "store"), *flags]
    )  # fmt: skip
    server, _, controller = await adapter_server.start(service_args)
    try:
        yield controller.advertise
    finally:
        await server.stop(0)
        await controller.close()


async def _run(tiny_llama, adapter: Path, tmp: Path) -> None:
    flags, client_tls = _secrets(tmp)
    parse = argparse.ArgumentParser()
    add_security_args(parse)
    security = security_from_args(parse.parse_args(flags))
    (tmp / "keys").write_text(KEYS)
    health_port = free_port()
    async with (
        pod_in_process(tiny_llama, "tiny", None, security, max_loras=2) as pod,
        _adapter_service(f"127.0.0.1:{pod.control_port}", tiny_llama.name, tmp, flags) as service,
        gateway_in_process(
            ["--pods", f"127.0.0.1:{pod.port}", "--api-keys-file", str(tmp / "keys"),
             "--adapter-service", service, "--health-port", str(health_port), *flags]
        ) as gateway,
    ):  # fmt: skip
        target = f"127.0.0.1:{gateway.port}"
        await _control_checks(f"127.0.0.1:{pod.control_port}", security, client_tls)
        token = ServiceToken(str(tmp / "token")).value()
        await asyncio.to_thread(_admin_checks, target, service, client_tls, token, adapter)
        req = token_request([5, 6, 7], 4, temperature=0.0)
        req.adapter = "secured"
        md = (("authorization", "Bearer key-user"),)
        async with aio_channel(target, client_tls) as ch:
            stream = generation_pb2_grpc.GenerationStub(ch).Generate(req, metadata=md, timeout=60)
            out = [r async for r in stream]
        assert out[-1].final.usage.completion_tokens == 4
        assert await asyncio.to_thread(_plaintext_refused, target)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{health_port}") as ch:  # the kubelet's probe
            reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def _plaintext_refused(target: str) -> bool:
    with sync_channel(target, TlsConfig()) as ch:
        stub = adapters_pb2_grpc.AdaptersStub(ch).List
        try:
            stub(adapters_pb2.ListAdaptersRequest(), timeout=3)
        except grpc.RpcError as e:
            return e.code() == Code.UNAVAILABLE
    return False


def test_a_cluster_with_mtls_and_the_service_token_serves_an_adapter_end_to_end(
    tiny_llama, lora_dirs, tmp_path
):
    asyncio.run(_run(tiny_llama, lora_dirs["a"], tmp_path))
