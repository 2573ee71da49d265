"""`spindle gateway`: one door in front of the model pods.

It authenticates the caller (API key), checks which adapters the key may use, picks a pod of
the request's base model (gateway/router.py), and relays the pod's stream as serialized bytes
(gateway/relay.py). A pod that fails goes out of rotation and the request goes on on another
pod of its model: from the start before its first token, and after that resumed from the
tokens the caller already has
(`GenerateRequest.resume`), so the caller sees one stream, neither repeated nor cut. The
caller's deadline is passed on to the pod and cancellation travels with it, so an abandoned
request frees its KV blocks.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry import trace

from gateway import prefix, router
from gateway.adapters import AdapterDirectory, AdminProxy
from gateway.auth import ANONYMOUS, ApiKeys, AuthError, Caller
from gateway.limits import POD_RETRY_S, STREAM_RETRY_S, Limits
from gateway.metrics import GatewayMetrics, counted, status_code
from gateway.pods import Pod, PodPool, check_target, dns_discovery, static_discovery
from gateway.relay import Relayed, add_generation_service, client_span
from spindle import flagtypes, request_ids, serving, telemetry
from spindle.client import finish_reason_name
from spindle.errors import ConfigError
from spindle.grpc_status import PROMPT_TOKENS, abort, abort_exhausted
from spindle.openai_api.context import HttpCallContext
from spindle.openai_api.responses_store import store_of
from spindle.openai_api.server import OpenAIServer, add_http_args
from spindle.security import Security, add_security_args, security_from_args
from spindle.v1 import adapters_pb2_grpc, generation_pb2_grpc
from spindle.v1 import generation_pb2 as pb

log = logging.getLogger("spindle.gateway")
Code = grpc.StatusCode
SERVICES = ("spindle.v1.Generation", "spindle.v1.Adapters")


@dataclass
class Routed:
    caller: Caller
    pod: Pod


class GatewayService(generation_pb2_grpc.GenerationServicer):
    def __init__(
        self,
        pool: PodPool,
        keys: ApiKeys | None,
        max_attempts: int = 3,
        weights: router.Weights | None = None,
        directory: AdapterDirectory | None = None,
        tracer: trace.Tracer | None = None,
    ) -> None:
        self.pool, self.keys, self.directory = pool, keys, directory
        self.tracer = tracer or trace.get_tracer(__name__)
        self.max_attempts, self.weights = max_attempts, weights
        self.prefixes = prefix.PrefixIndex()
        self.inflight: dict[str, Routed] = {}
        self.limits = Limits()
        self.metrics = GatewayMetrics(pool)
        self.draining = False
        self.port = 0  # set once listening
        self.http: OpenAIServer | None = None  # the OpenAI-compatible API, when --http-port is set
        self.http_port = 0

    async def _caller(self, context: grpc.aio.ServicerContext, metered: bool = True) -> Caller:
        """The authenticated caller; `metered` calls spend one of its rate (Abort does not: a
        cancel frees capacity)."""
        if self.keys is None:
            return ANONYMOUS
        try:
            caller = self.keys.authenticate(context.invocation_metadata())
        except AuthError as e:
            await abort(context, Code.UNAUTHENTICATED, str(e))
        wait = self.limits.take(caller) if metered else 0.0
        if wait:
            self.metrics.refusals.labels("rate_limit").inc()
            await abort_exhausted(
                context,
                f"API key {caller.name!r} is over its rate limit ({caller.rate:g} requests/s); "
                f"retry in {wait:.2f} s",
                wait,
            )
        return caller

    async def authenticated(self, context: grpc.aio.ServicerContext | HttpCallContext) -> Caller:
        """The caller, or UNAUTHENTICATED; not metered (the request it comes with is, once read)."""
        return await self._caller(context, metered=False)

    def _choose(
        self, req: pb.GenerateRequest, hashes: list[bytes], tried: set[str], prompt_tokens: int = 0
    ) -> Pod | None:
        """The best pod of the request's model not tried yet whose context holds the prompt."""
        pods = self.pool.healthy(exclude=tried, model=req.model if req.HasField("model") else None)
        pods = [p for p in pods if p.holds(prompt_tokens)]
        adapter = req.adapter if req.HasField("adapter") else None
        matched = self.prefixes.match(hashes, [p.address for p in pods])
        address = router.choose([p.candidate() for p in pods], adapter, matched, self.weights)
        return self.pool.pods.get(address) if address else None

    async def _admissible(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> tuple[Caller, str]:
        """The caller and request id of a request the gateway may relay, or abort."""
        caller = await self._caller(context)
        if self.draining:
            self.metrics.refusals.labels("draining").inc()
            await abort(context, Code.UNAVAILABLE, "the gateway is shutting down; retry")
        if request.WhichOneof("prompt") is None:
            await abort(
                context, Code.INVALID_ARGUMENT, "the request has no prompt: set `text`, `chat` or `token_ids`"
            )
        adapter = request.adapter if request.HasField("adapter") else None
        if not caller.may_use(adapter):
            allowed = "none" if not caller.adapters else ", ".join(sorted(caller.adapters))
            self.metrics.refusals.labels("adapter").inc()
            await abort(
                context,
                Code.PERMISSION_DENIED,
                f"API key {caller.name!r} may not use adapter {adapter!r} (allowed: {allowed})",
            )
        if request.HasField("priority") and request.priority < caller.priority:
            self.metrics.refusals.labels("priority").inc()
            await abort(
                context,
                Code.PERMISSION_DENIED,
                f"API key {caller.name!r} may not ask for priority {request.priority} (its most urgent: "
                f"{caller.priority}; lower is served first)",
            )
        if adapter == "":  # the pods' own answer; no pod "serves" the empty name (was NOT_FOUND)
            empty = "adapter is set but empty; leave it unset to use the base model"
            await abort(context, Code.INVALID_ARGUMENT, empty)
        directory = self.directory
        if directory is not None and _registered_name(adapter) and not await directory.registered(adapter):
            await abort(
                context,
                Code.NOT_FOUND,
                f"adapter {adapter!r} is not registered (check the name; ListModels lists the adapters)",
            )
        rid, problem = request_ids.request_id(request.request_id)
        if problem is not None:
            await abort(context, Code.INVALID_ARGUMENT, problem)
        if rid in self.inflight:
            await abort(context, Code.ALREADY_EXISTS, f"request id {rid!r} is already in flight")
        if not self.limits.acquire(caller, context):
            self.metrics.refusals.labels("streams").inc()
            await abort_exhausted(
                context,
                f"API key {caller.name!r} has {caller.concurrency} streams open, its limit; "
                "retry when one ends",
                STREAM_RETRY_S,
            )
        return caller, rid

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        m, start, first = self.metrics, time.monotonic(), True
        model, error = m.model_label(request.model if request.HasField("model") else None), None
        m.streams.inc()
        try:  # the stream holds one of its caller's concurrency slots (taken in _admissible)
            async for resp in self._generate(request, context):
                if first:
                    m.ttft.labels(model).observe(time.monotonic() - start)
                    first = False
                yield resp
            m.latency.labels(model).observe(time.monotonic() - start)
        except BaseException as e:
            error = e
            raise
        finally:
            self.limits.release(context)
            m.streams.dec()
            m.requests.labels("Generate", model, status_code(context, error)).inc()

    async def _generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        caller, rid = await self._admissible(request, context)
        upstream = pb.GenerateRequest()
        upstream.CopyFrom(request)
        upstream.request_id = rid
        await self._check_model(upstream, context)
        span = trace.get_current_span()
        _annotate(span, request, caller, rid)
        hashes = prefix.block_hashes(upstream)
        await self._place_if_needed(upstream, hashes, context)
        stream = Relayed(upstream)
        if upstream.WhichOneof("prompt") == "token_ids":  # its length is known: only pods it fits
            stream.prompt_tokens = len(upstream.token_ids.ids)
        try:
            async for raw in self._relay(stream, caller, hashes, span, context):
                yield raw
            final = stream.final() if span.is_recording() else None
            if final is not None:
                _annotate_final(span, final)
        finally:
            self.inflight.pop(rid, None)

    async def _check_model(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        """Refuse a request naming a base model no pod serves, or naming none in a fleet of several
        (which one was meant is not known) unless its adapter says (pods that hold it)."""
        served = self.pool.base_models()
        if request.HasField("model"):
            if served and request.model not in served:
                name = request.model
                why = f"model {name!r} is not served here (served: {', '.join(sorted(served))})"
                if self._is_adapter(name):  # HTTP's `model` may name one; gRPC's may not
                    why = f"{name!r} is a LoRA adapter, not a base model (name it in `adapter`); {why}"
                await abort(context, Code.NOT_FOUND, why)
        elif len(served) > 1 and not request.HasField("adapter"):
            await abort(
                context,
                Code.INVALID_ARGUMENT,
                f"this gateway serves several base models ({', '.join(sorted(served))}): name one in `model`",
            )

    def _is_adapter(self, name: str) -> bool:
        """Whether a pod offers an adapter `name` or the adapter service has one registered."""
        pods = self.pool.pods.values()
        offered = any(p.load is not None and name in p.load.available_adapters for p in pods)
        return offered or (self.directory is not None and name in (self.directory.catalog or {}))

    async def _relay(
        self,
        stream: Relayed,
        caller: Caller,
        hashes: list[bytes],
        span: trace.Span,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[bytes]:
        """Relay from the best pod; on a pod failure go on with the next one (up to max_attempts
        pods): from the start before the first token, resumed after what was relayed later."""
        tried: set[str] = set()
        last_code, last_error = Code.UNAVAILABLE, "no healthy model pod"
        upstream, rid = stream.request, stream.request.request_id
        for attempt in range(1, self.max_attempts + 1):
            pod = self._choose(upstream, hashes, tried, stream.prompt_tokens)
            if pod is None:
                of_model = self.pool.healthy(model=upstream.model or None)
                if not tried and of_model and not any(p.holds(stream.prompt_tokens) for p in of_model):
                    await abort(context, Code.INVALID_ARGUMENT, _too_long(stream.prompt_tokens, of_model))
                if not tried and upstream.HasField("adapter") and of_model:
                    await abort(context, Code.NOT_FOUND, _no_adapter(upstream, self.pool.base_models()))
                break
            if not upstream.HasField("model") and pod.load is not None:
                # Pinned: pods of other models never see it, and a stream resumed after a pod
                # failure goes on under the model it began with (it went on under whichever the
                # next pod served: a silently wrong answer). The pod checks the name too.
                upstream.model = pod.load.model
            request = stream.next_request()
            if request is None:
                return  # the pod failed after its final message: the caller has everything
            if attempt > 1:  # another pod takes it on: from the start, or resumed mid-stream
                self.metrics.failover(resumed=bool(stream.messages))
            tried.add(pod.address)
            self.inflight[rid] = Routed(caller, pod)
            self.prefixes.record(hashes, pod.address)
            if span.is_recording():
                span.set_attribute("spindle.pod", pod.address)
                span.set_attribute("spindle.attempts", attempt)
            try:
                with pod.streaming(), client_span(self.tracer, pod.address, context) as (_, metadata):
                    call = pod.generate_raw(request, metadata=metadata, timeout=context.time_remaining())
                    try:
                        if attempt == 1:  # x-request-id once the pod has the request (its headers came):
                            await call.initial_metadata()  # an Abort sent on seeing it finds it there
                            await context.send_initial_metadata((("x-request-id", rid),))
                        async for raw in call:
                            stream.add(raw)
                            yield raw
                    finally:
                        call.cancel()
                self.pool.record(pod, Code.OK)
                return
            except grpc.aio.AioRpcError as e:
                last_code, last_error = e.code(), f"{pod.address}: {e.code().name}: {e.details()}"
                await self._after_failure(pod, e, stream, context)
        message = f"no model pod could take the request ({last_error})"
        if last_code == Code.RESOURCE_EXHAUSTED:  # every pod tried was full: transient
            await abort_exhausted(context, message, POD_RETRY_S)
        await abort(context, Code.UNAVAILABLE, message)

    async def _after_failure(
        self, pod: Pod, e: grpc.aio.AioRpcError, stream: Relayed, context: grpc.aio.ServicerContext
    ) -> None:
        """Return to try the next pod, or end the call with the pod's status when it is final.

        A pod that is UNAVAILABLE (it died, or drained) is ejected and the request goes on
        elsewhere, resumed if tokens were relayed; one at capacity before the first token too,
        and one that no longer serves the request's model (`_moved`) or whose context is shorter
        than the prompt while another's is not (`_fits_elsewhere`). Anything else is the
        request's own outcome (bad input, deadline, an engine fault)."""
        code, rid = e.code(), stream.request.request_id
        self.pool.record(pod, code)
        if code == Code.UNAVAILABLE:
            self.pool.eject(pod, f"Generate failed: {e.details()}")
        first = not stream.messages  # refused before its first token
        tokens = _prompt_tokens(e) if code == Code.INVALID_ARGUMENT else None  # too long for the pod
        elsewhere = (
            code == Code.UNAVAILABLE
            or (code == Code.RESOURCE_EXHAUSTED and first)
            or (code == Code.NOT_FOUND and first and await self._moved(pod, stream))
            or (tokens is not None and first and self._fits_elsewhere(pod, tokens, stream))
        )
        if elsewhere:
            n = len(stream.messages)
            what = f"resuming {rid} after {n} relayed messages" if n else f"retrying {rid}"
            log.info("%s on another pod (%s: %s)", what, pod.address, code.name)
            return
        if (
            tokens is not None
        ):  # too long for every pod of its model: name the longest context, not this one's
            await abort(context, code, _too_long(tokens, [pod, *self.pool.healthy(model=pod.load.model)]))
        await abort(context, code, e.details())

    async def _moved(self, pod: Pod, stream: Relayed) -> bool:
        """Whether a pod that refused the request NOT_FOUND serves another model now than its last
        report said: restarted on its address with another checkpoint since. The refusal was
        the gateway's stale view, not the caller's error (it reached the caller as NOT_FOUND for a
        model the fleet serves); the pod is checked again, and routed by its new model."""
        if not stream.request.HasField("model"):
            return False
        await self.pool.recheck(pod)
        return not pod.serves(stream.request.model)

    def _fits_elsewhere(self, pod: Pod, tokens: int, stream: Relayed) -> bool:
        """Whether a prompt of `tokens` that `pod` refused as longer than its context fits another
        pod of the model: pods of one model may have different contexts (--max-model-len, KV
        cache sizes), and the refusal was final, however many pods could have served it. The
        request goes on only to pods that hold it."""
        stream.prompt_tokens = max(stream.prompt_tokens, tokens)
        model = stream.request.model if stream.request.HasField("model") else None
        return any(p.holds(tokens, known=True) for p in self.pool.healthy(exclude=[pod.address], model=model))

    async def _place_if_needed(
        self, req: pb.GenerateRequest, hashes: list[bytes], context: grpc.aio.ServicerContext
    ) -> None:
        """No ready pod holds the adapter: have the adapter service place it, then see it placed."""
        if self.directory is None or not _registered_name(req.adapter) or self._choose(req, hashes, set()):
            return
        adapter, left = req.adapter, context.time_remaining()
        caller_bound = left is not None and left < self.directory.placement_timeout
        try:
            pods = self.pool.healthy(model=req.model if req.HasField("model") else None)
            placed = await self.directory.place(adapter, pods, left)
        except asyncio.TimeoutError:
            if caller_bound:  # the caller's own deadline ran out, not --placement-timeout
                await abort(
                    context,
                    Code.DEADLINE_EXCEEDED,
                    f"the request's deadline passed while adapter {adapter!r} was being placed on a pod",
                )
            await abort(
                context,
                Code.UNAVAILABLE,
                f"placing adapter {adapter!r} on a model pod is taking too long; retry",
            )
        except grpc.aio.AioRpcError as e:
            await abort(context, e.code(), f"placing adapter {adapter!r}: {e.details()}")
        log.info("adapter %s placed on %s (%s)", adapter, ",".join(placed.pods), placed.source)
        await self.pool.poll_now()  # the pods' load reports now list it

    @counted("Abort")
    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        caller = await self._caller(context, metered=False)
        if not request.request_id:
            await abort(context, Code.INVALID_ARGUMENT, "request_id is empty: name the request to abort")
        routed = self.inflight.get(request.request_id)
        if routed is None or routed.caller != caller:  # another caller's request does not exist for you
            await abort(context, Code.NOT_FOUND, f"no request {request.request_id!r} of yours is in flight")
        try:
            return await routed.pod.generation.Abort(request, timeout=_remaining(context, 5.0))
        except grpc.aio.AioRpcError as e:
            await abort(context, e.code(), e.details())

    @counted("ListModels")
    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        caller = await self._caller(context)
        pods = self.pool.healthy()
        if not pods:
            await abort(context, Code.UNAVAILABLE, "no healthy model pod")
        replies = await asyncio.gather(
            *(p.generation.ListModels(request, timeout=_remaining(context, 5.0)) for p in pods),
            return_exceptions=True,
        )
        seen: dict[str, pb.ModelInfo] = {}
        for reply in replies:
            if isinstance(reply, BaseException):
                continue
            for m in reply.models:
                if m.kind != pb.MODEL_KIND_ADAPTER or caller.may_use(m.id):
                    kept = seen.setdefault(m.id, m)
                    if m.max_model_len > kept.max_model_len:  # the longest context the fleet has for it
                        seen[m.id] = m
        if not seen and all(_code(r) == Code.DEADLINE_EXCEEDED for r in replies):
            await abort(context, Code.DEADLINE_EXCEEDED, "the deadline passed before a model pod answered")
        if not seen:
            await abort(context, Code.UNAVAILABLE, "no model pod answered ListModels")
        if self.directory is not None and await self.directory.refresh():
            # The registry is the authority on adapters: every registered one, wherever it is.
            base = next((m.id for m in seen.values() if m.kind == pb.MODEL_KIND_BASE), "")
            seen = {
                k: m for k, m in seen.items() if not _registered_name(k) or m.kind != pb.MODEL_KIND_ADAPTER
            }
            for entry in (self.directory.catalog or {}).values():
                if caller.may_use(entry.name):
                    seen[entry.name] = pb.ModelInfo(
                        id=entry.name, kind=pb.MODEL_KIND_ADAPTER, base_model=base, pods=entry.pods
                    )
        return pb.ListModelsResponse(models=sorted(seen.values(), key=lambda m: (m.kind, m.id)))


def _prompt_tokens(e: grpc.aio.AioRpcError) -> int | None:
    """The prompt's length a pod's refusal says (`PROMPT_TOKENS`): it was longer than its context."""
    value = next((v for k, v in e.trailing_metadata() or () if k == PROMPT_TOKENS), None)
    return int(value) if isinstance(value, str) and value.isdigit() else None


def _too_long(prompt_tokens: int, pods: list[Pod]) -> str:
    longest = max(p.load.max_model_len for p in pods if p.load is not None)
    return (
        f"prompt has {prompt_tokens} tokens; the longest context of this model's pods is {longest} tokens "
        "and the prompt must leave room for at least one generated token"
    )


def _no_adapter(request: pb.GenerateRequest, base_models: set[str]) -> str:
    """The refusal of an adapter no pod has; it names the base models too: over HTTP a `model` that
    is no base model's name is taken for an adapter's (vLLM's convention), a misspelt one too."""
    model = f" of model {request.model!r}" if request.HasField("model") else ""
    served = f" (base models: {', '.join(sorted(base_models))})" if base_models else ""
    return f"no model pod{model} serves adapter {request.adapter!r}{served}"


def _registered_name(adapter: str | None) -> bool:
    """An adapter the registry owns; `@active` and other `@` names are the pods' own (SetActive)."""
    return bool(adapter) and not adapter.startswith("@")


def _code(reply: object) -> grpc.StatusCode | None:
    return reply.code() if isinstance(reply, grpc.aio.AioRpcError) else None


def _remaining(context: grpc.aio.ServicerContext, default: float) -> float:
    left = context.time_remaining()
    return default if left is None else min(left, default)


def _annotate(span: trace.Span, req: pb.GenerateRequest, caller: Caller, rid: str) -> None:
    if not span.is_recording():
        return
    span.set_attribute(
        telemetry.OPERATION, "chat" if req.WhichOneof("prompt") == "chat" else "text_completion"
    )
    span.set_attribute(telemetry.PROVIDER, "spindle")
    span.set_attribute(telemetry.RESPONSE_ID, rid)
    span.set_attribute("spindle.caller", caller.name)
    if req.HasField("model"):
        span.set_attribute(telemetry.REQUEST_MODEL, req.model)
    if req.HasField("adapter"):
        span.set_attribute(telemetry.ADAPTER, req.adapter)
    if req.HasField("max_tokens"):
        span.set_attribute(telemetry.MAX_TOKENS, req.max_tokens)


def _annotate_final(span: trace.Span, final: pb.Final) -> None:
    span.set_attribute(telemetry.INPUT_TOKENS, final.usage.prompt_tokens)
    span.set_attribute(telemetry.OUTPUT_TOKENS, final.usage.completion_tokens)
    # as the pod's span spells it: the enum's own name split one trace's reasons into two vocabularies
    span.set_attribute(telemetry.FINISH_REASONS, [finish_reason_name(final.finish_reason)])


# --- the command ------------------------------------------------------------------------------


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.description = "Run the gateway: authenticate, route and relay requests to model pods over gRPC."
    g = parser.add_argument_group("server")
    g.add_argument(
        "--host",
        default="0.0.0.0",
        help="address to listen on; 0.0.0.0 or :: = every address, IPv4 and IPv6 [0.0.0.0]",
    )
    g.add_argument("--port", type=flagtypes.port, default=50051, help="gRPC port [50051]")
    add_http_args(g)
    g.add_argument(
        "--metrics-port",
        type=flagtypes.port,
        default=0,
        help="Prometheus /metrics port (the chart sets 9092); 0 = off [0]",
    )
    g.add_argument(
        "--log-level", type=flagtypes.log_level, default="INFO", help="DEBUG, INFO, WARNING, ERROR [INFO]"
    )
    g.add_argument(
        "--drain-timeout",
        type=flagtypes.seconds_or_none,
        default=30.0,
        help="on SIGTERM, seconds for in-flight streams [30]",
    )
    serving.add_send_timeout_arg(g, 60.0, "shorter than the pods' 300: a stalled client is no failing pod")
    d = parser.add_argument_group("model pods")
    d.add_argument("--pods", default="", help="static list of model pods, HOST:PORT,HOST:PORT")
    d.add_argument("--pods-dns", default="", help="HOST:PORT of a headless Service; each address is a pod")
    d.add_argument(
        "--discovery-interval", type=flagtypes.seconds, default=5.0, help="seconds between DNS lookups [5]"
    )
    d.add_argument(
        "--health-interval", type=flagtypes.seconds, default=1.0, help="seconds between pod checks [1]"
    )
    d.add_argument(
        "--health-timeout", type=flagtypes.seconds, default=1.0, help="seconds a pod check may take [1]"
    )
    d.add_argument(
        "--failure-threshold",
        type=flagtypes.at_least(1),
        default=2,
        help="failed checks in a row that eject a pod [2]",
    )
    d.add_argument(
        "--outlier-errors",
        type=flagtypes.at_least(0),
        default=5,
        help="requests in a row a pod fails with INTERNAL / UNKNOWN / DATA_LOSS that eject it (0: never) [5]",
    )
    d.add_argument(
        "--outlier-ejection",
        type=flagtypes.seconds,
        default=30.0,
        help="seconds such a pod stays out, times its ejections in a row (at most 10) [30]",
    )
    d.add_argument(
        "--max-attempts",
        type=flagtypes.at_least(1),
        default=3,
        help="pods tried for a request before its first token [3]",
    )
    s = parser.add_argument_group("adapter service")
    s.add_argument(
        "--adapter-service",
        default="",
        help="HOST:PORT of the adapter service: place registered adapters on demand, serve the admin API",
    )
    s.add_argument(
        "--placement-timeout",
        type=flagtypes.seconds,
        default=60.0,
        help="seconds a request waits for a placement [60]",
    )
    a = parser.add_argument_group("authentication")
    a.add_argument(
        "--api-keys-file",
        default="",
        help="file or directory (mounted Secret) of `NAME KEY ADAPTERS` lines; see gateway/auth.py",
    )
    a.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="serve without API keys (local use only; every caller may use every adapter)",
    )
    add_security_args(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    serving.setup_logging(args.log_level)
    if bool(args.pods) == bool(args.pods_dns):
        raise ConfigError("give exactly one of --pods HOST:PORT,... or --pods-dns HOST:PORT")
    if not args.api_keys_file and not args.allow_unauthenticated:
        raise ConfigError("give --api-keys-file, or --allow-unauthenticated for local use")
    return serving.run_event_loop(serve(args))


async def serve(args: argparse.Namespace) -> int:
    provider = telemetry.tracer_provider_from_env("spindle-gateway")
    gateway, server, health = await start(args, provider)
    stop = asyncio.Event()
    serving.on_shutdown_signal(lambda why: stop.set())
    await stop.wait()
    log.info("draining")
    serving.exit_if_stuck(args.drain_timeout + 10.0, "the gateway")
    await shutdown(gateway, server, health, args.drain_timeout)
    telemetry.shutdown(provider)
    return 0


def _api_keys(path: str) -> ApiKeys:
    """The keys of `--api-keys-file`; a file missing, unreadable, empty or malformed is a
    ConfigError naming the flag (it was a FileNotFoundError / ValueError traceback)."""
    try:
        return ApiKeys(path)
    except OSError as e:
        raise ConfigError(f"--api-keys-file {path}: {e.strerror}") from e
    except ValueError as e:
        raise ConfigError(f"--api-keys-file: {e}") from e


async def start(
    args: argparse.Namespace, provider: Any = None
) -> tuple[GatewayService, grpc.aio.Server, Any]:
    """Build, bind and start a gateway (also used in-process by tests and the benchmark)."""
    keys = _api_keys(args.api_keys_file) if args.api_keys_file else None
    security = security_from_args(args)
    if keys is None:
        log.warning("no API keys: every caller is accepted (--allow-unauthenticated)")
    discover = (
        dns_discovery(args.pods_dns)
        if args.pods_dns
        else static_discovery([a.strip() for a in args.pods.split(",") if a.strip()])
    )
    send_timeout = getattr(args, "send_timeout", 0.0)
    server = serving.make_server(telemetry.server_interceptors(provider), send_timeout)
    directory = _adapter_directory(args, provider, security)
    health = serving.Health(server, SERVICES)
    await health.serve_plaintext(args.host, getattr(args, "health_port", 0))
    gateway: GatewayService

    async def on_change() -> None:
        if keys is not None:
            keys.reload()
        if directory is not None:
            await directory.refresh()
        await health.set(bool(pool.healthy()) and not gateway.draining)

    pool = PodPool(
        discover,
        interval=args.health_interval,
        timeout=args.health_timeout,
        failure_threshold=args.failure_threshold,
        outlier_errors=getattr(args, "outlier_errors", 5),
        outlier_ejection=getattr(args, "outlier_ejection", 30.0),
        discovery_interval=args.discovery_interval,
        interceptors=telemetry.client_interceptors(provider),
        on_change=on_change,
        on_eject=lambda address: gateway.prefixes.forget_pod(address),
        security=security,
    )
    tracer = telemetry.get_tracer("spindle.gateway", provider)
    gateway = GatewayService(pool, keys, max_attempts=args.max_attempts, directory=directory, tracer=tracer)
    add_generation_service(gateway, server)
    adapters_pb2_grpc.add_AdaptersServicer_to_server(AdminProxy(directory, gateway._caller), server)
    serving.enable_reflection(server, SERVICES)
    async with serving.stopped_on_failure(lambda: server.stop(None), health.stop, pool.close):
        gateway.port = serving.bind(server, args.host, args.port, security.tls)
        await server.start()
        await pool.start()
        where = serving.host_port(args.host, gateway.port)  # an IPv6 host in brackets
        log.info("gateway listening on %s in front of %d pods", where, len(pool.pods))
        if getattr(args, "metrics_port", 0):
            metrics_port = gateway.metrics.serve(args.host, args.metrics_port)
            log.info("metrics on http://%s/metrics", serving.host_port(args.host, metrics_port))
        if getattr(args, "http_port", 0):
            gateway.http = _openai_server(args, gateway, pool, health, tracer, send_timeout)
            gateway.http_port = await gateway.http.start(args.host, args.http_port, security.tls)
            log.info("OpenAI-compatible HTTP API on %s", serving.host_port(args.host, gateway.http_port))
    return gateway, server, health


def _adapter_directory(
    args: argparse.Namespace, provider: Any, security: Security
) -> AdapterDirectory | None:
    """The adapter service's client, when `--adapter-service` names one."""
    adapter_service = getattr(args, "adapter_service", "")
    if not adapter_service:
        return None
    check_target(adapter_service, "--adapter-service")  # dialled, and warned of, forever
    interceptors = telemetry.client_interceptors(provider)
    return AdapterDirectory(adapter_service, interceptors, getattr(args, "placement_timeout", 60.0), security)


def _openai_server(
    args: argparse.Namespace,
    gateway: GatewayService,
    pool: PodPool,
    health: serving.Health,
    tracer: Any,
    send_timeout: float,
) -> OpenAIServer:
    """OpenAI's HTTP API in front of the same gateway: its callers are admitted by the same keys and
    routed as gRPC callers are."""
    return OpenAIServer(
        gateway,
        pool.base_models,
        lambda: health.serving,
        tracer,
        getattr(args, "tool_call_parser", "none"),
        getattr(args, "reasoning_parser", "none"),
        getattr(args, "reasoning_key_file", None),
        on_request=gateway.metrics.http_request,
        admit=gateway.authenticated,
        send_timeout=send_timeout,
        store=store_of(args),
    )


async def shutdown(
    gateway: GatewayService, server: grpc.aio.Server, health: Any, drain_timeout: float
) -> None:
    gateway.draining = True
    await health.set(False)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + drain_timeout
    while gateway.inflight and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if gateway.http is not None:
        await gateway.http.stop()
    await server.stop(grace=1.0)
    await health.stop()
    await gateway.pool.close()
    gateway.metrics.stop()
    if gateway.directory is not None:
        await gateway.directory.close()
