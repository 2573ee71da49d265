"""The model pod's serving RPCs: Generation (Generate, Abort, ListModels) and PodStatus.

Every handler validates its input and answers with a status code a caller can act on; no
per-request failure escapes the handler, so one bad request never takes the pod down.
ModelControl (adapters, Drain) is in control.py, on the pod's control port.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from opentelemetry import trace

from model_service.engine.sequence import RequestOutput
from model_service.errors import SpindleError, UnavailableError
from model_service.pod import wire
from model_service.pod.state import InFlight, ModelPod
from model_service.pod.status import abort_for
from spindle import telemetry
from spindle.grpc_status import abort, internal_error
from spindle.v1 import generation_pb2 as pb
from spindle.v1 import generation_pb2_grpc, pod_status_pb2, pod_status_pb2_grpc

log = logging.getLogger(__name__)
Code = grpc.StatusCode


async def _require_serving(pod: ModelPod, context: grpc.aio.ServicerContext) -> None:
    if pod.lost is not None:
        await abort(context, Code.UNAVAILABLE, pod.lost_message())
    if pod.draining:
        await abort(context, Code.UNAVAILABLE, "model pod is draining (shutting down); send to another pod")
    if not pod.ready:
        await abort(context, Code.UNAVAILABLE, "model pod is still loading its model; retry shortly")


async def _engine_request(request: pb.GenerateRequest) -> dict[str, Any]:
    """The engine's keywords for `request`. llguidance checks a structured output's grammar as it
    is read (engine/structured_output.py), for up to seconds (a schema of 9,000 optional
    properties: 2-4 s); on the event loop that stalled every stream, health check and load
    report of the pod, so such a request is read on a thread (llguidance lets go of the GIL)."""
    if request.sampling.HasField("structured_output"):
        return await asyncio.to_thread(wire.engine_request, request)
    return wire.engine_request(request)


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, pod: ModelPod, tracer: trace.Tracer) -> None:
        self.pod, self.tracer = pod, tracer

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        rid, kwargs, echo = await self._admissible(request, context)
        pod = self.pod
        assert pod.async_engine is not None  # _admissible checked the pod is serving
        span = trace.get_current_span()
        _annotate_request(span, pod.model_name, rid, kwargs)
        resume = kwargs.get("resume")
        req = pod.begin(rid, kwargs.get("adapter"), len(resume.output_token_ids) if resume else 0)
        unrecorded: RequestOutput | None = None  # its latest output, until metrics and span have it
        try:
            await context.send_initial_metadata((("x-request-id", rid),))
            # Outputs that queued up while the last message was being sent go out as one message,
            # and with --stream-interval N at least N tokens go in one (but the first and last).
            batches = pod.async_engine.generate_batches(rid, stream_interval=pod.stream_interval, **kwargs)
            async with contextlib.aclosing(batches) as stream:
                batch = await _admitted(stream, context)
                pod.accepted(req)
                if req.abort_requested:  # it came while the request was on its way to the engine,
                    pod.async_engine.abort(rid)  # where that abort found nothing to stop
                while True:
                    unrecorded = out = batch[-1]
                    req.on_output(batch[0])
                    msg = wire.chunk(batch, pod.token_texts)
                    if echo is not None:  # the first message carries the prompt's text
                        msg = msg or pb.GenerateResponse(request_id=rid, chunk=pb.Chunk())
                        msg.chunk.prompt_text, echo = echo, None
                    if msg is not None:
                        req.on_tokens(time.monotonic(), len(msg.chunk.token_ids))
                        yield msg
                    if out.finished:  # recorded before the final goes out: a scrape after it sees it
                        self._record(req, out, span)
                        unrecorded = None
                        yield await self._final(req, out, context)
                        return
                    batch = await anext(stream)
        except UnavailableError as e:  # the pod lost a device mid-stream
            await abort(context, Code.UNAVAILABLE, f"{e} (after {req.num_tokens} tokens)")
        finally:
            if unrecorded is not None:  # the engine ran it, and the call ended before it did
                self._record(req, unrecorded, span)
            pod.end(req)

    async def _admissible(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> tuple[str, dict[str, Any], str | None]:
        """The request id, engine keywords and echoed prompt text (`echo_prompt`) of a request
        this pod can take now, or abort."""
        pod = self.pod
        await _require_serving(pod, context)
        try:
            rid, kwargs = wire.request_id(request), await _engine_request(request)
            echo = wire.prompt_text(request, pod.token_texts.tokenizer) if request.echo_prompt else None
        except SpindleError as e:
            await abort_for(context, e)
        if request.HasField("model") and request.model != pod.model_name:
            await abort(
                context,
                Code.NOT_FOUND,
                f"model {request.model!r} is not served here (this pod: {pod.model_name!r})",
            )
        if rid in pod.inflight:  # this process's one check (the engine trusts it): see Engine.add_request
            await abort(context, Code.ALREADY_EXISTS, f"request id {rid!r} is already in flight")
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            await abort(
                context, Code.DEADLINE_EXCEEDED, "the deadline expired before the request was admitted"
            )
        return rid, kwargs, echo

    async def _final(
        self, req: InFlight, out: RequestOutput, context: grpc.aio.ServicerContext
    ) -> pb.GenerateResponse:
        if out.finish_reason == "error" and self.pod.lost is not None:
            await abort(context, Code.UNAVAILABLE, self.pod.lost_message())
        if out.finish_reason == "error":
            failed = internal_error(out.error or "", log, f"request {req.request_id} failed in the engine")
            await abort(context, Code.INTERNAL, f"request {req.request_id} failed: {failed}")
        if out.finish_reason == "invalid":  # found once the engine had it: a grammar this vocabulary lacks
            await abort(context, Code.INVALID_ARGUMENT, f"request {req.request_id}: {out.error}")
        if out.finish_reason == "capacity":  # a beam search larger than this pod can ever hold
            await abort(context, Code.RESOURCE_EXHAUSTED, f"request {req.request_id}: {out.error}")
        if out.finish_reason == "abort" and req.request_id in self.pod.drain_aborted:
            await abort(
                context,
                Code.UNAVAILABLE,
                f"model pod shut down; request aborted after {req.num_tokens} tokens (retry it elsewhere)",
            )
        return wire.final(out)

    def _record(self, req: InFlight, out: RequestOutput, span: trace.Span) -> None:
        """Metrics and the queue / prefill / decode spans, once the call is over: `out` is the
        engine's last output for it, unfinished when the call ended first (the caller cancelled,
        its deadline passed, the pod lost its device): then an "abort", as the engine ends it."""
        now = time.monotonic()
        reason = (out.finish_reason or "unknown") if out.finished else "abort"
        m, pod = self.pod.metrics, self.pod
        admitted = req.scheduled or req.first_token or now
        first = req.first_token or now
        m.e2e.observe(now - req.arrival)
        m.queue.observe(admitted - req.arrival)
        if req.first_token is not None:
            m.ttft.observe(first - req.arrival)
            m.prefill.observe(first - admitted)
            m.decode.observe(now - first)
        for gap in req.itl:
            m.itl.observe(gap)
            m.tpot.observe(gap)
        # A resumed request's output begins with the tokens another pod generated (and counted):
        # here they were prefilled, as its prompt was (vLLM's "prefill tokens processed"). The
        # span says so too: a trace's pod spans add up to the tokens generated, each once.
        prefilled, generated = out.num_prompt_tokens + req.resumed, max(len(out.token_ids) - req.resumed, 0)
        m.prompt_tokens.inc(prefilled)
        m.generation_tokens.inc(generated)
        m.finished.labels(pod.model_name, reason).inc()
        if not span.is_recording():
            return
        span.set_attribute(telemetry.INPUT_TOKENS, prefilled)
        span.set_attribute(telemetry.OUTPUT_TOKENS, generated)
        span.set_attribute(telemetry.FINISH_REASONS, [reason])
        if req.first_token is not None:
            span.set_attribute(telemetry.TIME_TO_FIRST_TOKEN, first - req.arrival)
        if telemetry.capture_content():
            span.set_attribute(
                telemetry.OUTPUT_MESSAGES, json.dumps([{"role": "assistant", "content": out.text}])
            )
        ctx = trace.set_span_in_context(span)
        for name, start, end in (
            ("queue", req.arrival, admitted),
            ("prefill", admitted, first),
            ("decode", first, now),
        ):
            if end > start:
                child = self.tracer.start_span(f"spindle.{name}", context=ctx, start_time=req.wall_ns(start))
                child.end(end_time=req.wall_ns(end))

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        if not request.request_id:
            await abort(context, Code.INVALID_ARGUMENT, "request_id is empty: name the request to abort")
        if request.request_id not in self.pod.inflight or self.pod.async_engine is None:
            await abort(
                context,
                Code.NOT_FOUND,
                f"no request {request.request_id!r} is in flight here (finished already?)",
            )
        self.pod.inflight[request.request_id].abort_requested = True
        self.pod.async_engine.abort(request.request_id)
        return pb.AbortResponse()

    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        pod = self.pod
        await _require_serving(pod, context)
        models = [pb.ModelInfo(id=pod.model_name, kind=pb.MODEL_KIND_BASE, max_model_len=pod.max_model_len)]
        try:
            # As of the last step boundary (adapters change only there), as load reports: asking the
            # engine thread waited for the step in progress, 48 s of one long prefill on a CPU, well
            # past the gateway's 5 s for ListModels (and its HTTP /v1/models).
            adapters = (await pod.load_stats.recent()).adapters
        except UnavailableError as e:  # the engine thread is stuck (`LoadStats`)
            await abort(context, Code.UNAVAILABLE, str(e))
        for a in adapters:
            models.append(pb.ModelInfo(id=a.name, kind=pb.MODEL_KIND_ADAPTER, base_model=pod.model_name))
        return pb.ListModelsResponse(models=models)


async def _admitted(
    stream: AsyncIterator[list[RequestOutput]], context: grpc.aio.ServicerContext
) -> list[RequestOutput]:
    """The stream's first outputs; the engine refuses a request only here, before any output."""
    try:
        return await anext(stream)
    except Exception as e:  # a SpindleError is the request's fault; anything else a bug (INTERNAL)
        await abort_for(context, e)


def _annotate_request(span: trace.Span, model: str, rid: str, kwargs: dict[str, Any]) -> None:
    if not span.is_recording():
        return
    params = kwargs["params"]
    span.set_attribute(telemetry.OPERATION, "chat" if "messages" in kwargs else "text_completion")
    span.set_attribute(telemetry.PROVIDER, "spindle")
    span.set_attribute(telemetry.REQUEST_MODEL, model)
    span.set_attribute(telemetry.RESPONSE_ID, rid)
    span.set_attribute(telemetry.MAX_TOKENS, params.max_tokens)
    span.set_attribute(telemetry.TEMPERATURE, params.temperature)
    span.set_attribute(telemetry.TOP_P, params.top_p)
    if params.top_k:
        span.set_attribute(telemetry.TOP_K, params.top_k)
    if params.seed is not None:
        span.set_attribute(telemetry.SEED, params.seed)
    if kwargs.get("adapter"):
        span.set_attribute(telemetry.ADAPTER, kwargs["adapter"])
    if telemetry.capture_content():
        if "messages" in kwargs:
            span.set_attribute(telemetry.INPUT_MESSAGES, json.dumps(kwargs["messages"]))
        elif "prompt" in kwargs:
            span.set_attribute(
                telemetry.INPUT_MESSAGES, json.dumps([{"role": "user", "content": kwargs["prompt"]}])
            )


class PodStatusService(pod_status_pb2_grpc.PodStatusServicer):
    def __init__(self, pod: ModelPod) -> None:
        self.pod = pod

    async def GetLoad(
        self, request: pod_status_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> pod_status_pb2.PodLoad:
        if self.pod.async_engine is None:
            await abort(context, Code.UNAVAILABLE, "model pod is still loading its model")
        try:
            return await self.pod.load_report()
        except UnavailableError as e:  # the engine thread is stuck (`LoadStats`)
            await abort(context, Code.UNAVAILABLE, str(e))
