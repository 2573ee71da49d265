"""A chat completion's answer as OpenAI's Responses API answers it: a `response` object and its
server-sent events.

The answer is read by the chat path (`Reply.chunks`: the reasoning and tool-call parsers, as a
chat stream reads them) and its deltas become output items in the order they come: a `reasoning`
item for `reasoning_content`, a `message` with one `output_text` part for `content`, a
`function_call` item per call. Each item streams as OpenAI streams it (`output_item.added`, its
content part, its deltas, their `done` events, `output_item.done`), between `response.created` /
`response.in_progress` and `response.completed` (or `response.incomplete`, with
`incomplete_details.reason` "max_output_tokens", for an answer cut short). A whole response is
the same events' final snapshot, so streamed and whole answers cannot differ. A completed or
incomplete response whose request did not say `store: false` is kept as returned, when the
process keeps responses (responses_store.py).
"""

from __future__ import annotations

import copy
import time
import uuid
from collections.abc import Collection, Sequence
from dataclasses import replace
from typing import Any

from spindle.openai_api import reasoning_blob, requests
from spindle.openai_api.errors import ApiError, bad_request
from spindle.openai_api.fanout import Answer
from spindle.openai_api.requests import Call
from spindle.openai_api.responses import ChatFormat, Reply, total
from spindle.openai_api.responses_input import chat_body, includes_reasoning_blobs
from spindle.openai_api.responses_store import Store, ToKeep, input_items, kept_or_logged, not_found
from spindle.v1 import generation_pb2 as pb

# item kind -> (id prefix, its text delta and done events); a function call streams its arguments
_KINDS = {
    "message": ("msg_", "response.output_text"),
    "reasoning": ("rs_", "response.reasoning_text"),
    "function_call": ("fc_", "response.function_call_arguments"),
}


class ResponsesFormat(ChatFormat):
    """POST /v1/responses: the body as the chat request it means (responses_input.py), answered
    by a `ResponsesReply`. `reasoning_key`: the deployment's --reasoning-key-file key, which
    reasoning blobs are signed and checked with (None: encoded only, reasoning_blob.py);
    `store`: where responses are kept (None: none is, and what needs one is refused)."""

    object, id_prefix = "response", "resp_"

    def __init__(
        self,
        tool_parser: str = "none",
        reasoning_parser: str = "none",
        reasoning_key: bytes | None = None,
        store: Store | None = None,
    ) -> None:
        super().__init__(tool_parser, reasoning_parser)
        self.reasoning_key, self.store = reasoning_key, store

    def parse(self, body: dict[str, Any], base_models: Collection[str]) -> tuple[pb.GenerateRequest, Call]:
        """The request as without a store (`parse_as` looks its `previous_response_id` up)."""
        return self._parsed(body, base_models, None, None)

    async def parse_as(
        self, body: dict[str, Any], base_models: Collection[str], owner: str | None
    ) -> tuple[pb.GenerateRequest, Call]:
        """The request, after the conversation of its `previous_response_id` (the caller
        `owner`'s); what is kept of its response unless it says `store: false`."""
        return self._parsed(body, base_models, owner, await self._earlier(body, owner))

    def _parsed(
        self,
        body: dict[str, Any],
        base_models: Collection[str],
        owner: str | None,
        earlier: list[dict[str, Any]] | None,
    ) -> tuple[pb.GenerateRequest, Call]:
        """The request after `earlier`, the conversation it continues (None: no store)."""
        chat = chat_body(body, self.reasoning_key, earlier)
        req, call = requests.chat_request(chat, base_models, self.tool_parser, self.reasoning_parser)
        sealed = includes_reasoning_blobs(body.get("include"))
        kept = None
        if earlier is not None:
            conversation = (*earlier, *input_items(body["input"]))
            _unique_ids(conversation)
            kept = ToKeep(conversation, owner) if body.get("store") is not False else None
        said = restated(body, kept is not None)
        return req, replace(call, restated=said, sealed_reasoning=sealed, kept=kept)

    async def _earlier(self, body: dict[str, Any], owner: str | None) -> list[dict[str, Any]] | None:
        """The conversation `previous_response_id` continues ([] for none; None: no store)."""
        if self.store is None:
            return None
        previous = body.get("previous_response_id")
        if previous is None:
            return []
        if not isinstance(previous, str):
            raise bad_request("`previous_response_id` must be a response's id", "previous_response_id")
        stored = await self.store.get(previous, owner)
        if stored is None:
            raise not_found(previous, previous=True)
        return stored.conversation()

    def reply(self, call: Call, request_id: str) -> Reply:
        return ResponsesReply(self, call, request_id)


def _unique_ids(items: Sequence[dict[str, Any]]) -> None:
    """OpenAI's 400 for an input item whose id the conversation holds already: a client that
    sends the previous output back with `previous_response_id` gave the model that turn twice."""
    seen: set[str] = set()
    for item in items:
        if item["id"] in seen:
            why = "an item is given once in a conversation, `previous_response_id`'s included: send new ones"
            raise bad_request(f"Duplicate item found with id {item['id']!r:.100} ({why})", "input")
        seen.add(item["id"])


def restated(body: dict[str, Any], stored: bool = False) -> dict[str, Any]:
    """The request's settings a response object restates (OpenAI's defaults where unset), and
    whether it is `stored`."""
    return {
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
        "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
        "reasoning": body.get("reasoning"),
        "temperature": body.get("temperature"),
        "text": {"format": {"type": "text"}, **(body.get("text") or {})},
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p"),
        "user": body.get("user"),
        "store": stored,
        "background": False,
        "truncation": "disabled",
        "previous_response_id": body.get("previous_response_id"),
    }


class ResponsesReply(Reply):
    """One generation's Responses API answer, as events (streamed) or the response (whole)."""

    named_events = True  # `event: <type>` before each `data:`, as OpenAI sends them
    done = b""  # no `[DONE]`: `response.completed` ends the stream

    def __post_init__(self) -> None:
        super().__post_init__()
        self._sequence = 0
        self._items: list[dict[str, Any]] = []  # the output items so far, the last maybe open
        self._open = False  # whether the last item still streams
        self._finish: str | None = None  # the chat finish reason, once it came
        self._failed: dict[str, str] | None = None  # the error a failed stream ended with
        self._to_keep: dict[str, Any] | None = None  # the whole response, once its request wants it kept

    def opening(self) -> list[dict[str, Any]]:
        response = self._response("in_progress")
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]  # fmt: skip

    def chunks(self, index: int, prompt: int, message: pb.GenerateResponse) -> list[dict[str, Any]]:
        """The events for one message: the chat deltas it reads as, as output items."""
        events: list[dict[str, Any]] = []
        for chunk in super().chunks(index, prompt, message):
            for choice in chunk["choices"]:
                events += self._delta(choice["delta"])
                if choice.get("finish_reason") is not None:
                    events += self._finished(choice["finish_reason"])
        return events

    def usage_chunks(self) -> list[dict[str, Any]]:
        """The last event: the whole response, completed or incomplete."""
        response = self._kept(self._response(self._status()))
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return [self._event(kind, response=response)]

    def failure(self, error: ApiError) -> list[dict[str, Any]]:
        """A failure after the stream began: OpenAI's `error` event, then `response.failed` (the
        lifecycle event a client waiting for the response's end reads; its `error.code` one of
        the Responses API's)."""
        self._failed = {"code": "rate_limit_exceeded" if error.status == 429 else "server_error",
                        "message": error.message}  # fmt: skip
        return [self._event("error", code=error.code, message=error.message, param=error.param),
                self._event("response.failed", response=self._response("failed"))]  # fmt: skip

    def whole(self, choices: Sequence[tuple[int, Answer]], answers: Sequence[Answer]) -> dict[str, Any]:
        """The response the stream's events would have built (one generation: no `n` here)."""
        for message in answers[0].messages:
            self.chunks(0, answers[0].prompt, message)
        return self._kept(self._response(self._status()))

    def _kept(self, response: dict[str, Any]) -> dict[str, Any]:
        """`response` (completed or incomplete), to be stored by `keep` when its request asked."""
        if self.call.kept is not None and self.fmt.store is not None:
            self._to_keep = response
        return response

    async def keep(self) -> None:
        if self._to_keep is not None:  # set only where the request asked and there is a store
            await kept_or_logged(self.fmt.store, self._to_keep, self.call.kept)

    def _status(self) -> str:
        return "completed" if self._finish in ("stop", "tool_calls") else "incomplete"

    def _response(self, status: str) -> dict[str, Any]:
        done = status != "in_progress"
        cut = {"reason": "max_output_tokens" if self._finish == "length" else None}
        return {
            "id": self.fmt.id_prefix + self.request_id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": self._failed,
            "incomplete_details": cut if status == "incomplete" else None,
            "model": self.call.model,
            "output": copy.deepcopy(self._items) if done else [],
            "usage": _usage(total(self._finals)) if done and self._finals else None,
            **self.call.restated,
        }

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._sequence += 1
        return {"type": kind, "sequence_number": self._sequence - 1, **fields}

    def _delta(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """A chat delta's reasoning, content and tool-call pieces as item events."""
        out = []
        if delta.get("reasoning_content"):
            out += self._more("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            out += self._more("message", delta["content"])
        for call in delta.get("tool_calls") or []:
            if "id" in call:  # a new call: its id and name, then its arguments
                out += [*self._close(), *self._add(_call_item(call))]
            if call["function"].get("arguments"):
                out += self._more("function_call", call["function"]["arguments"])
        return out

    def _more(self, kind: str, text: str) -> list[dict[str, Any]]:
        """More text of the open item of `kind` (a new one when the open one is another kind)."""
        out = []
        if not (self._open and self._items[-1]["type"] == kind):
            out = [*self._close(), *self._add(_text_item(kind))]
        item = self._items[-1]
        if kind == "function_call":
            item["arguments"] += text
        else:
            item["content"][0]["text"] += text
        extra = {"content_index": 0, **({"logprobs": []} if kind == "message" else {})}
        return [*out, self._event(f"{_KINDS[kind][1]}.delta", **self._at(), **extra, delta=text)]

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        """A new item, and its content part (none for a function call)."""
        self._items.append(item)
        self._open = True
        added = {**copy.deepcopy(item), "content": []} if "content" in item else copy.deepcopy(item)
        out = [self._event("response.output_item.added", output_index=len(self._items) - 1, item=added)]
        if "content" in item:
            part = copy.deepcopy(item["content"][0])
            out.append(self._event("response.content_part.added", **self._at(), content_index=0, part=part))
        return out

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        """The open item's `done` events, with its whole text (none when no item is open)."""
        if not self._open:
            return []
        self._open = False
        item = self._items[-1]
        item["status"] = status
        done = f"{_KINDS[item['type']][1]}.done"
        if item["type"] == "function_call":
            out = [self._event(done, **self._at(), name=item["name"], arguments=item["arguments"])]
        else:
            part = item["content"][0]
            extra = {"logprobs": []} if item["type"] == "message" else {}
            if item["type"] == "reasoning" and self.call.sealed_reasoning:  # its whole text, sent back later
                item["encrypted_content"] = reasoning_blob.seal(part["text"], self.fmt.reasoning_key)
            out = [self._event(done, **self._at(), content_index=0, text=part["text"], **extra),
                   self._event("response.content_part.done", **self._at(), content_index=0,
                               part=copy.deepcopy(part))]  # fmt: skip
        return [*out, self._event("response.output_item.done", output_index=len(self._items) - 1,
                                  item=copy.deepcopy(item))]  # fmt: skip

    def _finished(self, reason: str) -> list[dict[str, Any]]:
        """The answer's end: its last item closed (incomplete when cut), an empty message when it
        said nothing at all (a response always answers with an item)."""
        self._finish = reason
        out = [] if self._items else self._add(_text_item("message"))
        return out + self._close("completed" if self._status() == "completed" else "incomplete")

    def _at(self) -> dict[str, Any]:
        return {"item_id": self._items[-1]["id"], "output_index": len(self._items) - 1}


def _text_item(kind: str) -> dict[str, Any]:
    """A new message or reasoning item, its one text part empty."""
    item_id = _KINDS[kind][0] + uuid.uuid4().hex
    if kind == "message":
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return {"id": item_id, "type": "message", "role": "assistant", "status": "in_progress",
                "content": [part]}  # fmt: skip
    return {"id": item_id, "type": "reasoning", "summary": [], "status": "in_progress",
            "content": [{"type": "reasoning_text", "text": ""}]}  # fmt: skip


def _call_item(call: dict[str, Any]) -> dict[str, Any]:
    """A function_call item for a chat call delta's start (its id is the call's `call_id`)."""
    item_id = _KINDS["function_call"][0] + uuid.uuid4().hex
    return {"id": item_id, "type": "function_call", "status": "in_progress", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": ""}  # fmt: skip


def _usage(u: pb.Usage) -> dict[str, Any]:
    """The Responses API's usage. Cached and reasoning tokens are not counted apart here (the
    reasoning is read from the text), so their details say 0, as the chat path reports none."""
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }
