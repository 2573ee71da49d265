"""`GenerateResponse` messages -> OpenAI's JSON: whole responses, stream chunks, models.

Chat completions and completions differ only in how a choice and its logprobs look, so each is
a `Format` and everything else (ids, usage, the stream's last chunks) is shared. Logprob tokens
are named by their text, as the pod decoded each alone (OpenAI's and vLLM's form: a client looks
up the chance of "Yes" by its text); `token_id:N` (vLLM's `return_tokens_as_token_ids` form) where
the pod has no tokenizer (token-id serving). A chat with tools, or served with a reasoning parser,
has its text read (`ChatOutput`): its thinking is `reasoning_content` (reasoning_parsers.py), its
calls `tool_calls` (tool_parsers.py), as vLLM and OpenAI send them, whole and streamed.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from spindle.openai_api import reasoning_parsers, requests
from spindle.openai_api.errors import ApiError
from spindle.openai_api.fanout import Answer
from spindle.openai_api.requests import Call
from spindle.openai_api.tool_parsers import Arguments, CallStart, HarmonyReader, Piece, Thought
from spindle.openai_api.tools import ToolUse
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
        self,
        text: str,
        logprobs: Sequence[pb.TokenLogprob] | None,
        final: pb.Final | None,
        first: bool,
        offsets: Sequence[int] = (),
    ) -> dict:
        """A stream chunk's choice; `first` = the stream's first; `offsets`: where each logprob
        token starts in the choice's text (`TextOffsets`), for a format that says so."""
        return self.choice(text, logprobs, final)

    async def parse_as(
        self, body: dict[str, Any], base_models: Collection[str], owner: str | None
    ) -> tuple[pb.GenerateRequest, Call]:
        """`parse`, for the caller `owner` (the API key's name: whose stored responses it sees);
        awaited, as the Responses API's reads a stored response (maybe in Redis)."""
        return self.parse(body, base_models)

    def reply(self, call: Call, request_id: str) -> Reply:
        """The answer to one request of this format, whole or streamed."""
        return Reply(self, call, request_id)


class ChatFormat(Format):
    object, chunk_object, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl-"

    def __init__(self, tool_parser: str = "none", reasoning_parser: str = "none") -> None:
        # the server's --tool-call-parser and --reasoning-parser
        self.tool_parser, self.reasoning_parser = tool_parser, reasoning_parser

    def parse(self, body: dict[str, Any], base_models: Collection[str]) -> tuple[pb.GenerateRequest, Call]:
        return requests.chat_request(body, base_models, self.tool_parser, self.reasoning_parser)

    def choice(self, text: str, logprobs: Sequence[pb.TokenLogprob] | None, final: pb.Final | None) -> dict:
        message = {"role": "assistant", "content": text}
        return {"index": 0, "message": message, "logprobs": self._logprobs(logprobs), **_finish(final)}

    def delta(
        self,
        text: str,
        logprobs: Sequence[pb.TokenLogprob] | None,
        final: pb.Final | None,
        first: bool,
        offsets: Sequence[int] = (),
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
        """A whole choice: its text is all there is, so its tokens' offsets are read from it."""
        offsets = TextOffsets().whole(logprobs or [], text)
        return {"index": 0, "text": text, "logprobs": self._logprobs(logprobs, offsets), **_finish(final)}

    def delta(
        self,
        text: str,
        logprobs: Sequence[pb.TokenLogprob] | None,
        final: pb.Final | None,
        first: bool,
        offsets: Sequence[int] = (),
    ) -> dict:
        return {"index": 0, "text": text, "logprobs": self._logprobs(logprobs, offsets), **_finish(final)}

    @staticmethod
    def _logprobs(logprobs: Sequence[pb.TokenLogprob] | None, offsets: Sequence[int]) -> dict | None:
        if logprobs is None:
            return None
        return {
            "text_offset": list(offsets),
            "tokens": [token_name(lp) for lp in logprobs],
            "token_logprobs": [lp.logprob if lp.HasField("logprob") else None for lp in logprobs],
            "top_logprobs": [_top_and_sampled(lp) if lp.HasField("logprob") else None for lp in logprobs],
        }


def _top_and_sampled(lp: pb.TokenLogprob) -> dict[str, float]:
    """A completion's top tokens and the sampled one: OpenAI's legacy API (and vLLM's) always
    lists the sampled token, so up to `logprobs` + 1 entries; a client that compares the sampled
    token with the best of these (is it greedy?) finds it even with `logprobs: 0`. The dict is
    keyed by text, and different tokens can share one (byte tokens of a UTF-8 character each
    decode to U+FFFD): a text keeps its likeliest token's logprob, so the best value listed is
    the top token's and a sampled token that was not the top is never read as greedy."""
    out: dict[str, float] = {}
    for name, logprob in [*((token_name(t), t.logprob) for t in lp.top), (token_name(lp), lp.logprob)]:
        out[name] = max(logprob, out.get(name, logprob))
    return out


_PARTIAL = "\ufffd"  # what a token holding part of a UTF-8 character decodes to alone


class TextOffsets:
    """`text_offset` (OpenAI's legacy logprobs): where each of one choice's logprob tokens starts
    in the choice's text, read by aligning each token's text (decoded alone) with the choice's.
    Summing the tokens' lengths, as vLLM does, drifts past the text wherever they differ from
    it: byte tokens of one character each decode to U+FFFD (three for a CJK character, one in
    the text), a special token (a BOS) is in no text, a stop string cut the text short. Here a
    token that holds part of a character starts where that character does (its later bytes'
    tokens too), a token absent from the text takes no room, and one whose text has not come
    yet (held back for a stop string, or cut) starts where the text so far ends."""

    def __init__(self) -> None:
        self.text = ""  # the choice's text so far
        self.at = 0  # where the next token's text starts
        self.slack = 0  # characters the partial tokens since `at` may span (each U+FFFD is one at most)

    def whole(self, logprobs: Sequence[pb.TokenLogprob], text: str) -> list[int]:
        """A whole choice's offsets: its text is complete, so none points past its end."""
        return [min(at, len(text)) for at in self.more(logprobs, text)]

    def more(self, logprobs: Sequence[pb.TokenLogprob], text: str) -> list[int]:
        """The offsets of the next tokens, given the text that came with them."""
        self.text += text
        return [self._next(lp.token if lp.HasField("token") else None) for lp in logprobs]

    def _next(self, token: str | None) -> int:
        head = (token or "").split(_PARTIAL, 1)[0]  # its text before any partial character
        at = self._find(head) if head else None
        if at is not None:
            self.at, self.slack = at + len(head), 0
        self.slack += len(token or "") - len(head)
        return at if at is not None else self.at

    def _find(self, head: str) -> int | None:
        """Where whole text `head` starts: right at `at`, past the characters partial tokens
        began (at least one if any did), or one further (a SentencePiece token decoded alone
        loses its leading space); where the text ends, when `head` would go on past it. None:
        nowhere (a special token the text does not hold)."""
        first = self.at + (1 if self.slack else 0)
        for at in range(first, self.at + self.slack + 2):
            if self.text.startswith(head, at):
                return at
        rest = self.text[first:]
        return first if len(rest) < len(head) and head.startswith(rest) else None


def prompt_logprobs(scores: Sequence[pb.TokenLogprob]) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token (the first null), {token id: {logprob, rank,
    decoded_token}} for the token and its top alternatives (rank 1 the likeliest; the prompt
    token's own rank is null unless it is among them)."""
    out: list[dict[str, Any] | None] = []
    for lp in scores:
        if not lp.HasField("logprob"):
            out.append(None)
            continue
        entry = {str(t.token_id): _vllm_logprob(t, rank) for rank, t in enumerate(lp.top, 1)}
        entry.setdefault(str(lp.token_id), _vllm_logprob(lp, None))
        out.append(entry)
    return out


def _vllm_logprob(lp: pb.TokenLogprob | pb.TopLogprob, rank: int | None) -> dict[str, Any]:
    return {"logprob": lp.logprob, "rank": rank, "decoded_token": token_name(lp)}


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


class ChatOutput:
    """One chat choice's text read as its parts: the reasoning (with a reasoning parser: the
    model's thinking, `reasoning_content`), then content and tool calls (with `use`: calls read
    from the content only, so markup the model thinks about is never a call). As OpenAI's JSON: a
    `CallStart` is a new call (its `index`, an id (`ToolUse.call_id`), its name), `Arguments` extend the
    last one. With `parallel_tool_calls: false` the calls after the first are dropped, as vLLM
    does."""

    def __init__(self, use: ToolUse | None, reasoning: str = "none", include_reasoning: bool = True) -> None:
        self.use = use
        self.include_reasoning = include_reasoning  # false: the reasoning is read and dropped
        self.thinking = reasoning_parsers.reader(reasoning, calls=use is not None and use.choice == "auto")
        # Harmony's reasoning reader reads the calls too (they are messages of one format)
        reads_calls = isinstance(self.thinking, HarmonyReader)
        self.reader = use.reader() if use is not None and not reads_calls else None
        self.calls: list[dict[str, Any]] = []
        self._dropping = False

    def feed(self, text: str) -> list[Thought | Piece]:
        """The pieces of more text: reasoning first, the content read for calls."""
        return self._read(self.thinking.feed(text) if self.thinking else [text], finish=False)

    def finish(self) -> list[Thought | Piece]:
        return self._read(self.thinking.finish() if self.thinking else [], finish=True)

    def _read(self, pieces: list[Thought | Piece], finish: bool) -> list[Thought | Piece]:
        if self.reader is None:
            return [p for p in pieces if p]
        out: list[Thought | Piece] = []
        for piece in pieces:
            out += self.reader.feed(piece) if isinstance(piece, str) else [piece]
        return out + (self.reader.finish() if finish else [])

    def deltas(self, pieces: list[Thought | Piece]) -> list[dict[str, Any]]:
        """Stream deltas for these pieces (and the calls they make, kept for the whole answer)."""
        out: list[dict[str, Any]] = []
        for piece in pieces:
            if isinstance(piece, Thought):
                out += [{"reasoning_content": piece.text}] if self.include_reasoning else []
            elif isinstance(piece, CallStart):
                self._dropping = bool(self.calls) and not self.use.parallel
                if not self._dropping:
                    call_id = self.use.call_id()
                    self.calls.append({"id": call_id, "type": "function",
                                       "function": {"name": piece.name, "arguments": ""}})  # fmt: skip
                    out.append(_call_delta(len(self.calls) - 1, id=call_id, type="function",
                                           function={"name": piece.name, "arguments": ""}))  # fmt: skip
            elif isinstance(piece, Arguments):
                if not self._dropping:
                    self.calls[-1]["function"]["arguments"] += piece.text
                    out.append(_call_delta(len(self.calls) - 1, function={"arguments": piece.text}))
            else:
                out.append({"content": piece})
        return out

    def finish_reason(self, final: pb.Final, given: str | None) -> str | None:
        """ "tool_calls" when the model stopped after calling (OpenAI's and vLLM's); a call forced
        by name finishes "stop", as both answer it."""
        named = self.use is not None and self.use.choice == "named"
        called = self.calls and not named and final.finish_reason == pb.FINISH_REASON_STOP
        return "tool_calls" if called else given

    def whole(self, choice: dict[str, Any], text: str, final: pb.Final | None) -> None:
        """A whole answer's choice: content is the text outside the reasoning and the calls (null
        when there is none beside calls or reasoning, as OpenAI and vLLM answer), and
        `reasoning_content` the reasoning (null when there is none) with a reasoning parser."""
        deltas = self.deltas(self.feed(text) + self.finish())
        content = "".join(d["content"] for d in deltas if "content" in d)
        reasoning = "".join(d["reasoning_content"] for d in deltas if "reasoning_content" in d)
        empty = None if self.calls or self.thinking else ""
        message: dict[str, Any] = {"role": "assistant", "content": content or empty}
        if self.thinking:
            message["reasoning_content"] = reasoning or None
        if self.calls:
            message["tool_calls"] = self.calls
        choice["message"] = message
        if final is not None:
            choice["finish_reason"] = self.finish_reason(final, choice["finish_reason"])


def _call_delta(index: int, **fields: Any) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, **fields}]}


def total(finals: Sequence[tuple[int, pb.Final]]) -> pb.Usage:
    """Several generations' usage, (prompt, final) each, as one: their completion tokens summed,
    each prompt's tokens counted once however many choices answer it (as OpenAI counts `n`)."""
    prompts = {p: f.usage.prompt_tokens for p, f in finals}
    generated = sum(f.usage.completion_tokens for _, f in finals)
    return pb.Usage(prompt_tokens=sum(prompts.values()), completion_tokens=generated)


@dataclass
class Reply:
    """One request's answer as it streams: the envelope every object of it shares, and each
    choice's own state (whether its first delta was sent, its tool calls). A stream is
    `opening()`, `chunks` of each message, `usage_chunks()` (or `failure` once it failed), then
    `done`; each object a `data:` line (after an `event:` line naming its `type` when
    `named_events`)."""

    named_events = False
    done = b"data: [DONE]\n\n"

    fmt: Format
    call: Call
    request_id: str
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self._started: set[int] = set()  # choices whose first delta was sent
        self._outputs: dict[int, ChatOutput] = {}
        self._offsets: dict[int, TextOffsets] = {}  # each streamed choice's `text_offset` reading
        self._finals: list[tuple[int, pb.Final]] = []  # (prompt, final) of each generation streamed

    def opening(self) -> list[dict[str, Any]]:
        """What a stream starts with, before the first message's chunks: nothing for a chat."""
        return []

    def failure(self, error: ApiError) -> list[dict[str, Any]]:
        """What a stream that failed after its first byte says: the error JSON the SDKs raise from."""
        return [error.body()]

    async def keep(self) -> None:
        """What the answer leaves behind once it is whole (the Responses API's stored response),
        awaited before the client reads the answer's end: a next turn sent at once, to any front
        replica, finds it. Nothing for a chat or a completion."""

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.fmt.id_prefix + self.request_id, "object": obj, "created": self.created,
                "model": self.call.model}  # fmt: skip

    def _output(self, index: int) -> ChatOutput | None:
        """Choice `index`'s reading of its text (None: the text is the answer as it is)."""
        if self.call.tools is None and self.call.reasoning == "none":
            return None
        if index not in self._outputs:
            self._outputs[index] = ChatOutput(
                self.call.tools, self.call.reasoning, self.call.include_reasoning
            )
        return self._outputs[index]

    def _echoed(self, prompt: int, chunk: pb.Chunk | None) -> str:
        """What a choice's text starts with, given its first chunk: with `echo` its prompt's text
        (a token-id prompt's as the pod decoded it, in that chunk), else nothing."""
        if not self.call.echo:
            return ""
        given = self.call.prompts[prompt]
        return given if isinstance(given, str) else chunk.prompt_text if chunk is not None else ""

    def whole(self, choices: Sequence[tuple[int, Answer]], answers: Sequence[Answer]) -> dict[str, Any]:
        """The non-streamed response: the choices, (index, answer), and the usage of every
        generation run (`best_of`'s unreturned candidates too: the pods ran them)."""
        finals = [(a.prompt, a.final) for a in answers]
        done = [(p, f) for p, f in finals if f is not None]
        u = usage(total(done)) if len(done) == len(finals) else None
        out = [self._choice(index, answer) for index, answer in choices]
        response = {**self._envelope(self.fmt.object), "choices": out, "usage": u}
        if self.call.prompt_logprobs and not self.call.prompts:  # a chat's: one prompt, in the response
            response["prompt_logprobs"] = prompt_logprobs(_prompt_scores(answers[0]) if answers else [])
        return response

    def _choice(self, index: int, answer: Answer) -> dict[str, Any]:
        """One whole choice: every chunk's text and logprobs, and the final."""
        chunks = [m.chunk for m in answer.messages if m.HasField("chunk")]
        final = answer.final
        logprobs = [lp for c in chunks for lp in self._logprobs_of(c)] if self.call.logprobs else None
        text = "".join(c.text for c in chunks)
        echoed = self._echoed(answer.prompt, chunks[0] if chunks else None)
        choice = {**self.fmt.choice(echoed + text, logprobs, final), "index": index}
        if self.call.prompt_logprobs and self.call.prompts:  # a completion's: on each choice, as vLLM's
            choice["prompt_logprobs"] = prompt_logprobs(_prompt_scores(answer))
        output = self._output(index)
        if output is not None:
            output.whole(choice, text, final)
        return choice

    def _logprobs_of(self, chunk: pb.Chunk) -> list[pb.TokenLogprob]:
        """A chunk's logprobs, after its prompt's when `echo` puts the prompt in the text."""
        return [*chunk.prompt_logprobs, *chunk.logprobs] if self.call.echo else list(chunk.logprobs)

    def chunks(self, index: int, prompt: int, message: pb.GenerateResponse) -> list[dict[str, Any]]:
        """The stream chunks for one message of choice `index` (answering prompt `prompt`): its
        text, or its finish."""
        first = index not in self._started
        self._started.add(index)
        base = self._envelope(self.fmt.chunk_object)
        if self.call.include_usage:
            base["usage"] = None
        if message.HasField("final"):
            self._finals.append((prompt, message.final))
        output = self._output(index)
        if output is not None:
            return self._read_chunks(base, index, message, first, output)
        text = self._echoed(prompt, message.chunk if message.HasField("chunk") else None) if first else ""
        if message.HasField("chunk"):
            c = message.chunk
            logprobs = self._logprobs_of(c) if self.call.logprobs else None
            if not (c.text or text or logprobs or first):
                return []  # tokens whose text is held back (a stop string may follow): nothing to say yet
            offsets = self._offsets.setdefault(index, TextOffsets()).more(logprobs or [], text + c.text)
            delta = self.fmt.delta(text + c.text, logprobs, None, first, offsets)
            return [{**base, "choices": [{**delta, "index": index}]}]
        return [self._finish_chunk(base, index, message.final, first, text)]

    def usage_chunks(self) -> list[dict[str, Any]]:
        """The stream's last chunk, with every generation's usage, when `include_usage` asks for it."""
        if not self.call.include_usage:
            return []
        return [{**self._envelope(self.fmt.chunk_object), "choices": [], "usage": usage(total(self._finals))}]

    def _finish_chunk(
        self, base: dict[str, Any], index: int, final: pb.Final, first: bool, text: str = ""
    ) -> dict[str, Any]:
        """A choice's last chunk: its finish_reason."""
        choice = {**self.fmt.delta(text, [] if self.call.logprobs else None, final, first), "index": index}
        output = self._output(index)
        if output is not None:
            choice["finish_reason"] = output.finish_reason(final, choice["finish_reason"])
        return {**base, "choices": [choice]}

    def _read_chunks(
        self,
        base: dict[str, Any],
        index: int,
        message: pb.GenerateResponse,
        first: bool,
        output: ChatOutput,
    ) -> list[dict[str, Any]]:
        """A chat stream read for reasoning and tool calls: `reasoning_content` deltas, then
        content deltas holding only the text outside the calls (markup is held back until it is
        known to be a tag or a call or not); each call comes as OpenAI streams one: index, id and
        name first, then its arguments. A message's logprobs ride on its first delta."""
        final = message.final if message.HasField("final") else None
        deltas = output.deltas(output.finish() if final is not None else output.feed(message.chunk.text))
        if first:
            deltas.insert(0, {"role": "assistant", "content": ""})
        logprobs = list(message.chunk.logprobs) if self.call.logprobs and final is None else None
        if logprobs and not deltas:
            deltas = [{"content": ""}]
        out = [{**base, "choices": [{"index": index, "delta": delta, "finish_reason": None,
                                      "logprobs": ChatFormat._logprobs(logprobs if i == 0 else None)}]}
               for i, delta in enumerate(deltas)]  # fmt: skip
        return out + ([self._finish_chunk(base, index, final, first=False)] if final is not None else [])


def _prompt_scores(answer: Answer) -> list[pb.TokenLogprob]:
    """The prompt logprobs one generation's first chunk carries."""
    return [lp for m in answer.messages if m.HasField("chunk") for lp in m.chunk.prompt_logprobs]


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
