"""A cancel storm against a model pod over real gRPC: many concurrent streams, each cut at a random
point by a client cancel or an Abort RPC, or left to finish, each checked against the engine's
uninterrupted output for its own (prompt, adapter, beams). Used by tests/test_faults.py (a dense
model, LoRA adapters, beam search) and tests/test_hybrid_faults.py (a recurrent hybrid).

Greedy streams are cut after a random number of streamed tokens. A beam request streams nothing
until its one final chunk, so it is cut after a random delay instead, which lands at whatever
search step the engine is in (or before admission, or after the end).
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from dataclasses import dataclass

import grpc

from model_service.engine.engine import Engine
from spindle.v1 import generation_pb2 as pb
from spindle.v1 import generation_pb2_grpc
from tests.service_helpers import token_request

Code = grpc.StatusCode


@dataclass(frozen=True)
class Key:
    """What decides a stream's tokens: its prompt, adapter and beam width."""

    prompt: tuple[int, ...]
    adapter: str | None = None
    num_beams: int = 1


@dataclass(frozen=True)
class Storm:
    """`refs`: each key's uninterrupted tokens at `max_tokens` (a greedy stream asks for 1 to
    `max_tokens`, a beam request for exactly `max_tokens`: beam search under a shorter limit is not
    a prefix of it). A beam request is cut after 0 to `beam_cut_s` seconds."""

    refs: dict[Key, list[int]]
    max_tokens: int
    beam_cut_s: float = 0.1
    concurrency: int = 32


def reference_tokens(engine: Engine, keys: list[Key], max_tokens: int) -> dict[Key, list[int]]:
    """Each key's tokens from the engine run directly, all in one batch: the oracle per stream."""
    reqs = [
        {"prompt_token_ids": list(k.prompt), "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
         "num_beams": k.num_beams, **({"adapter": k.adapter} if k.adapter else {})}
        for k in keys
    ]  # fmt: skip
    return {k: out.token_ids for k, out in zip(keys, engine.generate(reqs), strict=True)}


def request(key: Key, max_tokens: int, rid: str) -> pb.GenerateRequest:
    req = token_request(list(key.prompt), max_tokens, temperature=0.0)
    req.request_id = rid
    if key.adapter:
        req.adapter = key.adapter
    if key.num_beams > 1:
        req.sampling.num_beams = key.num_beams
    return req


async def run_storm(address: str, n: int, storm: Storm, seed: int) -> Counter[str]:
    """`n` streams, `storm.concurrency` at a time, over random keys; returns how each ended,
    e.g. {"greedy finished": .., "beam abort": ..}. Raises on any stream whose tokens are wrong."""
    rng, tally = random.Random(seed), Counter[str]()
    keys = list(storm.refs)
    gate = asyncio.Semaphore(storm.concurrency)
    async with grpc.aio.insecure_channel(address) as ch:
        g = generation_pb2_grpc.GenerationStub(ch)

        async def run(i: int) -> None:
            key, rid = rng.choice(keys), f"storm-{seed}-{i}"
            async with gate:
                if key.num_beams > 1:
                    outcome = await _beam_stream(g, key, rid, rng, storm)
                else:
                    outcome = await _greedy_stream(g, key, rid, rng, storm)
            tally[f"{'beam' if key.num_beams > 1 else 'greedy'} {outcome}"] += 1

        await asyncio.wait_for(asyncio.gather(*(run(i) for i in range(n))), timeout=600)
    return tally


async def _greedy_stream(g, key: Key, rid: str, rng: random.Random, storm: Storm) -> str:
    """A stream cut after a random number of tokens (client cancel, Abort RPC, or none); its tokens
    must be a prefix of its own key's greedy tokens, whoever shared its batches."""
    ref = storm.refs[key]
    max_tokens = rng.randint(1, storm.max_tokens)
    cut_after, how = rng.randint(0, max_tokens), rng.choice(["cancel", "abort", "none"])
    call = g.Generate(request(key, max_tokens, rid), timeout=120)
    tokens: list[int] = []
    try:
        if how != "none" and cut_after == 0:
            await _cut(g, call, how, rid)
        async for msg in call:
            tokens += list(msg.chunk.token_ids)
            if msg.HasField("final"):
                if msg.final.finish_reason == pb.FINISH_REASON_ABORT:
                    break
                assert msg.final.finish_reason == pb.FINISH_REASON_LENGTH, msg
                assert tokens == ref[:max_tokens], (rid, key, tokens)
                return "finished"
            if how != "none" and len(tokens) >= cut_after > 0:
                await _cut(g, call, how, rid)
    except grpc.aio.AioRpcError as e:
        assert e.code() in (Code.CANCELLED, Code.NOT_FOUND), (rid, e.code(), e.details())
    except asyncio.CancelledError:
        pass
    assert tokens == ref[: len(tokens)], (rid, key, tokens)  # a prefix of its own output
    return how


async def _beam_stream(g, key: Key, rid: str, rng: random.Random, storm: Storm) -> str:
    """A beam request cut after a random delay (or not): it ends with exactly its key's beam
    output, or with nothing (ignore_eos: no hypothesis finishes before the length limit, so an
    aborted search has no best one to return)."""
    how = rng.choice(["cancel", "abort", "none"])
    call = g.Generate(request(key, storm.max_tokens, rid), timeout=120)
    cutter = None
    if how != "none":
        cutter = asyncio.create_task(_cut_later(g, call, how, rid, rng.uniform(0, storm.beam_cut_s)))
    tokens: list[int] = []
    try:
        async for msg in call:
            tokens += list(msg.chunk.token_ids)
            if msg.HasField("final") and msg.final.finish_reason != pb.FINISH_REASON_ABORT:
                assert msg.final.finish_reason == pb.FINISH_REASON_LENGTH, msg
                assert tokens == storm.refs[key], (rid, key, tokens)
                return "finished"
    except grpc.aio.AioRpcError as e:
        assert e.code() == Code.CANCELLED, (rid, e.code(), e.details())
    except asyncio.CancelledError:
        pass
    finally:
        if cutter is not None:
            cutter.cancel()
            await asyncio.gather(cutter, return_exceptions=True)
    assert how != "none", (rid, "ended without a final")
    # Cut: nothing, or all of its output if the cut fell between the chunk and the final message.
    assert tokens in ([], storm.refs[key]), (rid, key, tokens)
    return how


async def _cut_later(g, call, how: str, rid: str, delay: float) -> None:
    await asyncio.sleep(delay)
    try:
        await _cut(g, call, how, rid)
    except grpc.aio.AioRpcError as e:  # Abort of a request that is not there (yet, or any more)
        assert e.code() == Code.NOT_FOUND, (rid, e.code(), e.details())


async def _cut(g, call, how: str, rid: str) -> None:
    if how == "cancel":
        call.cancel()
    else:
        await g.Abort(pb.AbortRequest(request_id=rid), timeout=10)
