"""The Responses API's stored responses: what `previous_response_id`, `GET /v1/responses/{id}`,
`DELETE /v1/responses/{id}` and `GET /v1/responses/{id}/input_items` read.

OpenAI stores a response unless the request says `store: false`, and clients (the Agents SDK,
LangChain) chain turns by sending only the new input with the previous response's id. Kept here:
each completed or incomplete response, the object as it was returned, with every input item the
model was given (an earlier response's conversation included), so that the next turn's prompt is
that conversation, that response's output and the new input, through the same chat path. A
response is seen only by the caller (API key) that made it, and kept `--responses-store-ttl-s`.

Where, as `--responses-store-redis-url` says:
- empty (the default): this front process's memory (as vLLM keeps them), bounded by count and by
  bytes (the least recently used go first). Several front replicas each keep their own, so a
  chained request must reach the same one (sticky sessions), or the client sends the whole
  conversation: behind the Helm chart's two gateway replicas, half the chained turns were 404s.
- a Redis URL (`RedisStore`; the chart's default when it runs Redis): shared by every replica, so a
  turn may reach any of them. Each response is one key, `spindle:responses:<owner hash>:<id>`,
  that expires with the TTL; `--responses-store-max-bytes` bounds one response (one larger is not
  kept), and Redis's own `maxmemory` (with a `volatile-*` eviction policy, least recently used
  first) bounds them all: `--responses-store-max` does not apply. Reaching Redis is awaited on
  the event loop (redis-py's asyncio client, as the adapter service's registry: one client recipe,
  spindle/redis_client.py). A Redis that does not answer is a 503 naming it for what needs a
  stored response; a response that cannot be stored is still answered (logged).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from spindle import flagtypes, redis_client
from spindle.errors import ConfigError
from spindle.openai_api.errors import ApiError, bad_request

log = logging.getLogger(__name__)

DEFAULT_MAX, DEFAULT_MAX_BYTES, DEFAULT_TTL_S = 10_000, 256 << 20, 3600.0
OFF = (
    "responses are not stored here (--responses-store-max, --responses-store-max-bytes or "
    "--responses-store-ttl-s is 0)"
)
KEY_PREFIX = "spindle:responses:"
QUIET_S = 5.0  # after Redis did not answer, how long calls fail at once (`RedisStore._answering`)
MAX_REDIS_TTL_MS = 2**62  # what Redis's PX takes, with room for its clock (its limit: 2**63 - 1 - now)
_ID_PREFIXES = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_", "reasoning": "rs_"}


@dataclass(frozen=True)
class ToKeep:
    """What a request asks to be kept of its response: every input item the model is given
    (each with an id), and the caller it is kept for (None: no API keys)."""

    input: tuple[dict[str, Any], ...]
    owner: str | None


@dataclass(frozen=True)
class Stored:
    """A kept response: the object as returned, the input items it answered, and for whom."""

    response: dict[str, Any]
    input: tuple[dict[str, Any], ...]
    owner: str | None

    def conversation(self) -> list[dict[str, Any]]:
        """What a response continuing this one follows: its input, then its output."""
        return [*self.input, *self.response["output"]]


class StoreUnavailable(ApiError):
    """A 503: the store does not answer, or answers with a refusal (`refused`: a Redis out of
    memory, a read-only replica, a wrong password). Says which store, where, which of the two (a
    Redis that was full was reported as one that "does not answer", and sent its operator to the
    network), and what a client can do meanwhile (a 500 with a traceback told the operator nothing)."""

    def __init__(self, where: str, why: str, refused: bool = False, logged: bool = False) -> None:
        self.logged = logged  # the store logged this outage already (`RedisStore._answering`)
        state = "refuses it" if refused else "does not answer"
        message = (
            f"the Responses API's response store ({where}) {state}: {why}. Stored responses "
            "(`previous_response_id`, /v1/responses/{id}) are out of reach until it does; meanwhile "
            "send the whole conversation as `input` with `store: false`"
        )
        super().__init__(503, "service_unavailable_error", "UNAVAILABLE", message)


class Store(Protocol):
    """Where responses are kept: `ResponseStore` (this process) or `RedisStore` (shared). Any
    call may raise StoreUnavailable."""

    async def put(self, response: dict[str, Any], kept: ToKeep) -> None: ...

    async def get(self, response_id: str, owner: str | None) -> Stored | None: ...

    async def delete(self, response_id: str, owner: str | None) -> bool: ...

    async def close(self) -> None: ...

    async def check(self, within: float) -> None: ...


def encoded(response: dict[str, Any], kept: ToKeep) -> bytes:
    """A response and its input as JSON: what Redis holds, and what the byte bounds count."""
    return json.dumps([response, kept.input], ensure_ascii=False).encode()


class _Entry(NamedTuple):
    stored: Stored
    size: int  # bytes, as JSON
    expires: float


class ResponseStore:
    """Responses by id in this process, at most `max_count` of them and `max_bytes` (as JSON) in
    all, each for `ttl_s` seconds after it was stored; the least recently used go first."""

    def __init__(
        self, max_count: int, max_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_count, self.max_bytes, self.ttl_s, self.clock = max_count, max_bytes, ttl_s, clock
        self._entries: OrderedDict[tuple[str | None, str], _Entry] = OrderedDict()  # by (owner, id)
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    async def put(self, response: dict[str, Any], kept: ToKeep) -> None:
        """Keep `response`; the least recently used go until it fits (one larger than the whole
        budget is not kept)."""
        await self.delete(response["id"], kept.owner)  # an id a caller gave again (x-request-id): the new one
        size = len(encoded(response, kept))
        if size > self.max_bytes:
            return
        stored = Stored(response, kept.input, kept.owner)
        self._entries[kept.owner, response["id"]] = _Entry(stored, size, self.clock() + self.ttl_s)
        self._bytes += size
        while len(self._entries) > self.max_count or self._bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    async def get(self, response_id: str, owner: str | None) -> Stored | None:
        """The response `response_id` kept for `owner`, if it is there and not expired."""
        entry = self._entries.get((owner, response_id))
        if entry is None:
            return None
        if entry.expires <= self.clock():
            self._drop((owner, response_id))
            return None
        self._entries.move_to_end((owner, response_id))
        return entry.stored

    async def delete(self, response_id: str, owner: str | None) -> bool:
        """Forget response `response_id` of `owner`; whether it was there."""
        found = await self.get(response_id, owner) is not None
        if found:
            self._drop((owner, response_id))
        return found

    async def close(self) -> None:
        """Nothing to let go of: the responses go with the process."""

    async def check(self, within: float) -> None:
        """Always there: this process's memory."""

    def _drop(self, key: tuple[str | None, str]) -> None:
        self._bytes -= self._entries.pop(key).size


class RedisStore:
    """Responses in Redis, shared by every front replica: one key a response, expiring `ttl_s`
    after it was stored, none larger than `max_bytes` (the module's docstring: how the bounds map
    onto Redis). `client`: a `redis.asyncio.Redis`; `where`: its address, as errors name it."""

    def __init__(self, client: Any, where: str, max_bytes: int, ttl_s: float) -> None:
        # imported only with a Redis: the gateway runs without redis-py
        from redis.exceptions import AuthenticationError, RedisError, ResponseError

        self.r, self.where, self.max_bytes, self.ttl_ms = client, where, max_bytes, max(int(ttl_s * 1000), 1)
        self._failures, self._refusals = (RedisError, OSError), (ResponseError, AuthenticationError)
        self._quiet_until, self._last_failure = 0.0, ""  # the breaker (`_answering`)

    @classmethod
    def from_url(cls, url: str, max_bytes: int, ttl_s: float) -> RedisStore:
        """The store at `url`, its password there or in SPINDLE_REDIS_PASSWORD."""
        client = redis_client.connect(url, redis_client.env_password())
        return cls(client, f"Redis at {redis_client.address(url)}", max_bytes, ttl_s)

    async def put(self, response: dict[str, Any], kept: ToKeep) -> None:
        """Keep `response`; one larger than `max_bytes` is not kept, and forgets an older one of
        the same id (an x-request-id given again), as the in-process store does."""
        raw, key = encoded(response, kept), _key(kept.owner, response["id"])
        async with self._answering():
            if len(raw) > self.max_bytes:
                await self.r.delete(key)
            else:
                await self.r.set(key, raw, px=self.ttl_ms)

    async def get(self, response_id: str, owner: str | None) -> Stored | None:
        """The response `response_id` kept for `owner`, if Redis still holds it."""
        async with self._answering():
            raw = await self.r.get(_key(owner, response_id))
        if raw is None:
            return None
        response, items = json.loads(raw)
        return Stored(response, tuple(items), owner)

    async def delete(self, response_id: str, owner: str | None) -> bool:
        """Forget response `response_id` of `owner`; whether it was there."""
        async with self._answering():
            return bool(await self.r.delete(_key(owner, response_id)))

    async def close(self) -> None:
        await self.r.aclose()

    async def check(self, within: float) -> None:
        """Whether Redis answers within `within` s, at start: a wrong URL, password or database
        was said only at a client's first chained turn, as a 503."""
        async with self._answering():
            try:
                await asyncio.wait_for(self.r.ping(), within)
            except asyncio.TimeoutError as e:
                raise TimeoutError(f"no answer within {within:g} s") from e

    @contextlib.asynccontextmanager
    async def _answering(self) -> AsyncIterator[None]:
        """Redis's failures (unreachable, timed out, a refusal: out of memory, a wrong password) as
        StoreUnavailable, with what an operator can do about the cause. A breaker: for `QUIET_S`
        after Redis did not answer, calls fail at once rather than ask again. A hung Redis held
        every Responses API answer (`store` is true by default) for the commands' bound, ~6 s,
        and logged a warning for each."""
        if time.monotonic() < self._quiet_until:
            why = f"{self._last_failure}; not asked again for {QUIET_S:g} s after that"
            raise StoreUnavailable(self.where, why, logged=True)
        try:
            yield
        except self._failures as e:
            why = _why(e, self.where)
            if isinstance(e, self._refusals):  # a refusal comes at once: nothing to wait out
                raise StoreUnavailable(self.where, why, refused=True) from e
            self._quiet_until, self._last_failure = time.monotonic() + QUIET_S, why
            log.warning(
                "the Responses API's response store (%s) does not answer: %s; for %g s every call to "
                "it fails at once (stored responses out of reach, new ones not kept)",
                self.where,
                why,
                QUIET_S,
            )
            raise StoreUnavailable(self.where, why, logged=True) from e


_HINTS = {
    "OutOfMemoryError": "Redis is at its maxmemory and its maxmemory-policy evicts nothing: give it "
    "volatile-lru, as the Helm chart's Redis has, so that the least recently used responses go first",
    "ReadOnlyError": "this Redis is a read-only replica: give the primary's URL",
}


def _why(e: BaseException, where: str) -> str:
    """`e` as a message says it, with a hint where the error alone misleads (a rediss:// URL of a
    Redis without TLS is a timeout: the server waits for a command, the client for a handshake)."""
    from redis.exceptions import TimeoutError as RedisTimeoutError

    hint = _HINTS.get(type(e).__name__)
    if hint is None and isinstance(e, TimeoutError | RedisTimeoutError) and "rediss://" in where:
        hint = "a rediss:// URL: does this Redis serve TLS? One without it never answers the TLS handshake"
    said = f"{type(e).__name__}: {str(e).rstrip('.')}"
    return f"{said} ({hint})" if hint else said


def _key(owner: str | None, response_id: str) -> str:
    """The Redis key of `owner`'s response `response_id`: the owner (an API key's name) hashed,
    so that no caller's name is readable from the keys nor can collide with another's."""
    who = "-" if owner is None else hashlib.sha256(owner.encode()).hexdigest()[:32]
    return f"{KEY_PREFIX}{who}:{response_id}"


async def kept_or_logged(store: Store, response: dict[str, Any], kept: ToKeep) -> None:
    """Store `response`, which its client gets anyway: a store that does not answer fails no
    answer already produced, it is logged (the client finds it missing when it chains)."""
    try:
        await store.put(response, kept)
    except StoreUnavailable as e:
        level = logging.DEBUG if e.logged else logging.WARNING  # a warning an outage, not a response
        log.log(level, "response %s answered but not stored: %s", response["id"], e.message)


def add_store_args(parser: argparse.ArgumentParser | Any) -> None:
    """`--responses-store-max`, `--responses-store-max-bytes`, `--responses-store-ttl-s` and
    `--responses-store-redis-url`."""
    count, size = flagtypes.at_least(0), flagtypes.at_least(0)
    parser.add_argument(
        "--responses-store-max",
        type=count,
        default=DEFAULT_MAX,
        help="how many Responses API responses this process keeps in memory for `previous_response_id` "
        "and GET/DELETE /v1/responses/{id} (the least recently used go first; not with "
        "--responses-store-redis-url); 0 = none is kept, `store: true` and `previous_response_id` are "
        f"refused [{DEFAULT_MAX}]",
    )
    parser.add_argument(
        "--responses-store-max-bytes",
        type=size,
        default=DEFAULT_MAX_BYTES,
        help="the most bytes (as JSON, each response with its whole conversation) the kept responses take "
        "in all (in Redis: one response; Redis's maxmemory bounds them all); 0 = none is kept "
        f"[{DEFAULT_MAX_BYTES}]",
    )
    parser.add_argument(
        "--responses-store-ttl-s",
        type=flagtypes.seconds_or_none,
        default=DEFAULT_TTL_S,
        help=f"how long a kept response is kept, in seconds; 0 = none is kept [{DEFAULT_TTL_S:g}]",
    )
    parser.add_argument(
        "--responses-store-redis-url",
        default="",
        help="redis://HOST:PORT/DB (rediss:// for TLS): keep Responses API responses in this Redis, shared "
        "by every gateway replica, so a chained turn may reach any of them (password: in the URL or "
        "SPINDLE_REDIS_PASSWORD); empty = in this process's memory [empty]",
    )


def store_of(args: argparse.Namespace) -> Store | None:
    """The store the flags ask for (None: responses are not kept)."""
    count = getattr(args, "responses_store_max", DEFAULT_MAX)
    size = getattr(args, "responses_store_max_bytes", DEFAULT_MAX_BYTES)
    ttl = getattr(args, "responses_store_ttl_s", DEFAULT_TTL_S)
    url = getattr(args, "responses_store_redis_url", "")
    if not (count and size and ttl):
        return None
    if not url:
        return ResponseStore(count, size, ttl)
    if not ttl * 1000 <= MAX_REDIS_TTL_MS:  # inf was an OverflowError traceback, 1e20 every put refused
        why = "in Redis a response must expire (at most 2**62 ms: a key that never expires is never evicted"
        raise ConfigError(f"--responses-store-ttl-s: {why} under a volatile-* maxmemory-policy), got {ttl:g}")
    try:
        return RedisStore.from_url(url, size, ttl)
    except ImportError as e:
        why = f"--responses-store-redis-url needs redis-py: pip install 'spindle[gateway]' ({e})"
        raise ConfigError(why) from e
    except ValueError as e:  # a URL redis-py refuses (no scheme, a bad port)
        raise ConfigError(f"--responses-store-redis-url: {e}") from e


def input_items(given: Any) -> list[dict[str, Any]]:
    """`input` (already checked) as the items input_items lists: a string is a user message,
    a message's string content an `input_text` part (`output_text` for an assistant's), and
    every item has an id and a status (OpenAI's on items it returns; the SDKs' function_call and
    function_call_output items require one)."""
    if isinstance(given, str):
        given = [{"role": "user", "content": given}]
    out = []
    for item in given:
        kind = item.get("type", "message")
        item = {**item, "type": kind}
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
        item.setdefault("id", _ID_PREFIXES.get(kind, "item_") + uuid.uuid4().hex)
        item.setdefault("status", "completed")
        out.append(item)
    return out


def not_found(response_id: str, previous: bool = False, why: str = "") -> ApiError:
    """OpenAI's 404 for a response it does not hold."""
    message = f"{'Previous response' if previous else 'Response'} with id {response_id!r:.200} not found."
    param = "previous_response_id" if previous else None
    return ApiError(404, "invalid_request_error", "NOT_FOUND", message + (f" ({why})" if why else ""), param)


def page(items: Sequence[dict[str, Any]], query: Mapping[str, str]) -> dict[str, Any]:
    """GET .../input_items: `items` as OpenAI's list, by `order` ("desc", newest first, unless
    "asc"), `limit` (1 to 100, 20) items after the item `after`."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request(f'`order` must be "asc" or "desc", got {order!r:.100}', "order")
    limit = query.get("limit", "20")
    if not (limit.isdigit() and 1 <= int(limit) <= 100):
        raise bad_request(f"`limit` must be 1 to 100, got {limit!r:.100}", "limit")
    ordered = list(items) if order == "asc" else list(reversed(items))
    start = 0
    if "after" in query:
        ids = [item["id"] for item in ordered]
        if query["after"] not in ids:
            raise bad_request(f"`after`: no input item {query['after']!r:.100} in this response", "after")
        start = ids.index(query["after"]) + 1
    data = ordered[start : start + int(limit)]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": start + int(limit) < len(ordered),
    }
