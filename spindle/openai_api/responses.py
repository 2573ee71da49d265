"""`GenerateResponse` messages -> OpenAI's JSON: whole responses, stream chunks, models.

Chat completions and completions differ only in how a choice and its logprobs look, so each is
a `Format` and everything else (ids, usage, the stream's last chunks) is shared. Logprob tokens
are named by their text, as the pod decoded each alone (OpenAI's and vLLM's form: a client looks
up the chance of "Yes" by its text); `token_id:N` (vLLM's `return_tokens_as_token_ids` form) where
the pod has no tokenizer (token-id serving).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from spindle.openai_api import requests
from spindle.openai_api.requests import Call
from spindle.v1 import generation_pb2 as pb

_FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}


def token_name(lp: pb.TokenLogprob | pb.TopLogprob) -> str:
    """The token's text, or `token_id:N` where the pod sent none."""
    return lp.token if lp.HasField("token") else f"token_id:{lp.token_id}"


class Format(ABC):
    """How one endpoint's requests are read and its responses look."""

    object = chunk_object = id_prefix = ""
    parse: Callable[[dict[str, Any], Collection[str]], tuple[pb.GenerateRequest, Call]]

    @abstractmethod
    def choice(self, text: str, logprobs: Sequence[pb.TokenLogprob] | None, final: pb.Final | None) -> dict:
        """A whole response's choice (text and logprobs so far, and how it finished)."""

    def delta(
        self, text: str, logprobs: Sequence[pb.TokenLogprob] | None, final: pb.Final | None, first: bool
    ) -> dict:
        """A stream chunk's choice; `first` = the stream's first."""
        return self.choice(text, logprobs, final)


class ChatFormat(Format):
    object, chunk_object, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl-"
    parse = staticmethod(requests.chat_request)

    def choice(self, text: str, logprobs: Sequence[pb.TokenLogprob] | None, final: pb.Final | None) -> dict:
        message = {"role": "assistant", "content": text}
        return {"index": 0, "message": message, "logprobs": self._logprobs(logprobs), **_finish(final)}

    def delta(
        self, text: str, logprobs: Sequence[pb.TokenLogprob] | None, final: pb.Final | None, first: bool
    ) -> dict:
        if first:
            delta = {"role": "assistant", "content": text}
        else:  # content in every chunk but the last, which only finishes (OpenAI's stream)
            delta = {"content": text} if final is None else {}
        return {"index": 0, "delta": delta, "logprobs": self._logprobs(logprobs), **_finish(final)}

    @staticmethod
    def _logprobs(logprobs: Sequence[pb.TokenLogprob] | None) -> dict | None:
        if logprobs is None:
            return None
        return {"content": [{**_chat_token(lp), "top_logprobs": [_chat_token(t) for t in lp.top]}
                            for lp in logprobs]}  # fmt: skip


def _chat_token(lp: pb.TokenLogprob | pb.TopLogprob) -> dict[str, Any]:
    """A chat logprob's token: its text and that text's UTF-8 bytes (vLLM's; null without a text)."""
    raw = list(lp.token.encode()) if lp.HasField("token") else None
    return {"token": token_name(lp), "logprob": lp.logprob, "bytes": raw}


class CompletionFormat(Format):
    object = chunk_object = "text_completion"
    id_prefix = "cmpl-"
    parse = staticmethod(requests.completion_request)

    def choice(self, text: str, logprobs: Sequence[pb.TokenLogprob] | None, final: pb.Final | None) -> dict:
        return {"index": 0, "text": text, "logprobs": self._logprobs(logprobs), **_finish(final)}

    @staticmethod
    def _logprobs(logprobs: Sequence[pb.TokenLogprob] | None) -> dict | None:
        if logprobs is None:
            return None
        return {
            "tokens": [token_name(lp) for lp in logprobs],
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [_top_and_sampled(lp) for lp in logprobs],
        }


def _top_and_sampled(lp: pb.TokenLogprob) -> dict[str, float]:
    """A completion's top tokens and the sampled one: OpenAI's legacy API (and vLLM's) always
    lists the sampled token, so up to `logprobs` + 1 entries; a client that compares the sampled
    token with the best of these (is it greedy?) finds it even with `logprobs: 0`."""
    return {**{token_name(t): t.logprob for t in lp.top}, token_name(lp): lp.logprob}


def _finish(final: pb.Final | None) -> dict[str, Any]:
    """finish_reason, and vLLM's stop_reason: the stop string or stop token id that ended it."""
    if final is None:
        return {"finish_reason": None}
    which = final.WhichOneof("stop_reason")
    return {
        "finish_reason": _FINISH.get(final.finish_reason),
        "stop_reason": getattr(final, which) if which else None,
    }


def usage(u: pb.Usage) -> dict[str, int]:
    total = u.prompt_tokens + u.completion_tokens
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens, "total_tokens": total}


@dataclass
class Reply:
    """One request's answer as it streams: the envelope every object of it shares."""

    fmt: Format
    call: Call
    request_id: str
    created: int = field(default_factory=lambda: int(time.time()))

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.fmt.id_prefix + self.request_id, "object": obj, "created": self.created,
                "model": self.call.model}  # fmt: skip

    def whole(self, messages: Sequence[pb.GenerateResponse]) -> dict[str, Any]:
        """The non-streamed response: every chunk's text and logprobs, and the final."""
        chunks = [m.chunk for m in messages if m.HasField("chunk")]
        final = next((m.final for m in messages if m.HasField("final")), None)
        logprobs = [lp for c in chunks for lp in c.logprobs] if self.call.logprobs else None
        choice = self.fmt.choice("".join(c.text for c in chunks), logprobs, final)
        u = usage(final.usage) if final is not None else None
        return {**self._envelope(self.fmt.object), "choices": [choice], "usage": u}

    def chunks(self, message: pb.GenerateResponse, first: bool) -> list[dict[str, Any]]:
        """The stream chunks for one message: its text, or the finish (and the usage when asked)."""
        base = self._envelope(self.fmt.chunk_object)
        if self.call.include_usage:
            base["usage"] = None
        if message.HasField("chunk"):
            c = message.chunk
            logprobs = list(c.logprobs) if self.call.logprobs else None
            if not (c.text or logprobs or first):
                return []  # tokens whose text is held back (a stop string may follow): nothing to say yet
            return [{**base, "choices": [self.fmt.delta(c.text, logprobs, None, first)]}]
        out = [
            {
                **base,
                "choices": [self.fmt.delta("", [] if self.call.logprobs else None, message.final, first)],
            }
        ]
        if self.call.include_usage:
            out.append({**base, "choices": [], "usage": usage(message.final.usage)})
        return out


def models(listed: pb.ListModelsResponse) -> dict[str, Any]:
    """GET /v1/models: base models and adapters (their base as `parent`, as vLLM lists LoRAs)."""
    data = []
    for m in listed.models:
        base = m.base_model if m.kind == pb.MODEL_KIND_ADAPTER else None
        entry = {"id": m.id, "object": "model", "created": 0, "owned_by": "spindle", "root": base or m.id,
                 "parent": base}  # fmt: skip
        if m.max_model_len:
            entry["max_model_len"] = m.max_model_len
        data.append(entry)
    return {"object": "list", "data": data}
