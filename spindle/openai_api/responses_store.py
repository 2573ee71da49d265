"""The Responses API's stored responses: what `previous_response_id`, `GET /v1/responses/{id}`,
`DELETE /v1/responses/{id}` and `GET /v1/responses/{id}/input_items` read.

OpenAI stores a response unless the request says `store: false`, and clients (the Agents SDK,
LangChain) chain turns by sending only the new input with the previous response's id. Kept here,
in this front process's memory (as vLLM keeps them): each completed or incomplete response, the
object as it was returned, with every input item the model was given (an earlier response's
conversation included), so that the next turn's prompt is that conversation, that response's
output and the new input, through the same chat path. Bounded by count and by bytes (the least
recently used go first) and by age (`--responses-store-ttl-s`); a response is seen only by the
caller (API key) that made it. Several front replicas each keep their own: a chained request
must reach the same one (sticky sessions), or the client sends the whole conversation.
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from spindle import flagtypes
from spindle.openai_api.errors import ApiError, bad_request

DEFAULT_MAX, DEFAULT_MAX_BYTES, DEFAULT_TTL_S = 10_000, 256 << 20, 3600.0
OFF = (
    "responses are not stored here (--responses-store-max, --responses-store-max-bytes or "
    "--responses-store-ttl-s is 0)"
)
_ID_PREFIXES = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_", "reasoning": "rs_"}


@dataclass(frozen=True)
class ToKeep:
    """What a request asks to be kept of its response: every input item the model is given
    (each with an id), and the caller it is kept for (None: no API keys)."""

    input: tuple[dict[str, Any], ...]
    owner: str | None


@dataclass
class Stored:
    """A kept response: the object as returned, the input items it answered, and for whom."""

    response: dict[str, Any]
    input: tuple[dict[str, Any], ...]
    owner: str | None
    size: int  # bytes, as JSON
    expires: float

    def conversation(self) -> list[dict[str, Any]]:
        """What a response continuing this one follows: its input, then its output."""
        return [*self.input, *self.response["output"]]


class ResponseStore:
    """Responses by id, at most `max_count` of them and `max_bytes` (as JSON) in all, each for
    `ttl_s` seconds after it was stored; the least recently used go first."""

    def __init__(
        self, max_count: int, max_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_count, self.max_bytes, self.ttl_s, self.clock = max_count, max_bytes, ttl_s, clock
        self._entries: OrderedDict[tuple[str | None, str], Stored] = OrderedDict()  # by (owner, id)
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict[str, Any], kept: ToKeep) -> None:
        """Keep `response`; the least recently used go until it fits (one larger than the whole
        budget is not kept)."""
        self.delete(response["id"], kept.owner)  # an id a caller gave again (x-request-id): the new one
        size = len(json.dumps([response, kept.input], ensure_ascii=False).encode())
        if size > self.max_bytes:
            return
        entry = Stored(response, kept.input, kept.owner, size, self.clock() + self.ttl_s)
        self._entries[kept.owner, response["id"]] = entry
        self._bytes += size
        while len(self._entries) > self.max_count or self._bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def get(self, response_id: str, owner: str | None) -> Stored | None:
        """The response `response_id` kept for `owner`, if it is there and not expired."""
        entry = self._entries.get((owner, response_id))
        if entry is None:
            return None
        if entry.expires <= self.clock():
            self._drop((owner, response_id))
            return None
        self._entries.move_to_end((owner, response_id))
        return entry

    def delete(self, response_id: str, owner: str | None) -> bool:
        """Forget response `response_id` of `owner`; whether it was there."""
        found = self.get(response_id, owner) is not None
        if found:
            self._drop((owner, response_id))
        return found

    def _drop(self, key: tuple[str | None, str]) -> None:
        self._bytes -= self._entries.pop(key).size


def add_store_args(parser: argparse.ArgumentParser | Any) -> None:
    """`--responses-store-max`, `--responses-store-max-bytes` and `--responses-store-ttl-s`."""
    count, size = flagtypes.at_least(0), flagtypes.at_least(0)
    parser.add_argument(
        "--responses-store-max",
        type=count,
        default=DEFAULT_MAX,
        help="how many Responses API responses this process keeps in memory for `previous_response_id` "
        "and GET/DELETE /v1/responses/{id} (the least recently used go first); 0 = none is kept, "
        f"`store: true` and `previous_response_id` are refused [{DEFAULT_MAX}]",
    )
    parser.add_argument(
        "--responses-store-max-bytes",
        type=size,
        default=DEFAULT_MAX_BYTES,
        help="the most bytes (as JSON, each response with its whole conversation) the kept responses take "
        f"in all; 0 = none is kept [{DEFAULT_MAX_BYTES}]",
    )
    parser.add_argument(
        "--responses-store-ttl-s",
        type=flagtypes.seconds_or_none,
        default=DEFAULT_TTL_S,
        help=f"how long a kept response is kept, in seconds; 0 = none is kept [{DEFAULT_TTL_S:g}]",
    )


def store_of(args: argparse.Namespace) -> ResponseStore | None:
    """The store the flags ask for (None: responses are not kept)."""
    count = getattr(args, "responses_store_max", DEFAULT_MAX)
    size = getattr(args, "responses_store_max_bytes", DEFAULT_MAX_BYTES)
    ttl = getattr(args, "responses_store_ttl_s", DEFAULT_TTL_S)
    return ResponseStore(count, size, ttl) if count and size and ttl else None


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
