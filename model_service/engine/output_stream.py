"""One request's outputs on their way from the engine thread to the one task that reads them.

The engine never waits for a reader: a step's outputs are handed over and the next step runs.
A reader slower than the steps (a client reading one message a second, or one that stopped
reading, so that gRPC's flow control holds the pod's handler at its send) used to find one
queued `RequestOutput` per step, each holding the request's whole text so far: behind one
stalled client a 20,000-token stream held 1.7 GB, and a pod serving for weeks ran out of
memory on a few of them. Here what the reader has not taken yet is merged as it arrives (vLLM's
`RequestOutputCollector`): the unsent tokens, text and logprobs once, with the latest output's
totals, at most the request's own output however far behind the reader is.
"""

from __future__ import annotations

import asyncio

from model_service.engine.sampler import TokenLogprobs
from model_service.engine.sequence import RequestOutput

Output = RequestOutput | Exception  # an exception ends the stream (`AsyncEngine.fail_streams`)


class _Merged:
    """Consecutive outputs of one request as one: their deltas joined, the last one's totals.
    A reader that keeps up takes each output as it came: nothing is joined until a second one
    comes before it is taken."""

    def __init__(self, first: RequestOutput) -> None:
        self.first = self.last = first
        self.num_tokens = len(first.new_token_ids)
        self._joined: _Joined | None = None

    def add(self, out: RequestOutput) -> None:
        if self._joined is None:
            self._joined = _Joined(self.first)
        self._joined.add(out)
        self.num_tokens += len(out.new_token_ids)
        self.last = out

    def output(self) -> RequestOutput:
        last, joined = self.last, self._joined
        if joined is None:
            return last
        return RequestOutput(
            last.request_id,
            joined.token_ids,
            "".join(joined.texts),
            last._token_ids,  # the engine's (source, start, end) view: not copied here
            last.text,
            last.finished,
            last.finish_reason,
            last.num_prompt_tokens,
            joined.logprobs,
            last.stop_reason,
            last.error,
            joined.scheduled_at,
            joined.prompt,
        )


class _Joined:
    """The deltas of several outputs, joined: what `wire.chunk` reads of each, in order."""

    def __init__(self, first: RequestOutput) -> None:
        self.token_ids: list[int] = []
        self.texts: list[str] = []
        self.logprobs: list[TokenLogprobs] = []
        self.prompt: tuple[list[int], list[TokenLogprobs]] | None = None
        self.scheduled_at: float | None = None
        self.add(first)

    def add(self, out: RequestOutput) -> None:
        self.token_ids += out.new_token_ids
        self.texts.append(out.new_text)
        if len(out.new_logprobs) == len(out.new_token_ids):  # as `wire.chunk` reads one output
            self.logprobs += out.new_logprobs
        self.prompt = self.prompt or _prompt(out)
        if self.scheduled_at is None:
            self.scheduled_at = out.first_scheduled_at


def _prompt(out: RequestOutput) -> tuple[list[int], list[TokenLogprobs]] | None:
    if out.prompt_token_ids is None or out.prompt_logprobs is None:
        return None
    return out.prompt_token_ids, out.prompt_logprobs


class OutputStream:
    """Filled on the reader's event loop (the engine thread posts with `call_soon_threadsafe`),
    emptied by `take`. After the stream's last output or error nothing more is kept."""

    def __init__(self) -> None:
        self._merged: _Merged | None = None
        self._error: Exception | None = None
        self._ended = False  # its last output or its error came (taken or not)
        self._changed = asyncio.Event()

    def put(self, out: Output) -> None:
        if self._ended:
            return
        if isinstance(out, Exception):
            self._error = out
        elif self._merged is None:
            self._merged = _Merged(out)
        else:
            self._merged.add(out)
        self._ended = isinstance(out, Exception) or out.finished
        self._changed.set()

    async def take(self, tokens: int = 0) -> list[Output]:
        """What has come since the last take, once there is some, and until it adds `tokens`
        tokens or the stream ended: one merged output, then the stream's error if it has one."""
        while self._error is None and (
            self._merged is None or (self._merged.num_tokens < tokens and not self._ended)
        ):
            self._changed.clear()
            await self._changed.wait()
        batch: list[Output] = [self._merged.output()] if self._merged is not None else []
        self._merged = None
        if self._error is not None:
            batch.append(self._error)
        return batch
