"""Prompts, completions and API keys stay out of logs and traces unless the operator opts in.

A gateway and a SmolLM2 pod in this test's event loop, every logger at DEBUG and every span in
an in-memory exporter, serve a chat request whose prompt holds a secret. The secret, the answer
and the caller's key must appear nowhere; with the GenAI content switch on
(OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true) the same run does record the prompt and
the answer in spans, which shows the search would find them.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from spindle.client import chat_request
from spindle.v1 import generation_pb2_grpc
from tests.service_helpers import gateway_in_process, pod_in_process

SECRET = "hunter2-QX7Z-9931"
API_KEY = "sk-live-5f0c1e8b9a7d4c2e"


async def _ask(port: int) -> str:
    req = chat_request(
        [{"role": "user", "content": f"My password is {SECRET}. Repeat my password."}],
        max_tokens=12,
        temperature=0.0,
    )
    md = (("authorization", f"Bearer {API_KEY}"),)
    text = ""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        async for r in generation_pb2_grpc.GenerationStub(ch).Generate(req, metadata=md, timeout=60):
            text += r.chunk.text if r.HasField("chunk") else ""
    return text


def _span_text(exporter: InMemorySpanExporter) -> str:
    parts = []
    for s in exporter.get_finished_spans():
        parts += [s.name, *(f"{k}={v}" for k, v in s.attributes.items())]
        parts += [f"{e.name} {dict(e.attributes or {})}" for e in s.events]
    return "\n".join(parts)


def _logs(caplog, since: int) -> str:
    return "\n".join(f"{r.getMessage()} {r.exc_text or ''}" for r in caplog.records[since:])


async def _run(smollm2, tmp_path, caplog, monkeypatch) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    (tmp_path / "keys").write_text(f"alice {API_KEY} *\n")
    async with (
        pod_in_process(smollm2, "smollm2", provider) as pod,
        gateway_in_process(
            ["--pods", f"127.0.0.1:{pod.port}", "--api-keys-file", str(tmp_path / "keys")], provider
        ) as gateway,
    ):
        assert "loaded 1 API keys" in _logs(caplog, 0)  # the logs are being searched
        monkeypatch.delenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", raising=False)
        since = len(caplog.records)
        answer = (await _ask(gateway.port)).strip()
        spans, logs = _span_text(exporter), _logs(caplog, since)
        assert len(answer) >= 8, answer  # a real answer to look for
        assert "spindle.caller=alice" in spans  # the spans are being searched
        for needle in (SECRET, "My password is", answer, API_KEY):
            assert needle not in logs, needle
            assert needle not in spans, needle

        monkeypatch.setenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "true")  # the opt-in
        exporter.clear()
        since = len(caplog.records)
        assert (await _ask(gateway.port)).strip() == answer
        spans, logs = _span_text(exporter), _logs(caplog, since)
        assert SECRET in spans and answer in spans.replace('\\"', '"')
        assert SECRET not in logs and API_KEY not in logs and API_KEY not in spans  # keys: never


def test_prompts_answers_and_keys_stay_out_of_logs_and_spans_unless_opted_in(
    smollm2, tmp_path, caplog, monkeypatch
):
    with caplog.at_level(logging.DEBUG):
        asyncio.run(_run(smollm2, tmp_path, caplog, monkeypatch))
