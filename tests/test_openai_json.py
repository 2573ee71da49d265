"""The HTTP API writes standard JSON: a logprob of -inf (a token the model rules out entirely) or
NaN (a broken model) is no JSON number, and strict parsers (JavaScript's `JSON.parse`, Go's,
serde's) reject the whole response for one of them. Whole and streamed, read as strictly."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator

import httpx

from spindle.v1 import generation_pb2 as pb
from tests.service_helpers import openai_client_of


def _strict(text: str):
    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


class _RulesOut:
    """A model whose one token has logprob -inf among its top tokens, and NaN beside it."""

    async def Generate(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.GenerateResponse]:
        top = [pb.TopLogprob(token_id=7, logprob=-0.5), pb.TopLogprob(token_id=8, logprob=-math.inf),
               pb.TopLogprob(token_id=9, logprob=math.nan)]  # fmt: skip
        lp = pb.TokenLogprob(token_id=7, logprob=-0.5, top=top, token="Hi")
        yield pb.GenerateResponse(chunk=pb.Chunk(token_ids=[7], text="Hi", logprobs=[lp]))
        yield pb.GenerateResponse(final=pb.Final(finish_reason=pb.FINISH_REASON_STOP, usage=pb.Usage()))


def test_non_finite_logprobs_are_written_as_json_numbers():
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 3}

    async def run() -> tuple[str, str]:
        async with openai_client_of(_RulesOut(), "m") as client:
            url = str(client.base_url) + "chat/completions"
            async with httpx.AsyncClient() as http:
                whole = await http.post(url, json=body)
                streamed = await http.post(url, json={**body, "stream": True})
            return whole.text, streamed.text

    whole, streamed = asyncio.run(run())
    tops = _strict(whole)["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    assert [t["logprob"] for t in tops] == [-0.5, -9999.0, None]
    events = [_strict(line.removeprefix("data: ")) for line in streamed.splitlines()
              if line.startswith("data: {")]  # fmt: skip
    streamed_tops = [c["logprobs"]["content"][0]["top_logprobs"] for e in events for c in e["choices"]
                     if c.get("logprobs") and c["logprobs"]["content"]]  # fmt: skip
    assert [t["logprob"] for t in streamed_tops[0]] == [-0.5, -9999.0, None]
