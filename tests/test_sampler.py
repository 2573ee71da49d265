"""The sampler on synthetic logits, against HF's logits processors as the oracle."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from model_service.engine.sampler import SampleRow, _apply_penalties, filtered_probs, sample
from model_service.engine.sampling_params import SamplingParams
from model_service.errors import InvalidRequestError

VOCAB = 256


def _logits(rows: int, vocab: int = VOCAB, scale: float = 2.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * scale


def _params(**kw) -> SamplingParams:
    p = SamplingParams(**kw)
    p.validate()
    return p


def _row(seed: int | None = None, prompt=(), output=(), **kw) -> SampleRow:
    gen = torch.Generator() if seed is not None else None
    return SampleRow(_params(seed=seed, **kw), gen, [*prompt, *output], len(prompt))


def _hf_allowed(logits: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> set[int]:
    """Tokens HF's warpers (in generate's order) leave finite for one row of logits."""
    ids = torch.zeros((1, 1), dtype=torch.long)
    scores = logits[None].clone()
    warpers = [TemperatureLogitsWarper(temperature)]
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    if min_p > 0.0:
        warpers.append(MinPLogitsWarper(min_p))
    for w in warpers:
        scores = w(ids, scores)
    return set(torch.isfinite(scores[0]).nonzero().flatten().tolist())


def _our_allowed(logits: torch.Tensor, params: SamplingParams) -> set[int]:
    return set((filtered_probs(logits[None], [params])[0] > 0).nonzero().flatten().tolist())


# --- greedy -------------------------------------------------------------------------------


def test_greedy_is_argmax():
    logits = _logits(16)
    tokens, lps = sample(logits, [_row(temperature=0.0) for _ in range(16)])
    assert tokens == logits.argmax(dim=-1).tolist()
    assert lps == [None] * 16


@pytest.mark.parametrize("temperature", [1e-6, 1e-30, 1e-40, 5e-324])
def test_near_zero_temperature_is_greedy_not_nan(temperature):
    # Regression: logits / 1e-40 overflowed to inf, softmax gave NaN and argmax picked token 0.
    logits = torch.tensor([[1.0, 5.0, 2.0, 4.9]])
    for seed in range(5):
        assert sample(logits, [_row(seed=seed, temperature=temperature)])[0] == [1]


@pytest.mark.parametrize(
    "kw", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}, {"top_k": 1, "temperature": 3.0}]
)
def test_single_survivor_filters_equal_greedy(kw):
    logits = _logits(32, seed=1)
    argmax = logits.argmax(dim=-1).tolist()
    for seed in range(3):
        rows = [_row(seed=seed * 100 + i, **kw) for i in range(32)]
        assert sample(logits, rows)[0] == argmax


# --- filtering: allowed sets against HF ---------------------------------------------------

FILTER_CASES = [
    {},
    {"temperature": 0.7},
    {"top_k": 5},
    {"top_k": 40, "temperature": 1.5},
    {"top_k": VOCAB + 10},
    {"top_p": 0.9},
    {"top_p": 0.5, "temperature": 0.6},
    {"top_p": 0.99, "temperature": 2.0},
    {"min_p": 0.1},
    {"min_p": 0.02, "temperature": 1.3},
    {"top_k": 50, "top_p": 0.8},
    {"top_k": 20, "top_p": 0.95, "min_p": 0.05, "temperature": 0.8},
    {"top_p": 0.7, "min_p": 0.2, "temperature": 1.7},
]


def _hf_kwargs(p: SamplingParams) -> dict:
    return {"temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p}


@pytest.mark.parametrize(
    "kw", FILTER_CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "none"
)
def test_allowed_set_matches_hf(kw):
    params = _params(**kw)
    logits = _logits(8, seed=2)
    for i in range(logits.shape[0]):
        assert _our_allowed(logits[i], params) == _hf_allowed(logits[i], **_hf_kwargs(params))


def test_default_top_p_filters_nothing_on_a_large_vocab():
    # Regression: with top_p=1 the cumulative mass summed from the head reached 1.0 early through
    # float rounding, and thousands of tail tokens were dropped.
    logits = _logits(4, vocab=49152, scale=10.0, seed=3)
    probs = filtered_probs(logits, [_params()] * 4)
    assert torch.equal(probs > 0, logits.softmax(dim=-1) > 0)


def test_mixed_rows_in_one_batch_match_hf_row_by_row():
    params = [_params(**kw) for kw in FILTER_CASES]
    logits = _logits(len(params), seed=4)
    allowed = filtered_probs(logits, params) > 0
    for i, p in enumerate(params):
        assert set(allowed[i].nonzero().flatten().tolist()) == _hf_allowed(logits[i], **_hf_kwargs(p))


def _strictly_more_likely_rule(x: torch.Tensor, top_k: int, top_p: float, min_p: float) -> set[int]:
    """Tokens a cut keeps, token by token (the CUDA kernel's rule): fewer than top_k tokens
    strictly more likely, less than top_p of the top-k tokens' mass strictly more likely, and at
    least min_p times the most likely one's probability."""
    kept_k = [v for v in range(len(x)) if (x > x[v]).sum() < top_k]
    probs = torch.full_like(x, float("-inf")).index_copy(0, torch.tensor(kept_k), x[kept_k]).softmax(0)
    return {v for v in kept_k if probs[x > x[v]].sum() < top_p and probs[v] >= min_p * probs.max()}


@pytest.mark.parametrize(
    "kw",
    [{"top_k": 7}, {"top_k": 40}, {"top_p": 0.6}, {"top_p": 0.9, "min_p": 0.05}, {"top_k": 30, "top_p": 0.8}],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()),
)
def test_a_cut_keeps_every_token_tied_at_its_edge(kw):
    # Regression: the sort path cut by rank, keeping an arbitrary few of the tokens tied with the
    # last one kept, where HF's top-k (and vLLM's, and the CUDA kernel's cuts) keep them all.
    # bfloat16 logits (a GPU's lm_head) tie often; these rows hold 3-16 tokens tied at top-k's edge.
    logits = (_logits(6, vocab=512, scale=1.0, seed=11) * 8).round() / 8
    params = _params(**kw)
    for row in logits:
        ours = _our_allowed(row, params)
        assert ours == _strictly_more_likely_rule(row, params.top_k or VOCAB * 2, params.top_p, params.min_p)
        if "top_p" not in kw:
            assert ours == _hf_allowed(row, **_hf_kwargs(params))


@pytest.mark.parametrize("kw", FILTER_CASES[1:], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_sampled_tokens_stay_in_allowed_set(kw):
    torch.manual_seed(5)
    logits = _logits(1, scale=1.0, seed=5)  # flat-ish, so the tail would be sampled if allowed
    allowed = _hf_allowed(logits[0], **_hf_kwargs(_params(**kw)))
    n = 2000
    tokens, _ = sample(logits.expand(n, -1), [_row(**kw) for _ in range(n)])
    assert set(tokens) <= allowed
    if len(allowed) > 1:
        assert len(set(tokens)) > 1  # it really sampled


# --- penalties ----------------------------------------------------------------------------


@pytest.mark.parametrize("penalty", [1.3, 0.7, 2.0])
def test_repetition_penalty_matches_hf(penalty):
    logits = _logits(2, seed=6)
    prompt, output = [3, 7, 7, 100, 5], [5, 9, 200, 9, 3]
    rows = [_row(temperature=0.0, repetition_penalty=penalty, prompt=prompt, output=output)] * 2
    ours = _apply_penalties(logits, rows)
    ids = torch.tensor([prompt + output] * 2)
    ref = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    assert not torch.equal(ours, logits)


def test_repetition_penalty_changes_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, -1.0, 0.5]])
    assert sample(logits, [_row(temperature=0.0)])[0] == [0]
    assert sample(logits, [_row(temperature=0.0, repetition_penalty=1.2, prompt=[0])])[0] == [1]
    # negative logits are multiplied, so a penalized negative token sinks further
    logits = torch.tensor([[-0.5, -0.6, -3.0]])
    assert sample(logits, [_row(temperature=0.0, repetition_penalty=1.5, output=[0])])[0] == [1]


@pytest.mark.parametrize(("presence", "frequency"), [(0.5, 0.0), (0.0, 0.3), (1.0, -0.5), (-2.0, 2.0)])
def test_presence_and_frequency_penalties_follow_openai(presence, frequency):
    logits = _logits(1, seed=7)
    prompt, output = [1, 2, 3, 4], [4, 4, 4, 10, 11, 10, 255]
    row = _row(presence_penalty=presence, frequency_penalty=frequency, prompt=prompt, output=output)
    ours = _apply_penalties(logits, [row])
    counts = torch.zeros(VOCAB)
    for t in output:  # OpenAI: over generated tokens only, not the prompt
        counts[t] += 1
    expected = logits[0] - counts * frequency - (counts > 0).float() * presence
    torch.testing.assert_close(ours[0], expected)


def test_penalties_of_a_batch_are_each_row_s_own():
    """Rows with different penalties, histories with repeats, rows without output or penalties:
    the batch gives every row what that row alone gives."""
    g = torch.Generator().manual_seed(11)
    rows = []
    for i in range(12):
        prompt = torch.randint(0, VOCAB, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g)
        output = torch.randint(0, 20, (i % 4 * 7,), generator=g)  # small ids: repeats
        penalties = {
            "repetition_penalty": 1.0 + 0.1 * (i % 3),
            "presence_penalty": 0.25 * (i % 2),
            "frequency_penalty": 0.1 * (i % 5),
        }
        rows.append(_row(prompt=prompt.tolist(), output=output.tolist(), **penalties))
    logits = _logits(len(rows), seed=12)
    alone = torch.cat([_apply_penalties(logits[i : i + 1], [r]) for i, r in enumerate(rows)])
    assert torch.equal(_apply_penalties(logits, rows), alone)
    assert not torch.equal(alone, logits)


def test_all_penalties_combined_and_only_on_their_rows():
    logits = _logits(3, seed=8)
    prompt, output = [1, 2, 3], [3, 3, 50]
    rows = [
        _row(temperature=0.0),
        _row(
            repetition_penalty=1.5, presence_penalty=0.4, frequency_penalty=0.2, prompt=prompt, output=output
        ),
        _row(top_k=3, prompt=prompt, output=output),
    ]
    ours = _apply_penalties(logits, rows)
    ref = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([prompt + output]), logits[1:2].clone())[0]
    counts = torch.bincount(torch.tensor(output), minlength=VOCAB).float()
    ref = ref - 0.2 * counts - 0.4 * (counts > 0).float()
    torch.testing.assert_close(ours[1], ref)
    assert torch.equal(ours[0], logits[0]) and torch.equal(ours[2], logits[2])
    assert torch.equal(logits, _logits(3, seed=8))  # the input is not modified


# --- the distribution -----------------------------------------------------------------------


def _chi_square(tokens: list[int], probs: list[float]) -> float:
    n = len(tokens)
    counts = torch.bincount(torch.tensor(tokens), minlength=len(probs)).tolist()
    assert all(c == 0 for c, p in zip(counts, probs, strict=True) if p == 0)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs, strict=True) if p > 0)


# chi-square critical values at p = 1e-6 are about 27.6 (3 dof) and 24.0 (1 dof): a loose bound
@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        ({}, [0.1, 0.2, 0.3, 0.4]),
        ({"temperature": 2.0}, [math.sqrt(x) for x in (0.1, 0.2, 0.3, 0.4)]),
        ({"top_k": 2}, [0.0, 0.0, 3 / 7, 4 / 7]),
        ({"top_p": 0.6}, [0.0, 0.0, 3 / 7, 4 / 7]),
        ({"min_p": 0.4}, [0.0, 0.2, 0.3, 0.4]),
    ],
)
def test_distribution_matches_probabilities(kw, expected):
    expected = [e / sum(expected) for e in expected]
    logits = torch.tensor([[0.1, 0.2, 0.3, 0.4]]).log()
    n = 20000
    torch.manual_seed(9)
    unseeded, _ = sample(logits.expand(n, -1), [_row(**kw) for _ in range(n)])
    row = _row(seed=10, **kw)
    seeded = []
    for _ in range(4000):  # one request drawing 4000 tokens: one noise draw per output position
        seeded += sample(logits, [row])[0]
        row.token_ids.append(seeded[-1])
    assert _chi_square(unseeded, expected) < 30
    assert _chi_square(seeded, expected) < 30


# --- seeds ----------------------------------------------------------------------------------


def _seeded_run(position: int, others: list[dict], steps: int = 25) -> list[int]:
    """Tokens a seed-42 row draws over `steps` steps when placed at `position` among `others`."""
    target = _row(seed=42, temperature=0.8, top_p=0.9, top_k=100)
    other_rows = [_row(**kw) for kw in others]
    got = []
    for step in range(steps):
        logits = _logits(len(others) + 1, scale=1.0, seed=1000 + step)
        target_logits = _logits(1, scale=1.0, seed=step)[0]
        rows = list(other_rows)
        rows.insert(position, target)
        logits[position] = target_logits
        tokens, _ = sample(logits, rows)
        got.append(tokens[position])
        target.token_ids.append(tokens[position])
    return got


def test_seeded_row_ignores_its_batch_and_position():
    others = [
        {"seed": 7, "temperature": 1.2},
        {},  # unseeded: draws from the global generator
        {"temperature": 0.0, "repetition_penalty": 1.3, "prompt": [1, 2]},
        {"seed": 42, "top_k": 5},  # the same seed in another request is a separate generator
        {"logprobs": 5, "min_p": 0.1, "presence_penalty": 0.5, "output": [3, 3]},
    ]
    alone = _seeded_run(0, [])
    assert len(set(alone)) > 3  # really random
    assert _seeded_run(0, others) == alone
    assert _seeded_run(2, others) == alone
    assert _seeded_run(len(others), others) == alone
    assert _seeded_run(1, others[::-1]) == alone


def test_a_seeded_row_resumed_from_its_history_draws_what_it_would_have():
    """Noise is keyed by (seed, output position): a fresh generator given the first tokens of a
    run (a stream resumed on another pod) continues it exactly."""
    alone = _seeded_run(0, [])
    for cut in (1, 7, 24):
        resumed = _row(seed=42, temperature=0.8, top_p=0.9, top_k=100, output=alone[:cut])
        resumed.generator.manual_seed(999)  # whatever state it is in: the position decides
        logits = _logits(1, scale=1.0, seed=cut)
        assert sample(logits, [resumed])[0] == [alone[cut]]
    other = _row(seed=43, temperature=0.8, top_p=0.9, top_k=100)
    others = []
    for step in range(25):
        others += sample(_logits(1, scale=1.0, seed=step), [other])[0]
        other.token_ids.append(others[-1])
    assert others != alone


def test_different_seeds_differ_and_same_seed_repeats():
    logits = _logits(1, scale=0.5, seed=11).expand(64, -1)
    a = sample(logits, [_row(seed=s) for s in range(64)])[0]
    b = sample(logits, [_row(seed=s) for s in range(64)])[0]
    assert a == b
    assert len(set(a)) > 10


# --- logprobs -------------------------------------------------------------------------------


def test_logprobs_come_from_raw_logits_and_top_n_is_sorted():
    logits = _logits(5, seed=12)
    rows = [
        _row(logprobs=5, temperature=0.0),
        _row(logprobs=20, temperature=1.5, top_k=3, seed=1),
        _row(logprobs=0, repetition_penalty=2.0, prompt=[0, 1, 2], seed=2),
        _row(temperature=0.0),
        _row(logprobs=3, presence_penalty=2.0, frequency_penalty=2.0, output=[4, 4], min_p=0.3, seed=3),
    ]
    tokens, lps = sample(logits, rows)
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert lps[3] is None
    for i, (r, tok, lp) in enumerate(zip(rows, tokens, lps, strict=True)):
        if r.params.logprobs is None:
            continue
        assert lp is not None
        assert lp.logprob == pytest.approx(ref[i, tok].item(), abs=1e-5)
        n = r.params.logprobs
        assert len(lp.top) == n
        ids = [t for t, _ in lp.top]
        vals = [v for _, v in lp.top]
        assert vals == sorted(vals, reverse=True)
        assert ids == ref[i].argsort(descending=True)[:n].tolist()
        for t, v in lp.top:
            assert v == pytest.approx(ref[i, t].item(), abs=1e-5)
    assert lps[2].top == []


def test_logprobs_with_minus_inf_logits():
    logits = torch.tensor([[0.0, float("-inf"), 1.0, float("-inf")]])
    tokens, lps = sample(logits, [_row(logprobs=4, seed=0)])
    assert tokens[0] in (0, 2)
    assert [t for t, _ in lps[0].top][:2] == [2, 0]
    assert lps[0].top[2][1] == float("-inf")


# --- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"top_p": 0.0},
        {"top_p": 1.1},
        {"top_k": -2},
        {"min_p": 1.5},
        {"repetition_penalty": 0.0},
        {"repetition_penalty": float("nan")},
        {"repetition_penalty": float("inf")},
        {"presence_penalty": 2.5},
        {"frequency_penalty": float("nan")},
        {"logprobs": 21},
        {"max_tokens": 0},
        {"stop": [""]},
        {"seed": -1},
        # not integers: a float logprobs passed validation and then failed the whole batch in sample()
        {"logprobs": 5.0},
        {"top_k": 2.5},
        {"seed": 1.5},
        # HF's beam search applies a repetition penalty; ours has none and used to ignore it
        {"num_beams": 2, "repetition_penalty": 1.2},
        {"num_beams": 2, "presence_penalty": 0.5},
        {"length_penalty": float("nan")},
        {"length_penalty": "1.0"},
    ],
    ids=lambda kw: ",".join(f"{k}={v!r}" for k, v in kw.items()),
)
def test_validate_rejects(kw):
    with pytest.raises(InvalidRequestError):
        _params(**kw)


def test_stop_lists_are_bounded_as_each_token_pays_for_them():
    """Each stop string is searched for, each stop id looked up, after every token on the engine
    thread every request shares: a million stop strings held each step of the pod back by 0.5 s."""
    at_bound = {"stop": [f"s{i}" for i in range(128)], "stop_token_ids": list(range(1024))}
    _params(**at_bound)  # the bounds themselves are served
    _params(stop=["x" * 1024])
    too_many = [
        ({"stop": [f"s{i}" for i in range(129)]}, "129 stop strings; at most 128"),
        ({"stop": ["x" * 1025]}, "1,025 characters long; at most 1,024"),
        ({"stop_token_ids": [1] * 1025}, "1,025 stop_token_ids; at most 1024"),
    ]
    for kw, message in too_many:
        with pytest.raises(InvalidRequestError, match=message):
            _params(**kw)


# --- property -------------------------------------------------------------------------------


@st.composite
def _batches(draw):
    vocab = draw(st.integers(2, 300))
    ids = st.lists(st.integers(0, vocab - 1), max_size=8)
    specs = []
    for _ in range(draw(st.integers(1, 4))):
        kw = {
            "temperature": draw(st.one_of(st.just(0.0), st.floats(0.05, 5.0))),
            "top_k": draw(st.one_of(st.just(0), st.integers(1, vocab + 5))),
            "top_p": draw(st.one_of(st.just(1.0), st.floats(0.01, 1.0))),
            "min_p": draw(st.one_of(st.just(0.0), st.floats(0.0, 1.0))),
            "repetition_penalty": draw(st.one_of(st.just(1.0), st.floats(0.5, 2.0))),
            "presence_penalty": draw(st.one_of(st.just(0.0), st.floats(-2.0, 2.0))),
            "frequency_penalty": draw(st.one_of(st.just(0.0), st.floats(-2.0, 2.0))),
            "seed": draw(st.one_of(st.none(), st.integers(0, 2**63 - 1))),
            "logprobs": draw(st.one_of(st.none(), st.integers(0, min(vocab, 20)))),
        }
        specs.append((kw, draw(ids), draw(ids)))
    return vocab, specs


@settings(max_examples=150, deadline=None)
@given(batch=_batches(), logits_seed=st.integers(0, 2**31), scale=st.floats(0.1, 8.0))
def test_property_sampled_token_is_allowed(batch, logits_seed, scale):
    """Any mix of settings in one batch: each token is one HF would allow after the same penalties."""
    vocab, specs = batch
    rows, penalized = [], []
    logits = _logits(len(specs), vocab=vocab, scale=scale, seed=logits_seed)
    for i, (kw, prompt, output) in enumerate(specs):
        rows.append(_row(prompt=prompt, output=output, **kw))
        # the oracle: HF's repetition penalty, then OpenAI's presence/frequency penalties
        ref = logits[i : i + 1].clone()
        if prompt + output:
            ref = RepetitionPenaltyLogitsProcessor(kw["repetition_penalty"])(
                torch.tensor([prompt + output]), ref
            )
        counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab).float()
        penalized.append(
            ref[0] - kw["frequency_penalty"] * counts - kw["presence_penalty"] * (counts > 0).float()
        )
    tokens, lps = sample(logits, rows)
    for row, pen, tok, lp, raw in zip(rows, penalized, tokens, lps, logits, strict=True):
        p = row.params
        assert 0 <= tok < vocab
        if p.greedy:
            assert pen[tok] >= pen.max() - 1e-4
        else:
            allowed = _hf_allowed(pen, p.temperature, p.top_k if p.top_k < vocab else 0, p.top_p, p.min_p)
            assert tok in allowed
        if p.logprobs is None:
            assert lp is None
        else:
            assert lp.logprob == pytest.approx(torch.log_softmax(raw, -1)[tok].item(), abs=1e-5)
            assert len(lp.top) == p.logprobs
