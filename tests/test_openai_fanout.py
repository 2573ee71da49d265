"""One HTTP request, several generations (spindle/openai_api/fanout.py): `n`, a completion's list
of prompts, `best_of` and `echo`, through the `openai` SDK against `spindle up` (shared with
test_openai_http.py). The oracle is the single request: each choice must be what one request
with its prompt and derived seed answers."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncIterator

import openai
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from spindle.openai_api.fanout import derived_seed
from spindle.openai_api.requests import chat_request
from spindle.openai_api.responses import ChatFormat, Reply
from spindle.openai_api.server import OpenAIServer
from spindle.v1 import generation_pb2 as pb
from tests.service_helpers import openai_client_of
from tests.test_openai_http import BASE, QUESTION, _idle, _sdk

STORY = "Once upon a"


def _streamed(chunks) -> tuple[dict[int, str], dict[int, str], list]:
    """A stream's text and finish reason per choice index, and its usage chunks."""
    texts: dict[int, str] = defaultdict(str)
    finishes: dict[int, str] = {}
    usages = []
    for chunk in chunks:
        if chunk.usage is not None:
            usages.append(chunk.usage)
        for c in chunk.choices:
            texts[c.index] += (c.delta.content or "") if hasattr(c, "delta") else c.text
            if c.finish_reason is not None:
                assert c.index not in finishes, "one finish chunk per choice"
                finishes[c.index] = c.finish_reason
    return dict(texts), finishes, usages


def test_n_choices_with_a_seed_are_reproducible_distinct_and_each_a_single_request(spindle_up):
    client = _sdk(spindle_up.http)
    asked = {"model": BASE, "messages": QUESTION, "max_tokens": 6, "temperature": 1.0, "seed": 7}
    out = client.chat.completions.create(**asked, n=3, extra_headers={"x-request-id": "fan-1"})
    texts = [c.message.content for c in out.choices]
    assert [c.index for c in out.choices] == [0, 1, 2] and len(set(texts)) == 3, texts
    assert out.id == "chatcmpl-fan-1"
    singles = [client.chat.completions.create(**{**asked, "seed": 7 + i}) for i in range(3)]
    assert texts == [s.choices[0].message.content for s in singles]  # choice i: seed + i
    assert out.usage.prompt_tokens == singles[0].usage.prompt_tokens  # the prompt counted once
    assert out.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    stream = client.chat.completions.create(**asked, n=3, stream=True, stream_options={"include_usage": True})
    streamed, finishes, usages = _streamed(stream)
    assert streamed == dict(enumerate(texts))  # interleaved, each by its index: the same choices
    assert finishes == {i: c.finish_reason for i, c in enumerate(out.choices)}
    assert [u.total_tokens for u in usages] == [out.usage.total_tokens]  # one usage chunk, last


def test_a_list_of_prompts_with_n_is_prompt_major(spindle_up):
    """Choice index = prompt * n + i (OpenAI's rule), text prompts and token-id prompts alike."""
    client = _sdk(spindle_up.http)
    greedy = {"model": BASE, "max_tokens": 4, "temperature": 0}
    for prompts in ([STORY, "The capital of France is"], [[504, 3458, 28], [1780, 314]]):
        singles = [client.completions.create(**greedy, prompt=p) for p in prompts]
        out = client.completions.create(**greedy, prompt=prompts, n=2)
        assert [c.index for c in out.choices] == [0, 1, 2, 3]
        assert [c.text for c in out.choices] == [s.choices[0].text for s in singles for _ in range(2)]
        assert out.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
        assert out.usage.completion_tokens == 2 * sum(s.usage.completion_tokens for s in singles)
        streamed, finishes, _ = _streamed(
            client.completions.create(**greedy, prompt=prompts, n=2, stream=True)
        )
        assert streamed == {c.index: c.text for c in out.choices} and set(finishes) == {0, 1, 2, 3}


def test_best_of_returns_the_candidates_with_the_highest_cumulative_logprob(spindle_up):
    client = _sdk(spindle_up.http)
    asked = {"model": BASE, "prompt": STORY, "max_tokens": 5, "temperature": 1.0, "seed": 11}
    candidates = [
        client.completions.create(**{**asked, "seed": 11 + i}, logprobs=0).choices[0] for i in range(4)
    ]
    ranked = sorted(candidates, key=lambda c: sum(c.logprobs.token_logprobs), reverse=True)
    assert len({c.text for c in candidates}) > 2  # sampled: the choice is a choice
    out = client.completions.create(**asked, n=2, best_of=4)
    assert [c.text for c in out.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in out.choices] == [0, 1] and out.choices[0].logprobs is None  # not asked for
    assert out.usage.completion_tokens == 4 * 5  # every candidate ran
    with_logprobs = client.completions.create(**asked, n=1, best_of=4, logprobs=1)
    assert with_logprobs.choices[0].text == ranked[0].text  # logprobs: within a batch's float noise
    assert with_logprobs.choices[0].logprobs.token_logprobs == pytest.approx(
        ranked[0].logprobs.token_logprobs, abs=1e-3
    )


def test_echo_starts_each_choice_with_its_prompt(spindle_up):
    client = _sdk(spindle_up.http)
    greedy = {"model": BASE, "max_tokens": 3, "temperature": 0}
    prompts = [STORY, "Hello"]
    singles = [client.completions.create(**greedy, prompt=p).choices[0].text for p in prompts]
    out = client.completions.create(**greedy, prompt=prompts, echo=True)
    assert [c.text for c in out.choices] == [p + s for p, s in zip(prompts, singles, strict=True)]
    streamed, _, _ = _streamed(client.completions.create(**greedy, prompt=prompts, echo=True, stream=True))
    assert streamed == {c.index: c.text for c in out.choices}


def test_a_client_that_hangs_up_on_n_choices_aborts_them_all(spindle_up):
    long = {"model": BASE, "messages": QUESTION, "max_tokens": 2000, "extra_body": {"ignore_eos": True}}
    stream = _sdk(spindle_up.http).chat.completions.create(**long, n=3, stream=True)
    next(iter(stream))  # they run
    stream.close()
    assert _idle(spindle_up.pod) < 5  # 3 x 2,000 tokens would take minutes
    with pytest.raises(openai.APITimeoutError):  # not streamed: the client gives up waiting
        _sdk(spindle_up.pod_http, timeout=1.0).chat.completions.create(**long, n=2)
    assert _idle(spindle_up.pod) < 5


class _OneFails:
    """A Generation servicer whose request `{id}-1` fails after one chunk while the others stream
    until closed; it records the ids whose streams were closed."""

    def __init__(self) -> None:
        self.closed: set[str] = set()

    async def Generate(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.GenerateResponse]:
        try:
            yield pb.GenerateResponse(chunk=pb.Chunk(token_ids=[1], text="a"))
            if request.request_id.endswith("-1"):
                raise RuntimeError("a bug")
            await asyncio.Event().wait()
        finally:
            self.closed.add(request.request_id)


@pytest.mark.parametrize("stream", [False, True])
def test_a_failure_in_one_generation_closes_the_others(stream):
    servicer = _OneFails()

    async def run() -> None:
        async with openai_client_of(servicer, BASE) as client:
            with pytest.raises(openai.APIError, match="internal error"):
                answer = await client.chat.completions.create(
                    model=BASE, messages=QUESTION, n=3, stream=stream, extra_headers={"x-request-id": "r"}
                )
                async for _ in answer:
                    pass

    asyncio.run(asyncio.wait_for(run(), 10))
    assert servicer.closed == {"r-0", "r-1", "r-2"}


def test_a_derived_seed_stays_an_int64():
    assert derived_seed(7, 2) == 9 and derived_seed(2**63 - 1, 1) == -(2**63)


def test_each_choice_reads_its_own_tool_calls():
    """Interleaved streams of two choices: choice 0's call markup must not swallow choice 1's text."""
    tools = [{"type": "function", "function": {"name": "get_time"}}]
    _, call = chat_request({"messages": QUESTION, "tools": tools, "n": 2}, {BASE}, "hermes")
    reply = Reply(ChatFormat(), call, "r")
    texts = {"open": '<tool_call>{"name": "get_time", ', "close": '"arguments": {}}</tool_call>', "hi": "Hi"}
    chunk = {k: pb.GenerateResponse(chunk=pb.Chunk(text=t)) for k, t in texts.items()}
    final = pb.GenerateResponse(final=pb.Final(finish_reason=pb.FINISH_REASON_STOP))
    sent = [(0, chunk["open"]), (1, chunk["hi"]), (0, chunk["close"]), (1, final), (0, final)]
    choices = [c for k, m in sent for out in reply.chunks(k, 0, m) for c in out["choices"]]
    content = {
        i: "".join(c["delta"].get("content") or "" for c in choices if c["index"] == i) for i in (0, 1)
    }
    names = [
        t["function"].get("name")
        for c in choices
        for t in c["delta"].get("tool_calls", [])
        if c["index"] == 0
    ]
    finishes = {c["index"]: c["finish_reason"] for c in choices if c["finish_reason"]}
    assert content == {0: "", 1: "Hi"} and names[0] == "get_time" and finishes == {0: "tool_calls", 1: "stop"}


class _Annotating:
    """A Generation servicer that annotates the current span as the gateway's and the pod's do."""

    async def Generate(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.GenerateResponse]:
        trace.get_current_span().set_attribute("gen_ai.response.id", request.request_id)
        yield pb.GenerateResponse(chunk=pb.Chunk(token_ids=[1], text="a"))
        yield pb.GenerateResponse(final=pb.Final(usage=pb.Usage(prompt_tokens=2, completion_tokens=1)))


def test_each_generation_is_traced_in_its_own_span():
    """The servicer annotates the span it runs in (id, usage, finish): several generations in the
    request's one span would leave the last one's figures as the request's."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    async def run() -> None:
        server = OpenAIServer(_Annotating(), lambda: (BASE,), lambda: True, provider.get_tracer(__name__))
        port = await server.start("127.0.0.1", 0)
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        try:
            out = await client.completions.create(
                model=BASE, prompt=["x", "y"], n=2, extra_headers={"x-request-id": "t"}
            )
            assert out.usage.prompt_tokens == 4 and out.usage.completion_tokens == 4
        finally:
            await client.close()
            await server.stop()

    asyncio.run(run())
    (request,) = [s for s in exporter.get_finished_spans() if s.name == "POST /v1/completions"]
    parts = [s for s in exporter.get_finished_spans() if s.name == "spindle.generation"]
    assert request.attributes["gen_ai.response.id"] == "t"
    assert sorted(s.attributes["gen_ai.response.id"] for s in parts) == ["t-0", "t-1", "t-2", "t-3"]
    assert all(s.parent.span_id == request.context.span_id for s in parts)
