"""Beam search equals HF `generate(num_beams=...)` and shares the prompt's KV blocks."""

from __future__ import annotations

import pytest
import torch

from model_service.engine.sampling_params import SamplingParams
from tests.conftest import assert_all_blocks_free, make_engine


def _hf_beams(hf, ids: list[int], eos: int | list[int] | None, **kw) -> list[int]:
    stops = [eos] if isinstance(eos, int) else eos or []
    pad = stops[0] if stops else 0
    out = hf.generate(torch.tensor([ids]), do_sample=False, eos_token_id=eos, pad_token_id=pad, **kw)
    gen = out[0, len(ids) :].tolist()
    ends = [i for i, t in enumerate(gen) if t in stops]
    return gen[: ends[0] + 1] if ends else gen


@pytest.fixture(scope="module")
def hf_tiny(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama.name, dtype=torch.float32).eval()


# Two questions, each one a beam-search rule decides: France's answer ends in EOS within the 12
# tokens, and HF's result there moves with the length penalty; the colour's runs all 12 tokens and
# moves with the beam width (one beam fewer gives another answer). A third question ("Give me one
# word for happy.") behaved as the colour one in every case here, so it proved nothing more.
BEAM_QUESTIONS = ["What is the capital of France?", "Name a color."]


# Each case a rule of the search: the beam width, the length penalty and when to stop.
SMOLLM2_BEAM_CASES = [(2, 1.0, False), (3, 0.5, True), (4, 2.0, "never"), (4, 1.0, True)]


def test_smollm2_beam_search_equals_hf(smollm2, hf_smollm2):
    """HF searches one question under one case at a time; the engine runs every case's search on
    both questions at once (eight beam groups of 2 to 4 beams in one batch): its steps are an
    eighth of HF's and the batch is harder, as each group must keep its own width, penalty and
    stopping rule beside the others'. Each case is still checked alone against HF."""
    engine = make_engine(smollm2)
    chat = smollm2.tokenizer.apply_chat_template
    prompts = [chat([{"role": "user", "content": q}]) for q in BEAM_QUESTIONS]
    cases = [
        {"num_beams": num_beams, "length_penalty": length_penalty, "early_stopping": early_stopping}
        for num_beams, length_penalty, early_stopping in SMOLLM2_BEAM_CASES
    ]
    requests = [{"prompt_token_ids": ids, "max_tokens": 12, **kw} for kw in cases for ids in prompts]
    got = engine.generate(requests)
    for i, kw in enumerate(cases):
        expected = [_hf_beams(hf_smollm2, ids, eos=2, max_new_tokens=12, **kw) for ids in prompts]
        assert [o.token_ids for o in got[2 * i : 2 * i + 2]] == expected, kw
    assert_all_blocks_free(engine)


@pytest.mark.parametrize(
    ("num_beams", "length_penalty", "early_stopping"), [(2, 1.0, False), (5, 0.7, True), (3, 1.5, "never")]
)
def test_tiny_beam_search_equals_hf_alongside_other_requests(
    tiny_llama, hf_tiny, num_beams, length_penalty, early_stopping
):
    """Beams share the scheduler with ordinary requests and survive preemption."""
    engine = make_engine(tiny_llama, num_kv_blocks=40, block_size=4, max_num_batched_tokens=16)
    prompts = [[5 + i, 17, 33, 101 + i, 250, 7, 9, 64, 12 + i] for i in range(3)]
    expected = [_hf_beams(hf_tiny, p, eos=None, num_beams=num_beams, max_new_tokens=10) for p in prompts]
    for i, p in enumerate(prompts):
        engine.add_request(
            prompt_token_ids=p,
            request_id=f"beam{i}",
            params=SamplingParams(num_beams=num_beams, max_tokens=10, ignore_eos=True),
        )
        engine.add_request(
            prompt_token_ids=p[::-1],
            request_id=f"greedy{i}",
            params=SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
        )
    final = {}
    while engine.has_unfinished():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    assert [final[f"beam{i}"].token_ids for i in range(3)] == expected
    assert all(final[f"beam{i}"].finish_reason == "length" for i in range(3))
    assert_all_blocks_free(engine)


# (which token of the free search's answer is made a stop token, include_stop_str_in_output): on
# this model the 4th ends HF's search there, the 3rd turns it onto another path of full length.
STOP_TOKEN_CASES = [(3, False), (3, True), (2, False)]


@pytest.mark.parametrize(("position", "include_stop_str_in_output"), STOP_TOKEN_CASES)
def test_beam_search_ends_at_stop_token_ids_as_hf_and_reads_as_sampling(
    tiny_smollm2, position, include_stop_str_in_output
):
    """A stop token ends a hypothesis as one of HF's eos_token_id list does (the search ignored
    them), and the answer reads as a sampled one's: no stop token text unless asked for, and the
    stop token as stop_reason."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_smollm2.name, dtype=torch.float32).eval()
    tok = tiny_smollm2.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Name a color."}])
    stop = _hf_beams(hf, prompt, eos=None, num_beams=2, max_new_tokens=8)[position]
    expected = _hf_beams(hf, prompt, eos=[stop], num_beams=2, max_new_tokens=8)
    request = {
        "prompt_token_ids": prompt,
        "num_beams": 2,
        "max_tokens": 8,
        "ignore_eos": True,
        "stop_token_ids": [stop],
        "include_stop_str_in_output": include_stop_str_in_output,
    }
    out = make_engine(tiny_smollm2).generate([request])[0]
    assert out.token_ids == expected
    stopped = expected[-1] == stop
    assert (out.finish_reason, out.stop_reason) == (("stop", stop) if stopped else ("length", None))
    text_ids = expected[:-1] if stopped and not include_stop_str_in_output else expected
    assert out.text == tok.decode(text_ids)


def test_beams_share_prompt_blocks(tiny_llama):
    engine = make_engine(tiny_llama, block_size=4, enable_prefix_caching=False)
    prompt = list(range(10, 30))  # 20 tokens = 5 full blocks
    engine.add_request(
        prompt_token_ids=prompt, params=SamplingParams(num_beams=4, max_tokens=6, ignore_eos=True)
    )
    engine.step()  # prefill
    engine.step()  # first beam step: four beams now exist
    used = engine.cache.num_total_blocks - engine.cache.num_free_blocks
    # Unshared, 4 beams x 6 blocks = 24; shared, the 5 prompt blocks count once.
    assert used <= 5 + 4 * 2
    while engine.has_unfinished():
        engine.step()
    assert_all_blocks_free(engine)


def test_abort_beam_request_frees_all_beams(tiny_llama):
    engine = make_engine(tiny_llama, block_size=4)
    engine.add_request(
        prompt_token_ids=list(range(10, 30)),
        request_id="b",
        params=SamplingParams(num_beams=3, max_tokens=20, ignore_eos=True),
    )
    for _ in range(4):
        engine.step()
    assert engine.abort("b")
    outs = engine.step()
    assert outs and outs[0].finish_reason == "abort"
    assert_all_blocks_free(engine)


def test_a_failing_beam_request_fails_alone(tiny_llama, monkeypatch):
    from model_service.engine.beam_search import BeamGroup

    def broken(self, logits, outputs):
        raise RuntimeError("injected beam fault")

    monkeypatch.setattr(BeamGroup, "advance", broken)
    engine = make_engine(tiny_llama, block_size=4)
    engine.add_request(
        prompt_token_ids=[5, 6, 7],
        request_id="beams",
        params=SamplingParams(num_beams=2, max_tokens=5, ignore_eos=True),
    )
    engine.add_request(
        prompt_token_ids=[8, 9, 10],
        request_id="plain",
        params=SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
    )
    final = {}
    while engine.has_unfinished():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    assert final["beams"].finish_reason == "error" and "injected beam fault" in final["beams"].error
    assert final["plain"].finish_reason == "length" and len(final["plain"].token_ids) == 5
    assert_all_blocks_free(engine)


def test_a_finished_beam_search_frees_its_request_id(tiny_llama):
    """Found by the beam cancel storm (tests/test_faults.py): a search that ended by itself stayed
    in the engine's request table, so its id stayed "in use", and an Abort after the end raised
    KeyError on the engine thread (the pod then hung every stream)."""
    engine = make_engine(tiny_llama, block_size=4)
    req = {"prompt_token_ids": [5, 6, 7, 8], "max_tokens": 8, "num_beams": 3, "request_id": "b"}
    first = engine.generate([req])[0].token_ids
    assert engine.requests == {} and engine.abort("b") is False
    assert engine.generate([req])[0].token_ids == first  # the id is free again
    assert_all_blocks_free(engine)


def test_every_beam_of_a_group_finished_at_once_ends_it_once(tiny_llama):
    """As when a waiting adapter fails every waiting beam of one request: one final output."""
    engine = make_engine(tiny_llama, block_size=4)
    engine.add_request(
        prompt_token_ids=[5, 6, 7, 8], request_id="b", params=SamplingParams(num_beams=3, max_tokens=8)
    )
    for _ in range(3):
        engine.step()
    for beam in list(engine.beams.live["b"]):
        engine.table.finish(beam, "error")
    assert [o.request_id for o in engine.step()] == ["b"]
    assert_all_blocks_free(engine)


def test_a_beam_search_larger_than_the_kv_cache_ends_with_a_capacity_error(tiny_llama):
    """8 beams of 40 new tokens need up to ~85 blocks of 4 tokens at once. With 12 the beams that
    ran waited for siblings that could never be admitted (their blocks
    held by those same beams): the engine stepped forever doing nothing and every other request
    starved. Now the search ends with finish_reason "capacity" (the pod: RESOURCE_EXHAUSTED),
    every block comes back, and the next request is served. A search that cannot even start (its
    prompt's 5 full blocks + a block a beam > 12) is refused at once, OUT_OF_RANGE at the pod."""
    from model_service.errors import BeyondCapacityError

    engine = make_engine(tiny_llama, block_size=4, num_kv_blocks=12)
    params = SamplingParams(num_beams=8, max_tokens=40, ignore_eos=True)
    with pytest.raises(BeyondCapacityError, match=r"at least 13 K/V blocks .* has 12 \(1 too many\)"):
        engine.add_request(prompt_token_ids=list(range(3, 23)), request_id="never", params=params)
    engine.add_request(prompt_token_ids=list(range(3, 19)), request_id="big", params=params)
    outputs = []
    for _ in range(200):
        outputs += engine.step()
        if not engine.has_unfinished():
            break
    [final] = [o for o in outputs if o.finished]
    assert final.finish_reason == "capacity" and "beam search of 8 beams needs" in (final.error or "")
    assert_all_blocks_free(engine)
    small = {"prompt_token_ids": [5, 6, 7, 8], "max_tokens": 4, "num_beams": 2}
    assert engine.generate([small])[0].finish_reason == "length"
    assert_all_blocks_free(engine)


def _two_searches(tiny_llama, num_kv_blocks: int, names: str = "ab", abort_restarted: bool = False) -> dict:
    """Searches of 8 beams of 40 tokens, "a" on a 20-token prompt from 3, "b" from 50 (which needs
    fewer blocks at once: beams that end alike share more), run to the end: request id ->
    (finish_reason, token ids). `abort_restarted`: abort a search as soon as it has started over."""
    engine = make_engine(tiny_llama, block_size=4, num_kv_blocks=num_kv_blocks)
    for name in names:
        start = 3 if name == "a" else 50
        engine.add_request(
            prompt_token_ids=list(range(start, start + 20)), request_id=name,
            params=SamplingParams(num_beams=8, max_tokens=40, ignore_eos=True),
        )  # fmt: skip
    finals = {}
    for _ in range(3000):
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = (out.finish_reason, out.token_ids)
        restarted = [rid for rid, beams in engine.beams.live.items() if beams[0].group.restarted]
        if abort_restarted and restarted:
            assert engine.abort(restarted[0])
            abort_restarted = False
        if not engine.has_unfinished():
            break
    assert_all_blocks_free(engine)
    assert not engine.requests and not engine.beams.live
    return finals


def test_two_beam_searches_that_each_fit_alone_both_finish_side_by_side(tiny_llama):
    """On 28 blocks, a or b alone finishes; together the older preempted the younger's beams one
    by one, which then could not come back (they no longer shared blocks) and the younger ended
    with a capacity error. Now it starts over whole, with the same output."""
    alone = {**_two_searches(tiny_llama, 256, "a"), **_two_searches(tiny_llama, 256, "b")}
    assert _two_searches(tiny_llama, 28) == alone
    assert {reason for reason, _ in alone.values()} == {"length"}


def test_of_two_beam_searches_the_one_that_never_fits_ends_and_the_other_finishes(tiny_llama):
    """On 24 blocks "a" cannot run even alone, "b" can: "a" ends with a capacity error after
    starting over once, "b" finishes with its own output (both used to end)."""
    both = _two_searches(tiny_llama, 24)
    assert both["a"][0] == "capacity"
    assert both["b"] == _two_searches(tiny_llama, 256, "b")["b"]


def test_a_beam_search_that_started_over_can_be_aborted(tiny_llama):
    """The request table follows the search's new root: an abort by request id still ends it."""
    both = _two_searches(tiny_llama, 28, abort_restarted=True)
    assert both["b"][0] == "abort"
    assert both["a"] == _two_searches(tiny_llama, 256, "a")["a"]


def test_beams_of_one_search_never_preempt_each_other(tiny_llama, hf_tiny):
    """A short request beside a 3-beam search on 24 blocks of 2 (the search alone fits): the
    request preempted beams, which came back apart, without shared blocks; then a beam that
    needed blocks preempted a sibling waiting for it, which came back and preempted it in turn,
    forever (~600 preemptions in 3,000 steps, every other request starved). Now a beam is never
    its sibling's victim: it preempts itself, and once nothing running can free a block its
    search starts over whole, with HF's beams."""
    engine = make_engine(
        tiny_llama, block_size=2, num_kv_blocks=24, max_num_batched_tokens=6, max_num_seqs=3,
        enable_prefix_caching=False,
    )  # fmt: skip
    plain = {"prompt_token_ids": list(range(40, 44)), "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    prompt = list(range(60, 83))
    engine.add_request_dict({**plain, "request_id": "plain"})
    engine.add_request(
        prompt_token_ids=prompt, request_id="beams",
        params=SamplingParams(num_beams=3, max_tokens=7, ignore_eos=True),
    )  # fmt: skip
    finals = {}
    for _ in range(1000):
        finals |= {o.request_id: o.token_ids for o in engine.step() if o.finished}
        if not engine.has_unfinished():
            break
    assert not engine.has_unfinished(), (
        f"still running after 1,000 steps: {engine.stats().num_preemptions} preemptions"
    )
    assert engine.stats().num_preemptions > 0
    assert finals["beams"] == _hf_beams(hf_tiny, prompt, eos=None, num_beams=3, max_new_tokens=7)
    assert finals["plain"] == make_engine(tiny_llama).generate([plain])[0].token_ids
    assert_all_blocks_free(engine)
