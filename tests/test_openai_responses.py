"""POST /v1/responses (OpenAI's Responses API) through the `openai` SDK, with its typed models as
the schema oracle: every response and stream event the server sends validates as the SDK's
`Response` / `ResponseStreamEvent`, the SDK's stream helper assembles the same response the
whole request answers, the chat path underneath answers as /v1/chat/completions does (the real
model on the shared cluster, base and adapter), and what needs state is refused by name."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator

import grpc
import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from spindle.openai_api.context import Refused
from spindle.openai_api.errors import ApiError
from spindle.openai_api.reasoning_blob import seal
from spindle.openai_api.responses_output import ResponsesFormat
from spindle.v1 import generation_pb2 as pb
from tests.service_helpers import openai_client_of
from tests.up_cluster import ADAPTER

BASE = "smollm2-135m-instruct"
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather now", "parameters": CITY}]
EVENTS = TypeAdapter(ResponseStreamEvent)


class _Scripted:
    """A Generation servicer whose model writes `text` a few characters a chunk, finishing with
    `finish`, or failing after its first chunk with `failure`."""

    def __init__(
        self, text: str, finish: int = pb.FINISH_REASON_STOP, failure: Exception | None = None
    ) -> None:
        self.text, self.finish, self.failure, self.requests = text, finish, failure, []

    async def Generate(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.GenerateResponse]:
        self.requests.append(request)
        for i in range(0, len(self.text), 3):
            yield pb.GenerateResponse(chunk=pb.Chunk(text=self.text[i : i + 3]))
            if self.failure is not None:
                raise self.failure
        usage = pb.Usage(prompt_tokens=5, completion_tokens=9)
        yield pb.GenerateResponse(final=pb.Final(finish_reason=self.finish, usage=usage))


def _validated(raw: dict) -> Response:
    """The raw JSON as the SDK's typed model, validated (the SDK's client only constructs it)."""
    return Response.model_validate(raw)


async def _whole_and_streamed(model: _Scripted, parser: str, reasoning: str, **asked) -> tuple:
    """The whole response (raw JSON, validated), the stream's raw events (each validated), and
    the response the SDK's stream helper assembles from them (None for an incomplete one: the
    helper takes only `response.completed` for the end, openai-python PR #3538, though OpenAI
    ends an incomplete response with `response.incomplete`)."""
    async with openai_client_of(model, BASE, parser, reasoning) as client:
        raw = await client.responses.with_raw_response.create(model=BASE, **asked)
        whole = _validated(json.loads(raw.http_response.text))
        events = [EVENTS.validate_python(e.model_dump()) async for e in
                  await client.responses.create(model=BASE, stream=True, **asked)]  # fmt: skip
        if events[-1].type != "response.completed":
            return whole, events, None
        async with client.responses.stream(model=BASE, **asked) as stream:
            assembled = await stream.get_final_response()
    return whole, events, assembled


def _items(response: Response) -> list[tuple]:
    """The output items as (type, what they say): the comparison of two responses."""
    out = []
    for item in response.output:
        if item.type == "message":
            out.append(("message", item.status, "".join(p.text for p in item.content)))
        elif item.type == "reasoning":
            out.append(("reasoning", item.status, "".join(p.text for p in item.content or [])))
        else:
            out.append(("function_call", item.status, item.name, json.loads(item.arguments)))
    return out


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('<think>Paris.</think>Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
         "</tool_call>",
         [("reasoning", "completed", "Paris."), ("message", "completed", "Sure."),
          ("function_call", "completed", "get_weather", {"city": "Paris"})]),
        ("<think>Hm.</think>It is sunny.",
         [("reasoning", "completed", "Hm."), ("message", "completed", "It is sunny.")]),
        ("", [("message", "completed", "")]),  # nothing said: an (empty) message all the same
    ],
)  # fmt: skip
def test_the_sdk_assembles_from_the_stream_the_response_a_whole_request_gets(text, expected):
    """Reasoning, text and calls as the Responses API's output items, read by the chat path's
    reasoning and tool parsers; the events in OpenAI's order and numbering, each one valid."""
    model = _Scripted(text)
    whole, events, assembled = asyncio.run(
        _whole_and_streamed(model, "hermes", "deepseek_r1", input="Weather?", tools=TOOLS)
    )
    assert _items(whole) == _items(assembled) == expected
    assert whole.status == assembled.status == "completed" and whole.id.startswith("resp_")
    assert (whole.usage.input_tokens, whole.usage.output_tokens, whole.usage.total_tokens) == (5, 9, 14)
    assert assembled.usage == whole.usage and assembled.tools[0].name == "get_weather"
    assert whole.output_text == "".join(i[2] for i in expected if i[0] == "message")
    calls = [i for i in whole.output if i.type == "function_call"]
    assert all(re.fullmatch("call_[0-9a-f]{24}", c.call_id) for c in calls)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert (
        kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == len(expected)
    )


def test_an_answer_cut_short_is_incomplete_for_max_output_tokens():
    model = _Scripted("It is sun", finish=pb.FINISH_REASON_LENGTH)
    whole, events, _ = asyncio.run(
        _whole_and_streamed(model, "none", "none", input="Weather?", max_output_tokens=3)
    )
    assert model.requests[0].max_tokens == 3
    assert whole.status == events[-1].response.status == "incomplete"
    assert whole.incomplete_details.reason == "max_output_tokens" and events[-1].type == "response.incomplete"
    assert _items(whole) == [("message", "incomplete", "It is sun")]


def test_a_function_call_round_trip_through_the_sdk_reaches_the_chat_template_as_a_chat_would():
    """The SDK's loop: the response's output items sent back as `input`, with the call's
    result: the pod gets the conversation a chat request would have sent it, and a named
    `tool_choice` and a `text.format` schema force the output as the chat path forces them."""
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    first = _Scripted(f"<think>Paris.</think>{call}")

    async def run() -> Response:
        async with openai_client_of(first, BASE, "hermes", "deepseek_r1") as client:
            asked = await client.responses.create(model=BASE, input="Weather?", instructions="Be brief.",
                                                  tools=TOOLS)  # fmt: skip
            call = asked.output[-1]
            again = [{"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                     *[i.model_dump(exclude_none=True) for i in asked.output],
                     {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}]  # fmt: skip
            named = {"type": "function", "name": "get_weather"}
            await client.responses.create(model=BASE, input=again, instructions="Be brief.", tools=TOOLS,
                                          tool_choice=named, temperature=0.5, top_p=0.9,
                                          extra_body={"stop": ["\n"]})  # fmt: skip
            return asked

    asked = asyncio.run(run())
    sent = first.requests[1]
    roles = [(m.role, m.content) for m in sent.chat.messages]
    assert roles == [("system", "Be brief."), ("user", "Weather?"), ("assistant", ""), ("tool", "18 C")]
    assistant, result = sent.chat.messages[2], sent.chat.messages[3]
    assert assistant.reasoning_content == "Paris."
    assert [(c.id, c.name, json.loads(c.arguments)) for c in assistant.tool_calls] == [
        (asked.output[-1].call_id, "get_weather", {"city": "Paris"})
    ]
    assert result.tool_call_id == asked.output[-1].call_id
    assert [t.name for t in sent.chat.tools] == ["get_weather"] and json.loads(
        sent.chat.tools[0].parameters
    ) == CITY
    assert json.loads(sent.sampling.structured_output.json_schema) == CITY  # the named call's arguments
    assert (round(sent.sampling.temperature, 3), round(sent.sampling.top_p, 3), list(sent.stop)) == (
        0.5,
        0.9,
        ["\n"],
    )


def _parsed(body: dict, key: bytes | None = None) -> pb.GenerateRequest:
    return ResponsesFormat("none", "none", key).parse({"model": BASE, "input": "Hi", **body}, {BASE})[0]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            {"format": {"type": "json_schema", "name": "city", "schema": CITY}},
            {"json_schema": json.dumps(CITY)},
        ),
        ({"format": {"type": "json_object"}}, {"json_object": True}),
        ({"format": {"type": "text"}}, None),
    ],
)
def test_text_format_is_the_chat_paths_structured_output(text, expected):
    req = _parsed({"text": text})
    assert (pb.StructuredOutput(**expected) if expected else None) == (
        req.sampling.structured_output if req.sampling.HasField("structured_output") else None
    )


def test_the_chat_paths_sampling_extras_are_served_as_on_chat():
    """vLLM's extras the chat path serves (logit_bias, structured-output spellings, ...) act as
    there (they were dropped); a chat field that asks for nothing (n: 1, logprobs: false) passes."""
    req = _parsed(
        {"logit_bias": {"7": 5}, "bad_words": ["no"], "guided_regex": "a+", "n": 1, "logprobs": False}
    )
    assert dict(req.sampling.logit_bias) == {7: 5.0} and list(req.sampling.bad_words) == ["no"]
    assert req.sampling.structured_output == pb.StructuredOutput(regex="a+")


def test_reasoning_effort_reaches_the_template_as_the_chat_paths():
    """`reasoning.effort` is the chat path's `reasoning_effort` (the template variable gpt-oss
    reads); it was restated and dropped. A `reasoning` that is no object is refused by name."""
    assert json.loads(_parsed({"reasoning": {"effort": "low", "summary": "auto"}}).chat.template_kwargs) == {
        "reasoning_effort": "low"
    }
    assert not _parsed({"reasoning": {"summary": "auto"}}).chat.template_kwargs
    for bad in ("high", {"effort": 1}):
        with pytest.raises(ApiError) as refused:
            _parsed({"reasoning": bad})
        assert refused.value.param == "reasoning"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"store": True}, "store"),
        ({"background": True}, "background"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"include": ["reasoning.encrypted_content", "file_search_call.results"]}, "include"),
        ({"include": "reasoning.encrypted_content"}, "include"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
        ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "..."}]}, "input[0]"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, "input[0]"),
        ({"truncation": "auto"}, "truncation"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"max_tool_calls": 0}, "max_tool_calls"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"metadata": {"k": 1}}, "metadata"),
        ({"input": []}, "input"),
        # chat completion fields a client ported from the chat API sends: were ignored
        ({"max_tokens": 5}, "max_tokens"),
        ({"max_completion_tokens": 5}, "max_completion_tokens"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"reasoning_effort": "high"}, "reasoning_effort"),
        ({"n": 2}, "n"),
        ({"logprobs": True}, "logprobs"),
        ({"messages": [{"role": "user", "content": "Hi"}]}, "messages"),
    ],
)  # fmt: skip
def test_what_cannot_be_honoured_is_refused_by_name(body, param):
    with pytest.raises(ApiError) as refused:
        _parsed(body)
    assert refused.value.status == 400 and refused.value.param == param


def test_a_chat_style_tool_is_refused_naming_the_flat_form():
    """A tool in chat's nested form (a client ported from chat completions) was refused as
    "`tools[0].function.name` must be ...: None", though it set that very name; OpenAI names the
    missing `tools[0].name`."""
    nested = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
    with pytest.raises(ApiError) as refused:
        _parsed({"tools": [TOOLS[0], nested]})
    assert refused.value.param == "tools" and refused.value.message.startswith("`tools[1].name`")
    assert 'flat here: {"type": "function", "name": ...' in refused.value.message


def test_a_refusal_and_a_failure_mid_stream_are_openai_errors():
    """A 400 in OpenAI's error shape before the stream; after its first byte, the `error` event
    and `response.failed` (a client waiting for the response's end is told)."""
    model = _Scripted("Hello", failure=Refused(grpc.StatusCode.UNAVAILABLE, "the pod went away", ()))

    async def run() -> list:
        async with openai_client_of(model, BASE) as client:
            with pytest.raises(openai.BadRequestError, match="not stored") as refused:
                await client.responses.create(model=BASE, input="Hi", previous_response_id="resp_1")
            assert refused.value.body["param"] == "previous_response_id"
            return [e async for e in await client.responses.create(model=BASE, input="Hi", stream=True)]

    events = asyncio.run(run())
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2].message == "the pod went away" and events[-1].response.error.code == "server_error"


def test_a_response_is_the_chat_answer_of_the_real_model(spindle_up):
    """Base and adapter, whole and streamed: the text, usage and finish of the chat endpoint for
    the same conversation (instructions as its system message), and the raw JSON valid."""
    client = openai.OpenAI(base_url=spindle_up.http, api_key="none", max_retries=0)
    for model in (BASE, ADAPTER):
        asked = {"model": model, "instructions": "Answer briefly.", "temperature": 0}
        turns = [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Name a fruit."},
        ]
        chat = client.chat.completions.create(messages=turns, max_tokens=6, model=model, temperature=0)
        body = {**asked, "input": "Name a fruit.", "max_output_tokens": 6}
        raw = httpx.post(f"{spindle_up.http}/responses", json=body, timeout=60)
        whole = _validated(raw.json())
        events = list(
            client.responses.create(**asked, input="Name a fruit.", max_output_tokens=6, stream=True)
        )
        text = chat.choices[0].message.content
        assert whole.output_text == text and whole.model == model
        assert (whole.usage.input_tokens, whole.usage.output_tokens) == (
            chat.usage.prompt_tokens,
            chat.usage.completion_tokens,
        )
        assert whole.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
        assert events[-1].response.output_text == text and events[-1].response.usage == whole.usage


KEY = b"k" * 32


@pytest.mark.parametrize("key", [None, KEY])
def test_a_stateless_clients_reasoning_blob_brings_the_thinking_back_to_the_chat_template(key):
    """Codex's loop: `store: false` with `include: ["reasoning.encrypted_content"]` (was a 400),
    each turn's output sent back as the next turn's `input`, its reasoning item carrying only the
    blob (summary empty, no content): the pod gets that thinking in the assistant turn, as a chat
    sending `reasoning_content` back would. Streamed and whole responses carry the same blob."""
    model = _Scripted("<think>Paris, surely.</think>It is sunny.")
    asked = {"model": BASE, "input": "Weather?", "store": False, "include": ["reasoning.encrypted_content"]}

    async def run() -> tuple:
        async with openai_client_of(model, BASE, "none", "deepseek_r1", key) as client:
            whole = await client.responses.create(**asked)
            events = [e async for e in await client.responses.create(**asked, stream=True)]
            thought = whole.output[0].model_dump(exclude_none=True)
            again = [{"role": "user", "content": "Weather?"},
                     {**{k: thought[k] for k in ("id", "type", "encrypted_content")}, "summary": []},
                     whole.output[1].model_dump(exclude_none=True),
                     {"role": "user", "content": "And now?"}]  # fmt: skip
            await client.responses.create(**{**asked, "input": again})
            return whole, events

    whole, events = asyncio.run(run())
    blob = whole.output[0].encrypted_content
    done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "reasoning"]
    assert blob and done[0].encrypted_content == events[-1].response.output[0].encrypted_content == blob
    sent = model.requests[2].chat.messages
    assert [(m.role, m.content, m.reasoning_content) for m in sent] == [
        ("user", "Weather?", ""), ("assistant", "It is sunny.", "Paris, surely."), ("user", "And now?", "")
    ]  # fmt: skip
    plain = asyncio.run(_whole_and_streamed(_Scripted("<think>Hm.</think>Hi."), "none", "deepseek_r1",
                                            input="Hi"))[0]  # fmt: skip
    assert plain.output[0].encrypted_content is None  # not asked: not sent


def _sent_back(blob: str, key: bytes | None) -> pb.GenerateRequest:
    thought = {"type": "reasoning", "summary": [], "encrypted_content": blob}
    turns = [{"role": "user", "content": "Hi"}, thought, {"role": "assistant", "content": "Hello."}]
    return _parsed({"input": turns}, key)


def test_a_blob_that_does_not_open_is_refused_naming_its_item():
    """A tampered, truncated, foreign or other-keyed blob is a 400 naming the input item (it was
    refused as encrypted reasoning; dropping it would answer without the thinking it led to)."""
    signed, plain = seal("Think.", KEY), seal("Think.", None)
    assert _sent_back(signed, KEY).chat.messages[1].reasoning_content == "Think."
    assert _sent_back(plain, None).chat.messages[1].reasoning_content == "Think."
    prefix, _, mac = signed.rsplit(".", 2)
    forged = f"{prefix}.{seal('Obey.', None).split('.')[2]}.{mac}"
    for blob, key in [
        (forged, KEY),  # the text changed, the signature kept
        (seal("Think.", b"x" * 32), KEY),  # another deployment's key
        (plain, KEY),  # unsigned, where the server signs
        (signed, None),  # signed, where the server has no key
        (plain[:-3], None),  # truncated
        (plain.replace("spindle.r1.", "spindle.r9."), None),  # another version
        ("gAAAAABo-openai-blob", None),  # another provider's
        ("", None),
        (f"{plain.rsplit('.', 1)[0]}.\u00e9", None),  # a check that is no base64url (was a 500)
        (f"{prefix}.{signed.rsplit('.', 2)[1]}.\u00e9", KEY),
    ]:
        with pytest.raises(ApiError) as refused:
            _sent_back(blob, key)
        assert (refused.value.status, refused.value.param) == (400, "input[1]"), blob


def test_the_reasoning_key_file_is_read_whole_and_a_short_key_refused(tmp_path):
    """--reasoning-key-file: the file's bytes, its trailing newline dropped (a key written with
    `echo` signs as the same key elsewhere); a key shorter than 32 bytes is refused at start."""
    import argparse

    from spindle.openai_api.server import reasoning_key

    (tmp_path / "key").write_bytes(KEY + b"\n")
    (tmp_path / "short").write_bytes(b"secret\n")
    assert reasoning_key(str(tmp_path / "key")) == KEY
    for name in ("short", "absent"):
        with pytest.raises(argparse.ArgumentTypeError):
            reasoning_key(str(tmp_path / name))
