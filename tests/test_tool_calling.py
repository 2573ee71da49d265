"""Tool calling in the OpenAI-compatible API: the parsers that read calls out of a model's text
(whole and in any streamed split), the request's tools and tool_choice on the gRPC request, the
pod's chat template rendering them as transformers does, and the `openai` SDK reading the calls
of a scripted model through the HTTP server. The real model's forced calls (tool_choice
"required" or named) and a round trip run in test_openai_http.py, on the shared cluster."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator

import openai
import pytest

from model_service.engine.detokenizer import IncrementalDetokenizer
from model_service.engine.requests import PromptReader
from model_service.errors import InvalidRequestError
from model_service.models.tokenizer import Tokenizer
from model_service.pod import wire
from spindle import cli
from spindle.openai_api.errors import ApiError
from spindle.openai_api.requests import chat_request
from spindle.openai_api.tool_parsers import (
    PARSERS,
    Arguments,
    CallStart,
    HermesReader,
    Llama3JsonReader,
    MistralReader,
    NamedReader,
    PythonicReader,
    Reader,
    RequiredReader,
)
from spindle.v1 import generation_pb2 as pb
from tests.service_helpers import openai_client_of

BASE = "m"
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather now", "parameters": CITY},
    },
    {"type": "function", "function": {"name": "get_time"}},
]
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
PARIS = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}


def _fed(reader: Reader, text: str, size: int) -> list:
    """The pieces of `text` fed `size` characters at a time, merged as a client accumulates them."""
    pieces = []
    for i in range(0, len(text), size):
        pieces += reader.feed(text[i : i + size])
    return _merged(pieces + reader.finish())


def _merged(pieces: list) -> list:
    """Adjacent content joined, each call's arguments joined: what a client ends up with."""
    out: list = []
    for p in pieces:
        if isinstance(p, str) and out and isinstance(out[-1], str):
            out[-1] += p
        elif isinstance(p, Arguments) and out and isinstance(out[-1], Arguments):
            out[-1] = Arguments(out[-1].text + p.text)
        else:
            out.append(p)
    return out


def _call(name: str, arguments: str) -> list:
    return [CallStart(name), Arguments(arguments)]


PARIS_CALL, TIME_CALL = _call("get_weather", '{"city": "Paris"}'), _call("get_time", "{}")
# Mistral's calls after `[TOOL_CALLS]`: a JSON list before tokenizer v11, `name[ARGS]{...}` per
# call from v11 on (a `[CALL_ID]` may come before `[ARGS]`), text before the calls kept
MISTRAL = [
    (f'Let me look.\n[TOOL_CALLS] [{WEATHER}, {{"name": "get_time", "arguments": {{}}}}]',
     ["Let me look.", *PARIS_CALL, *TIME_CALL]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}', [*PARIS_CALL, *TIME_CALL]),
    ('Sure.[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris"}\nDone.',
     ["Sure.", *PARIS_CALL, "Done."]),
    (f"[TOOL_CALLS]{WEATHER}", PARIS_CALL),  # one call, not in a list
    ('[TOOL_CALLS]f[ARGS]{"s": "[ARGS] é", "n": [1, {"k": null}]}',
     _call("f", '{"s": "[ARGS] é", "n": [1, {"k": null}]}')),
    # malformed: the model's text, markup and all (a part the next `[TOOL_CALLS]` closes, alone)
    *[(text, [text]) for text in (
        '[TOOL_CALLS]get_weather[ARGS]{"city": oops}', 'x [TOOL_CALLS] [{"arguments": {}}]',
        "[TOOL_CALLS]get_weather", '[TOOL_CALLS] [{"name": "get_wea', "[TOOL_CALLS]",
        '[TOOL_CALLS]get weather[ARGS]{}', '[TOOL_CALLS]f[ARGS]["a"]', "[TOOL_CALLS] []")],
    ('[TOOL_CALLS]get_weather[ARGS]{"ci[TOOL_CALLS]get_time[ARGS]{}',
     ['[TOOL_CALLS]get_weather[ARGS]{"ci', *TIME_CALL]),
    # no call: the text exactly, and a "[" that is not the markup
    ("  a [TOOL b [1] \n", ["  a [TOOL b [1] \n"]),
    ("ends with [TOOL_CALL", ["ends with [TOOL_CALL"]),
]  # fmt: skip
# Llama 3.2 / 4's Python list of calls, read with `ast` (literals only, never run)
PYTHONIC = [
    ('[get_weather(city="Paris"), get_time()]', [*PARIS_CALL, *TIME_CALL]),
    ("\n[f(a=-1, b=[1.5, (2, 'x')], c={'k': None, 't': True}, d=\"é\", e=+2)]\n",
     _call("f", '{"a": -1, "b": [1.5, [2, "x"]], "c": {"k": null, "t": true}, "d": "é", "e": 2}')),
    # not all calls of literals: the model's text (the operation is parsed, never run)
    *[(text, [text]) for text in (
        "[1] See the docs.", "Sure: [f(a=1)]", "[f(a=1)] and more", "[f(1)]", "[f(a=x)]",
        "[f(a=__import__('os').system('x'))]", "[f(**k)]", "[f(a=1e999)]", "[f(a=b'x')]", "[f(a={1: 2})]",
        "[m.f(a=1)]", '[get_weather(city="Pa', "[]", "[f(a=1), 2]", "[f(a=1)][0]", "[ [f(a=1)] ]", "[" * 300,
        "  ", "[f", "[f(a=1, a=2)]")],
]  # fmt: skip


@pytest.mark.parametrize(
    ("make", "text", "expected"),
    [
        # several calls, text before and after, whitespace between the blocks dropped but for what
        # parted the text before from them (the content reads "Let me look.\nDone.", not glued)
        (HermesReader, f"Let me look.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n"
         '{"name": "get_time", "arguments": {}}\n</tool_call>\nDone.',
         ["Let me look.", *_call("get_weather", '{"city": "Paris"}'), *_call("get_time", "{}"), "\nDone."]),
        (HermesReader, f"\n<tool_call>{WEATHER}</tool_call> \n Done. ",
         [*_call("get_weather", '{"city": "Paris"}'), "Done."]),
        # a closing tag inside an argument's string does not end the call; one after a block
        # that is no call's closes it (and the calls after it are read)
        (HermesReader, '<tool_call>{"name": "f", "arguments": {"s": "a</tool_call>b"}}</tool_call>',
         _call("f", '{"s": "a</tool_call>b"}')),
        (HermesReader, '<tool_call>{"name": "f", "arguments": {"s": "</tool_call>"}}',
         _call("f", '{"s": "</tool_call>"}')),
        (HermesReader, f"<tool_call>{{oops}}</tool_call> x </tool_call><tool_call>{WEATHER}</tool_call>",
         ["<tool_call>{oops}</tool_call> x </tool_call>", *_call("get_weather", '{"city": "Paris"}')]),
        # no call: the text exactly, whitespace and all, and a "<" that is not the markup
        (HermesReader, "  a < b <tool \n", ["  a < b <tool \n"]),
        # malformed JSON, or no name: the model's text, markup and all, never a 500
        *[(HermesReader, text, [text]) for text in ('x <tool_call>{"name": oops}</tool_call>',
                                                     '<tool_call>{"arguments": {}}</tool_call>')],
        # the output ends inside a block: a whole JSON is a call (vLLM's reading), a cut one is text
        (HermesReader, f"<tool_call>{WEATHER}", _call("get_weather", '{"city": "Paris"}')),
        (HermesReader, '<tool_call>{"name": "get_wea', ['<tool_call>{"name": "get_wea']),
        (HermesReader, "ends with <tool_c", ["ends with <tool_c"]),
        # arguments as a JSON text (some models write them so): passed on as they are
        (HermesReader, '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
         _call("f", '{"a": 1}')),
        (Llama3JsonReader, '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", '
         '"parameters": {}}', [*_call("get_weather", '{"city": "Paris"}'), *_call("get_time", "{}")]),
        (Llama3JsonReader, '<|python_tag|>{"name": "f", "parameters": {"é": 1}}', _call("f", '{"é": 1}')),
        (Llama3JsonReader, "The answer is {x}.", ["The answer is {x}."]),
        *[(Llama3JsonReader, text, [text]) for text in ('{"name": "f", "parameters": {}} and more',
                                                         '[{"name": "get_weather", "parameters": {"ci')],
        (Llama3JsonReader, '{"city": "Paris"}', ['{"city": "Paris"}']),  # JSON, but no call
        *[(MistralReader, text, expected) for text, expected in MISTRAL],
        *[(PythonicReader, text, expected) for text, expected in PYTHONIC],
        (RequiredReader, '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", '
         '"parameters": {}}]', [*_call("get_weather", '{"city": "Paris"}'), *_call("get_time", "{}")]),
        *[(RequiredReader, text, [text]) for text in ('[{"name": "get_weather", "parameters": {"ci', "[]")],
        (lambda: NamedReader("get_weather"), '{"city": "Paris"}', _call("get_weather", '{"city": "Paris"}')),
    ],
)  # fmt: skip
def test_a_reader_reads_the_same_calls_whole_and_in_any_split(make, text, expected):
    assert _merged(make().read(text)) == expected
    for size in (1, 2, 3, 7):  # the markup split across stream deltas at every place
        assert _fed(make(), text, size) == expected, size


@pytest.mark.parametrize(
    ("make", "text", "expected"),
    [(MistralReader, *case) for case in MISTRAL] + [(PythonicReader, *case) for case in PYTHONIC],
)
def test_mistral_and_pythonic_read_the_same_calls_split_at_every_position(make, text, expected):
    for at in range(len(text) + 1):
        reader = make()
        assert _merged(reader.feed(text[:at]) + reader.feed(text[at:]) + reader.finish()) == expected, at


@pytest.mark.parametrize(
    ("make", "text", "names"),
    [
        (HermesReader, f"Hi <tool_call>{WEATHER}</tool_call>", ["get_weather"]),
        (MistralReader, 'Hi [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
         ["get_weather", "get_time"]),
        (MistralReader, f"Hi [TOOL_CALLS] [{WEATHER}]", ["get_weather"]),
    ],
)  # fmt: skip
def test_a_streamed_reader_never_sends_markup_as_content(make, text, names):
    reader = make()
    sent = [p for ch in text for p in reader.feed(ch)] + reader.finish()
    content = "".join(p for p in sent if isinstance(p, str))
    assert content == "Hi" and "<" not in content and "[" not in content
    assert [p.name for p in sent if isinstance(p, CallStart)] == names


DEEP, DEEP_OBJECT = "[" * 100_000, '{"a": ' * 100_000  # deeper than Python's recursion limit


@pytest.mark.parametrize(
    ("make", "text"),
    [
        (HermesReader, f"<tool_call>{DEEP}</tool_call>"),
        (Llama3JsonReader, DEEP_OBJECT),
        (RequiredReader, DEEP),
        (MistralReader, f"[TOOL_CALLS] {DEEP}"),
        (MistralReader, f"[TOOL_CALLS]f[ARGS]{DEEP_OBJECT}"),
        (PythonicReader, f"[f(a={DEEP})]"),
    ],
)
def test_json_nested_past_the_recursion_limit_is_content_not_a_crash(make, text):
    """A model can write 100k "[" (json's decoder then raises RecursionError, not ValueError): not a
    call, so the text is content, as any other malformed call is, not a failed response."""
    assert _merged(make().read(text)) == [text]


def test_a_forced_calls_arguments_stream_as_they_come():
    named = NamedReader("f")
    assert named.feed('{"a"') == _call("f", '{"a"') and named.feed(": 1}") == [Arguments(": 1}")]


def _parsed(body: dict, parser: str = "hermes") -> tuple[pb.GenerateRequest, object]:
    return chat_request({"messages": ASK, **body}, {BASE}, parser)


def test_tools_and_tool_choice_map_onto_the_grpc_request():
    req, call = _parsed({"tools": TOOLS})
    assert [(t.name, t.description, t.parameters) for t in req.chat.tools] == [
        ("get_weather", "Weather now", json.dumps(CITY)),
        ("get_time", "", ""),
    ]
    assert call.tools.choice == "auto" and call.tools.parser == "hermes"
    assert not req.sampling.HasField("structured_output")  # "auto": the model decides
    # "none": the tools are rendered (vLLM's default), the output is text
    req, call = _parsed({"tools": TOOLS, "tool_choice": "none"}, parser="none")
    assert len(req.chat.tools) == 2 and call.tools is None
    # a named function: its parameters are the schema; no parser needed
    named = {"type": "function", "function": {"name": "get_weather"}}
    req, call = _parsed({"tools": TOOLS, "tool_choice": named}, parser="none")
    assert json.loads(req.sampling.structured_output.json_schema) == CITY and call.tools.name == "get_weather"
    # "required": an array of calls of the given tools (one at most without parallel calls)
    req, call = _parsed(
        {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}, parser="none"
    )
    schema = json.loads(req.sampling.structured_output.json_schema)
    assert schema["minItems"] == 1 and schema["maxItems"] == 1 and not call.tools.parallel
    branches = schema["items"]["anyOf"]
    assert [b["properties"]["name"]["enum"] for b in branches] == [["get_weather"], ["get_time"]]
    assert branches[0]["properties"]["parameters"] == CITY
    assert branches[1]["properties"]["parameters"] == {"type": "object", "properties": {}}


def test_a_conversation_with_calls_and_results_maps_onto_the_grpc_request():
    parts = [{"type": "text", "text": "18 C"}]
    turns = [*ASK, {"role": "assistant", "content": None, "tool_calls": [PARIS]},
             {"role": "tool", "tool_call_id": "call_1", "content": parts}]  # fmt: skip
    req, _ = chat_request({"messages": turns, "tools": TOOLS}, {BASE}, "hermes")
    assistant, result = req.chat.messages[1], req.chat.messages[2]
    assert assistant.content == "" and list(assistant.tool_calls) == [
        pb.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')
    ]
    assert (result.role, result.tool_call_id, result.content) == ("tool", "call_1", "18 C")


CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ({"tools": TOOLS}, "--tool-call-parser"),  # "auto" without a parser: vLLM refuses it too
        ({"tools": TOOLS, "tool_choice": "auto"}, "--tool-call-parser"),
        ({"tool_choice": "required"}, "needs `tools`"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "`tool_choice` must be"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not one of"),
        ({"tools": [{"type": "function"}]}, r"`tools\[0\]` must be"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "letters, digits"),
        ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "letters, digits"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
         "JSON Schema of an object"),
        ({"tools": [TOOLS[1], TOOLS[1]]}, "twice"),
        ({"tools": {"get_time": {}}}, "must be a list"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "no structured-output form"),
        ({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": "no"}, "true or false"),
        ({"functions": [{"name": "f"}]}, "send `tools`"),
        ({"messages": [{"role": "tool", "content": "18 C"}]}, "tool_call_id"),
        ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f",
          "arguments": "{oops"}}]}]}, "JSON object's text"),
        ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": "c"}]}]}, "must be"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]}, "only an assistant"),
        ({"messages": [{"role": "function", "content": "x"}]}, "role 'function'"),
    ],
)  # fmt: skip
def test_what_is_refused_is_named(body, problem):
    with pytest.raises(ApiError, match=problem) as refused:
        chat_request({"messages": ASK, **body}, {BASE}, "none")
    assert refused.value.status == 400


# A chat template that uses what transformers passes it: `tools`, an assistant's `tool_calls`
# (arguments written with tojson, as Qwen's and Hermes' templates do) and a tool result's id.
TEMPLATE = """
{%- if tools %}<|im_start|>system
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{{ message.content }}{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response id="{{ message.tool_call_id }}">{{ message.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def _byte_tokenizer():
    """A tokenizer of one token per byte (equal ids, equal text) with TEMPLATE."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    raw = RawTokenizer(models.BPE(vocab, []))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(tokenizer_object=raw)
    hf.chat_template = TEMPLATE
    return hf


def pod_prompt_ids(hf, turns: list[dict], tools: list[dict], *parsers: str) -> list[int]:
    """The prompt the pod renders with `hf`'s chat template for a chat of `turns` and `tools` sent
    through the HTTP front (`chat_request` with `parsers`: tool, then reasoning) and the wire, as
    the engine's `PromptReader` reads it."""
    req, _ = chat_request({"messages": turns, "tools": tools}, {BASE}, *parsers)
    kwargs = wire.engine_request(pb.GenerateRequest.FromString(req.SerializeToString()))
    reader = PromptReader(
        Tokenizer(hf), vocab_size=len(hf), max_model_len=4096, num_blocks=4096, block_size=1
    )
    return reader.token_ids(None, kwargs["messages"], None, kwargs["tools"])


def test_the_pod_renders_tools_calls_and_results_as_transformers_does():
    """The oracle: transformers' own `apply_chat_template(messages, tools=...)` on the OpenAI
    conversation, with the call's arguments as an object (its documented form: a template writes
    them with tojson, and a JSON text would come out quoted twice)."""
    turns = [*ASK, {"role": "assistant", "content": "Looking.", "tool_calls": [PARIS]},
             {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]  # fmt: skip
    hf = _byte_tokenizer()
    ids = pod_prompt_ids(hf, turns, TOOLS, "hermes")
    with_object = {**PARIS, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    as_objects = [*ASK, {**turns[1], "tool_calls": [with_object]}, turns[2]]
    expected = hf.apply_chat_template(as_objects, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    assert ids == list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    text = hf.decode(ids)
    assert '"arguments": {"city": "Paris"}' in text and '<tool_response id="call_1">18 C' in text
    assert '"name": "get_weather"' in text and "Weather now" in text


@pytest.mark.parametrize(
    ("parser", "markers", "written", "make"),
    [
        ("hermes", ["<tool_call>", "</tool_call>"], f"<tool_call>\n{WEATHER}\n</tool_call>", HermesReader),
        (
            "mistral",
            ["[TOOL_CALLS]", "[ARGS]"],
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
            MistralReader,
        ),
    ],
)
def test_a_call_whose_markup_is_special_tokens_is_decoded_and_read(parser, markers, written, make):
    """Some checkpoints (Hermes 2 Pro's) mark `<tool_call>` special, and Mistral's mark
    `[TOOL_CALLS]` and `[ARGS]`: the pod, which skips special tokens by default, must decode them
    for the parser (as vLLM's hermes and mistral parsers ask), or the call is bare JSON content (or
    the name glued to its arguments). Markup-free reading (a forced call, llama3_json's JSON,
    pythonic's list) keeps the default."""
    hf = _byte_tokenizer()
    hf.add_special_tokens({"additional_special_tokens": markers})
    ids = hf.encode(written, add_special_tokens=False)
    assert (
        len(ids) < len(written) - sum(map(len, markers)) + len(markers) + 1
    )  # the markers are one token each

    def decoded(body: dict, parser: str) -> str:
        req, _ = _parsed(body, parser)
        params = wire.sampling_params(pb.GenerateRequest.FromString(req.SerializeToString()))
        detokenizer = IncrementalDetokenizer(Tokenizer(hf), hf.encode("Hi", add_special_tokens=False),
                                             params.skip_special_tokens)  # fmt: skip
        return "".join(detokenizer.push(t) for t in ids)

    assert _merged(make().read(decoded({"tools": TOOLS}, parser))) == PARIS_CALL
    assert markers[0] not in decoded({"tools": TOOLS, "tool_choice": "required"}, parser)
    for markup_free in ("llama3_json", "pythonic"):
        assert markers[0] not in decoded({"tools": TOOLS}, markup_free)


class _Scripted:
    """A Generation servicer whose model writes `text`, a few characters per chunk."""

    def __init__(self, text: str) -> None:
        self.text, self.requests = text, []

    async def Generate(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.GenerateResponse]:
        self.requests.append(request)
        for i in range(0, len(self.text), 3):
            yield pb.GenerateResponse(chunk=pb.Chunk(text=self.text[i : i + 3]))
        usage = pb.Usage(prompt_tokens=5, completion_tokens=9)
        yield pb.GenerateResponse(final=pb.Final(finish_reason=pb.FINISH_REASON_STOP, usage=usage))


async def _both(client: openai.AsyncOpenAI, **asked) -> tuple:
    """The whole answer, and the stream's accumulated content, calls and finish reason."""
    whole = await client.chat.completions.create(model=BASE, messages=ASK, **asked)
    content, calls, finish = "", {}, None
    async for chunk in await client.chat.completions.create(model=BASE, messages=ASK, stream=True, **asked):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for c in delta.tool_calls or []:
            if c.id:  # the first delta of a call: index, id, name
                calls[c.index] = {
                    "id": c.id,
                    "name": c.function.name,
                    "arguments": c.function.arguments or "",
                }
            else:
                calls[c.index]["arguments"] += c.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    return whole.choices[0], content, [calls[i] for i in sorted(calls)], finish


ID_FORMS = {"mistral": "[A-Za-z0-9]{9}", "other": "call_[0-9a-f]{24}"}


@pytest.mark.parametrize(
    ("parser", "text", "content", "calls"),
    [
        ("hermes", f"Sure.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n"
         '{"name": "get_time", "arguments": {}}\n</tool_call>',
         "Sure.", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
        ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
         [("get_weather", {"city": "Paris"})]),
        ("hermes", '<tool_call>{"name": broken</tool_call>', '<tool_call>{"name": broken</tool_call>', []),
        ("mistral", 'Sure.\n[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
         "Sure.", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
        ("mistral", f"[TOOL_CALLS] [{WEATHER}]", None, [("get_weather", {"city": "Paris"})]),
        *[("mistral", text, text, []) for text in ['[TOOL_CALLS]get_weather[ARGS]{"city": Paris}']],
        ("pythonic", '[get_weather(city="Paris"), get_time()]', None,
         [("get_weather", {"city": "Paris"}), ("get_time", {})]),
        ("pythonic", "[get_weather(city=Paris)]", "[get_weather(city=Paris)]", []),
    ],
)  # fmt: skip
def test_the_sdk_reads_the_calls_a_model_writes(parser, text, content, calls):
    """Streamed and not, the calls are OpenAI's `tool_calls` (arguments as JSON text, ids
    "call_..." but a mistral server's 9 letters and digits), the content never holds the markup,
    and a malformed call is plain content."""
    model = _Scripted(text)

    async def run() -> tuple:
        async with openai_client_of(model, BASE, parser) as client:
            return await _both(client, tools=TOOLS)

    choice, streamed, streamed_calls, finish = asyncio.run(run())
    assert len(model.requests[0].chat.tools) == 2  # the tools reached the pod's template
    got = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]
    assert got == calls and choice.message.content == content
    ids = [c.id for c in choice.message.tool_calls or []] + [c["id"] for c in streamed_calls]
    assert all(re.fullmatch(ID_FORMS.get(parser, ID_FORMS["other"]), i) for i in ids) and len(
        set(ids)
    ) == len(ids)
    assert all(c.type == "function" for c in choice.message.tool_calls or [])
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed_calls] == calls
    assert streamed == (content or "")
    assert choice.finish_reason == finish == ("tool_calls" if calls else "stop")


def test_parallel_tool_calls_false_keeps_the_first_call():
    model = _Scripted(f"<tool_call>{WEATHER}</tool_call><tool_call>" + '{"name": "get_time"}</tool_call>')

    async def run() -> tuple:
        async with openai_client_of(model, BASE, "hermes") as client:
            return await _both(client, tools=TOOLS, parallel_tool_calls=False)

    choice, _, streamed_calls, _ = asyncio.run(run())
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    assert [c["name"] for c in streamed_calls] == ["get_weather"]


# Qwen3's way with the thinking of past turns: kept (and rendered) for the assistant turns after
# the last user message, the tool-calling loop under way; dropped before it.
THINKING_TEMPLATE = """{%- set ns = namespace(last_user=0) %}
{%- for message in messages %}{% if message.role == "user" %}{% set ns.last_user = loop.index0 %}
{%- endif %}{% endfor %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{%- set current = loop.index0 > ns.last_user %}
{%- if message.role == "assistant" and message.reasoning_content is string and current %}
<think>{{ message.reasoning_content }}</think>{% endif %}
{{ message.content }}{% for call in message.tool_calls or [] %}<tool_call>{{ call.function.name }}
{%- endfor %}<|im_end|>
{% endfor %}<|im_start|>assistant
"""


def test_an_assistant_turns_thinking_sent_back_reaches_the_template():
    """A tool-calling loop sends the assistant's turn back with its `reasoning_content` (or
    vLLM's newer `reasoning`): Qwen3's template renders it for the turns of the current loop, so
    it must reach the template as transformers takes it; it was dropped."""
    for field in ("reasoning_content", "reasoning"):
        thought = {"role": "assistant", "content": "", field: "Paris, so call it.", "tool_calls": [PARIS]}
        turns = [*ASK, thought, {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
        hf = _byte_tokenizer()
        hf.chat_template = THINKING_TEMPLATE
        ids = pod_prompt_ids(hf, turns, TOOLS, "hermes")
        with_object = {**PARIS, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        sent = {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Paris, so call it.",
            "tool_calls": [with_object],
        }
        expected = hf.apply_chat_template([*ASK, sent, turns[2]], add_generation_prompt=True, tokenize=True)
        assert ids == list(expected["input_ids"] if hasattr(expected, "keys") else expected)
        assert "<think>Paris, so call it.</think>" in hf.decode(ids)
    with pytest.raises(ApiError, match="reasoning_content must be a string"):
        chat_request(
            {"messages": [*ASK, {"role": "assistant", "content": "", "reasoning_content": 3}]}, {BASE}
        )


# Mistral's chat templates take a call back only with an id of 9 letters and digits (mistral-common's
# rule; Mistral 7B v0.3's template raises this very error): the check, as a template writes it.
MISTRAL_TEMPLATE = """
{%- macro checked(id) %}{% if id is not string or id | length != 9 or not id.isalnum() %}
{{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}{% endif %}
{{- id }}{% endmacro %}
{%- for message in messages %}
{%- if message.role == "user" %}[INST]{{ message.content }}[/INST]
{%- elif message.tool_calls %}[TOOL_CALLS]{% for call in message.tool_calls %}{{ call.function.name }}
{{- "[CALL_ID]" + checked(call.id) + "[ARGS]" }}{{ call.function.arguments | tojson }}{% endfor %}</s>
{%- elif message.role == "tool" %}[TOOL_RESULTS]{{ checked(message.tool_call_id) }}[TOOL_CONTENT]
{{- message.content }}[/TOOL_RESULTS]
{%- endif %}{% endfor %}"""


@pytest.mark.parametrize(
    ("choice", "text"),
    [
        ("auto", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'),
        ("required", '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'),  # forced: no markup
    ],
)
def test_a_mistral_servers_calls_go_back_through_a_mistral_template(choice, text):
    """The SDK's answer, call and result sent back as the next turn, renders through a template
    with Mistral's id rule; an OpenAI-form id ("call_...") is what it refuses."""
    model = _Scripted(text)

    async def run() -> openai.types.chat.ChatCompletion:
        async with openai_client_of(model, BASE, "mistral") as client:
            return await client.chat.completions.create(
                model=BASE, messages=ASK, tools=TOOLS, tool_choice=choice
            )

    message = asyncio.run(run()).choices[0].message
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]
    hf = _byte_tokenizer()
    hf.chat_template = MISTRAL_TEMPLATE

    def rendered(call_id: str) -> str:
        call = {**message.tool_calls[0].model_dump(), "id": call_id}
        turns = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": call_id, "content": "18 C"}]  # fmt: skip
        return hf.decode(pod_prompt_ids(hf, turns, TOOLS, "mistral"))

    given = message.tool_calls[0].id
    assert f'[CALL_ID]{given}[ARGS]{{"city": "Paris"}}' in rendered(given)
    assert f"[TOOL_RESULTS]{given}[TOOL_CONTENT]18 C" in rendered(given)
    with pytest.raises(InvalidRequestError, match=r"refused these messages.*length 9"):
        rendered("call_" + given)


@pytest.mark.parametrize("command", ["serve", "gateway", "up"])
def test_every_command_offers_the_parsers_and_refuses_an_unknown_one(command, capsys, monkeypatch):
    """`--tool-call-parser` (and SPINDLE_TOOL_CALL_PARSER) on the pod, the gateway and `spindle up`:
    the readers' names, and a misspelt one refused naming it, before anything starts."""
    _, parser = cli.command_parser(command)
    action = next(a for a in parser._actions if a.dest == "tool_call_parser")
    assert tuple(action.choices) == PARSERS and {"mistral", "pythonic"} < set(PARSERS)
    with pytest.raises(SystemExit):
        parser.parse_known_args(["--tool-call-parser", "mistrall"])
    assert "invalid choice: 'mistrall'" in capsys.readouterr().err
    monkeypatch.setenv("SPINDLE_TOOL_CALL_PARSER", "pythonic")
    assert cli.command_parser(command)[1].parse_known_args([])[0].tool_call_parser == "pythonic"
    monkeypatch.setenv("SPINDLE_TOOL_CALL_PARSER", "Mistral")
    with pytest.raises(SystemExit):
        cli.command_parser(command)
    assert "SPINDLE_TOOL_CALL_PARSER='Mistral'" in capsys.readouterr().err
