"""Draft-model speculation: a draft sharing SmolLM2's tokenizer proposes, the target verifies.

The promises: greedy output is token-for-token the output without speculation, whatever the
draft (the target itself, which agrees with it almost always, or another random model, which
almost never does), in a mixed batch with a LoRA request, chunked prefill, prefix-cache hits and
preemption; the draft's K/V blocks all come back exactly once (finish, abort, preemption);
sampled rows hand the rejection sampler the draft's q; a draft with another vocabulary is
refused at startup, naming both models.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

from bench.lora import write_adapter
from model_service.engine.draft import DraftProposer
from model_service.engine.engine import Engine
from model_service.engine.executor import kv_blocks_for_budget
from model_service.engine.speculation import SpeculativeConfig
from model_service.errors import InvalidRequestError, ModelLoadError
from model_service.models.loader import load_model
from spindle.cli import main
from tests.conftest import assert_all_blocks_free, make_engine, make_tiny_checkpoint, write_tiny_smollm2
from tests.test_speculation import CODE, MIXED_REQUESTS, REPEAT


def draft_config(model: str, k: int = 4, method: str = "draft") -> str:
    return json.dumps({"method": method, "model": model, "num_speculative_tokens": k})


@pytest.fixture(scope="module")
def tiny_draft(smollm2, tmp_path_factory) -> Path:
    return write_tiny_smollm2(smollm2, tmp_path_factory.mktemp("tiny_draft"), extra_rows=64)


def assert_draft_blocks_free(engine: Engine) -> None:
    assert_all_blocks_free(engine)
    proposer = engine.speculation.proposer
    assert isinstance(proposer, DraftProposer)
    assert not proposer.drafts
    assert proposer.cache.num_free_blocks == proposer.cache.num_total_blocks


def test_draft_configs_parse_as_vllm_spells_them():
    assert SpeculativeConfig.from_json(draft_config("d", method="draft_model")).is_draft
    inferred = SpeculativeConfig.from_json('{"model": "d", "num_speculative_tokens": 3}')
    assert inferred is not None and inferred.is_draft and inferred.num_speculative_tokens == 3
    with pytest.raises(InvalidRequestError, match='needs "model"'):
        SpeculativeConfig.from_json('{"method": "draft"}')
    with pytest.raises(InvalidRequestError, match='"model" is for method "draft"'):
        SpeculativeConfig.from_json('{"method": "ngram", "model": "d"}')


def test_a_draft_with_another_vocabulary_is_refused_naming_both(smollm2, tiny_llama, tiny_draft, tmp_path):
    names = re.escape(f"draft model '{tiny_llama.name}' and target model 'smollm2'")
    with pytest.raises(ModelLoadError, match=f"{names}.*320 vs 49152"):
        make_engine(smollm2, speculative_config=draft_config(tiny_llama.name))
    other = tmp_path / "other"  # the same weights, one token more in the tokenizer
    other.mkdir()
    for f in tiny_draft.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_draft))
    tokenizer.add_tokens(["<not-in-smollm2>"])
    tokenizer.save_pretrained(str(other))
    with pytest.raises(ModelLoadError, match="different tokenizers \\(1 of"):
        make_engine(smollm2, speculative_config=draft_config(str(other)))


# The n-gram test's mixed batch (a LoRA row, a prefix-cache hit, a sampled row verified against
# the draft's q, a stop string), shorter.
REQUESTS = [{**r, "max_tokens": min(r["max_tokens"], 16)} for r in MIXED_REQUESTS]
GREEDY = [i for i, r in enumerate(REQUESTS) if r["temperature"] == 0]


Outputs = list[tuple[list[int], str | None]]


def run_batch(
    target, adapter: Path, spec: str | None, preemption_mode: str = "recompute"
) -> tuple[Engine, Outputs]:
    engine = make_engine(
        target,
        num_kv_blocks=6,  # small enough to preempt
        max_num_batched_tokens=64,  # prompts prefill (and the draft catches up) in chunks
        preemption_mode=preemption_mode,
        lora_modules={"a": str(adapter)},
        speculative_config=spec,
    )
    return engine, [(o.token_ids, o.finish_reason) for o in engine.generate(REQUESTS)]


# The batch's target is SmolLM2's tokenizer over a tiny random Llama (`tiny_smollm2`): the
# promises are the verifier's and the caches', which a model's size does not change, and
# SmolLM2's steps made these runs ~25 s of the suite's CPU. The other draft, `tiny_draft`, is
# another random model of that vocabulary (64 rows more), which the target almost never agrees with.
@pytest.fixture(scope="module")
def adapter(tiny_smollm2, tmp_path_factory) -> Path:
    return write_adapter(tmp_path_factory.mktemp("lora") / "a", tiny_smollm2.config, rank=8, seed=1)


@pytest.fixture(scope="module")
def plain(tiny_smollm2, adapter) -> tuple[Engine, Outputs]:
    return run_batch(tiny_smollm2, adapter, None)


@pytest.mark.parametrize("draft, preemption_mode", [("self", "swap"), ("tiny", "recompute")])
def test_greedy_output_is_identical_with_a_draft_model(
    tiny_smollm2, adapter, plain, tiny_draft, draft, preemption_mode
):
    plain_engine, expected = plain
    model = tiny_smollm2.name if draft == "self" else str(tiny_draft)
    engine, outputs = run_batch(tiny_smollm2, adapter, draft_config(model), preemption_mode)
    assert [outputs[i] for i in GREEDY] == [expected[i] for i in GREEDY]
    stats = engine.stats()  # what the pod exports as vllm:spec_decode_* metrics
    assert stats.spec_proposed_tokens > 0 and stats.num_preemptions > 0 and stats.prefix_cache_hit_tokens > 0
    acceptance = stats.spec_accepted_tokens / stats.spec_proposed_tokens
    if draft == "self":  # the same weights agree with the target, bar float ties
        assert acceptance > 0.9 and engine.num_steps < plain_engine.num_steps
    else:
        assert acceptance < 0.3
    assert_draft_blocks_free(engine)


def test_sampled_rows_carry_the_draft_distribution_and_stay_reproducible(smollm2, tiny_draft):
    request = {"prompt": CODE, "max_tokens": 10, "temperature": 0.9, "top_k": 50, "seed": 11}
    outputs = []
    for _ in range(2):
        engine = make_engine(smollm2, speculative_config=draft_config(str(tiny_draft), k=3))
        rid = engine.add_request_dict(request)
        engine.step()  # prefill: the target samples a token, the draft proposes after it
        seq = engine.requests[rid]
        proposal = engine.speculation.proposals.get(seq)
        assert proposal is not None and len(proposal.tokens) == 3 and proposal.probs is not None
        q = proposal.probs
        assert q.shape == (3, smollm2.config.vocab_size)
        assert torch.allclose(q.sum(-1), torch.ones(3)) and int((q[0] > 0).sum()) <= 50  # top-k
        assert all(q[i, t] > 0 for i, t in enumerate(proposal.tokens))  # drawn from q
        outputs.append(engine.run_to_completion()[rid].token_ids)
        assert engine.speculation.proposed > 0
        assert_draft_blocks_free(engine)
    assert outputs[0] == outputs[1] and len(outputs[0]) == 10


def test_aborted_and_finished_sequences_free_their_draft_blocks_once(smollm2, tiny_draft):
    engine = make_engine(smollm2, speculative_config=draft_config(str(tiny_draft), k=2))
    keep = engine.add_request_dict({"prompt": CODE, "max_tokens": 8, "temperature": 0})
    gone = engine.add_request_dict({"messages": REPEAT, "max_tokens": 30, "temperature": 0})
    engine.step()
    engine.step()
    proposer = engine.speculation.proposer
    assert isinstance(proposer, DraftProposer) and set(proposer.drafts) == {keep, gone}
    assert engine.abort(gone)
    assert set(proposer.drafts) == {keep}
    assert len(engine.run_to_completion()[keep].token_ids) == 8
    assert_draft_blocks_free(engine)


def test_generate_takes_a_draft_config(tiny_llama, tmp_path, capsys):
    request = {"prompt_token_ids": [5, 6, 7, 8], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    reqs = tmp_path / "reqs.jsonl"
    reqs.write_text(json.dumps(request) + "\n")
    spec = draft_config(tiny_llama.name, k=3)
    argv = ["generate", "--model", tiny_llama.name, "--requests", str(reqs), "--json", "--device", "cpu"]
    assert main([*argv, "--speculative-config", spec]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == make_engine(tiny_llama).generate([request])[0].token_ids
    assert main([*argv, "--speculative-config", draft_config("/no/such/draft")]) == 2
    assert "/no/such/draft" in capsys.readouterr().err


def test_a_draft_with_a_smaller_table_skips_sequences_holding_tokens_past_it(smollm2, tmp_path):
    draft = write_tiny_smollm2(smollm2, tmp_path / "small", extra_rows=-8)
    vocab = smollm2.config.vocab_size
    requests = [
        {"prompt_token_ids": [*smollm2.tokenizer.encode(CODE), vocab - 1], "max_tokens": 6, "temperature": 0},
        {"prompt": CODE, "max_tokens": 6, "temperature": 0},
    ]
    engine = make_engine(smollm2, speculative_config=draft_config(str(draft), k=2))
    outputs = [o.token_ids for o in engine.generate(requests)]
    assert outputs == [o.token_ids for o in make_engine(smollm2).generate(requests)]
    assert 0 < engine.speculation.proposed <= 2 * 5  # only the second request drafts: at most 5 steps of 2
    assert_draft_blocks_free(engine)


def test_the_kv_memory_budget_is_split_between_target_and_draft(smollm2):
    cfg, budget = smollm2.config, 64 << 20
    alone = kv_blocks_for_budget(cfg, 16, torch.float32, torch.device("cpu"), budget, 0.9)
    with_self_draft = kv_blocks_for_budget(cfg, 16, torch.float32, torch.device("cpu"), budget, 0.9, cfg)
    assert alone > 0 and with_self_draft == alone // 2


# --- the output distribution, end to end ---------------------------------------------------
SMALL_VOCAB = 16  # so a few hundred samples test each position's distribution with power


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny random target and another random draft over 16 tokens: q differs from p."""
    root = tmp_path_factory.mktemp("small_vocab")
    kw = {"vocab_size": SMALL_VOCAB, "max_position_embeddings": 64}
    return make_tiny_checkpoint("llama", root / "t", seed=0, **kw), make_tiny_checkpoint(
        "llama", root / "d", seed=5, **kw
    )


@torch.no_grad()
def _hf_marginals(path: Path, prompt: list[int], steps: int, temperature: float, top_k: int) -> torch.Tensor:
    """[steps, vocab]: each output position's exact distribution under HF's own temperature and
    top-k warpers, summed over every continuation before it (16^2 of them at the third)."""
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    warp = LogitsProcessorList([TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k)])
    ids, weight, out = torch.tensor([prompt]), torch.ones(1, 1), []
    for _ in range(steps):
        probs = warp(ids, model(ids).logits[:, -1]).softmax(-1)
        out.append((weight * probs).sum(0))
        weight = (weight * probs).reshape(-1, 1)
        ids = torch.cat(
            (ids.repeat_interleave(SMALL_VOCAB, 0), torch.arange(SMALL_VOCAB).repeat(len(ids))[:, None]), 1
        )
    return torch.stack(out)


def _chi_square(tokens: list[int], probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic and its degrees of freedom over the tokens the target can draw,
    those expecting fewer than 5 pooled."""
    counts = torch.bincount(torch.tensor(tokens), minlength=len(probs)).double()
    expected = probs.double() * len(tokens)
    assert counts[expected == 0].sum() == 0, "a token the target cannot draw"
    pooled = (expected > 0) & (expected < 5)
    cells = [(counts[expected >= 5], expected[expected >= 5])]
    if pooled.any():
        cells.append((counts[pooled].sum()[None], expected[pooled].sum()[None]))
    counts, expected = (torch.cat(column) for column in zip(*cells, strict=True))
    return float(((counts - expected) ** 2 / expected).sum()), len(counts) - 1


def test_a_draft_models_sampled_output_has_the_targets_distribution(small_vocab):
    """400 sampled requests beside greedy ones, a random draft proposing two tokens: each of the
    three output positions is distributed as HF's exact marginal for the target (temperature and
    top-k on p and q alike), and the greedy rows are the plain greedy tokens. Accepting every
    proposal fails this by a chi-square in the thousands; drawing a rejection's token from p
    instead of max(p - q, 0) by 67 (the bound here, 4.5 standard deviations over 14 dof, is 38)."""
    target, draft = small_vocab
    prompt, n, sampling = [3, 5, 7, 3, 5, 7, 3, 5], 400, {"temperature": 0.9, "top_k": 10}
    base = {"prompt_token_ids": prompt, "max_tokens": 3, "ignore_eos": True}
    greedy = [{**base, "temperature": 0, "prompt_token_ids": prompt[i:]} for i in range(3)]
    loaded = load_model(str(target), torch.float32, torch.device("cpu"))
    room = {"max_num_seqs": n + 3, "max_waiting_requests": n + 3, "max_num_batched_tokens": 16 * n}
    engine = make_engine(loaded, speculative_config=draft_config(str(draft), k=2), **room)
    torch.manual_seed(0)
    outputs = engine.generate([*greedy, *[{**base, **sampling}] * n])
    assert [o.token_ids for o in outputs[:3]] == [o.token_ids for o in make_engine(loaded).generate(greedy)]
    exact = _hf_marginals(target, prompt, 3, **sampling)
    for position in range(3):
        chi2, dof = _chi_square([o.token_ids[position] for o in outputs[3:]], exact[position])
        assert chi2 < dof + 4.5 * (2 * dof) ** 0.5, (position, chi2, dof)
    assert 0 < engine.speculation.accepted < engine.speculation.proposed
    assert_draft_blocks_free(engine)
