"""One HTTP request, several generations: `n` choices, a completion's list of prompts and
`best_of`, served as vLLM serves them, by fanning out over single-answer `Generate` streams (one
GenerateRequest per prompt and candidate), so each is routed, limited, retried and aborted as a
gRPC request is.

- `plan`: the requests. Candidate i of prompt p is request `{id}-{p * best_of + i}` (ids are unique
  in flight), with `seed + i` as its seed when the request has one (vLLM's rule): the whole is
  reproducible and its choices differ. Every prompt's candidates share that rule, as each of
  vLLM's prompts is a request of its own.
- `Merged`: their streams as one, in arrival order; closing it closes every stream (a client
  that disconnects, or one stream's failure, aborts the others in the engine).
- `chosen`: which candidates are the choices (`best_of`: the n with the highest cumulative
  logprob per prompt, vLLM's rule), and their indices, prompt * n + rank (OpenAI's).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType

import grpc

from spindle.openai_api.errors import from_status
from spindle.openai_api.requests import Call, set_prompt
from spindle.v1 import generation_pb2 as pb

_INT64 = 2**64
_QUEUED_PER_STREAM = 64  # messages a stream may run ahead of a slow client before it waits


@dataclass(frozen=True)
class Part:
    """One generation: the prompt it answers and its request."""

    prompt: int
    request: pb.GenerateRequest


@dataclass
class Answer:
    """One generation's messages, as they came."""

    prompt: int
    messages: list[pb.GenerateResponse] = field(default_factory=list)

    @property
    def final(self) -> pb.Final | None:
        return next((m.final for m in self.messages if m.HasField("final")), None)

    def cumulative_logprob(self) -> float:
        return sum(lp.logprob for m in self.messages if m.HasField("chunk") for lp in m.chunk.logprobs)


def derived_seed(seed: int, i: int) -> int:
    """Candidate i's seed: seed + i, wrapped into the proto's int64."""
    return (seed + i + _INT64 // 2) % _INT64 - _INT64 // 2


def plan(template: pb.GenerateRequest, call: Call, request_id: str) -> tuple[str, list[Part]]:
    """The response's id and the requests to run. One generation is `template` as it is (the
    request id the caller gave, or the servicer's); several get ids `{id}-{k}` from the caller's
    id or a new one."""
    if call.generations == 1:
        template.request_id = request_id
        return request_id, [Part(0, template)]
    base = request_id or uuid.uuid4().hex
    parts = []
    for p, prompt in enumerate(call.prompts or [None]):
        for i in range(call.best_of):
            req = pb.GenerateRequest()
            req.CopyFrom(template)
            if prompt is not None:
                set_prompt(req, prompt)
            req.request_id = f"{base}-{len(parts)}"
            if template.HasField("seed"):
                req.seed = derived_seed(template.seed, i)
            if call.best_of > call.n and not req.HasField("logprobs"):
                req.logprobs = 0  # the sampled tokens' logprobs, to rank the candidates by
            parts.append(Part(p, req))
    return base, parts


def chosen(answers: Sequence[Answer], call: Call) -> list[tuple[int, Answer]]:
    """The choices, (index, answer), in index order: per prompt its n candidates with the highest
    cumulative logprob (all of them, in order, without `best_of`)."""
    out = []
    for p in range(max(1, len(call.prompts))):
        candidates = answers[p * call.best_of : (p + 1) * call.best_of]
        if call.best_of > call.n:
            candidates = sorted(candidates, key=Answer.cumulative_logprob, reverse=True)[: call.n]
        out += [(p * call.n + rank, a) for rank, a in enumerate(candidates)]
    return out


class Merged:
    """Several message streams as one: `(stream number, message)` as they arrive, the first
    failure raised. One stream is read as it is; several are each pumped by a task into a bounded
    queue (a slow client holds them back, as it holds one stream). Leaving the `async with`
    closes every stream still open."""

    def __init__(self, streams: Sequence[AsyncIterator[pb.GenerateResponse]]) -> None:
        self._streams = list(streams)
        self._queue: asyncio.Queue = asyncio.Queue(maxsize=_QUEUED_PER_STREAM * len(self._streams))
        self._pumps: list[asyncio.Task] = []
        self._open = len(self._streams)

    async def __aenter__(self) -> Merged:
        if len(self._streams) > 1:
            self._pumps = [asyncio.create_task(self._pump(k, s)) for k, s in enumerate(self._streams)]
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        for pump in self._pumps:
            pump.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        if len(self._streams) == 1:
            await self._streams[0].aclose()  # type: ignore[attr-defined]

    def __aiter__(self) -> Merged:
        return self

    async def __anext__(self) -> tuple[int, pb.GenerateResponse]:
        if len(self._streams) == 1:
            return 0, await anext(self._streams[0])
        while self._open:
            k, item = await self._queue.get()
            if item is None:
                self._open -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                return k, item
        raise StopAsyncIteration

    async def _pump(self, k: int, stream: AsyncIterator[pb.GenerateResponse]) -> None:
        try:
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                async for message in stream:
                    await self._queue.put((k, message))
            await self._queue.put((k, None))
        except Exception as e:  # the consumer raises it; leaving then cancels the other pumps
            await self._queue.put((k, e))


async def started(merged: Merged, count: int) -> list[tuple[int, pb.GenerateResponse]]:
    """The messages until each of `count` streams has sent its first: every request was admitted
    (a refusal raises here, before the HTTP status is sent). A stream that ends without a message
    is the server's failure."""
    got: list[tuple[int, pb.GenerateResponse]] = []
    seen: set[int] = set()
    while len(seen) < count:
        item = await anext(merged, None)
        if item is None:
            raise from_status(grpc.StatusCode.INTERNAL, "the model stream ended without an answer")
        got.append(item)
        seen.add(item[0])
    return got
