"""gpt-oss's Harmony format in the OpenAI-compatible API (vLLM's `--reasoning-parser openai_gptoss`
and `--tool-call-parser openai`): the reader that splits the analysis channel (reasoning), the
final and commentary channels (content) and `to=functions.NAME` messages (calls), whole and split
at every position; the pod keeping Harmony's special-token markers for it (a tokenizer with them
added as special, as o200k_harmony has them); the `openai` SDK reading chat completions and the
Responses API from a scripted model; and a call's turn sent back through a gpt-oss-like chat
template, with transformers' `apply_chat_template` as the oracle."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from model_service.engine.detokenizer import IncrementalDetokenizer
from model_service.models.tokenizer import Tokenizer
from model_service.pod import wire
from spindle.openai_api.reasoning_parsers import READERS
from spindle.openai_api.requests import chat_request
from spindle.openai_api.tool_parsers import Arguments, CallStart, HarmonyReader, OpenAIReader, Thought
from spindle.v1 import generation_pb2 as pb
from tests.service_helpers import openai_client_of
from tests.test_openai_responses import _items, _whole_and_streamed
from tests.test_tool_calling import _byte_tokenizer, pod_prompt_ids

BASE = "m"
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
MARKERS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
# What gpt-oss writes after the template's `<|start|>assistant` (its stop tokens <|call|> and
# <|return|> end the output, their text dropped): thinking, then an answer or a call.
ANSWER = (
    "<|channel|>analysis<|message|>User asks. Easy.<|end|><|start|>assistant<|channel|>final<|message|>Sunny."
)
CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}')  # fmt: skip
PARIS = [CallStart("get_weather"), Arguments('{"city":"Paris"}')]


def _merged(pieces: list) -> list:
    """Adjacent reasoning, content or arguments joined: what a client ends up with."""
    out: list = []
    for p in pieces:
        if out and type(p) is type(out[-1]) and not isinstance(p, CallStart):
            out[-1] = out[-1] + p if isinstance(p, str) else type(p)(out[-1].text + p.text)
        else:
            out.append(p)
    return out


CASES = [
    (ANSWER, [Thought("User asks. Easy."), "Sunny."]),
    (CALL, [Thought("Need the weather."), *PARIS]),
    # the recipient in the header before the channel (as the chat template renders a call), the
    # first message's header right after the prompt's `<|start|>assistant`; a second call
    (' to=functions.get_weather<|channel|>commentary json<|message|>{"city":"Paris"}<|call|>'
     "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}",
     [*PARIS, CallStart("get_time"), Arguments("{}")]),
    # a preamble (commentary, no recipient) is content; two analysis messages read as one, parted
    ("<|channel|>analysis<|message|>A.<|end|><|start|>assistant<|channel|>analysis<|message|>B.<|end|>"
     "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>"
     'commentary to=functions.get_weather<|constrain|>json<|message|>{"city":"Paris"}',
     [Thought("A.\nB."), "Checking.", *PARIS]),
    # a built-in tool's call (browser, python) is reasoning, as vLLM reads it
    ('<|channel|>analysis to=browser.search code<|message|>{"query": "x"}<|end|>'
     "<|start|>assistant<|channel|>final<|message|>Done.<|return|>",
     [Thought('{"query": "x"}'), "Done."]),
    # cut by max_tokens: in the thinking (all reasoning), in a header (nothing of it), in a call
    ("<|channel|>analysis<|message|>Hmm, Paris", [Thought("Hmm, Paris")]),
    ("<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant<|channel|>fin", [Thought("Hmm.")]),
    ("<|chan", []),
    ('<|channel|>commentary to=functions.get_weather json<|message|>{"ci',
     ['<|channel|>commentary to=functions.get_weather json<|message|>{"ci']),
    # markup-like text inside a message is its text; an output that is no Harmony at all is content
    ("<|channel|>final<|message|>a <|en b <|mess", ["a <|en b <|mess"]),
    ("Just text.", ["Just text."]),
    ("", []),
]  # fmt: skip


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_the_reader_reads_harmony_whole_and_split_at_every_position(text, expected):
    assert _merged(READERS["openai_gptoss"]().read(text)) == expected
    for at in range(len(text) + 1):
        reader = HarmonyReader()
        sent = reader.feed(text[:at]) + reader.feed(text[at:]) + reader.finish()
        assert _merged(sent) == expected, at
        assert all(p.text if isinstance(p, (Thought, Arguments)) else p for p in sent)  # no empty deltas
    for size in (1, 3, 7):
        reader, sent = HarmonyReader(), []
        for i in range(0, len(text), size):
            sent += reader.feed(text[i : i + size])
        assert _merged(sent + reader.finish()) == expected, size


def test_calls_not_read_are_content_and_the_tool_parser_alone_drops_the_thinking():
    """No tools (or tool_choice "none"): a call the model writes anyway is content, as written.
    `--tool-call-parser openai` without the reasoning parser: the analysis channel is dropped
    (vLLM's parser keeps the final channel), never sent as content."""
    assert _merged(HarmonyReader(calls=False).read(CALL)) == [
        Thought("Need the weather."),
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city":"Paris"}',
    ]
    assert _merged(OpenAIReader().read(CALL)) == PARIS and _merged(OpenAIReader().read(ANSWER)) == ["Sunny."]


def _harmony_tokenizer():
    """A byte tokenizer with Harmony's markers added as special tokens (o200k_harmony's are)."""
    hf = _byte_tokenizer()
    hf.add_special_tokens({"additional_special_tokens": MARKERS})
    return hf


@pytest.mark.parametrize(
    ("body", "reasoning", "tool_parser", "written", "expected"),
    [
        ({}, "openai_gptoss", "none", ANSWER, [Thought("User asks. Easy."), "Sunny."]),
        ({"tools": TOOLS}, "openai_gptoss", "openai", CALL, [Thought("Need the weather."), *PARIS]),
        ({"tools": TOOLS}, "none", "openai", CALL, PARIS),
    ],
)
def test_the_pod_decodes_harmonys_special_tokens_for_the_parsers(
    body, reasoning, tool_parser, written, expected
):
    """Harmony's markers are special tokens, which the pod skips by default: the answer would read
    "analysisUser asks. Easy.assistantfinalSunny." (all content, the thinking shown to the user).
    Either parser asks the pod to keep them, as vLLM does for gpt-oss."""
    hf = _harmony_tokenizer()
    ids = hf.encode(written, add_special_tokens=False)
    assert len(ids) < len(written) - 10  # the markers are one token each
    req, _ = chat_request({"messages": ASK, **body}, {BASE}, tool_parser, reasoning)
    params = wire.sampling_params(pb.GenerateRequest.FromString(req.SerializeToString()))
    detokenizer = IncrementalDetokenizer(Tokenizer(hf), hf.encode("Hi", add_special_tokens=False),
                                         params.skip_special_tokens)  # fmt: skip
    decoded = "".join(detokenizer.push(t) for t in ids)
    reader = HarmonyReader() if reasoning != "none" else OpenAIReader()
    assert decoded == written and _merged(reader.read(decoded)) == expected


class _Scripted:
    """A Generation servicer whose model writes `text`, `size` characters a chunk."""

    def __init__(self, text: str, size: int = 3) -> None:
        self.text, self.size, self.requests = text, size, []

    async def Generate(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.GenerateResponse]:
        self.requests.append(request)
        for i in range(0, len(self.text), self.size):
            yield pb.GenerateResponse(chunk=pb.Chunk(text=self.text[i : i + self.size]))
        usage = pb.Usage(prompt_tokens=5, completion_tokens=9)
        yield pb.GenerateResponse(final=pb.Final(finish_reason=pb.FINISH_REASON_STOP, usage=usage))


def _asked(text: str, size: int, reasoning: str = "openai_gptoss", **asked) -> tuple:
    """The whole answer, and the stream accumulated: reasoning, content, calls, finish reason
    (`reasoning`: the server's --reasoning-parser; its --tool-call-parser is openai)."""

    async def run() -> tuple:
        async with openai_client_of(_Scripted(text, size), BASE, "openai", reasoning) as client:
            whole = await client.chat.completions.create(model=BASE, messages=ASK, **asked)
            got = {"reasoning": "", "content": "", "calls": {}, "finish": None}
            async for chunk in await client.chat.completions.create(
                model=BASE, messages=ASK, stream=True, **asked
            ):
                delta = chunk.choices[0].delta
                got["reasoning"] += getattr(delta, "reasoning_content", None) or ""
                got["content"] += delta.content or ""
                for c in delta.tool_calls or []:
                    entry = got["calls"].setdefault(c.index, {"name": c.function.name, "arguments": ""})
                    entry["arguments"] += c.function.arguments or ""
                got["finish"] = chunk.choices[0].finish_reason or got["finish"]
            return whole.choices[0], got

    return asyncio.run(run())


@pytest.mark.parametrize("size", [1, 5])
def test_the_sdk_reads_reasoning_content_and_the_answer(size):
    choice, got = _asked(ANSWER, size)
    assert (choice.message.reasoning_content, choice.message.content, choice.finish_reason) == (
        "User asks. Easy.",
        "Sunny.",
        "stop",
    )
    assert (got["reasoning"], got["content"], got["calls"], got["finish"]) == (
        "User asks. Easy.",
        "Sunny.",
        {},
        "stop",
    )


@pytest.mark.parametrize("size", [1, 5])
def test_the_sdk_reads_the_call_as_tool_calls(size):
    choice, got = _asked(CALL, size, tools=TOOLS)
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert choice.message.reasoning_content == "Need the weather." and choice.message.content is None
    assert choice.finish_reason == got["finish"] == "tool_calls"
    assert (got["reasoning"], got["content"]) == ("Need the weather.", "")
    assert [(c["name"], json.loads(c["arguments"])) for c in got["calls"].values()] == [
        ("get_weather", {"city": "Paris"})
    ]


@pytest.mark.parametrize("asked", [{}, {"tools": TOOLS, "tool_choice": "none"}])
def test_the_tool_parser_alone_reads_a_chat_without_calls_as_harmony(asked):
    """`--tool-call-parser openai` without a reasoning parser: a chat without tools (or with
    `tool_choice` "none") is Harmony all the same, its final channel the content and its analysis
    dropped, as with tools; it was text, its markers skipped ("analysisUser asks.
    Easy.assistantfinalSunny.")."""
    choice, got = _asked(ANSWER, 5, reasoning="none", **asked)
    assert (choice.message.content, got["content"], got["reasoning"]) == ("Sunny.", "Sunny.", "")
    req, _ = chat_request({"messages": ASK, **asked}, {BASE}, "openai", "none")
    assert req.sampling.skip_special_tokens is False
    forced, _ = chat_request({"messages": ASK, "response_format": {"type": "json_object"}}, {BASE}, "openai")
    assert not forced.sampling.HasField("skip_special_tokens")  # a schema's output from its first token


def test_the_responses_api_shows_the_reasoning_item_and_the_function_call():
    tools = [{"type": "function", "name": "get_weather", "parameters": CITY}]
    whole, _, assembled = asyncio.run(
        _whole_and_streamed(_Scripted(CALL), "openai", "openai_gptoss", input="Weather?", tools=tools)
    )
    expected = [("reasoning", "completed", "Need the weather."),
                ("function_call", "completed", "get_weather", {"city": "Paris"})]  # fmt: skip
    assert _items(whole) == _items(assembled) == expected
    whole, _, assembled = asyncio.run(
        _whole_and_streamed(_Scripted(ANSWER), "openai", "openai_gptoss", input="?")
    )
    assert (
        _items(whole)
        == _items(assembled)
        == [
            ("reasoning", "completed", "User asks. Easy."),
            ("message", "completed", "Sunny."),
        ]
    )


# gpt-oss's chat template as it renders an assistant's call turn (the parts this test uses): the
# turn's reasoning, read from `thinking` (not `reasoning_content`), before its call; the call with
# its recipient in the header and its arguments written with tojson; the result as the function's.
GPT_OSS_TEMPLATE = """{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}
{%- if message.content and message.thinking %}{{ raise_exception("Cannot pass both content and thinking") }}
{%- elif message.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ message.thinking }}<|end|>
{%- endif %}{% set call = message.tool_calls[0].function %}<|start|>assistant to=functions.{{ call.name }}
{{- "<|channel|>commentary json<|message|>" }}{{ call.arguments | tojson }}<|call|>
{%- elif message.role == "assistant" %}<|start|>assistant<|channel|>final<|message|>{{ message.content }}
{{- "<|end|>" }}
{%- elif message.role == "tool" %}<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>
{{- message.content | tojson }}<|end|>
{%- else %}<|start|>{{ message.role }}<|message|>{{ message.content }}<|end|>{% endif %}
{%- endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"""


def test_a_call_turn_sent_back_renders_its_thinking_through_a_gpt_oss_template():
    """The SDK's answer (reasoning_content and the call) sent back with the call's result: gpt-oss's
    template renders the turn's reasoning before its call (OpenAI asks that it be sent back) from
    the message's `thinking`, which transformers fills from `reasoning_content`, and the call with
    its arguments as an object: the pod renders what transformers renders of the Harmony form."""
    choice, _ = _asked(CALL, 4, tools=TOOLS)
    answer = {"role": "assistant", "content": choice.message.content,
              "reasoning_content": choice.message.reasoning_content,
              "tool_calls": [c.model_dump() for c in choice.message.tool_calls]}  # fmt: skip
    turns = [*ASK, answer, {"role": "tool", "tool_call_id": answer["tool_calls"][0]["id"], "content": "18 C"}]
    hf = _harmony_tokenizer()
    hf.chat_template = GPT_OSS_TEMPLATE
    ids = pod_prompt_ids(hf, turns, TOOLS, "openai", "openai_gptoss")
    call = {**answer["tool_calls"][0], "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    harmony = {"role": "assistant", "content": "", "thinking": "Need the weather.", "tool_calls": [call]}
    expected = hf.apply_chat_template([*ASK, harmony, turns[2]], tools=TOOLS, add_generation_prompt=True)
    assert ids == list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert (
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant to=functions.get_weather"
        in (hf.decode(ids, skip_special_tokens=False))
    )
