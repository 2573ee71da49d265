"""logit_bias, allowed_token_ids, min_tokens and bad_words through the engine, with HF
transformers' own logits processors on the same tiny model as the oracle (greedy, float32), the
seeded-free sampler's distribution against the processed softmax, and the refusals."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from model_service.engine.logits_processors import bad_word_ids
from model_service.engine.sampler import SampleRow, sample
from model_service.engine.sampling_params import SamplingParams
from model_service.errors import InvalidRequestError
from tests.conftest import assert_all_blocks_free, make_engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EOS = 2
STEPS = 10
NGRAM = '{"method": "ngram"}'


class _Allowed:
    """HF has no processor for vLLM's allowed_token_ids: the mask it amounts to."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        keep = torch.full_like(scores, float("-inf"))
        keep[:, self.ids] = 0
        return scores + keep


@pytest.fixture(scope="module")
def hf(tiny_smollm2) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_smollm2.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def case(tiny_smollm2) -> dict[str, Any]:
    """The prompt and the plain greedy tokens, which the variants below bend."""
    prompt = tiny_smollm2.tokenizer.apply_chat_template([{"role": "user", "content": "Name a fruit."}])
    engine = make_engine(tiny_smollm2)
    out = engine.generate([{"prompt_token_ids": prompt, "max_tokens": STEPS, "temperature": 0}])[0]
    assert out.finish_reason == "length"
    return {"prompt": prompt, "plain": out.token_ids}


def _hf_greedy(hf, prompt: list[int], processors: list | None = None, **kw: Any) -> list[int]:
    from transformers import LogitsProcessorList

    kw.setdefault("eos_token_id", EOS)
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=STEPS, do_sample=False, pad_token_id=0,
            logits_processor=LogitsProcessorList(processors or []), **kw,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def test_greedy_equals_hf_processors(tiny_smollm2, hf, case):
    """Each processor, and bias with min_tokens and a stop token, in one batch: the greedy tokens
    are HF's with its SequenceBias, MinNewTokensLength and NoBadWords processors (and a mask for
    the allowed ids); penalties and structured output run in the same batch unchanged."""
    prompt, plain = case["prompt"], case["plain"]
    tok = tiny_smollm2.tokenizer
    one, two = _banned_words(tok, plain)
    words = bad_word_ids([one, two], tok)
    assert all(w[0] != prompt[-1] for w in words if len(w) > 1)  # HF also looks into the prompt
    stop_id = plain[5]
    variants = {  # name: (request fields, HF generate's keywords and processors)
        "bias": ({"logit_bias": {plain[0]: -100, plain[3]: -5.5, 17: 4.0}},
                 {"sequence_bias": {(plain[0],): -100.0, (plain[3],): -5.5, (17,): 4.0}}),
        "allowed": ({"allowed_token_ids": [plain[1], plain[4], 300, 301, EOS]},
                    {"processors": [_Allowed([plain[1], plain[4], 300, 301, EOS])]}),
        # EOS and the stop token made likely, held back until 4 tokens are out
        "min_tokens": ({"logit_bias": {EOS: 30, stop_id: 25}, "min_tokens": 4, "stop_token_ids": [stop_id]},
                       {"sequence_bias": {(EOS,): 30.0, (stop_id,): 25.0}, "min_new_tokens": 4,
                        "eos_token_id": [EOS, stop_id]}),
        "bad_words": ({"bad_words": [one, two]}, {"bad_words_ids": [list(w) for w in words]}),
        # a prompt token pushed up, then penalized (HF and vLLM bias first: the order shows)
        "bias_and_penalty": ({"logit_bias": {prompt[-3]: 8.0}, "repetition_penalty": 1.3},
                             {"sequence_bias": {(prompt[-3],): 8.0}, "repetition_penalty": 1.3}),
    }  # fmt: skip
    engine = make_engine(tiny_smollm2)
    base = {"prompt_token_ids": prompt, "max_tokens": STEPS, "temperature": 0}
    outs = engine.generate([{**base, **fields} for fields, _ in variants.values()])
    for name, out, (_, hf_kw) in zip(variants, outs, variants.values(), strict=True):
        processors = hf_kw.pop("processors", None)
        assert out.token_ids == _hf_greedy(hf, prompt, processors, **hf_kw), name
        assert out.token_ids != plain, f"{name}: the variant changed nothing, so tested nothing"
    assert len(outs[2].token_ids) == 5 and outs[2].finish_reason == "stop"  # 4 held, then EOS / the stop id
    assert_all_blocks_free(engine)


def _banned_words(tok, plain: list[int]) -> tuple[str, str]:
    """A one-token word and a two-token word of the plain answer whose vLLM tokenization is the
    answer's own tokens (the first of them after the first token: the two-token one must bite)."""

    def found(n: int) -> str:
        for i in range(1, len(plain) - n):
            word = tok.decode(plain[i : i + n])
            if tuple(plain[i : i + n]) in bad_word_ids([word], tok):
                return word
        raise AssertionError(f"no {n}-token word of the answer tokenizes back to itself")

    return found(1), found(2)


def test_min_tokens_skips_stop_strings_in_its_first_tokens(tiny_smollm2, case):
    """vLLM's min_tokens: a stop string the first min_tokens tokens complete ends nothing; one
    completed later does (a stop string was searched from the first token on)."""
    prompt, plain = case["prompt"], case["plain"]
    tok = tiny_smollm2.tokenizer
    text = tok.decode(plain)
    first = tok.decode(plain[:1]).strip()
    assert first and text.count(first) == 1
    late = tok.decode(plain[6:7]).strip()
    base = {"prompt_token_ids": prompt, "max_tokens": STEPS, "temperature": 0, "stop": [first]}
    early, held, later = make_engine(tiny_smollm2).generate(
        [base, {**base, "min_tokens": 3}, {**base, "stop": [first, late], "min_tokens": 3}]
    )
    assert early.finish_reason == "stop" and len(early.token_ids) == 1
    assert held.finish_reason == "length" and held.token_ids == plain
    assert later.finish_reason == "stop" and later.stop_reason == late and later.token_ids == plain[:7]


@pytest.mark.parametrize("config", [{"async_scheduling": "on"}, {"speculative_config": NGRAM}])
def test_processors_hold_with_async_scheduling_and_speculation(tiny_smollm2, case, config):
    """A step sampled on the device ahead of the host (async scheduling), or a speculative verify,
    would skip the processors: such a request runs as plain steps, as one with penalties does.
    (A repeated prompt and its own ids allowed: the n-gram proposer has proposals to verify.)"""
    prompt, plain = case["prompt"], case["plain"]
    cycle = plain[:5]
    request = {"prompt_token_ids": prompt + cycle * 3, "max_tokens": STEPS, "temperature": 0}
    limited = {**request, "allowed_token_ids": cycle, "logit_bias": {cycle[0]: -3.0}}
    expected = make_engine(tiny_smollm2).generate([request, limited])
    got = make_engine(tiny_smollm2, **config).generate([request, limited])
    assert got[0].token_ids == expected[0].token_ids
    assert got[1].token_ids == expected[1].token_ids and set(got[1].token_ids) <= set(cycle)


def test_sampled_distribution_is_the_processed_softmax():
    """Sampled rows draw from softmax((logits + bias) / T) over the allowed ids: 4,000 draws of
    one row against it (the CPU path; CUDA's kernels take the same processed logits)."""
    from model_service.engine.logits_processors import resolve

    torch.manual_seed(0)
    logits = torch.randn(1, 8)
    params = SamplingParams(temperature=0.7, logit_bias={3: 1.5, 5: -2.0}, allowed_token_ids=[1, 3, 5, 6])
    processors = resolve(params, None, {7})
    rows = [SampleRow(params, None, [0], 1, processors=processors) for _ in range(4000)]
    tokens, _ = sample(logits.expand(4000, 8).contiguous(), rows)
    counts = torch.bincount(torch.tensor(tokens), minlength=8).float() / 4000
    biased = logits[0] + torch.tensor([0, 0, 0, 1.5, 0, -2.0, 0, 0])
    mask = torch.full((8,), float("-inf"))
    mask[[1, 3, 5, 6]] = 0
    expected = ((biased + mask) / 0.7).softmax(-1)
    assert counts[[0, 2, 4, 7]].sum() == 0
    assert torch.allclose(counts, expected, atol=0.03), (counts, expected)


def test_a_row_the_processors_leave_empty_keeps_its_other_masks():
    """allowed ids all held back by min_tokens: the bans are lifted for that step (a draw from
    nothing would be an arbitrary token), the allowed mask's ids alone are not a ban there."""
    from model_service.engine.logits_processors import resolve

    params = SamplingParams(temperature=0, allowed_token_ids=[7], min_tokens=3)
    rows = [SampleRow(params, None, [0], 1, processors=resolve(params, None, {7}))]
    tokens, _ = sample(torch.tensor([[0.0, 5.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]]), rows)
    assert tokens == [1]  # the raw argmax, not token 0 of an all -inf row


@pytest.mark.parametrize(
    "fields, problem",
    [
        ({"logit_bias": {5: 101}}, r"logit_bias values must be in \[-100, 100\]"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias values"),
        ({"logit_bias": {49152: 1}}, r"logit_bias has token ids outside the vocabulary \[0, 49152\)"),
        ({"logit_bias": {-1: 1}}, "outside the vocabulary"),
        ({"logit_bias": {i: 1 for i in range(1025)}}, "at most 1,024"),
        ({"allowed_token_ids": [1, 10**6]}, r"allowed_token_ids has token ids outside.*1000000"),
        ({"allowed_token_ids": list(range(1025))}, "at most 1,024"),
        ({"min_tokens": 9, "max_tokens": 8}, r"min_tokens must be an integer in \[0, max_tokens \(8\)\]"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"bad_words": [""]}, "non-empty strings"),
        ({"bad_words": ["x"] * 129}, "at most 128 bad_words"),
        ({"bad_words": ["word " * 200] * 3}, "1,024 tokens"),
        ({"allowed_token_ids": [5], "bad_words": ["x"]}, None),  # fine: x is not 5
        ({"logit_bias": {5: 1}, "num_beams": 2}, "not supported with num_beams > 1"),
    ],
)
def test_refusals_name_the_problem(tiny_smollm2, fields, problem):
    engine = make_engine(tiny_smollm2)
    add = lambda: engine.add_request(prompt_token_ids=[1, 2, 3], params=SamplingParams.from_dict(fields))  # noqa: E731
    if problem is None:
        add()
        return
    with pytest.raises(InvalidRequestError, match=problem):
        add()
    assert not engine.requests


def test_bad_words_are_tokenized_as_vllm_does(tiny_smollm2):
    """Each word as written (left-stripped) and after a space, the second only when it is another
    tokenization of the same length; no special tokens; and none without a tokenizer."""
    tok = tiny_smollm2.tokenizer
    enc = lambda s: tuple(tok.hf.encode(s, add_special_tokens=False))  # noqa: E731
    assert bad_word_ids(["  hello"], tok) == [enc("hello"), enc(" hello")]
    assert enc("hello") != enc(" hello") and len(enc(" hello")) == len(enc("hello"))
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        bad_word_ids(["x"], None)
    ids = enc("x") + enc(" x")
    with pytest.raises(InvalidRequestError, match="allowed_token_ids"):
        make_engine(tiny_smollm2).add_request(
            prompt_token_ids=[1, 2], params=SamplingParams(allowed_token_ids=list(ids), bad_words=["x"])
        )


def test_processors_and_structured_output_both_apply(tiny_smollm2, case):
    """The grammar's mask and the processors together: a digit pushed up by logit_bias fills a
    four-digit regex; banned by bad_words as well, it appears nowhere, and the output still matches."""
    five = tiny_smollm2.tokenizer.hf.encode("5", add_special_tokens=False)
    assert len(five) == 1
    base = {"prompt_token_ids": case["prompt"], "max_tokens": 8, "temperature": 0,
            "structured_output": {"regex": "[0-9]{4}"}, "logit_bias": {five[0]: 100}}  # fmt: skip
    pushed, banned = make_engine(tiny_smollm2).generate([base, {**base, "bad_words": ["5"]}])
    assert (pushed.text, pushed.finish_reason) == ("5555", "stop")
    assert len(banned.text) == 4 and banned.text.isdigit() and "5" not in banned.text, banned.text


def test_a_requests_file_line_spells_them_as_json(tiny_smollm2, case):
    """`spindle generate --requests`: a JSON line's logit_bias has its ids as strings (OpenAI's
    form), and serves as the same request with int ids."""
    import json

    prompt, plain = case["prompt"], case["plain"]
    line = json.dumps({"prompt_token_ids": prompt, "max_tokens": 4, "temperature": 0,
                       "logit_bias": {str(plain[0]): -100}, "min_tokens": 2, "bad_words": ["x"],
                       "allowed_token_ids": plain[1:9]})  # fmt: skip
    engine = make_engine(tiny_smollm2)
    from_json = engine.generate([json.loads(line)])[0]
    as_ints = engine.generate([{**json.loads(line), "logit_bias": {plain[0]: -100}}])[0]
    assert from_json.token_ids == as_ints.token_ids and plain[0] not in from_json.token_ids
