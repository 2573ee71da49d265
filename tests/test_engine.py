"""Engine behaviour: batching, chunking, preemption, mixed steps, abort, bad input. On SmolLM2's
tokenizer and chat template over a tiny random Llama (`tiny_smollm2`): what is tested is the
engine's bookkeeping, which a model's size does not change (SmolLM2's own tokens against HF are
tests/test_smollm2_parity.py's), and SmolLM2's steps made this file ~28 s of the suite's CPU."""

from __future__ import annotations

import asyncio

import pytest

from model_service.engine.sampling_params import SamplingParams
from model_service.errors import CapacityError, InvalidRequestError, ModelLoadError
from model_service.models.loader import load_model
from tests.conftest import assert_all_blocks_free, forward, make_engine, new_sequence

QUESTIONS = ["What is 2+2?", "Name a large animal.", "Say hello in French.", "What color is the sky?"]


def _requests(tiny_smollm2, max_tokens: int = 12) -> list[dict]:
    return [
        {
            "prompt_token_ids": tiny_smollm2.tokenizer.apply_chat_template([{"role": "user", "content": q}]),
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        for q in QUESTIONS
    ]


@pytest.fixture(scope="module")
def reference(tiny_smollm2) -> list[list[int]]:
    """Each request run alone with a roomy engine: what every other schedule must reproduce."""
    engine = make_engine(tiny_smollm2)
    outputs = [engine.generate([r])[0].token_ids for r in _requests(tiny_smollm2)]
    assert len({tuple(o) for o in outputs}) == len(outputs)  # rows crossed between requests would show
    return outputs


@pytest.mark.parametrize("budget", [5, 64])
def test_chunked_prefill_matches_unchunked(tiny_smollm2, reference, budget):
    engine = make_engine(tiny_smollm2, max_num_batched_tokens=budget)
    assert [o.token_ids for o in engine.generate(_requests(tiny_smollm2))] == reference
    assert_all_blocks_free(engine)


def test_preemption_by_recompute_gives_identical_output(tiny_smollm2, reference):
    # 4 sequences of ~47 tokens each need 12 blocks of 4 at the end; give them 20 in all, so
    # the scheduler admits more than fit once they grow.
    engine = make_engine(tiny_smollm2, num_kv_blocks=20, block_size=4, max_num_batched_tokens=64)
    assert [o.token_ids for o in engine.generate(_requests(tiny_smollm2))] == reference
    assert engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(engine)


def test_mixed_step_each_request_samples_its_own_logits(tiny_smollm2, reference):
    """The seed's cross-request corruption story: >= 2 finishing prefills and >= 1 running decode
    in one forward pass; every request must still get its own tokens."""
    reqs = _requests(tiny_smollm2)
    engine = make_engine(tiny_smollm2)
    engine.add_request(
        prompt_token_ids=reqs[0]["prompt_token_ids"], params=SamplingParams.from_dict(reqs[0]), request_id="0"
    )
    engine.step()  # request 0 prefilled; it decodes from now on
    for i in (1, 2, 3):
        engine.add_request(
            prompt_token_ids=reqs[i]["prompt_token_ids"],
            params=SamplingParams.from_dict(reqs[i]),
            request_id=str(i),
        )
    schedule = engine.scheduler.schedule
    compositions = []

    def recording_schedule():
        batch = schedule()
        decodes = sum(1 for seq, n in batch.work if seq.num_pending == 1)
        finishing = sum(1 for seq, n in batch.work if n == seq.num_pending > 1)
        compositions.append((decodes, finishing))
        return batch

    engine.scheduler.schedule = recording_schedule
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.token_ids
    assert compositions[0][0] >= 1 and compositions[0][1] >= 2  # the step the story needs
    assert [final[str(i)] for i in range(4)] == reference
    assert_all_blocks_free(engine)


def test_mixed_forward_rows_equal_separate_passes(tiny_smollm2):
    import torch

    engine = make_engine(tiny_smollm2)
    prompts = [r["prompt_token_ids"] for r in _requests(tiny_smollm2)]
    # Separate: prefill each, then decode one token each.
    separate_prefill, separate_decode = [], []
    for ids in prompts:
        s = new_sequence(engine, len(ids) + 1)
        separate_prefill.append(forward(engine, [(s, ids, 1)])[0])
        separate_decode.append(forward(engine, [(s, [7], 1)])[0])
        engine.cache.free(s)
    # Mixed: seq 0 decodes while 1..3 prefill, all in one pass.
    s0 = new_sequence(engine, len(prompts[0]) + 1)
    forward(engine, [(s0, prompts[0], 1)])
    others = [new_sequence(engine, len(ids) + 1) for ids in prompts[1:]]
    rows = forward(engine, [(s0, [7], 1)] + [(s, ids, 1) for s, ids in zip(others, prompts[1:], strict=True)])
    assert torch.allclose(rows[0], separate_decode[0], atol=1e-4)
    for got, want in zip(rows[1:], separate_prefill[1:], strict=True):
        assert torch.allclose(got, want, atol=1e-4)
    for s in [s0, *others]:
        engine.cache.free(s)
    assert_all_blocks_free(engine)


def test_free_sequence_twice_is_an_error(tiny_smollm2):
    engine = make_engine(tiny_smollm2)
    s = new_sequence(engine, 40)
    engine.cache.free(s)
    with pytest.raises(RuntimeError, match="freed twice"):
        engine.cache.free(s)
    assert engine.cache.num_free_blocks == engine.cache.num_total_blocks


def test_abort_mid_generation_frees_every_block(tiny_smollm2):
    engine = make_engine(tiny_smollm2)
    reqs = _requests(tiny_smollm2, max_tokens=20)
    for i, r in enumerate(reqs):
        engine.add_request(
            prompt_token_ids=r["prompt_token_ids"], params=SamplingParams.from_dict(r), request_id=str(i)
        )
    for _ in range(5):
        engine.step()
    assert engine.cache.num_free_blocks < engine.cache.num_total_blocks
    assert engine.abort("1") and engine.abort("3")
    assert not engine.abort("1")  # already gone
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["1"].finish_reason == "abort" and finals["3"].finish_reason == "abort"
    assert finals["0"].finish_reason == "length" and len(finals["0"].token_ids) == 20
    assert_all_blocks_free(engine)


BAD_INPUTS = [
    ({"prompt": ""}, "prompt is empty"),
    ({"prompt_token_ids": []}, "empty"),
    ({"prompt_token_ids": [1, 10**9]}, "outside"),
    ({"prompt": "hi", "messages": [{"role": "user", "content": "x"}]}, "exactly one"),
    ({"messages": [{"content": "no role"}]}, "role"),
    ({"prompt": "hi", "params": SamplingParams(max_tokens=0)}, "max_tokens"),
    ({"prompt": "hi", "params": SamplingParams(max_tokens=-3)}, "max_tokens"),
    ({"prompt": "hi", "params": SamplingParams(top_p=0)}, "top_p"),
    ({"prompt_token_ids": [5] * 300}, "context"),
]


def test_bad_input_is_refused_and_engine_keeps_serving(tiny_smollm2, reference):
    """Each bad request is refused with its reason between two steps of a running one, which
    still gives the tokens it gives alone (one engine for all of them: a SmolLM2 generation each
    cost ~1.5 s of CPU and proved nothing more)."""
    engine = make_engine(tiny_smollm2, max_model_len=256)
    good = _requests(tiny_smollm2)[0]
    engine.add_request(
        prompt_token_ids=good["prompt_token_ids"], params=SamplingParams.from_dict(good), request_id="good"
    )
    final, bad = None, list(BAD_INPUTS)
    while engine.has_unfinished():
        if bad:
            kwargs, message = bad.pop(0)
            with pytest.raises(InvalidRequestError, match=message):
                engine.add_request(**kwargs)
        for out in engine.step():
            final = out if out.finished else final
    assert not bad, "the request finished before every bad input was tried"
    assert final is not None and final.token_ids == reference[0]
    assert_all_blocks_free(engine)


def test_prompt_that_can_never_fit_is_refused(tiny_smollm2):
    engine = make_engine(tiny_smollm2, num_kv_blocks=2, block_size=16, max_model_len=1000)
    # The context is capped to what the KV cache holds, so this is refused as too long at once.
    with pytest.raises((InvalidRequestError, CapacityError)):
        engine.add_request(prompt_token_ids=[5] * 40)


@pytest.mark.parametrize("form", ["prompt", "messages"])
def test_a_text_too_long_for_any_context_is_refused_before_it_is_tokenized(tiny_smollm2, monkeypatch, form):
    """Tokenizing ran on the engine thread for any length: a 40 MB prompt held it 37 s (every
    stream of the pod stalled) and grew the pod by 3 GB before being refused as too long."""
    engine = make_engine(tiny_smollm2, max_model_len=256)
    text = "x" * (engine.prompts.max_prompt_chars + 1)
    for name in ("encode", "apply_chat_template"):
        monkeypatch.setattr(engine.tokenizer, name, lambda *a: pytest.fail("the text was tokenized"))
    request = {"prompt": text} if form == "prompt" else {"messages": [{"role": "user", "content": text}]}
    with pytest.raises(InvalidRequestError, match=f"{form} has {len(text)} characters; .* context is 256"):
        engine.add_request(**request)


def test_unknown_model_path_is_a_clear_error():
    import torch

    with pytest.raises(ModelLoadError, match="neither a known alias"):
        load_model("/definitely/not/here", torch.float32, torch.device("cpu"))


def test_async_engine_streams_and_cancels(tiny_smollm2, reference):
    from model_service.engine.async_engine import AsyncEngine

    engine = make_engine(tiny_smollm2)
    aengine = AsyncEngine(engine)
    reqs = _requests(tiny_smollm2)

    async def collect(i: int) -> list[int]:
        params = SamplingParams.from_dict(reqs[i])
        tokens: list[int] = []
        async for out in aengine.generate(
            str(i), prompt_token_ids=reqs[i]["prompt_token_ids"], params=params
        ):
            tokens.extend(out.new_token_ids)
        return tokens

    async def cancel_early() -> None:
        params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        stream = aengine.generate("cancel", prompt="Tell me a long story.", params=params)
        async for _ in stream:
            break
        await stream.aclose()

    async def bad() -> None:
        with pytest.raises(InvalidRequestError):
            async for _ in aengine.generate("bad", prompt=""):
                pass

    async def main():
        results = await asyncio.gather(*(collect(i) for i in range(4)), cancel_early(), bad())
        return results[:4]

    try:
        assert asyncio.run(main()) == reference
        assert aengine.call(lambda e: (e.has_unfinished(), e.cache.num_free_blocks)) == (
            False,
            engine.cache.num_total_blocks,
        )
    finally:
        aengine.shutdown()


def test_a_command_that_raises_does_not_end_the_engine_thread(tiny_llama, monkeypatch):
    """An abort that raised on the engine thread used to end it: every stream then waited forever
    on a pod that still answered health checks (found by the beam cancel storm)."""
    from model_service.engine.async_engine import AsyncEngine

    engine = make_engine(tiny_llama)
    monkeypatch.setattr(engine, "abort", lambda request_id: 1 / 0)
    aengine = AsyncEngine(engine)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)

    async def after() -> list[int]:
        stream = aengine.generate("after", prompt_token_ids=[5, 6, 7], params=params)
        return [t async for out in stream for t in out.new_token_ids]

    try:
        aengine.abort("nobody")
        assert len(asyncio.run(asyncio.wait_for(after(), timeout=30))) == 3
    finally:
        aengine.shutdown()


def test_a_caller_gone_before_the_engine_took_its_request_aborts_it(tiny_llama):
    """A Generate cancelled (client cancel, deadline) while its request waited in the inbox used
    to leave the request to run to its end in the engine, for nobody: 40 streams with 20 ms
    deadlines on a busy pod had 31 requests still queued and running after every caller had
    its DEADLINE_EXCEEDED."""
    import threading

    from model_service.engine.async_engine import AsyncEngine

    engine = make_engine(tiny_llama)
    aengine = AsyncEngine(engine)
    busy = threading.Event()
    aengine._inbox.put(busy.wait)  # the engine thread is mid-step: the request waits in the inbox
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)

    async def cancelled_while_waiting() -> None:
        stream = aengine.generate("gone", prompt_token_ids=[5, 6, 7], params=params)
        task = asyncio.ensure_future(anext(stream))
        while "gone" not in aengine._adding:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        asyncio.run(cancelled_while_waiting())
        busy.set()
        seq = aengine.call(lambda e: e.requests.get("gone"))
        assert seq is None or seq.finished
    finally:
        busy.set()
        aengine.shutdown()


def test_generate_is_all_or_nothing(tiny_smollm2):
    engine = make_engine(tiny_smollm2)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        engine.generate([{"prompt": "fine", "max_tokens": 4}, {"prompt": "bad", "max_tokens": 0}])
    assert not engine.has_unfinished()
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("field", ["truncate_prompt_tokens", "max_token", "n"])
def test_a_request_field_the_engine_does_not_know_is_refused(tiny_smollm2, field):
    """A `--requests` line's misspelt or unsupported field would silently change the answer."""
    engine = make_engine(tiny_smollm2)
    with pytest.raises(InvalidRequestError, match=f"unknown request fields: {field}"):
        engine.generate([{"prompt": "fine", "max_tokens": 4, field: 2}])
    assert_all_blocks_free(engine)
