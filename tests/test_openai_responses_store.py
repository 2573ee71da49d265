"""The Responses API's stored responses (responses_store.py) through the `openai` SDK, its typed
models the schema oracle: a turn chained by `previous_response_id` reaches the model as the
whole conversation sent statelessly would, and retrieve, delete, input_items, 404s, eviction and
`store: false` behave as OpenAI's API does."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator

import openai
import pytest
from openai.types.responses import Response, ResponseItemList

from spindle.openai_api.responses_store import ResponseStore, ToKeep
from spindle.v1 import generation_pb2 as pb
from tests.service_helpers import openai_client_of
from tests.test_openai_responses import BASE
from tests.test_openai_responses import _Scripted as _Unnamed


class _Scripted(_Unnamed):
    """The scripted model, naming each request as the servicers do (its x-request-id, the id of
    the response)."""

    async def Generate(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.GenerateResponse]:
        await context.send_initial_metadata((("x-request-id", uuid.uuid4().hex),))
        async for message in super().Generate(request, context):
            yield message


def _store(count: int = 100) -> ResponseStore:
    return ResponseStore(count, 1 << 20, 60.0)


def _said(request) -> list[tuple]:
    return [(m.role, m.content, m.reasoning_content) for m in request.chat.messages]


def test_a_chained_turn_is_the_whole_conversation_and_is_retrieved_listed_and_deleted():
    """Turn 2 sends only its new input with turn 1's id: the pod gets the messages the whole
    conversation sent without a store gets (turn 1's reasoning carried, its `instructions` not:
    OpenAI's rule), under turn 2's `model`. The responses are retrieved as returned, their input
    items listed and paged as the SDK pages them, and a deleted one is gone."""
    model, store = _Scripted("<think>Hm.</think>It is sunny."), _store()

    async def run() -> tuple:
        async with openai_client_of(model, BASE, "none", "deepseek_r1", store=store) as client:
            first = await client.responses.create(model=BASE, input="Weather?", instructions="Be brief.")
            chained = {"previous_response_id": first.id, "instructions": "Be kind."}
            second = await client.responses.create(model="pirate", input="And tomorrow?", **chained)
            whole = [{"role": "user", "content": "Weather?"},
                     *[i.model_dump(exclude_none=True) for i in first.output],
                     {"role": "user", "content": "And tomorrow?"}]  # fmt: skip
            await client.responses.create(model="pirate", input=whole, instructions="Be kind.", store=False)
            raw = await client.responses.with_raw_response.retrieve(first.id)
            listed = await client.responses.with_raw_response.input_items.list(second.id, order="asc")
            paged = [i.id async for i in client.responses.input_items.list(second.id, limit=2)]
            deleted = await client.responses.with_raw_response.delete(first.id)
            with pytest.raises(openai.NotFoundError):
                await client.responses.retrieve(first.id)
            return first, second, raw.http_response.json(), listed.http_response.json(), paged, deleted

    first, second, retrieved, listed, paged, deleted = asyncio.run(run())
    chained, stateless = model.requests[1], model.requests[2]
    assert _said(chained) == _said(stateless) == [
        ("system", "Be kind.", ""), ("user", "Weather?", ""), ("assistant", "It is sunny.", "Hm."),
        ("user", "And tomorrow?", ""),
    ]  # fmt: skip
    assert chained.chat == stateless.chat and chained.adapter == "pirate"
    assert (second.store, second.previous_response_id, second.model) == (True, first.id, "pirate")
    assert first.store and first.previous_response_id is None
    assert Response.model_validate(retrieved) == first
    items = ResponseItemList.model_validate(listed)
    assert [(i.type, getattr(i, "role", None)) for i in items.data] == [
        ("message", "user"), ("reasoning", None), ("message", "assistant"), ("message", "user"),
    ]  # fmt: skip
    assert [i.id for i in items.data[1:3]] == [i.id for i in first.output]
    assert (items.first_id, items.last_id, items.has_more) == (items.data[0].id, items.data[-1].id, False)
    assert paged == [i.id for i in reversed(items.data)]  # newest first, two a page
    assert deleted.http_response.json() == {"id": first.id, "object": "response", "deleted": True}


def test_unknown_evicted_and_unstored_responses_are_openais_404():
    """An id never stored, one the count bound evicted, and a `store: false` response (its
    `store` field false) are 404s in OpenAI's shape naming the id, on retrieve and as a
    `previous_response_id`; a streamed response is stored as a whole one is."""
    model, store = _Scripted("Hi."), _store(count=2)

    async def run() -> tuple:
        async with openai_client_of(model, BASE, store=store) as client:
            unstored = await client.responses.create(model=BASE, input="Hi", store=False)
            oldest = await client.responses.create(model=BASE, input="Hi")
            events = [e async for e in await client.responses.create(model=BASE, input="Hi", stream=True)]
            newest = await client.responses.create(model=BASE, input="Hi")
            streamed = await client.responses.retrieve(events[-1].response.id)
            missing = []
            for gone in ("resp_nope", oldest.id, unstored.id):
                with pytest.raises(openai.NotFoundError) as retrieved:
                    await client.responses.retrieve(gone)
                with pytest.raises(openai.NotFoundError) as chained:
                    await client.responses.create(model=BASE, input="Hi", previous_response_id=gone)
                missing.append((retrieved.value.body, chained.value.body))
            return unstored, newest, streamed, events[-1].response, missing

    unstored, newest, streamed, streamed_as_sent, missing = asyncio.run(run())
    assert unstored.store is False and newest.store is True and streamed == streamed_as_sent
    assert len(store) == 2
    for gone, (retrieved, chained) in zip(("resp_nope", "resp_", "resp_"), missing, strict=True):
        assert retrieved["message"].startswith(f"Response with id '{gone}")
        assert chained["message"].startswith(f"Previous response with id '{gone}")
        assert chained["message"].endswith("not found.") and chained["param"] == "previous_response_id"


def test_the_store_forgets_by_age_and_bytes_and_shows_a_response_only_to_its_caller():
    now = [0.0]
    store = ResponseStore(10, 500, 60.0, clock=lambda: now[0])  # two of these fit, not three
    kept = ToKeep(({"type": "message", "id": "msg_1", "role": "user", "content": "x" * 100},), "alice")
    for n in range(3):
        store.put({"id": f"resp_{n}", "output": []}, kept)
    assert [store.get(f"resp_{n}", "alice") is not None for n in range(3)] == [False, True, True]  # bytes
    assert store.get("resp_2", "bob") is None and not store.delete("resp_2", "bob")
    now[0] = 61.0
    assert store.get("resp_2", "alice") is None and len(store) == 1  # expired, then dropped
    store.put({"id": "resp_big", "output": [{"text": "y" * 600}]}, kept)  # larger than all: not kept
    assert store.get("resp_big", "alice") is None


def test_without_a_store_what_needs_one_is_refused_naming_the_flag():
    async def run() -> dict:
        async with openai_client_of(_Scripted("Hi."), BASE) as client:
            with pytest.raises(openai.BadRequestError) as refused:
                await client.responses.create(model=BASE, input="Hi", store=True)
            with pytest.raises(openai.NotFoundError):
                await client.responses.retrieve("resp_1")
            return refused.value.body

    body = asyncio.run(run())
    assert body["param"] == "store" and "--responses-store-max" in json.dumps(body)


def test_a_response_cut_while_reasoning_is_continued():
    """A reasoning model cut by `max_output_tokens` while it thought answers an incomplete
    response whose output is a reasoning item alone; continuing it ("go on") by its id was a 400
    blaming the new input's first item, which the client cannot fix. Its turn is the assistant's,
    saying nothing, with that reasoning."""
    model, store = _Scripted("<think>Let me think", finish=pb.FINISH_REASON_LENGTH), _store()

    async def run() -> Response:
        async with openai_client_of(model, BASE, "none", "deepseek_r1", store=store) as client:
            cut = await client.responses.create(model=BASE, input="Hi", max_output_tokens=3)
            assert cut.status == "incomplete" and [o.type for o in cut.output] == ["reasoning"]
            return await client.responses.create(model=BASE, input="Go on.", previous_response_id=cut.id)

    assert asyncio.run(run()).status == "incomplete"
    assert _said(model.requests[1]) == [
        ("user", "Hi", ""), ("assistant", "", "Let me think"), ("user", "Go on.", ""),
    ]  # fmt: skip


def test_input_items_are_the_sdks_typed_items():
    """Every input item listed has the `status` OpenAI populates on items it returns, which the
    SDKs' function_call and function_call_output items require (a typed client failed on them)."""
    call = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}
    given = [{"role": "user", "content": "Hi"}, call, {"type": "function_call_output", "call_id": "call_1",
                                                        "output": "4"}]  # fmt: skip

    async def run() -> dict:
        async with openai_client_of(_Scripted("Hi."), BASE, store=_store()) as client:
            answer = await client.responses.create(model=BASE, input=given)
            return (await client.responses.with_raw_response.input_items.list(answer.id)).http_response.json()

    listed = ResponseItemList.model_validate(asyncio.run(run()))
    assert [(i.type, i.status) for i in listed.data] == [
        ("function_call_output", "completed"), ("function_call", "completed"), ("message", "completed"),
    ]  # fmt: skip


def test_an_item_the_conversation_has_already_is_refused():
    """A client that sends back the previous output along with its `previous_response_id` gave
    the model that turn twice (a function call was called twice); OpenAI refuses an item id the
    conversation already holds, and so does this."""
    model = _Scripted("Hi.")

    async def run() -> dict:
        async with openai_client_of(model, BASE, store=_store()) as client:
            first = await client.responses.create(model=BASE, input="Hi")
            again = [
                *[o.model_dump(exclude_none=True) for o in first.output],
                {"role": "user", "content": "And?"},
            ]
            with pytest.raises(openai.BadRequestError) as refused:
                await client.responses.create(model=BASE, input=again, previous_response_id=first.id)
            return refused.value.body

    body = asyncio.run(run())
    assert body["param"] == "input" and "Duplicate item" in body["message"] and len(model.requests) == 1


def test_a_response_too_large_to_keep_leaves_no_older_one_under_its_id():
    """A caller's x-request-id given again names a new response; one too large to keep left the
    older response under that id, which retrieve and `previous_response_id` then answered with."""
    store, kept = ResponseStore(10, 500, 60.0), ToKeep((), "alice")
    store.put({"id": "resp_x", "output": []}, kept)
    store.put({"id": "resp_x", "output": [{"text": "y" * 600}]}, kept)
    assert store.get("resp_x", "alice") is None and len(store) == 0 and store._bytes == 0
