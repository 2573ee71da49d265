"""A placement's spans join the trace of the request that caused it: gateway -> adapter service.

The gateway and the adapter service run in this test's event loop (an in-memory exporter sees
both); the model pod is a real process, and every hop is a real loopback gRPC connection."""

from __future__ import annotations

import argparse
import asyncio

import grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from adapter_service import server as adapter_server
from adapter_service.client import AdaptersClient
from gateway import server as gateway_server
from spindle.v1 import generation_pb2_grpc
from tests.service_helpers import spawn_pod, token_request, wait_serving

GENERATE = "/spindle.v1.Generation/Generate"


async def _run(
    pod: str, control: str, base: str, adapter_dir, storage, exporter: InMemorySpanExporter
) -> None:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    service_args = adapter_server.build_parser(argparse.ArgumentParser()).parse_args(
        [
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--pods",
            control,
            "--base-model",
            base,
            "--storage-dir",
            str(storage),
        ]
    )
    server, _, controller = await adapter_server.start(service_args, provider)
    gateway_args = gateway_server.build_parser(argparse.ArgumentParser()).parse_args(
        ["--host", "127.0.0.1", "--port", "0", "--http-port", "0", "--pods", pod, "--allow-unauthenticated",
         "--health-interval", "0.1", "--adapter-service", controller.advertise]
    )  # fmt: skip
    gateway, gserver, health = await gateway_server.start(gateway_args, provider)
    try:
        while not gateway.pool.healthy():
            await asyncio.sleep(0.02)
        target = f"127.0.0.1:{gateway.port}"
        await asyncio.to_thread(lambda: AdaptersClient(target).register("traced", adapter_dir))
        exporter.clear()
        async with grpc.aio.insecure_channel(target) as ch:
            req = token_request([5, 6, 7], 4, temperature=0.0)
            req.adapter = "traced"
            async for _ in generation_pb2_grpc.GenerationStub(ch).Generate(req, timeout=60):
                pass
    finally:
        await gateway_server.shutdown(gateway, gserver, health, 1.0)
        await server.stop(0)
        await controller.close()


def test_placement_spans_join_the_requests_trace(tiny_llama, lora_dirs, tmp_path):
    pod = spawn_pod(tiny_llama.name, tmp_path, "pod", "--max-loras", "2")
    try:
        wait_serving(pod)
        exporter = InMemorySpanExporter()
        asyncio.run(
            _run(
                pod.address,
                pod.control_address,
                tiny_llama.name,
                lora_dirs["a"],
                tmp_path / "store",
                exporter,
            )
        )
    finally:
        pod.stop()
    spans = exporter.get_finished_spans()
    gw = next(s for s in spans if s.name == GENERATE and s.kind == SpanKind.SERVER)
    place = next(s for s in spans if s.name == "spindle.adapter.place")
    by_id = {s.context.span_id: s for s in spans}
    chain, s = [], place
    while s.parent is not None and s.parent.span_id in by_id:
        s = by_id[s.parent.span_id]
        chain.append(s.name)
    assert place.context.trace_id == gw.context.trace_id
    assert chain[-1] == GENERATE and "/spindle.v1.Placement/Place" in chain, chain
    assert place.attributes["spindle.adapter"] == "traced"
    assert place.attributes["spindle.placement.source"] in ("staging", "storage")
    promote = [s for s in spans if s.name.endswith("PromoteFromPeer") and s.kind == SpanKind.CLIENT]
    assert promote and promote[0].parent.span_id == place.context.span_id
