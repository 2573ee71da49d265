"""Sampling, stop conditions and logprobs through the Engine on SmolLM2 (HF as the logprob oracle)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from model_service.engine.sampling_params import SamplingParams
from tests.conftest import assert_all_blocks_free, make_engine

QUESTION = "What is the capital of France?"
EXPECTED_GREEDY = "The capital of France is Paris."  # SmolLM2's greedy answer, then EOS
EOS = 2


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """One-token decode steps gain little from a second thread, and when other processes share the
    two cores, torch's threads wait on each other: this module ran 20-50x slower that way."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _chat(smollm2, content: str) -> list[int]:
    return smollm2.tokenizer.apply_chat_template([{"role": "user", "content": content}])


def _add(engine, request: dict[str, Any]) -> str:
    return engine.add_request(
        prompt_token_ids=request["prompt_token_ids"],
        params=SamplingParams.from_dict(request),
        request_id=request.get("request_id"),
    )


def _drain(engine, ids: list[str], streams: dict[str, dict] | None = None) -> dict[str, dict]:
    """Step until idle, collecting every request's streamed deltas and its final output."""
    streams = streams if streams is not None else {}
    for i in ids:
        streams.setdefault(i, {"text": [], "token_ids": [], "logprobs": [], "final": None})
    while engine.has_unfinished():
        for out in engine.step():
            s = streams[out.request_id]
            assert s["final"] is None, "output after the final one"
            s["text"].append(out.new_text)
            s["token_ids"] += out.new_token_ids
            s["logprobs"] += out.new_logprobs
            if out.finished:
                s["final"] = out
    return streams


# --- stop conditions (one greedy batch, many variants) ------------------------------------

STOP_VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {"max_tokens": 16, "logprobs": 5},
    "stop_str": {"max_tokens": 16, "stop": ["France is"]},
    # ends mid-token (" Paris" is one token), kept in the output
    "stop_str_included": {
        "max_tokens": 16,
        "stop": ["never-appears", "is Pa"],
        "include_stop_str_in_output": True,
    },
    # " France" completes both; the one that starts earlier in the text wins
    "stop_str_earliest": {"max_tokens": 16, "stop": ["France", "of France"]},
    "stop_str_first_token": {"max_tokens": 16, "stop": ["The"]},
    "stop_str_absent": {"max_tokens": 16, "stop": ["Berlin", "\n\n"]},
    "stop_token": {"max_tokens": 16, "stop_token_ids": []},  # filled in with " France"'s id
    "ignore_eos": {"max_tokens": 10, "ignore_eos": True},
    "short": {"max_tokens": 3, "stop": ["Paris"]},
}


@pytest.fixture(scope="module")
def stop_batch(smollm2) -> dict[str, dict]:
    prompt = _chat(smollm2, QUESTION)
    france = smollm2.tokenizer.encode(" France")
    assert len(france) == 1
    engine = make_engine(smollm2)
    ids = []
    for name, kw in STOP_VARIANTS.items():
        req = {"prompt_token_ids": prompt, "temperature": 0, "request_id": name, **kw}
        if name == "stop_token":
            req["stop_token_ids"] = france
        ids.append(_add(engine, req))
    streams = _drain(engine, ids)
    assert_all_blocks_free(engine)
    plain = streams["plain"]["final"]
    assert plain.text == EXPECTED_GREEDY, "the greedy answer changed; the stop tests below assume it"
    streams["prompt"] = prompt
    streams["france"] = france[0]
    streams["tokenizer"] = smollm2.tokenizer
    return streams


def _check_stream(s: dict, stop: list[str] | None = None) -> None:
    final = s["final"]
    assert "".join(s["text"]) == final.text
    assert s["token_ids"] == final.token_ids
    for piece in stop or []:
        assert not any(piece in delta for delta in s["text"])


def test_eos_ends_with_stop_by_default(stop_batch):
    s = stop_batch["plain"]
    final = s["final"]
    assert final.finish_reason == "stop"
    assert final.stop_reason == EOS
    assert final.token_ids[-1] == EOS and EOS not in final.token_ids[:-1]
    assert len(final.token_ids) < 16
    _check_stream(s)
    assert sum(1 for d in s["text"] if d) >= len(final.token_ids) - 2  # really streamed


@pytest.mark.parametrize(
    ("name", "cut", "reason"),
    [
        ("stop_str", "The capital of ", "France is"),
        ("stop_str_included", "The capital of France is Pa", "is Pa"),
        ("stop_str_earliest", "The capital ", "of France"),
        ("stop_str_first_token", "", "The"),
    ],
)
def test_stop_strings(stop_batch, name, cut, reason):
    s = stop_batch[name]
    final = s["final"]
    assert final.text == cut
    assert EXPECTED_GREEDY.startswith(final.text)
    assert final.finish_reason == "stop"
    assert final.stop_reason == reason
    # generation stopped at the token that completed the stop string
    plain_ids = stop_batch["plain"]["final"].token_ids
    assert final.token_ids == plain_ids[: len(final.token_ids)]
    decode = stop_batch["tokenizer"].decode
    assert reason in decode(final.token_ids)
    assert reason not in decode(final.token_ids[:-1])
    include = STOP_VARIANTS[name].get("include_stop_str_in_output", False)
    _check_stream(s, stop=None if include else STOP_VARIANTS[name]["stop"])
    if not include:
        assert reason not in final.text


def test_stop_string_never_seen(stop_batch):
    s = stop_batch["stop_str_absent"]
    assert s["final"].text == EXPECTED_GREEDY
    assert s["final"].finish_reason == "stop" and s["final"].stop_reason == EOS
    _check_stream(s, stop=["Berlin"])
    # text that might start a stop string is held back, the rest streams as it comes
    assert sum(1 for d in s["text"][:-1] if d) >= 3


def test_stop_token_ids(stop_batch):
    s = stop_batch["stop_token"]
    final = s["final"]
    france = stop_batch["france"]
    assert final.finish_reason == "stop"
    assert final.stop_reason == france
    assert final.token_ids[-1] == france and france not in final.token_ids[:-1]
    assert final.token_ids == stop_batch["plain"]["final"].token_ids[: len(final.token_ids)]
    assert final.text.startswith("The capital of")
    assert "France" not in final.text  # the stop token's text is not part of the answer (as vLLM)
    _check_stream(s)


def test_ignore_eos_runs_to_max_tokens(stop_batch):
    s = stop_batch["ignore_eos"]
    final = s["final"]
    plain_ids = stop_batch["plain"]["final"].token_ids
    assert len(final.token_ids) == 10
    assert len(plain_ids) < 10
    assert final.finish_reason == "length" and final.stop_reason is None
    assert final.token_ids[: len(plain_ids)] == plain_ids  # ran straight through the EOS
    _check_stream(s)


def test_max_tokens_before_stop_string(stop_batch):
    s = stop_batch["short"]
    final = s["final"]
    assert len(final.token_ids) == 3
    assert final.finish_reason == "length" and final.stop_reason is None
    assert final.text == "The capital of"
    _check_stream(s)


# --- logprobs against HF ------------------------------------------------------------------


def test_logprobs_match_hf(stop_batch, hf_smollm2):
    s = stop_batch["plain"]
    prompt, out = stop_batch["prompt"], s["final"].token_ids
    assert len(s["logprobs"]) == len(out)
    with torch.no_grad():
        logits = hf_smollm2(torch.tensor([prompt + out[:-1]])).logits[0, len(prompt) - 1 :]
    ref = torch.log_softmax(logits.float(), dim=-1)
    for pos, (tok, lp) in enumerate(zip(out, s["logprobs"], strict=True)):
        assert lp.logprob == pytest.approx(ref[pos, tok].item(), abs=1e-4)
        vals, ids = ref[pos].topk(5)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(vals.tolist(), abs=1e-4)
        assert lp.top[0][0] == tok  # greedy picked the top token


def test_no_logprobs_unless_asked(stop_batch):
    assert stop_batch["stop_str"]["logprobs"] == []


# --- seeded sampling ----------------------------------------------------------------------

SEEDED = {"temperature": 0.8, "top_p": 0.9, "seed": 1234, "max_tokens": 6, "ignore_eos": True}
HAIKU = "Write a haiku about autumn leaves."


def _seeded_requests(smollm2) -> dict[str, dict]:
    return {
        "target": {"prompt_token_ids": _chat(smollm2, HAIKU), **SEEDED},
        # same prompt and settings, another seed (and a prefix-cache hit on the target's prompt)
        "other_seed": {"prompt_token_ids": _chat(smollm2, HAIKU), **SEEDED, "seed": 4321},
        "other_seeded": {
            "prompt_token_ids": _chat(smollm2, "List three prime numbers."),
            "temperature": 1.0,
            "seed": 7,
            "max_tokens": 4,
        },
        "unseeded": {
            "prompt_token_ids": _chat(smollm2, "Explain what a hash table is."),
            "temperature": 0.7,
            "top_k": 20,
            "max_tokens": 5,
        },
        "greedy": {
            "prompt_token_ids": smollm2.tokenizer.encode("Once upon a time"),
            "temperature": 0,
            "max_tokens": 3,
            "repetition_penalty": 1.2,
        },
    }


def _run(smollm2, order: list[str], late: str | None = None) -> dict[str, list[int]]:
    """Token ids of each request, run as one batch in `order`; `late` joins after two steps."""
    reqs = _seeded_requests(smollm2)
    engine = make_engine(smollm2)
    ids = [_add(engine, {**reqs[name], "request_id": name}) for name in order]
    streams: dict[str, dict] = {}
    if late is not None:  # join while the others decode: its prefill shares a step with their decodes
        for _ in range(2):
            for out in engine.step():
                s = streams.setdefault(
                    out.request_id, {"text": [], "token_ids": [], "logprobs": [], "final": None}
                )
                s["token_ids"] += out.new_token_ids
        assert engine.has_unfinished()
        ids.append(_add(engine, {**reqs[late], "request_id": late}))
    streams = _drain(engine, ids, streams)
    assert_all_blocks_free(engine)
    return {name: streams[name]["final"].token_ids for name in ids}


def test_seeded_sampling_is_independent_of_the_batch(smollm2):
    alone = _run(smollm2, ["target"])["target"]
    assert len(alone) == SEEDED["max_tokens"]
    batched = _run(smollm2, ["target", "other_seed", "other_seeded", "unseeded", "greedy"])
    assert batched["target"] == alone
    assert batched["other_seed"] != alone  # the seed matters
    # a different position, and admitted mid-run
    assert _run(smollm2, ["greedy", "unseeded", "other_seeded"], late="target")["target"] == alone
