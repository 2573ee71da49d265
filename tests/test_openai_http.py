"""The OpenAI-compatible HTTP API through a client no one here wrote: the official `openai` SDK,
sync and async, plain and streaming, against `spindle up` (tests/up_cluster.py, shared with the
quickstart test) and against a gateway with API keys in front of its pod. Every request is a
few tokens: the cluster is real, the CPU is small."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator

import grpc
import httpx
import jsonschema
import openai
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from spindle.client import Client, chat_request, completion_request
from spindle.openai_api.context import Refused
from spindle.openai_api.errors import ApiError, from_status
from spindle.openai_api.requests import Call
from spindle.openai_api.requests import chat_request as http_chat_request
from spindle.openai_api.requests import completion_request as http_completion_request
from spindle.openai_api.responses import ChatFormat, CompletionFormat, Reply
from spindle.v1 import generation_pb2 as pb
from spindle.v1 import pod_status_pb2, pod_status_pb2_grpc
from tests.service_helpers import free_port, gateway_in_process, openai_client_of
from tests.up_cluster import ADAPTER

BASE = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "Name a fruit."}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def _sdk(base_url: str, **options) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, **options)


def _idle(pod: str, timeout: float = 10.0) -> float:
    """Seconds until the pod runs nothing and holds no KV block; fails after `timeout`."""
    start = time.monotonic()
    with grpc.insecure_channel(pod) as ch:
        status = pod_status_pb2_grpc.PodStatusStub(ch)
        while True:
            rep = status.GetLoad(pod_status_pb2.GetLoadRequest(), timeout=5)
            if rep.num_running == rep.num_waiting == 0 and rep.kv_blocks_free == rep.kv_blocks_total:
                return time.monotonic() - start
            assert time.monotonic() - start < timeout, f"the pod still runs a request: {rep}"
            time.sleep(0.05)


def test_sync_chat_plain_and_streamed_equal_grpc_greedy(spindle_up):
    client = _sdk(spindle_up.http)
    plain = client.chat.completions.create(
        model=BASE, messages=QUESTION, max_tokens=8, temperature=0, extra_headers={"x-request-id": "http-1"}
    )
    chunks = list(
        client.chat.completions.create(
            model=BASE, messages=QUESTION, max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    with Client(spindle_up.gateway) as grpc_client:
        via_grpc = grpc_client.generate(chat_request(QUESTION, max_tokens=8, temperature=0.0), timeout=60)
    text = plain.choices[0].message.content
    assert text and text == via_grpc.text
    assert plain.model == BASE and plain.object == "chat.completion" and plain.id == "chatcmpl-http-1"
    assert plain.usage.completion_tokens == via_grpc.completion_tokens
    assert plain.usage.prompt_tokens == via_grpc.prompt_tokens
    assert plain.choices[0].finish_reason == via_grpc.finish_reason
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == plain.usage.total_tokens
    assert chunks[-2].choices[0].finish_reason == plain.choices[0].finish_reason
    assert len({c.id for c in chunks}) == 1


def test_async_completions_with_an_adapter_and_logprobs(spindle_up, smollm2):
    async def run() -> tuple:
        client = openai.AsyncOpenAI(base_url=spindle_up.http, api_key="none", max_retries=0)
        plain = await client.completions.create(
            model=ADAPTER, prompt="Once upon a", max_tokens=4, temperature=0, logprobs=2
        )
        stream = await client.completions.create(
            model=ADAPTER, prompt="Once upon a", max_tokens=4, temperature=0, logprobs=2, stream=True
        )
        pieces = [c async for c in stream]
        base = await client.completions.create(
            model=BASE, prompt="Once upon a", max_tokens=4, temperature=0, logprobs=2
        )
        await client.close()
        return plain, pieces, base

    plain, pieces, base = asyncio.run(run())
    with Client(spindle_up.gateway) as grpc_client:
        via_grpc = grpc_client.generate(
            completion_request("Once upon a", max_tokens=4, temperature=0.0, adapter=ADAPTER), timeout=60
        )
    choice = plain.choices[0]
    assert choice.text == via_grpc.text
    assert choice.logprobs.token_logprobs != base.choices[0].logprobs.token_logprobs  # the adapter is applied
    assert choice.logprobs.tokens == [smollm2.tokenizer.hf.decode([t]) for t in via_grpc.token_ids]
    assert len(choice.logprobs.token_logprobs) == 4 and all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    assert all(len(top) == 2 for top in choice.logprobs.top_logprobs)
    assert "".join(p.choices[0].text for p in pieces) == choice.text
    assert [t for p in pieces for t in (p.choices[0].logprobs.tokens or [])] == choice.logprobs.tokens
    assert pieces[-1].choices[0].finish_reason == "length"


def test_chat_logprobs_and_models(spindle_up):
    client = _sdk(spindle_up.http)
    out = client.chat.completions.create(
        model=BASE, messages=QUESTION, max_tokens=3, temperature=0, logprobs=True, top_logprobs=3
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 3 for c in content)
    # Tokens by their text, as OpenAI names them (a client looks up "Yes" there), with its bytes
    assert "".join(c.token for c in content) == out.choices[0].message.content
    assert all(c.bytes == list(c.token.encode()) for c in content)
    assert all(c.top_logprobs[0].token == c.token for c in content)  # greedy: the best one
    assert all(c.top_logprobs[0].logprob >= c.top_logprobs[-1].logprob for c in content)
    models = {m.id: m for m in client.models.list()}
    assert models[ADAPTER].model_extra["parent"] == BASE and models[BASE].model_extra["parent"] is None


def test_the_pod_serves_the_same_api(spindle_up):
    pod = _sdk(spindle_up.pod_http)
    gateway = _sdk(spindle_up.http)
    asked = {"messages": QUESTION, "max_tokens": 5, "temperature": 0, "model": ADAPTER}
    assert (
        pod.chat.completions.create(**asked).choices[0].message.content
        == gateway.chat.completions.create(**asked).choices[0].message.content
    )
    for url in (spindle_up.http, spindle_up.pod_http):
        health = httpx.get(url.removesuffix("/v1") + "/health", timeout=5)
        assert health.status_code == 200 and health.json() == {"status": "ok"}


def test_a_client_that_hangs_up_aborts_its_request_in_the_engine(spindle_up):
    long = {"model": BASE, "messages": QUESTION, "max_tokens": 2000, "extra_body": {"ignore_eos": True}}
    stream = _sdk(spindle_up.http).chat.completions.create(**long, stream=True)
    next(iter(stream))  # it runs
    stream.close()
    assert _idle(spindle_up.pod) < 5  # 2,000 tokens would take a minute
    with pytest.raises(openai.APITimeoutError):  # not streamed: the client gives up waiting
        _sdk(spindle_up.pod_http, timeout=1.0).chat.completions.create(**long)
    assert _idle(spindle_up.pod) < 5


KEYS = """
admin   key-admin  *
limited key-limited  -  rate=0.001 burst=1
three   key-three    -  rate=0.001 burst=3
"""


def test_keys_scopes_limits_and_refusals_are_openai_errors(spindle_up, tmp_path):
    """A gateway with API keys in front of the same pod: every refusal is the status and error
    class the SDK expects, with OpenAI's error JSON."""
    (tmp_path / "keys").write_text(KEYS)
    http_port = free_port()
    flags = [
        "--pods",
        spindle_up.pod,
        "--api-keys-file",
        str(tmp_path / "keys"),
        "--http-port",
        str(http_port),
    ]

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    async def run() -> None:
        async with gateway_in_process(flags, provider):
            url = f"http://127.0.0.1:{http_port}/v1"

            def client(key: str) -> openai.AsyncOpenAI:
                return openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)

            ask = {"messages": QUESTION, "max_tokens": 1}
            with pytest.raises(openai.AuthenticationError, match="invalid API key"):
                await client("wrong").chat.completions.create(model=BASE, **ask)
            with pytest.raises(openai.PermissionDeniedError, match="may not use adapter"):
                await client("key-limited").chat.completions.create(model=ADAPTER, **ask)
            with pytest.raises(openai.RateLimitError) as limited:  # its one request was the 403's
                await client("key-limited").chat.completions.create(model=BASE, **ask)
            assert int(limited.value.response.headers["retry-after"]) > 1
            admin = client("key-admin")
            assert {m.id async for m in admin.models.list()} >= {BASE, ADAPTER}
            with pytest.raises(openai.NotFoundError, match="nope"):
                await admin.chat.completions.create(model="nope", **ask)
            with pytest.raises(openai.BadRequestError, match="at most 128") as refused:
                await admin.chat.completions.create(model=BASE, n=129, **ask)
            assert refused.value.body["param"] == "n" and refused.value.body["code"] == "INVALID_ARGUMENT"
            # n choices are n requests to the key's rate: 2 of its 3, then 2 more is one too many,
            # and the one admitted is cancelled with the refusal (the pod runs nothing after).
            three = client("key-three")
            assert len((await three.chat.completions.create(model=BASE, n=2, **ask)).choices) == 2
            with pytest.raises(openai.RateLimitError, match="2 generations, each counted as a request"):
                await three.chat.completions.create(
                    model=BASE, n=2, **{**ask, "max_tokens": 500}, extra_body={"ignore_eos": True}
                )
            await asyncio.to_thread(_idle, spindle_up.pod)
            unenforceable = {"type": "array", "uniqueItems": True}  # the grammar engine's refusal, as gRPC's
            schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": unenforceable}}
            with pytest.raises(openai.BadRequestError, match="uniqueItems"):
                await admin.chat.completions.create(model=BASE, response_format=schema, **ask)
            with pytest.raises(openai.BadRequestError, match="temperature"):
                await admin.chat.completions.create(model=BASE, temperature=-1, **ask)
            exporter.clear()
            done = await admin.completions.create(model=BASE, prompt="Hi", max_tokens=2, temperature=0)
            assert done.usage.completion_tokens == 2
            # Traced as a gRPC request is: the HTTP server span, the gateway's call to the pod inside it.
            (server,) = [s for s in exporter.get_finished_spans() if s.name == "POST /v1/completions"]
            (client,) = [s for s in exporter.get_finished_spans() if s.kind == SpanKind.CLIENT]
            assert server.kind == SpanKind.SERVER and client.parent.span_id == server.context.span_id
            assert server.attributes["gen_ai.response.id"] == done.id.removeprefix("cmpl-")

    asyncio.run(run())


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "tool_call_id"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "`text` string"),
        ({"messages": QUESTION, "tools": [{"type": "function"}]}, r"`tools\[0\]` must be"),
        ({"messages": QUESTION, "tool_choice": "required"}, "needs `tools`"),
        ({"messages": QUESTION, "function_call": {"name": "f"}}, "`function_call`"),
        ({"messages": QUESTION, "guided_choice": []}, "non-empty list of strings"),
        ({"messages": QUESTION, "response_format": {"type": "json_schema"}}, "response_format"),
        (
            {"messages": QUESTION, "response_format": {"type": "json_schema", "json_schema": "p"}},
            "response_format",
        ),
        ({"messages": QUESTION, "response_format": ["json_object"]}, "response_format"),
        ({"messages": QUESTION, "response_format": {"type": "json_object", "schema": 1}}, "response_format"),
        ({"messages": QUESTION, "structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one of"),
        (
            {"messages": QUESTION, "guided_regex": "a", "response_format": {"type": "json_object"}},
            "not several",
        ),
        ({"messages": QUESTION, "stream_options": {"include_usage": True}}, "stream: true"),
        ({"messages": QUESTION, "n": 0}, "`n` must be at least 1"),
        ({"messages": QUESTION, "n": 129}, "at most 128"),
        ({"messages": QUESTION, "n": 2, "best_of": 3}, "not supported in chat"),
        ({"messages": QUESTION, "stream": True, "stream_options": {"include_usage": "no"}}, "true or false"),
        ({"messages": QUESTION, "top_logprobs": 2}, "logprobs: true"),
        ({"messages": QUESTION, "max_tokens": "9"}, "an integer"),
        ({"prompt": ["a", [1]]}, "list of strings or of token-id lists"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ["a"] * 65, "n": 2}, "130 generations"),
        ({"prompt": "a", "n": 2, "best_of": 1}, "at least `n`"),
        ({"prompt": "a", "best_of": 2, "stream": True}, "cannot be streamed"),
        ({"prompt": [1, 2**40]}, "token ids"),
        ({"prompt": "a", "max_tokens": 2**40}, "out of range"),
        ({"prompt": "a", "echo": True, "logprobs": 1, "prompt_logprobs": 2}, "give the same number"),
        ({"messages": [*QUESTION, {"role": "assistant", "content": "A"}], "echo": True}, "echo"),
        ({"prompt": "a", "prompt_logprobs": 1, "stream": True}, "not supported with `stream: true`"),
        ({"messages": QUESTION, "prompt_logprobs": "1"}, "an integer"),
        # vLLM's extras that would change the answer: refused, not silently dropped
        ({"prompt": "a", "use_beam_search": True}, "beam search"),
        # the logits processors served: their kinds checked here, their values by the pod
        ({"prompt": "a", "logit_bias": {"five": 1}}, "logit_bias"),
        ({"prompt": "a", "logit_bias": {"5": "1"}}, "logit_bias"),
        ({"prompt": "a", "logit_bias": {str(2**40): 1}}, "logit_bias"),
        ({"prompt": "a", "allowed_token_ids": [-1]}, "allowed_token_ids"),
        ({"prompt": "a", "min_tokens": "8"}, "min_tokens"),
        ({"prompt": "a", "bad_words": [1]}, "bad_words"),
        ({"messages": [*QUESTION, {"role": "assistant", "function_call": CALL["function"]}]}, "function_"),
        ({"prompt": "a", "truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
        ({"messages": QUESTION, "continue_final_message": True}, "continue_final_message"),
        ({"messages": QUESTION, "chat_template": "{{ messages }}"}, "chat_template"),
        ({"messages": QUESTION, "chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs"),
        ({"messages": QUESTION, "add_generation_prompt": False}, "add_generation_prompt"),
        # the prompt's special tokens: a completion's text gets them (BOS), a chat's template has them
        ({"prompt": "a", "add_special_tokens": False}, "add_special_tokens"),
        ({"messages": QUESTION, "add_special_tokens": True}, "add_special_tokens"),
        ({"prompt": "a", "logits_processors": ["m.LP"]}, "logits_processors"),
    ],
)
def test_what_is_refused_is_named(body, problem):
    parse = http_completion_request if "prompt" in body else http_chat_request
    with pytest.raises(ApiError, match=problem) as refused:
        parse(body, {BASE})
    assert refused.value.status == 400


def test_logits_processors_map_onto_the_grpc_request():
    """OpenAI's logit_bias (ids as JSON strings) and vLLM's allowed_token_ids, min_tokens and
    bad_words reach SamplingParams, for a chat and a completion alike (they were refused)."""
    fields = {"logit_bias": {"5": -100, "7": 2.5}, "allowed_token_ids": [5, 7, 9], "min_tokens": 3,
              "bad_words": ["x y"]}  # fmt: skip
    forms = ((http_chat_request, {"messages": QUESTION}), (http_completion_request, {"prompt": "a"}))
    for parse, body in forms:
        s = parse({**body, **fields}, {BASE})[0].sampling
        assert dict(s.logit_bias) == {5: -100.0, 7: 2.5} and list(s.allowed_token_ids) == [5, 7, 9]
        assert s.min_tokens == 3 and list(s.bad_words) == ["x y"]


def test_fields_map_onto_the_grpc_request():
    req, call = http_chat_request(
        {"model": ADAPTER,
         "messages": [{"role": "developer", "content": [{"type": "text", "text": "Be brief."},
                                                        {"type": "text", "text": "Be kind."}]}, *QUESTION],
         "max_tokens": 5, "max_completion_tokens": 7, "temperature": 0, "top_p": 0.5, "seed": 3, "stop": "x",
         "presence_penalty": 0.1, "frequency_penalty": 0.2, "top_k": -1, "min_p": 0.05,
         "repetition_penalty": 1.1,
         "ignore_eos": True, "skip_special_tokens": False, "logprobs": True, "user": "u",
         "response_format": {"type": "text"}, "stream": True, "stream_options": {"include_usage": True},
         "tool_choice": "none", "function_call": "auto", "priority": -5, "add_special_tokens": False},
        {BASE},
    )  # fmt: skip
    assert req.adapter == ADAPTER and not req.HasField("model") and req.max_tokens == 7 and req.seed == 3
    assert [(m.role, m.content) for m in req.chat.messages] == [
        ("system", "Be brief.\nBe kind."),
        ("user", "Name a fruit."),
    ]
    s = req.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty) == (0, 0.5, 0, 0.05, 1.1)
    assert (s.presence_penalty, s.frequency_penalty, s.ignore_eos, s.skip_special_tokens) == (
        0.1,
        0.2,
        True,
        False,
    )
    assert list(req.stop) == ["x"] and req.logprobs == 0 and s.HasField("top_k")
    assert req.priority == -5  # vLLM's field, served over gRPC: lower is served first
    assert call.stream and call.include_usage and call.logprobs and call.model == ADAPTER
    req, call = http_completion_request({"prompt": [[1, 2, 3]]}, {BASE})
    assert list(req.token_ids.ids) == [1, 2, 3] and call.model == BASE and not req.HasField("adapter")
    assert not req.sampling.HasField("temperature")  # unset stays unset: the engine's default


@pytest.mark.parametrize(
    ("code", "status", "error_class"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400, openai.BadRequestError),
        (grpc.StatusCode.UNAUTHENTICATED, 401, openai.AuthenticationError),
        (grpc.StatusCode.PERMISSION_DENIED, 403, openai.PermissionDeniedError),
        (grpc.StatusCode.NOT_FOUND, 404, openai.NotFoundError),
        (grpc.StatusCode.ALREADY_EXISTS, 409, openai.ConflictError),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, openai.RateLimitError),
        (grpc.StatusCode.UNAVAILABLE, 503, openai.InternalServerError),
        (grpc.StatusCode.INTERNAL, 500, openai.InternalServerError),
    ],
)
def test_each_status_is_the_http_status_the_sdk_expects(code, status, error_class):
    error = from_status(code, "why", (("retry-after-ms", "1500"),))
    assert error.status == status and error.body()["error"]["code"] == code.name
    assert error.headers == {"retry-after-ms": "1500", "retry-after": "2"}
    # What the SDK raises for that answer (served by a stub transport: no server needed)
    answer = httpx.MockTransport(lambda _: httpx.Response(status, json=error.body(), headers=error.headers))
    client = openai.OpenAI(
        base_url="http://x/v1", api_key="k", max_retries=0, http_client=httpx.Client(transport=answer)
    )
    with pytest.raises(error_class, match="why"):
        client.completions.create(model=BASE, prompt="hi")


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, {"json_object": True}),
        ({"response_format": {"type": "json_object", "schema": {"type": "object"}}},  # Together, llama.cpp
         {"json_schema": '{"type": "object"}'}),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "strict": True,
                                                                         "schema": {"type": "object"}}}},
            {"json_schema": '{"type": "object"}'},
        ),
        ({"structured_outputs": {"json": {"type": "integer"}}}, {"json_schema": '{"type": "integer"}'}),
        ({"structured_outputs": {"json_object": True}}, {"json_object": True}),
        ({"structured_outputs": {"grammar": "start: 'a'"}}, {"grammar": "start: 'a'"}),
        ({"guided_json": '{"type": "string"}'}, {"json_schema": '{"type": "string"}'}),
        ({"guided_regex": "[0-9]+"}, {"regex": "[0-9]+"}),
        ({"guided_choice": ["yes", "no"]}, {"choice": {"choices": ["yes", "no"]}}),
    ],
)  # fmt: skip
def test_structured_output_fields_map_onto_the_grpc_request(fields, expected):
    req, _ = http_chat_request({"messages": QUESTION, **fields}, {BASE})
    if expected is None:
        assert not req.sampling.HasField("structured_output")
    else:
        assert req.sampling.structured_output == pb.StructuredOutput(**expected)


def test_a_structured_output_through_the_sdk(spindle_up):
    """The wiring, end to end (what the outputs are worth: the structured-output tests)."""
    out = _sdk(spindle_up.http).chat.completions.create(
        model=BASE, messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=4, temperature=0,
        extra_body={"guided_choice": ["yes", "no"]},
    )  # fmt: skip
    assert out.choices[0].message.content in ("yes", "no") and out.choices[0].finish_reason == "stop"


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
           "required": ["city"], "additionalProperties": False}  # fmt: skip
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "A city's weather", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    },
]


def _streamed_calls(client: openai.OpenAI, **asked) -> tuple[list[tuple[str, str]], str | None]:
    """The calls a streamed answer makes, as a client accumulates OpenAI's deltas, and its finish."""
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in client.chat.completions.create(**asked, stream=True):
        for c in chunk.choices[0].delta.tool_calls or []:
            if c.id:  # a call's first delta: index, id and name
                calls[c.index] = [c.function.name, ""]
            calls[c.index][1] += c.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return [tuple(calls[i]) for i in sorted(calls)], finish


def test_forced_tool_calls_and_a_round_trip_through_the_sdk(spindle_up):
    """tool_choice "required" or a named function on the real model, with no --tool-call-parser
    (as vLLM serves them): the structured-output engine forces a valid call, streamed and not;
    then the call and the tool's result go back through the chat template and the model answers."""
    client = _sdk(spindle_up.http)
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    asked = {"model": BASE, "messages": question, "tools": TOOLS, "max_tokens": 40, "temperature": 0}
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, finish in (("required", "tool_calls"), (named, "stop")):  # named: "stop", as OpenAI's
        out = client.chat.completions.create(**asked, tool_choice=choice, parallel_tool_calls=False)
        message = out.choices[0].message
        assert message.content is None and out.choices[0].finish_reason == finish, out
        (call,) = message.tool_calls
        assert call.id.startswith("call_") and call.type == "function"
        if choice == named:
            assert call.function.name == "get_weather"
        if call.function.name == "get_weather":
            jsonschema.validate(json.loads(call.function.arguments), WEATHER)
        streamed = _streamed_calls(client, **asked, tool_choice=choice, parallel_tool_calls=False)
        assert streamed == ([(call.function.name, call.function.arguments)], finish)  # greedy: the same
    result = {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}
    turns = [*question, message.model_dump(exclude_none=True), result]
    answer = client.chat.completions.create(
        **{**asked, "messages": turns, "max_tokens": 6}, tool_choice="none"
    )
    assert answer.choices[0].message.content and answer.choices[0].message.tool_calls is None
    with pytest.raises(openai.BadRequestError, match="--tool-call-parser"):  # "auto" needs a parser
        client.chat.completions.create(**asked)


class _Servicer:
    """A Generation servicer that answers one chunk, then fails with `failure`, and lists the
    base model and an adapter whose id holds a `/`."""

    def __init__(self, failure: Exception | None = None) -> None:
        self.failure = failure

    async def Generate(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.GenerateResponse]:
        yield pb.GenerateResponse(chunk=pb.Chunk(text="Hel"))
        raise self.failure

    async def ListModels(self, request: pb.ListModelsRequest, context) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=[
            pb.ModelInfo(id=BASE, kind=pb.MODEL_KIND_BASE, max_model_len=8192),
            pb.ModelInfo(id="org/tuned", kind=pb.MODEL_KIND_ADAPTER, base_model=BASE),
        ])  # fmt: skip


@pytest.mark.parametrize(
    ("failure", "message"),
    [
        (Refused(grpc.StatusCode.UNAVAILABLE, "the pod went away", ()), "the pod went away"),
        (RuntimeError("a bug at /srv/secret.py"), r"^internal error \(id [0-9a-f]{16}\); the server's log"),
    ],
)
def test_a_failure_after_the_stream_began_is_an_error_event(failure, message, caplog):
    """Whatever fails once the 200 is sent, the client reads an error event it raises from, not
    a second HTTP response written into the event stream (which it would see as a broken
    connection). A bug's own text (it read "internal error (RuntimeError: a bug at /srv/...)")
    stays in the log, under the id the client gets."""

    async def run() -> list[str]:
        async with openai_client_of(_Servicer(failure), BASE) as client:
            stream = await client.chat.completions.create(model=BASE, messages=QUESTION, stream=True)
            texts = []
            with pytest.raises(openai.APIError, match=message) as e:
                async for chunk in stream:
                    texts.append(chunk.choices[0].delta.content)
            assert "secret" not in str(e.value.body)
            return texts

    assert asyncio.run(run()) == ["Hel"]
    if isinstance(failure, RuntimeError):
        error_id = re.search(r"id ([0-9a-f]{16})", caplog.text).group(1)
        logged = [r for r in caplog.records if error_id in r.getMessage()]
        assert logged and logged[0].exc_info[1] is failure  # the id, with the traceback


def test_the_sdk_retrieves_one_model():
    async def run() -> None:
        async with openai_client_of(_Servicer(), BASE) as client:
            base, adapter = await client.models.retrieve(BASE), await client.models.retrieve("org/tuned")
            assert (base.id, base.object, base.model_extra["max_model_len"]) == (BASE, "model", 8192)
            assert adapter.id == "org/tuned" and adapter.model_extra["parent"] == BASE
            with pytest.raises(openai.NotFoundError, match="'nope' does not exist") as missing:
                await client.models.retrieve("nope")
            assert missing.value.body["param"] == "model" and missing.value.body["code"] == "NOT_FOUND"

    asyncio.run(run())


def test_a_completions_top_logprobs_hold_the_sampled_token():
    sampled = pb.TokenLogprob(token_id=7, logprob=-2.5, top=[pb.TopLogprob(token_id=3, logprob=-0.1)])
    greedy = pb.TokenLogprob(token_id=3, logprob=-0.1, top=[pb.TopLogprob(token_id=3, logprob=-0.1)])
    unranked = pb.TokenLogprob(token_id=9, logprob=-1.0)  # logprobs: 0
    logprobs = CompletionFormat().choice("abc", [sampled, greedy, unranked], None)["logprobs"]
    assert logprobs["top_logprobs"] == [
        {"token_id:3": -0.1, "token_id:7": -2.5},
        {"token_id:3": -0.1},
        {"token_id:9": -1.0},
    ]


@pytest.mark.parametrize("logprobs", [False, True])
def test_a_stream_has_no_empty_deltas(logprobs):
    """Tokens whose text the pod holds back (it may be a stop string's start) say nothing to the
    client: OpenAI's streams carry content in every chunk between the first and the last, and
    naive clients concatenate `delta.content` until `finish_reason`. With logprobs they are sent."""
    reply = Reply(ChatFormat(), Call(BASE, stream=True, include_usage=False, logprobs=logprobs), "r")
    held = pb.Chunk(token_ids=[5], text="", logprobs=[pb.TokenLogprob(token_id=5, logprob=-1.0)])
    messages = [pb.Chunk(token_ids=[4], text=""), held, pb.Chunk(token_ids=[6], text="ab")]
    deltas = [c["choices"][0]["delta"] for m in messages
              for c in reply.chunks(0, 0, pb.GenerateResponse(chunk=m))]  # fmt: skip
    middle = [{"content": ""}] if logprobs else []
    assert deltas == [{"role": "assistant", "content": ""}, *middle, {"content": "ab"}]


def test_a_body_nested_too_deep_for_the_parser_is_a_400():
    """JSON nested past Python's recursion limit is a client's bad body, not a server error (a
    500 the SDKs retry, logged with a traceback per request)."""

    async def run() -> httpx.Response:
        async with openai_client_of(_Servicer(), BASE) as client:
            url = str(client.base_url) + "completions"
            async with httpx.AsyncClient() as http:
                return await http.post(url, content=b"[" * 100_000 + b"]" * 100_000)

    answer = asyncio.run(run())
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["code"] == "INVALID_ARGUMENT" and "nested" in error["message"]


class _Answering:
    """A Generation servicer that answers "Hi." and stops."""

    async def Generate(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.GenerateResponse]:
        yield pb.GenerateResponse(chunk=pb.Chunk(text="Hi."))
        yield pb.GenerateResponse(final=pb.Final(finish_reason=pb.FINISH_REASON_STOP, usage=pb.Usage()))


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("chat/completions", '{"messages": [{"role": "user", "content": "a \\ud83d"}]}'),
        ("responses", '{"input": "cut inside an emoji \\ud83d"}'),
        ("responses", '{"input": "Hi", "metadata": {"k": "\\ud83d"}}'),
    ],
)
def test_a_lone_surrogate_escape_in_the_body_is_a_400(path, body):
    """`\\ud83d` alone is valid JSON syntax but no text (what JavaScript's JSON.stringify writes
    for a string cut inside an emoji): it failed the request's encoding to the pod, or the
    response's after the model had run (a restated `metadata`), as a 500 the SDKs retry. A
    surrogate pair (what `ensure_ascii` writes for an emoji) is text, and is served."""

    async def run(raw: str) -> httpx.Response:
        async with openai_client_of(_Answering(), BASE) as client, httpx.AsyncClient() as http:
            return await http.post(str(client.base_url) + path, content=raw.encode())

    answer = asyncio.run(run(body))
    assert answer.status_code == 400, answer.text
    assert "surrogate" in answer.json()["error"]["message"]
    paired = asyncio.run(run(body.replace("\\ud83d", "\\ud83d\\ude00")))
    assert paired.status_code == 200, paired.text


def test_a_chat_without_max_tokens_runs_to_the_context():
    """OpenAI's chat (and vLLM's) generate to EOS or the context when neither max_completion_tokens
    nor max_tokens is given; the engine's default of 256 would cut every long answer of a client
    that leaves them out (LangChain's ChatOpenAI does) at 256 tokens. The engine ends a request at
    its context whatever max_tokens says, so the largest the field holds means "to the context"."""
    req, _ = http_chat_request({"messages": QUESTION}, {BASE})
    assert req.max_tokens == 2**31 - 1
    req, _ = http_completion_request({"prompt": "Hi"}, {BASE})  # the engine's 256 (OpenAI's: 16)
    assert not req.HasField("max_tokens")


def _answers_on(family: int, host: str, port: int) -> bool:
    """Whether an HTTP GET /health over `family` to host:port is answered."""
    import socket

    with socket.socket(family) as sock:
        sock.settimeout(5)
        try:
            sock.connect((host, port))
        except OSError:
            return False
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        return sock.recv(12).startswith(b"HTTP/1.1")


def test_http_api_on_the_wildcard_host_answers_over_ipv6_and_ipv4():
    """The default --host 0.0.0.0 bound the HTTP API to IPv4 alone (gRPC takes 0.0.0.0 as every
    address of both families): on an IPv6 single-stack cluster the gateway's OpenAI API, and its
    httpGet /health readiness probe (kubelet dials the pod's IPv6 address), were refused while its
    gRPC port answered, so the gateway never became Ready."""
    import socket

    from opentelemetry.trace import get_tracer

    from spindle.openai_api.server import OpenAIServer

    if not socket.has_dualstack_ipv6():
        pytest.skip("no dual-stack IPv6 here")

    async def go() -> tuple[bool, bool]:
        server = OpenAIServer(object(), lambda: ("m",), lambda: True, get_tracer(__name__))
        port = await server.start("0.0.0.0", 0)
        try:
            return await asyncio.gather(
                asyncio.to_thread(_answers_on, socket.AF_INET6, "::1", port),
                asyncio.to_thread(_answers_on, socket.AF_INET, "127.0.0.1", port),
            )
        finally:
            await server.stop()

    assert asyncio.run(go()) == [True, True]
