"""Resuming a request from output another engine produced (SmolLM2, float32): the resumed stream
continues the original exactly, for greedy and seeded sampling, with stop strings, penalties and
logprobs; a resume that does not fit the request is refused with the reason."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from model_service.engine.requests import Resume
from model_service.engine.sampling_params import SamplingParams
from model_service.errors import InvalidRequestError
from tests.conftest import assert_all_blocks_free, make_engine

PROMPT = "Here is a short story about a robot who learns to paint:"
STOPS = ["\n\n\n\n", "THE END"]  # never hit: they make the engine hold text back
CASES: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0, "repetition_penalty": 1.3, "logprobs": 2},
    "seeded": {"temperature": 0.9, "top_p": 0.95, "seed": 7, "frequency_penalty": 0.4, "logprobs": 1},
}


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def engine(smollm2):
    return make_engine(smollm2)


def _params(case: str, max_tokens: int = 14) -> SamplingParams:
    return SamplingParams.from_dict({**CASES[case], "max_tokens": max_tokens, "stop": STOPS})


def _stream(engine, resume: Resume | None, params: SamplingParams) -> list:
    rid = engine.add_request(PROMPT, params=params, resume=resume)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    assert outs and outs[-1].finished and all(not o.finished for o in outs[:-1])
    return outs


def _joined(outs: list) -> tuple[list[int], str, list[float]]:
    return (
        [t for o in outs for t in o.new_token_ids],
        "".join(o.new_text for o in outs),
        [lp.logprob for o in outs for lp in o.new_logprobs],
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_resumed_stream_continues_the_original_exactly(engine, case):
    whole = _stream(engine, None, _params(case))
    tokens, text, logprobs = _joined(whole)
    assert len(tokens) == 14 and whole[-1].finish_reason == "length"
    sent_at = [len(_joined(whole[: i + 1])[1]) for i in range(len(whole))]
    assert any(n < len(o.text) for n, o in zip(sent_at, whole, strict=True)), "no text was held back"
    for cut in (1, 6, 13):  # after the cut-th output (one token per step here)
        sent_tokens, sent_text, _ = _joined(whole[:cut])
        rest = _stream(engine, Resume(sent_tokens, len(sent_text)), _params(case))
        new_tokens, new_text, new_logprobs = _joined(rest)
        assert sent_tokens + new_tokens == tokens, cut
        assert sent_text + new_text == text, cut
        assert new_logprobs == pytest.approx(logprobs[cut:], abs=1e-4)
        assert rest[-1].token_ids == tokens and rest[-1].finish_reason == "length"
        assert rest[-1].num_prompt_tokens == whole[-1].num_prompt_tokens
    assert_all_blocks_free(engine)


def test_a_resume_that_already_finished_sends_only_the_rest_and_the_final(engine):
    whole = _stream(engine, None, _params("greedy", max_tokens=5))
    tokens, text, _ = _joined(whole)
    sent_text = "".join(o.new_text for o in whole[:-1])  # the last output flushed held-back text
    rest = _stream(engine, Resume(tokens, len(sent_text)), _params("greedy", max_tokens=5))
    assert len(rest) == 1 and rest[0].new_token_ids == [] and rest[0].finish_reason == "length"
    assert sent_text + rest[0].new_text == text and rest[0].token_ids == tokens
    assert_all_blocks_free(engine)


@pytest.mark.parametrize(
    ("resume", "params", "needle"),
    [
        (Resume([1, 2], 0), {"num_beams": 2}, "beam search"),
        (Resume([1, 10**6], 0), {}, "outside"),
        (Resume([1, 2, 3], 0), {"max_tokens": 2}, "more than max_tokens"),
        (Resume([1, 2], -1), {}, "text_chars"),
        (Resume([1, 2], 10**4), {}, "characters of text"),
        (Resume([2, 5, 6], 0), {}, "goes on after output token 0"),  # 2 is EOS: the request stopped
    ],
)
def test_a_resume_that_does_not_fit_is_refused(engine, resume, params, needle):
    with pytest.raises(InvalidRequestError, match=needle):
        engine.add_request(PROMPT, params=SamplingParams.from_dict(params), resume=resume)
    assert_all_blocks_free(engine)
