"""Reasoning models in the OpenAI-compatible API (`--reasoning-parser`, as vLLM serves it): the
reader that splits `<think>...</think>` from the answer, whole and in any streamed split, and the
`openai` SDK reading `reasoning_content` from a scripted model through the HTTP server, streamed
and not, with tool calls after the thinking, `n` choices, and forced outputs."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from spindle import local
from spindle.cli import command_parser
from spindle.openai_api.reasoning_parsers import READERS, Thought
from spindle.v1 import generation_pb2 as pb
from tests.service_helpers import openai_client_of

BASE = "m"
ASK = [{"role": "user", "content": "Weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _merged(pieces: list) -> list:
    """Adjacent reasoning joined, adjacent content joined: what a client ends up with."""
    out: list = []
    for p in pieces:
        if out and type(p) is type(out[-1]):
            out[-1] = Thought(out[-1].text + p.text) if isinstance(p, Thought) else out[-1] + p
        else:
            out.append(p)
    return out


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # the template opened <think> (DeepSeek-R1, QwQ, Qwen3.5): only </think> is generated
        ("Paris is in France.\n</think>\n\nIt is sunny.", [Thought("Paris is in France."), "It is sunny."]),
        # the model opens it itself (Qwen3 up to 2507, some R1 distills), whitespace around dropped
        ("<think>\nLet me see.\n\n</think>\n\nSunny.\n", [Thought("Let me see."), "Sunny.\n"]),
        ("\n<think>a < b, </thinking> isn't</think>Yes", [Thought("a < b, </thinking> isn't"), "Yes"]),
        # empty thinking (Qwen3's /no_think): no reasoning at all
        ("<think>\n\n</think>\n\nHi", ["Hi"]),
        # no </think> (cut by max_tokens): all of it is reasoning, as vLLM reads it; "<thi" too
        ("Still thinking about", [Thought("Still thinking about")]),
        ("<think>Still thinking </thi", [Thought("Still thinking </thi")]),
        ("<thi", [Thought("<thi")]),
        ("", []),
        # a second </think> is the answer's text; a <think> after the start is the reasoning's
        ("x</think>y</think>z", [Thought("x"), "y</think>z"]),
        ("I <think> so</think>ok", [Thought("I <think> so"), "ok"]),
    ],
)  # fmt: skip
def test_the_reader_splits_the_thinking_whole_and_in_any_split(parser, text, expected):
    assert _merged(READERS[parser]().read(text)) == expected
    for size in range(1, 8):  # each tag split across stream deltas at every place
        reader, pieces = READERS[parser](), []
        for i in range(0, len(text), size):
            pieces += reader.feed(text[i : i + size])
        sent = pieces + reader.finish()
        assert _merged(sent) == expected, size
        assert all(p.text if isinstance(p, Thought) else p for p in sent)  # no empty deltas


class _Scripted:
    """A Generation servicer whose model writes `text`, `size` characters a chunk, and finishes
    with `finish`."""

    def __init__(self, text: str, size: int = 3, finish: int = pb.FINISH_REASON_STOP) -> None:
        self.text, self.size, self.finish, self.requests = text, size, finish, []

    async def Generate(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.GenerateResponse]:
        self.requests.append(request)
        for i in range(0, len(self.text), self.size):
            yield pb.GenerateResponse(chunk=pb.Chunk(text=self.text[i : i + self.size]))
            await asyncio.sleep(0)  # n > 1: the choices' chunks interleave
        usage = pb.Usage(prompt_tokens=5, completion_tokens=9)
        yield pb.GenerateResponse(final=pb.Final(finish_reason=self.finish, usage=usage))


def _asked(model: _Scripted, reasoning: str = "deepseek_r1", tool_parser: str = "none", **asked) -> tuple:
    """The whole answer and the stream's chunks, asked of `model` through the SDK."""

    async def run() -> tuple:
        async with openai_client_of(model, BASE, tool_parser, reasoning) as client:
            whole = await client.chat.completions.create(model=BASE, messages=ASK, **asked)
            stream = await client.chat.completions.create(model=BASE, messages=ASK, stream=True, **asked)
            return whole, [chunk async for chunk in stream]

    return asyncio.run(run())


def _streamed(chunks: list, index: int = 0) -> dict:
    """One choice's stream accumulated: its reasoning, content, calls, finish, and the order its
    kinds of delta came in."""
    got = {"reasoning": "", "content": "", "calls": {}, "finish": None, "order": []}
    for chunk in chunks:
        for choice in (c for c in chunk.choices if c.index == index):
            delta, kinds = choice.delta, []
            if getattr(delta, "reasoning_content", None):
                got["reasoning"] += delta.reasoning_content
                kinds.append("reasoning")
            if delta.content:
                got["content"] += delta.content
                kinds.append("content")
            for call in delta.tool_calls or []:
                entry = got["calls"].setdefault(call.index, {"name": call.function.name, "arguments": ""})
                entry["arguments"] += call.function.arguments or ""
                kinds.append("call")
            got["order"] += [k for k in kinds if not got["order"] or got["order"][-1] != k]
            got["finish"] = choice.finish_reason or got["finish"]
    return got


@pytest.mark.parametrize("size", [1, 4, 7])
def test_the_sdk_reads_reasoning_content_apart_from_content(size):
    """`message.reasoning_content` and `content`, and streamed `delta.reasoning_content` deltas
    then `delta.content` deltas, the markup in neither, however the pod's chunks split the tags."""
    whole, chunks = _asked(_Scripted("<think>\nParis is in France.\n</think>\n\nIt is sunny.", size))
    message = whole.choices[0].message
    assert (message.reasoning_content, message.content) == ("Paris is in France.", "It is sunny.")
    got = _streamed(chunks)
    assert (got["reasoning"], got["content"], got["finish"]) == (
        "Paris is in France.",
        "It is sunny.",
        "stop",
    )
    assert got["order"] == ["reasoning", "content"]


def test_include_reasoning_false_drops_the_reasoning():
    """vLLM's `include_reasoning: false`: the thinking is still kept out of the content, and dropped."""
    whole, chunks = _asked(_Scripted("Think.</think>Answer."), extra_body={"include_reasoning": False})
    assert (whole.choices[0].message.reasoning_content, whole.choices[0].message.content) == (None, "Answer.")
    got = _streamed(chunks)
    assert (got["reasoning"], got["content"]) == ("", "Answer.")


def test_an_answer_cut_while_thinking_is_all_reasoning_and_no_content():
    whole, chunks = _asked(_Scripted("Hmm, Paris. Let me", finish=pb.FINISH_REASON_LENGTH), max_tokens=5)
    message = whole.choices[0].message
    assert (message.reasoning_content, message.content, whole.choices[0].finish_reason) == (
        "Hmm, Paris. Let me",
        None,
        "length",
    )
    got = _streamed(chunks)
    assert (got["reasoning"], got["content"], got["finish"]) == ("Hmm, Paris. Let me", "", "length")


def test_tool_calls_are_read_after_the_thinking_only():
    """The model thinks about the call's markup, then calls: the call is read from the content
    only (the markup in its thinking is reasoning, not a call), streamed and not."""
    text = f"I should call <tool_call> with the city.</think>\n\n{WEATHER}"
    whole, chunks = _asked(_Scripted(text), "qwen3", "hermes", tools=TOOLS)
    choice = whole.choices[0]
    assert choice.message.reasoning_content == "I should call <tool_call> with the city."
    assert choice.message.content is None and choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    got = _streamed(chunks)
    assert got["reasoning"] == choice.message.reasoning_content and got["content"] == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in got["calls"].values()] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert got["order"] == ["reasoning", "call"] and got["finish"] == "tool_calls"


def test_each_of_n_choices_reads_its_own_thinking():
    """n > 1: each choice's stream is read apart, though their chunks interleave."""
    whole, chunks = _asked(_Scripted("Think.</think>Answer.", size=2), n=2)
    assert [(c.message.reasoning_content, c.message.content) for c in whole.choices] == [
        ("Think.", "Answer.")
    ] * 2
    for index in (0, 1):
        got = _streamed(chunks, index)
        assert (got["reasoning"], got["content"], got["order"]) == (
            "Think.",
            "Answer.",
            ["reasoning", "content"],
        )


def test_a_forced_output_is_content_and_no_parser_is_todays_answer():
    """An output forced to a schema is the schema's from its first token: content, not thinking
    (else a JSON answer with no </think> would be all reasoning). Without a parser the text is the
    answer as the model wrote it, with no reasoning_content."""
    schema = {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}}
    whole, chunks = _asked(_Scripted('{"sunny": true}'), response_format=schema)
    message = whole.choices[0].message
    assert message.content == '{"sunny": true}' and getattr(message, "reasoning_content", None) is None
    assert _streamed(chunks)["content"] == '{"sunny": true}' and _streamed(chunks)["reasoning"] == ""
    whole, chunks = _asked(_Scripted("a</think>b"), "none")
    assert whole.choices[0].message.content == "a</think>b" and _streamed(chunks)["content"] == "a</think>b"
    assert "reasoning_content" not in whole.choices[0].message.model_dump(exclude_unset=True)


def test_spindle_up_passes_the_reasoning_parser_to_the_pod_and_the_gateway():
    _, parser = command_parser("up")
    args = parser.parse_args(["--reasoning-parser", "qwen3"])
    local._pick_free_ports(args)
    for cmd in local._commands(args, "token")[::2]:  # the pod's and the gateway's
        assert cmd[cmd.index("--reasoning-parser") + 1] == "qwen3"
        command = cmd[cmd.index("spindle.cli") + 1]
        assert (
            command_parser(command)[1].parse_args(cmd[cmd.index(command) + 1 :]).reasoning_parser == "qwen3"
        )


@pytest.mark.parametrize("switch", ["enable_thinking", "thinking"])
def test_thinking_turned_off_by_the_template_is_all_content(switch):
    """`chat_template_kwargs: {"enable_thinking": false}` (Qwen3's switch; DeepSeek-V3.1's is
    `thinking`): the template closed the thinking in the prompt, so the whole output is the
    answer (as vLLM's qwen3 parser reads it), not reasoning with a null content."""
    off = {"chat_template_kwargs": {switch: False}}
    whole, chunks = _asked(_Scripted("It is sunny."), "qwen3", extra_body=off)
    message = whole.choices[0].message
    assert (message.content, getattr(message, "reasoning_content", None)) == ("It is sunny.", None)
    assert (_streamed(chunks)["content"], _streamed(chunks)["reasoning"]) == ("It is sunny.", "")
    on = {"chat_template_kwargs": {switch: True}}
    whole, _ = _asked(_Scripted("Hmm.</think>It is sunny."), "qwen3", extra_body=on)
    assert (whole.choices[0].message.reasoning_content, whole.choices[0].message.content) == (
        "Hmm.",
        "It is sunny.",
    )
