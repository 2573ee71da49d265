"""The Responses API's stored responses (responses_store.py) through the `openai` SDK, its typed
models the schema oracle: a turn chained by `previous_response_id` reaches the model as the
whole conversation sent statelessly would, and retrieve, delete, input_items, 404s, eviction and
`store: false` behave as OpenAI's API does, in this process's memory and in a real Redis (the
session's redis-server): two front replicas sharing one Redis serve each other's responses, and
a Redis that does not answer is a 503 naming it, not a failed answer."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import socket
import uuid
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace

import openai
import pytest
from openai.types.responses import Response, ResponseItemList

from spindle.errors import ConfigError
from spindle.openai_api.context import HttpCallContext
from spindle.openai_api.responses_store import (
    KEY_PREFIX,
    RedisStore,
    ResponseStore,
    StoreUnavailable,
    ToKeep,
    add_store_args,
    store_of,
)
from spindle.v1 import generation_pb2 as pb
from tests.adapter_helpers import redis_server
from tests.service_helpers import free_port, openai_client_of
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


@pytest.fixture(params=["memory", "redis"])
def new_store(request) -> Callable[..., ResponseStore | RedisStore]:
    """Makes a store of each kind (made inside the test's event loop: a Redis client is bound to
    the loop it first runs on); Redis is the session's real redis-server."""
    if request.param == "memory":
        return lambda max_bytes=1 << 20, ttl_s=60.0: ResponseStore(100, max_bytes, ttl_s)
    url = request.getfixturevalue("redis_url")
    return lambda max_bytes=1 << 20, ttl_s=60.0: RedisStore.from_url(url, max_bytes, ttl_s)


async def _by_key(context: HttpCallContext) -> SimpleNamespace:
    """Every caller admitted, its bearer token its name: whose stored responses it sees (the
    gateway's API keys' names)."""
    return SimpleNamespace(name=dict(context.invocation_metadata())["authorization"].removeprefix("Bearer "))


def _said(request) -> list[tuple]:
    return [(m.role, m.content, m.reasoning_content) for m in request.chat.messages]


def test_a_chained_turn_is_the_whole_conversation_and_is_retrieved_listed_and_deleted(new_store):
    """Turn 2 sends only its new input with turn 1's id: the pod gets the messages the whole
    conversation sent without a store gets (turn 1's reasoning carried, its `instructions` not:
    OpenAI's rule), under turn 2's `model`. The responses are retrieved as returned, their input
    items listed and paged as the SDK pages them, and a deleted one is gone."""
    model = _Scripted("<think>Hm.</think>It is sunny.")

    async def run() -> tuple:
        async with openai_client_of(model, BASE, "none", "deepseek_r1", store=new_store()) as client:
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

    async def run() -> None:
        for n in range(3):
            await store.put({"id": f"resp_{n}", "output": []}, kept)
        assert [await store.get(f"resp_{n}", "alice") is not None for n in range(3)] == [False, True, True]
        assert await store.get("resp_2", "bob") is None and not await store.delete("resp_2", "bob")
        now[0] = 61.0
        assert await store.get("resp_2", "alice") is None and len(store) == 1  # expired, then dropped
        await store.put({"id": "resp_big", "output": [{"text": "y" * 600}]}, kept)  # larger than all
        assert await store.get("resp_big", "alice") is None

    asyncio.run(run())


def test_redis_keeps_a_response_for_its_caller_under_a_hashed_key_until_it_expires(redis_url):
    """In Redis a response is one key, its caller's name hashed in it (never the name itself), that
    expires with --responses-store-ttl-s; one larger than --responses-store-max-bytes is not kept;
    another caller neither sees nor deletes it."""
    import redis

    kept = ToKeep(({"type": "message", "id": "msg_1", "role": "user", "content": "x"},), "alice's key")
    rid = f"resp_{uuid.uuid4().hex}"

    async def run() -> tuple:
        store = RedisStore.from_url(redis_url, 500, 0.5)
        try:
            await store.put({"id": rid, "output": []}, kept)
            await store.put({"id": rid + "big", "output": [{"text": "y" * 600}]}, kept)
            bobs = (await store.get(rid, "bob"), await store.delete(rid, "bob"))
            seen = (await store.get(rid, "alice's key"), *bobs)
            big = await store.get(rid + "big", "alice's key")
            keys = [k.decode() for k in redis.Redis.from_url(redis_url).keys(f"*{rid}*")]
            await asyncio.sleep(0.6)
            return seen, big, keys, await store.get(rid, "alice's key")
        finally:
            await store.close()

    (mine, bobs, bob_deleted), big, keys, expired = asyncio.run(run())
    assert mine is not None and mine.conversation() == list(kept.input) and mine.owner == "alice's key"
    assert bobs is None and not bob_deleted and big is None and expired is None
    assert len(keys) == 1 and keys[0].startswith(KEY_PREFIX) and keys[0].endswith(":" + rid)
    assert "alice" not in keys[0]


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


def test_a_response_cut_while_reasoning_is_continued(new_store):
    """A reasoning model cut by `max_output_tokens` while it thought answers an incomplete
    response whose output is a reasoning item alone; continuing it ("go on") by its id was a 400
    blaming the new input's first item, which the client cannot fix. Its turn is the assistant's,
    saying nothing, with that reasoning."""
    model = _Scripted("<think>Let me think", finish=pb.FINISH_REASON_LENGTH)

    async def run() -> Response:
        async with openai_client_of(model, BASE, "none", "deepseek_r1", store=new_store()) as client:
            cut = await client.responses.create(model=BASE, input="Hi", max_output_tokens=3)
            assert cut.status == "incomplete" and [o.type for o in cut.output] == ["reasoning"]
            return await client.responses.create(model=BASE, input="Go on.", previous_response_id=cut.id)

    assert asyncio.run(run()).status == "incomplete"
    assert _said(model.requests[1]) == [
        ("user", "Hi", ""), ("assistant", "", "Let me think"), ("user", "Go on.", ""),
    ]  # fmt: skip


def test_input_items_are_the_sdks_typed_items(new_store):
    """Every input item listed has the `status` OpenAI populates on items it returns, which the
    SDKs' function_call and function_call_output items require (a typed client failed on them)."""
    call = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}
    given = [{"role": "user", "content": "Hi"}, call, {"type": "function_call_output", "call_id": "call_1",
                                                        "output": "4"}]  # fmt: skip

    async def run() -> dict:
        async with openai_client_of(_Scripted("Hi."), BASE, store=new_store()) as client:
            answer = await client.responses.create(model=BASE, input=given)
            return (await client.responses.with_raw_response.input_items.list(answer.id)).http_response.json()

    listed = ResponseItemList.model_validate(asyncio.run(run()))
    assert [(i.type, i.status) for i in listed.data] == [
        ("function_call_output", "completed"), ("function_call", "completed"), ("message", "completed"),
    ]  # fmt: skip


def test_an_item_the_conversation_has_already_is_refused(new_store):
    """A client that sends back the previous output along with its `previous_response_id` gave
    the model that turn twice (a function call was called twice); OpenAI refuses an item id the
    conversation already holds, and so does this."""
    model = _Scripted("Hi.")

    async def run() -> dict:
        async with openai_client_of(model, BASE, store=new_store()) as client:
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


def test_a_response_too_large_to_keep_leaves_no_older_one_under_its_id(new_store):
    """A caller's x-request-id given again names a new response; one too large to keep left the
    older response under that id, which retrieve and `previous_response_id` then answered with."""
    kept, rid = ToKeep((), "alice"), f"resp_{uuid.uuid4().hex}"

    async def run() -> None:
        store = new_store(max_bytes=500)
        await store.put({"id": rid, "output": []}, kept)
        await store.put({"id": rid, "output": [{"text": "y" * 600}]}, kept)
        assert await store.get(rid, "alice") is None
        if isinstance(store, ResponseStore):
            assert len(store) == 0 and store._bytes == 0
        await store.close()

    asyncio.run(run())


def test_two_replicas_sharing_redis_serve_each_others_responses_to_their_caller_only(redis_url):
    """The Helm chart's two gateway replicas behind one Service: a response made through one is
    continued, retrieved, listed and deleted through the other (each kept its own, and about half
    the chained turns were 404s); another caller sees it through neither."""
    model = _Scripted("It is sunny.")

    def replica():
        store = RedisStore.from_url(redis_url, 1 << 20, 60.0)
        return openai_client_of(model, BASE, store=store, admit=_by_key)

    async def run() -> tuple:
        async with replica() as one, replica() as other:
            first = await one.with_options(api_key="alice").responses.create(model=BASE, input="Weather?")
            alice = other.with_options(api_key="alice").responses
            bob = other.with_options(api_key="bob").responses
            second = await alice.create(model=BASE, input="Tomorrow?", previous_response_id=first.id)
            retrieved = await alice.retrieve(first.id)
            listed = await alice.input_items.list(second.id, order="asc")
            hidden = []
            chained = {"model": BASE, "input": "Hi", "previous_response_id": first.id}
            for call in (lambda: bob.retrieve(first.id), lambda: bob.delete(first.id),
                         lambda: bob.create(**chained)):  # fmt: skip
                with pytest.raises(openai.NotFoundError) as refused:
                    await call()
                hidden.append(refused.value.status_code)
            await alice.delete(first.id)
            with pytest.raises(openai.NotFoundError):
                await one.with_options(api_key="alice").responses.retrieve(first.id)
            return first, retrieved, listed, hidden

    first, retrieved, listed, hidden = asyncio.run(run())
    assert retrieved == first and hidden == [404, 404, 404]
    assert _said(model.requests[1]) == [
        ("user", "Weather?", ""), ("assistant", "It is sunny.", ""), ("user", "Tomorrow?", ""),
    ]  # fmt: skip
    assert [getattr(i, "role", None) for i in listed.data] == ["user", "assistant", "user"]


def test_a_redis_that_does_not_answer_is_a_503_naming_it_and_answers_go_on(tmp_path, caplog):
    """Redis gone: what needs a stored response is a 503 in OpenAI's shape naming the store and
    its address (it was a 500 traceback), a response that cannot be stored is still answered
    (the outage logged once), and the server goes on serving chats."""
    model, hi = _Scripted("Hi."), [{"role": "user", "content": "Hi"}]

    async def run(url: str, stop: Callable[[], None]) -> tuple:
        async with openai_client_of(model, BASE, store=RedisStore.from_url(url, 1 << 20, 60.0)) as client:
            api = client.responses
            first = await api.create(model=BASE, input="Hi")
            stop()
            refused = []
            chained = {"model": BASE, "input": "Hi", "previous_response_id": first.id}
            for call in (lambda: api.retrieve(first.id), lambda: api.delete(first.id),
                         lambda: api.input_items.list(first.id), lambda: api.create(**chained)):  # fmt: skip
                with pytest.raises(openai.InternalServerError) as e:
                    await call()
                refused.append((e.value.status_code, e.value.body))
            unstored = await api.create(model=BASE, input="Hi")
            return refused, unstored, await client.chat.completions.create(model=BASE, messages=hi)

    with caplog.at_level(logging.WARNING), contextlib.ExitStack() as redis_up:
        url = redis_up.enter_context(redis_server(tmp_path))
        refused, unstored, chat = asyncio.run(run(url, redis_up.close))
    assert len(refused) == 4
    for status, body in refused:
        assert status == 503 and body["type"] == "service_unavailable_error" and body["code"] == "UNAVAILABLE"
        assert f"response store (Redis at {url})" in body["message"] and "`store: false`" in body["message"]
    assert unstored.status == "completed" and chat.choices[0].message.content == "Hi."
    # One warning for the outage, not one a call: within `QUIET_S` of it the store is not asked.
    assert caplog.text.count(f"response store (Redis at {url}) does not answer") == 1, caplog.text
    assert f"response {unstored.id} answered but not stored" not in caplog.text


class _MeetingAfterGets(RedisStore):
    """A Redis store whose reads return only once `n` reads are in: two requests' reads both
    land before either request's next command (as two replicas' requests may, at any time)."""

    def __init__(self, *args, n: int = 2) -> None:
        super().__init__(*args)
        self.n, self.reads, self.met = n, 0, asyncio.Event()

    async def get(self, response_id: str, owner: str | None):
        found = await super().get(response_id, owner)
        self.reads += 1
        if self.reads >= self.n:
            self.met.set()
        await asyncio.wait_for(self.met.wait(), 5.0)
        return found


def test_of_two_deletes_of_one_response_only_one_is_told_it_deleted_it(redis_url):
    """Two DELETEs of one response at once (two replicas, or one): one deletes it, the other is
    OpenAI's 404 (each found it, then deleted it, and both were told `deleted: true`)."""
    rid = f"resp_{uuid.uuid4().hex}"

    async def run() -> list:
        plain = RedisStore.from_url(redis_url, 1 << 20, 60.0)
        await plain.put({"id": rid, "output": []}, ToKeep((), None))
        await plain.close()
        store = RedisStore.from_url(redis_url, 1 << 20, 60.0)
        meeting = _MeetingAfterGets(store.r, store.where, store.max_bytes, 60.0)
        async with openai_client_of(_Scripted("Hi."), BASE, store=meeting) as client:
            deletes = [client.responses.delete(rid) for _ in range(2)]
            return await asyncio.gather(*deletes, return_exceptions=True)

    answers = asyncio.run(run())
    assert sum(a is None for a in answers) == 1, answers
    assert sum(isinstance(a, openai.NotFoundError) for a in answers) == 1, answers


def test_a_ttl_redis_cannot_keep_is_refused_at_start_naming_the_flag(redis_url):
    """`--responses-store-ttl-s inf` (a response kept for ever: right in memory) with a Redis URL
    was an OverflowError traceback at start, and 1e20 a Redis refusal of every response stored."""
    parser = argparse.ArgumentParser()
    add_store_args(parser)
    for ttl in ("inf", "1e20"):
        args = parser.parse_args(["--responses-store-ttl-s", ttl, "--responses-store-redis-url", redis_url])
        with pytest.raises(ConfigError, match="--responses-store-ttl-s"):
            store_of(args)
    memory = store_of(parser.parse_args(["--responses-store-ttl-s", "inf"]))
    assert isinstance(memory, ResponseStore)


def test_a_misconfigured_redis_is_reported_at_start_not_at_the_first_chained_turn(tmp_path, caplog):
    """A Redis URL nobody listens on, a wrong password, a database Redis does not have and a
    rediss:// URL of a Redis without TLS: the server starts (as the adapter service does, its Redis
    may come up after it) and says at once, naming the store and the cause; nothing was said
    until a client's chained turn was a 503."""
    from opentelemetry.trace import get_tracer

    from spindle.openai_api.server import OpenAIServer

    async def started(url: str) -> None:
        store = RedisStore.from_url(url, 1 << 20, 60.0)
        tracer = get_tracer(__name__)
        server = OpenAIServer(_Scripted("Hi."), lambda: (BASE,), lambda: True, tracer, store=store)
        await server.start("127.0.0.1", 0)
        await server.stop()

    with redis_server(tmp_path) as url:
        import redis

        redis.Redis.from_url(url).config_set("requirepass", "sekret")
        host = url.removeprefix("redis://").removesuffix("/0")
        wrong = {
            f"redis://127.0.0.1:{free_port()}/0": "ConnectionError",
            f"redis://:wrong@{host}/0": "AuthenticationError",
            f"redis://:sekret@{host}/99": "DB index is out of range",
            f"rediss://:sekret@{host}/0": "does this Redis serve TLS?",
        }
        for bad, cause in wrong.items():
            caplog.clear()
            with caplog.at_level(logging.WARNING):
                asyncio.run(started(bad))
            assert "response store (Redis at " in caplog.text and cause in caplog.text, (bad, caplog.text)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            asyncio.run(started(f"redis://:sekret@{host}/0"))
        assert caplog.text == ""


def test_redis_at_maxmemory_evicts_older_responses_or_its_refusal_is_logged_as_one(tmp_path, caplog):
    """The chart's Redis (volatile-lru) past its maxmemory: every response is answered and stored,
    the oldest evicted. An operator's Redis with `noeviction`: a response Redis refuses is still
    answered, and the log says Redis refused it and why (it said the store "does not answer",
    sending the operator to the network for a Redis that was full)."""
    import redis

    model, said = _Scripted("Hi."), "x" * 20_000  # each response ~20 kB in Redis: 150 of them, 3 MB

    async def run(url: str) -> tuple:
        async with openai_client_of(model, BASE, store=RedisStore.from_url(url, 1 << 20, 60.0)) as client:
            ids = [(await client.responses.create(model=BASE, input=said)).id for _ in range(150)]
            found = []
            for rid in (ids[0], ids[-1]):
                with contextlib.suppress(openai.NotFoundError):
                    found.append(await client.responses.retrieve(rid))
            return ids, [r.id for r in found]

    for policy in ("volatile-lru", "noeviction"):
        with redis_server(tmp_path) as url, caplog.at_level(logging.WARNING):
            redis.Redis.from_url(url).config_set("maxmemory-policy", policy)
            redis.Redis.from_url(url).config_set("maxmemory", "3mb")
            caplog.clear()
            ids, found = asyncio.run(run(url))
            kept = redis.Redis.from_url(url).dbsize()
        if policy == "volatile-lru":  # older ones evicted (which: Redis samples, its LRU is approximate)
            assert ids[-1] in found and kept < len(ids) and "not stored" not in caplog.text
        else:
            assert found == [ids[0]] and f"response {ids[-1]} answered but not stored" in caplog.text
            assert "refuses it: OutOfMemoryError" in caplog.text and "volatile-lru" in caplog.text
            assert "does not answer" not in caplog.text


def test_a_redis_that_hangs_is_not_asked_again_for_a_while(monkeypatch, caplog):
    """A Redis that accepts connections and never answers (stopped, a network black hole) held
    every Responses API answer for the commands' whole bound (~6 s; `store` is true by default)
    and logged a warning each: after one call times out, the store now fails at once for
    `QUIET_S`, logging that once, then asks Redis again."""
    import time

    from spindle import redis_client
    from spindle.openai_api import responses_store

    monkeypatch.setattr(responses_store, "QUIET_S", 0.5)

    async def run(port: int) -> list[tuple[float, bool]]:
        url = f"redis://127.0.0.1:{port}/0"
        client = redis_client.connect(url, timeout=0.2, attempts=1)
        store = RedisStore(client, f"Redis at {url}", 1 << 20, 60.0)
        timed = []
        for pause in (0, 0, 0, 0.6):
            await asyncio.sleep(pause)
            start = time.monotonic()
            with pytest.raises(StoreUnavailable) as e:
                await store.get("resp_x", None)
            timed.append((time.monotonic() - start, e.value.logged))
        await store.close()
        return timed

    with socket.create_server(("127.0.0.1", 0)) as silent, caplog.at_level(logging.WARNING):
        silent.listen(16)  # connections are accepted by the kernel, never answered
        timed = asyncio.run(run(silent.getsockname()[1]))
    assert timed[0][0] >= 0.15 and all(t < 0.05 for t, _ in timed[1:3]), timed  # not asked again
    assert timed[3][0] >= 0.15, timed  # asked again after QUIET_S
    assert all(logged for _, logged in timed)
    assert caplog.text.count("does not answer") == 2, caplog.text  # once an outage window
