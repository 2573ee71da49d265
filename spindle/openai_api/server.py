"""The OpenAI-compatible HTTP server (aiohttp) of the gateway and of each model pod.

Routes: POST /v1/chat/completions, POST /v1/completions, POST /v1/responses (OpenAI's
Responses API: a chat underneath; all three with `stream: true` as server-sent events), GET and
DELETE /v1/responses/{id} and GET /v1/responses/{id}/input_items (the responses this process
keeps, or the replicas' Redis: responses_store.py), GET /v1/models, GET /v1/models/{model}, and
GET /health (200 while the process serves, 503 while it loads or drains: the readiness Kubernetes
and the Gateway API Inference Extension probe). A request is handed to the process's own
Generation servicer (the gateway's `GatewayService` or the pod's `GenerationService`) with an
`HttpCallContext`, so it takes exactly the path a gRPC request takes. A client that disconnects
cancels its handler (aiohttp's handler cancellation), which closes the servicer's stream: the pod
aborts the request in the engine, the gateway cancels its call to the pod.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import math
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from typing import Any

import grpc
from aiohttp import web
from opentelemetry import context as otel_context
from opentelemetry import trace

from spindle import flagtypes, serving, telemetry
from spindle.errors import ListenError, listen_hint
from spindle.grpc_status import internal_error
from spindle.openai_api import fanout, reasoning_parsers, responses
from spindle.openai_api.context import HttpCallContext, Refused
from spindle.openai_api.errors import ApiError, bad_request, from_status
from spindle.openai_api.responses import ChatFormat, CompletionFormat, Format, Reply
from spindle.openai_api.responses_output import ResponsesFormat
from spindle.openai_api.responses_store import (
    OFF,
    Store,
    Stored,
    StoreUnavailable,
    add_store_args,
    not_found,
    page,
)
from spindle.openai_api.tool_parsers import PARSERS
from spindle.send_timeout import within
from spindle.tls import PLAINTEXT, ServerSslContext, TlsConfig
from spindle.traced_streams import callers_context
from spindle.v1 import generation_pb2 as pb

log = logging.getLogger(__name__)
STORE_CHECK_S = 2.0  # the start-up check of the response store, as the adapter service's of its Redis

MAX_BODY_BYTES = 64 << 20  # as the gRPC servers' largest message
DEFAULT_PORT = 8000  # vLLM's, and what OpenAI-compatible clients and routers assume
ROUTES = (
    "served: POST /v1/chat/completions, POST /v1/completions, POST /v1/responses, GET and DELETE "
    "/v1/responses/{id}, GET /v1/responses/{id}/input_items, GET /v1/models, GET /v1/models/{model}, "
    "GET /health"
)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_METHODS = frozenset({"GET", "POST", "HEAD", "OPTIONS", "PUT", "DELETE", "PATCH"})  # others: `other`


def add_http_args(parser: argparse.ArgumentParser | Any) -> None:
    """`--http-port`, `--tool-call-parser`, `--reasoning-parser`, `--reasoning-key-file` and the
    Responses API's store (`--responses-store-*`), the same flags (and SPINDLE_HTTP_PORT, ...)
    on the gateway and the model pod."""
    add_store_args(parser)
    parser.add_argument(
        "--http-port",
        type=flagtypes.port,
        default=DEFAULT_PORT,
        help=f"OpenAI-compatible HTTP API port (/v1/chat/completions, /v1/completions, /v1/responses, "
        f"/v1/models, /health); 0 = off [{DEFAULT_PORT}]",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=PARSERS,
        default="none",
        help='how the HTTP API reads the tool calls a model writes under `tool_choice` "auto" (vLLM\'s '
        "--enable-auto-tool-choice --tool-call-parser): hermes = <tool_call>{...}</tool_call> (Hermes, "
        'Qwen 2.5/3), llama3_json = {"name": ..., "parameters": ...} (Llama 3.1+), mistral = '
        "[TOOL_CALLS]... (Mistral, Mixtral, Ministral; calls get 9-character ids), openai = Harmony's "
        "<|channel|>commentary to=functions.NAME (gpt-oss), pythonic = "
        '[f(a=1), g()] (Llama 3.2/4); none = "auto" is refused, "required", a named function and "none" '
        "are served [none]",
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=reasoning_parsers.PARSERS,
        default="none",
        help="how the HTTP API reads a reasoning model's thinking, <think>...</think> before the answer "
        "(vLLM's --reasoning-parser): deepseek_r1 (DeepSeek-R1 and its distills, QwQ), qwen3 (Qwen3), "
        "openai_gptoss (gpt-oss: Harmony's analysis channel, and its calls): "
        "chat answers carry it as `reasoning_content`, apart from `content`; none = the text as the "
        "model wrote it [none]",
    )
    parser.add_argument(
        "--reasoning-key-file",
        type=reasoning_key,
        default=None,
        help="a file holding a secret key (any bytes, 32 or more) the Responses API signs the reasoning "
        'blobs it returns with (`include: ["reasoning.encrypted_content"]`, sent back by stateless '
        "clients such as Codex) and refuses a blob not signed with; every gateway and pod that must "
        "accept each other's blobs needs the same key. Unset: blobs are the reasoning text encoded, "
        "not encrypted nor signed, so a client may write the thinking it sends back [unset]",
    )


def reasoning_key(path: str) -> bytes:
    """--reasoning-key-file's key: the file's bytes (a trailing newline dropped), 32 or more."""
    try:
        with open(path, "rb") as f:
            key = f.read().rstrip(b"\r\n")
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {e.strerror}") from e
    if len(key) < 32:
        raise argparse.ArgumentTypeError(f"{path} holds {len(key)} bytes: a key needs 32 or more")
    return key


class OpenAIServer:
    """OpenAI's HTTP API over `generation` (a Generation servicer: `Generate` yields
    GenerateResponse messages or their serialized bytes, `ListModels` answers one).
    `base_models()` names the base models (a `model` that is none of them is an adapter);
    `ready()` is the process's health status; `tool_parser`, `reasoning_parser` and
    `reasoning_key` the --tool-call-parser, --reasoning-parser and --reasoning-key-file;
    `send_timeout` the --send-timeout (an event stream whose client reads nothing that long is
    closed, and its requests cancelled; 0: never); `store` where Responses API responses are
    kept (None: none is; closed with the server);
    `on_request`, when given, is told each request's method, route template and status (the
    gateway's metrics); `admit`, when given, sees each generation request's headers before its
    body is read, and refuses a caller by aborting (the gateway's API keys: a body of up to 64 MB
    is parsed on the event loop every request shares, for seconds, so one without a key must be
    refused before)."""

    def __init__(
        self,
        generation: Any,
        base_models: Callable[[], Collection[str]],
        ready: Callable[[], bool],
        tracer: trace.Tracer,
        tool_parser: str = "none",
        reasoning_parser: str = "none",
        reasoning_key: bytes | None = None,
        on_request: Callable[[str, str, int], None] | None = None,
        admit: Callable[[HttpCallContext], Awaitable[object]] | None = None,
        send_timeout: float = 0.0,
        store: Store | None = None,
    ) -> None:
        self.generation, self.base_models, self.ready, self.tracer = generation, base_models, ready, tracer
        self.admit, self.send_timeout, self.store = admit, send_timeout, store
        middlewares = [_traced(tracer), _openai_errors]  # the span sees the status of every refusal
        if on_request is not None:  # outermost: it sees every answer's final status
            middlewares.insert(0, _counted(on_request))
        self.app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares)
        chat, completion = ChatFormat(tool_parser, reasoning_parser), CompletionFormat()
        responses_api = ResponsesFormat(tool_parser, reasoning_parser, reasoning_key, store)
        self.app.router.add_post("/v1/chat/completions", lambda r: self._generate(r, chat))
        self.app.router.add_post("/v1/responses", lambda r: self._generate(r, responses_api))
        self.app.router.add_get("/v1/responses/{response_id}", self._retrieve)
        self.app.router.add_delete("/v1/responses/{response_id}", self._delete)
        self.app.router.add_get("/v1/responses/{response_id}/input_items", self._input_items)
        self.app.router.add_post("/v1/completions", lambda r: self._generate(r, completion))
        self.app.router.add_get("/v1/models", self._models)
        self.app.router.add_get("/v1/models/{model:.+}", self._model)  # ids may hold a `/`
        self.app.router.add_get("/health", self._health)
        self._runner: web.AppRunner | None = None

    async def start(self, host: str, port: int, tls: TlsConfig = PLAINTEXT) -> int:
        """Listen on host:port (0 = any free port), with TLS when `tls` has a certificate (its files
        re-read when they change); returns the port."""
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        ssl_context = ServerSslContext(tls).listening if tls.serves_tls else None
        try:
            if host in serving.WILDCARD_HOSTS:  # both families, as gRPC's ports: serving.listen_address
                sock = serving.listening_socket(host, port)
                site: web.BaseSite = web.SockSite(self._runner, sock, ssl_context=ssl_context)
            else:
                site = web.TCPSite(self._runner, host, port, ssl_context=ssl_context)
            await site.start()
        except OSError as e:
            await self._runner.cleanup()
            where = serving.host_port(host, port)
            raise ListenError(f"cannot listen for HTTP on {where}: {listen_hint(e)}") from e
        await self._check_store()
        return self._runner.addresses[0][1]

    async def _check_store(self) -> None:
        """Says at start whether the store answers (a wrong Redis URL, password or database was
        seen only as a client's 503). A warning, not a refusal to start, as the adapter service
        does with its Redis: it may come up after this process, and chats need no store."""
        if self.store is None:
            return
        try:
            await self.store.check(STORE_CHECK_S)
        except StoreUnavailable as e:
            if not e.logged:  # an outage the store logged itself (its breaker)
                log.warning("at start: %s", e.message)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self.store is not None:
            await self.store.close()

    async def _generate(self, request: web.Request, fmt: Format) -> web.StreamResponse:
        """One request, one generation or several (`n`, a list of prompts, `best_of`: fanout.py),
        each a `Generate` call with its own context (its own stream slot and x-request-id)."""
        owner = await self._owner(request)
        template, call = await fmt.parse_as(await _json_object(request), self.base_models(), owner)
        # the caller's x-request-id is checked as gRPC's request_id is
        rid, parts = fanout.plan(template, call, request.headers.get("x-request-id", ""))
        contexts = [HttpCallContext(request.headers) for _ in parts]
        streams = [self._messages(p.request, c, k if len(parts) > 1 else None)
                   for k, (p, c) in enumerate(zip(parts, contexts, strict=True))]  # fmt: skip
        if len(parts) > 1:  # the request's id (each generation's span has its own)
            trace.get_current_span().set_attribute(telemetry.RESPONSE_ID, rid)
        async with fanout.Merged(streams) as merged:
            early = await _started(merged, len(parts))  # a refusal raises here, before any byte is sent
            reply = fmt.reply(call, (contexts[0].request_id() or rid) if len(parts) == 1 else rid)
            headers = {"x-request-id": reply.request_id}
            if call.stream:
                prompts = [p.prompt for p in parts]
                return await _stream(request, reply, prompts, early, merged, headers, self.send_timeout)
            answers = [fanout.Answer(p.prompt) for p in parts]
            for k, message in [*early, *[m async for m in merged]]:
                answers[k].messages.append(message)
            whole = reply.whole(fanout.chosen(answers, call), answers)
            await reply.keep()
            return _json(whole, headers=headers)

    async def _owner(self, request: web.Request) -> str | None:
        """The caller `admit` lets in (its API key's name: whose stored responses it sees), or a
        refusal; None without `admit` (the pod's API, or no keys)."""
        if self.admit is None:
            return None
        return getattr(await self.admit(HttpCallContext(request.headers)), "name", None)

    async def _stored(self, request: web.Request) -> Stored:
        """The stored response the path names, this caller's; else OpenAI's 404."""
        owner, response_id = await self._owner(request), request.match_info["response_id"]
        stored = await self.store.get(response_id, owner) if self.store is not None else None
        if stored is None:
            raise not_found(response_id, why="" if self.store is not None else OFF)
        return stored

    async def _retrieve(self, request: web.Request) -> web.Response:
        """GET /v1/responses/{id} (`client.responses.retrieve`): the response as it was returned."""
        if request.query.get("stream", "false") != "false":
            raise bad_request("`stream`: a stored response is retrieved whole here", "stream")
        return _json((await self._stored(request)).response)

    async def _delete(self, request: web.Request) -> web.Response:
        """DELETE /v1/responses/{id} (`client.responses.delete`): forgotten. Of two deletes of one
        response at once (found by both), the one that did not delete it is a 404, as OpenAI's."""
        stored = await self._stored(request)
        gone = self.store is not None and await self.store.delete(stored.response["id"], stored.owner)
        if not gone:
            raise not_found(stored.response["id"])
        return _json({"id": stored.response["id"], "object": "response", "deleted": True})

    async def _input_items(self, request: web.Request) -> web.Response:
        """GET /v1/responses/{id}/input_items (`client.responses.input_items.list`): every input
        item the model was given, earlier turns' included, paged as OpenAI pages them."""
        return _json(page((await self._stored(request)).input, request.query))

    async def _messages(
        self, request: pb.GenerateRequest, context: HttpCallContext, generation: int | None
    ) -> AsyncIterator[pb.GenerateResponse]:
        """The servicer's stream as messages (the gateway relays serialized bytes), closed with this
        one, so a disconnect reaches the servicer's cleanup at once. One `generation` of several
        runs in a span of its own (`spindle.generation`, a child of the request's), which the
        servicer annotates (its id, usage, finish) as it does the request's span when alone."""
        span = self.tracer.start_as_current_span("spindle.generation") if generation is not None else None
        with span or contextlib.nullcontext() as current:
            if current is not None:
                current.set_attribute("spindle.generation", generation)
            async with contextlib.aclosing(self.generation.Generate(request, context)) as stream:
                async for m in stream:
                    yield m if isinstance(m, pb.GenerateResponse) else pb.GenerateResponse.FromString(m)

    async def _models(self, request: web.Request) -> web.Response:
        listed = await self.generation.ListModels(pb.ListModelsRequest(), HttpCallContext(request.headers))
        return _json(responses.models(listed))

    async def _model(self, request: web.Request) -> web.Response:
        """GET /v1/models/{model} (the SDKs' `models.retrieve`): one entry of the list this caller
        may use, or a 404 as for an unknown model in a request."""
        listed = await self.generation.ListModels(pb.ListModelsRequest(), HttpCallContext(request.headers))
        name = request.match_info["model"]
        entry = next((m for m in responses.models(listed)["data"] if m["id"] == name), None)
        if entry is None:
            raise ApiError(404, "not_found_error", "NOT_FOUND", f"model {name!r} does not exist", "model")
        return _json(entry)

    async def _health(self, request: web.Request) -> web.Response:
        ready = self.ready()
        return _json({"status": "ok" if ready else "not serving"}, status=200 if ready else 503)


async def _started(merged: fanout.Merged, count: int) -> list[tuple[int, pb.GenerateResponse]]:
    """`fanout.started`; a limit's refusal of a fan-out says that each generation counted (a key
    allowed fewer streams or a smaller burst than the request's generations is never admitted)."""
    try:
        return await fanout.started(merged, count)
    except Refused as e:
        if count == 1 or e.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise
        why = f"{e.details} (this request is {count} generations, each counted as a request)"
        raise Refused(e.code, why, e.trailers) from None


async def _stream(
    request: web.Request,
    reply: Reply,
    prompts: list[int],
    early: list[tuple[int, pb.GenerateResponse]],
    merged: fanout.Merged,
    headers: dict[str, str],
    send_timeout: float = 0.0,
) -> web.StreamResponse:
    """Server-sent events: the messages read so far, the rest as they come (each generation's
    chunks with its choice's index; `prompts[k]`: the prompt generation k answers), the usage
    chunk when asked for, then [DONE]. A failure after the first byte is an `error` event (what
    the `openai` SDKs raise from). A client that reads nothing for `send_timeout` seconds (0:
    never) while events wait is cut off: the connection is closed, and closing the streams
    cancels the requests (as when it disconnects)."""
    response = web.StreamResponse(headers={"content-type": "text/event-stream", "cache-control": "no-cache",
                                           **headers})  # fmt: skip
    await response.prepare(request)
    write = functools.partial(_write, response, send_timeout)
    try:
        await _events(request, reply, prompts, early, merged, write)
    except ConnectionResetError:
        pass  # the client left; closing the streams aborts the requests
    except Unread:
        log.info("closed an event stream whose client read nothing for %g s (--send-timeout)", send_timeout)
        if request.transport is not None:
            request.transport.abort()  # what it has not read is dropped: its socket is closed now
    return response


async def _events(
    request: web.Request,
    reply: Reply,
    prompts: list[int],
    early: list[tuple[int, pb.GenerateResponse]],
    merged: fanout.Merged,
    write: Callable[[bytes], Awaitable[None]],
) -> None:
    async def send(objects: list[dict[str, Any]]) -> None:
        if objects:  # server-sent events, one an object, each after an `event:` line if named
            await write(b"".join(_event(o, reply.named_events) for o in objects))

    try:
        await send(reply.opening())
        for k, message in early:
            await send(reply.chunks(k, prompts[k], message))
        async for k, message in merged:
            await send(reply.chunks(k, prompts[k], message))
        last = reply.usage_chunks()
        await reply.keep()
        await send(last)
    except Refused as e:
        await send(reply.failure(_failed(from_status(e.code, e.details, e.trailers))))
    except (ConnectionResetError, Unread):
        raise
    except Exception as e:  # the status line is sent: an answer now would corrupt the event stream
        await send(reply.failure(_failed(_internal(request, e))))
    await write(reply.done)


def _failed(error: ApiError) -> ApiError:
    """`error`, sent as an event after the 200: the span says so, as its status code cannot (an
    error when the server is at fault, the status it would have had a 5xx)."""
    span = trace.get_current_span()
    span.set_attribute("error.type", error.code)
    if error.status >= 500:
        span.set_status(trace.Status(trace.StatusCode.ERROR, f"{error.code}: {error.message}"))
    return error


def _traced(tracer: trace.Tracer) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """A server span per request but /health (probed every few seconds), continuing the caller's
    W3C trace context, named and annotated by OpenTelemetry's HTTP conventions; ERROR only for a
    5xx (a 4xx is the client's). The servicer's GenAI attributes go on it."""

    @web.middleware
    async def traced(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path == "/health":
            return await handler(request)
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else None
        attributes = {"http.request.method": request.method, "url.path": request.path}
        if route is not None:
            attributes["http.route"] = route
        name = f"{request.method} {route}" if route is not None else request.method
        # The caller's whole context is made current, not only its span: its baggage goes on to
        # the pods with the trace, as a gRPC caller's does (traced_streams.py).
        caller = callers_context(request.headers.items())
        token = otel_context.attach(caller)
        try:
            span = tracer.start_span(name, caller, trace.SpanKind.SERVER, attributes=attributes)
            with trace.use_span(span, end_on_exit=True):
                response = await handler(request)
                span.set_attribute("http.response.status_code", response.status)
                if response.status >= 500:
                    span.set_status(trace.Status(trace.StatusCode.ERROR))
                return response
        finally:
            otel_context.detach(token)

    return traced


def _counted(
    on_request: Callable[[str, str, int], None],
) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """Tell `on_request` each request's method, route template (bounded: `unmatched` for a path no
    route has, never the path itself) and status; 499 for a client that left before the answer."""

    @web.middleware
    async def counted(request: web.Request, handler: Handler) -> web.StreamResponse:
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        method = request.method if request.method in _METHODS else "other"
        status = 499
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as e:
            status = e.status
            raise
        except Exception:  # a client that left (CancelledError) stays 499
            status = 500
            raise
        finally:
            on_request(method, route, status)

    return counted


class Unread(Exception):
    """The client read nothing of an event stream for --send-timeout seconds."""


async def _write(response: web.StreamResponse, timeout: float, data: bytes) -> None:
    """`data` on the stream, waiting at most `timeout` seconds (0: forever) on a client that
    reads nothing (aiohttp waits while the socket's buffers are full), else Unread."""
    try:
        await within(response.write(data), timeout)
    except asyncio.TimeoutError:  # on 3.10 not the builtin TimeoutError
        raise Unread from None


def _event(obj: dict[str, Any], named: bool) -> bytes:
    head = f"event: {obj['type']}\n".encode() if named else b""
    return head + b"data: " + _dumps(obj).encode() + b"\n\n"


async def _json_object(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise bad_request(f"the request body is not JSON: {e}") from None
    except RecursionError:  # the parser recurses per level: a client's body, not our failure
        raise bad_request("the request body is nested too deeply to parse") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    _no_lone_surrogates(raw, body)
    return body


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _no_lone_surrogates(raw: bytes, body: dict[str, Any]) -> None:
    """A 400 for a string holding half of a UTF-16 surrogate pair (`"\\ud83d"` alone): JSON's
    syntax allows the escape and Python's parser takes it, but it is no text (JavaScript's
    JSON.stringify writes it for a string cut inside an emoji), and it failed later, as a 500 the
    SDKs retry: encoding the request for the pod, or the response after the model ran (a
    restated field). Only such an escape makes one (raw surrogate bytes are not UTF-8), so a
    body without any is not walked again."""
    if not _SURROGATE_ESCAPE.search(raw):
        return
    try:
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError as e:
        where = e.object[max(e.start - 40, 0) : e.start].encode(errors="replace").decode()
        raise bad_request(
            f"the request body holds an unpaired UTF-16 surrogate (\\u{ord(e.object[e.start]):04x}, after "
            f"{where!r}), which is no text: a string cut inside a character?"
        ) from None


def _dumps(obj: Any) -> str:
    """JSON as the standard has it: Python's `-Infinity` / `NaN` are no JSON, and a strict parser
    (JavaScript's `JSON.parse`, Go's, serde's) rejects the whole response for one logprob of
    -inf. Such floats are rare, so the fast path stays a plain dump."""
    try:
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except ValueError:
        return json.dumps(_finite(obj), separators=(",", ":"), ensure_ascii=False, allow_nan=False)


LOGPROB_FLOOR = -9999.0  # what vLLM writes for a logprob of -inf


def _finite(obj: Any) -> Any:
    """`obj` with -inf as `LOGPROB_FLOOR`, +inf as its negation and NaN as null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if math.isnan(obj) else math.copysign(-LOGPROB_FLOOR, obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(obj, status=status, headers=headers, dumps=_dumps)


@web.middleware
async def _openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every refusal as OpenAI's error JSON: ours, the servicer's statuses, and aiohttp's own
    (unknown path, wrong method, body too large)."""
    try:
        return await handler(request)
    except Refused as e:
        error = from_status(e.code, e.details, e.trailers)
    except ApiError as e:
        error = e
    except web.HTTPException as e:
        if e.status < 400:
            raise
        where = f" ({ROUTES})" if e.status in (404, 405) else ""
        message = f"{e.reason}: {request.method} {request.path}{where}"
        error = ApiError(e.status, "invalid_request_error", e.reason.upper().replace(" ", "_"), message)
    except Exception as e:
        error = _internal(request, e)
    return _json(error.body(), status=error.status, headers=error.headers)


def _internal(request: web.Request, e: Exception) -> ApiError:
    """An unexpected failure (a bug), logged with its traceback and answered as a 500."""
    message = internal_error(e, log, f"HTTP {request.method} {request.path} failed")
    return ApiError(500, "server_error", "INTERNAL", message)  # the exception's text: the log only
