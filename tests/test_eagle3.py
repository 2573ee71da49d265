"""EAGLE-3 speculation: a tiny random Llama target and an EAGLE-3 head for it in the real
checkpoint format (tests/eagle3_models.py: `midlayer.*`, `fc` over three of the target's layers,
a reduced vocabulary with `d2t`).

The promises: the head computes what an EAGLE-3 head computes (against a float32 computation
written here from the checkpoint tensors, the target's states from HF's `output_hidden_states`:
the executor's taps are those states); greedy output with EAGLE-3 speculation is token for token
the output without it, k = 1 and 3, under chunked prefill, prefix-cache hits, preemption and a
mixed batch (a sampled row, a LoRA row); a seeded sampled request is reproducible, and its q is
zero outside the head's vocabulary, which rejection sampling tolerates without bias; the rollback
leaves no stale draft K/V; malformed heads are refused with a message that names the problem.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_service.engine.batch_builder import StepItem
from model_service.engine.eagle3 import Eagle3Proposer
from model_service.engine.engine import Engine
from model_service.engine.speculation import SpeculativeConfig, accept_sampled
from model_service.errors import InvalidRequestError, ModelLoadError
from model_service.models.loader import LoadedModel, load_model
from spindle.cli import main
from tests.conftest import forward, make_engine, new_sequence
from tests.eagle3_models import DRAFT_VOCAB, VOCAB, eagle3_config, head_config, make_head, make_target
from tests.graph_replays import assert_graphs_equal_eager, on_the_cpu
from tests.hidden_state_proposers import assert_proposer_blocks_free, assert_rollback_leaves_no_stale_kv
from tests.test_lora import make_adapter

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[LoadedModel, Path]:
    root = tmp_path_factory.mktemp("eagle3")
    target = make_target(root / "target", agree=True)
    head = make_head(root / "head", target, agree=True)  # default layers (2, 2, 1) of 4
    return load_model(str(target), torch.float32, torch.device("cpu")), head


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def requests(max_tokens: int = 20) -> list[dict]:
    greedy = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return [{"prompt_token_ids": prompt(n, 100 + n), **greedy} for n in (20, 7, 13, 23)]


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_output_is_identical_with_eagle3_speculation(ckpt, k: int):
    target, head = ckpt
    plain = make_engine(target, block_size=4)
    expected = [o.token_ids for o in plain.generate(requests())]
    engine = make_engine(target, block_size=4, speculative_config=eagle3_config(head, k))
    assert [o.token_ids for o in engine.generate(requests())] == expected
    stats = engine.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_proposed_tokens  # accepted, and rolled back
    assert engine.num_steps < plain.num_steps
    module = engine.speculation.proposer.executor.module
    assert module.embed_tokens.weight is target.module.model.embed_tokens.weight  # absent: the target's
    assert module.lm_head.weight.shape[0] == DRAFT_VOCAB
    assert_proposer_blocks_free(engine, Eagle3Proposer)


@pytest.mark.parametrize("k", [1, 3])
def test_graph_replays_propose_and_emit_the_eager_steps_tokens(ckpt, k: int, monkeypatch: pytest.MonkeyPatch):
    """The CUDA-graph path's wiring on the CPU (tests/graph_replays.py's stand-ins): the target's
    verify steps keep the three layers' states as views of the replay's outputs, the head's feeds
    of verified runs and chained steps replay over its static input; tokens and proposals are
    the eager steps'. The GPU test runs real graphs (tests/test_eagle3_gpu.py)."""
    target, head = ckpt
    expected = [o.token_ids for o in make_engine(target, block_size=4).generate(requests())]

    def make(eager: bool) -> Engine:
        spec = eagle3_config(head, k)
        return make_engine(target, block_size=4, max_num_seqs=8, speculative_config=spec)

    assert_graphs_equal_eager(on_the_cpu(monkeypatch, make), requests(), expected, monkeypatch)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_greedy_output_is_identical_under_chunked_prefill_prefix_hits_preemption_and_a_mixed_batch(
    ckpt, tmp_path: Path, mode: str
):
    """Prompts arrive in chunks of 8 (the head keeps pace, one pass per chunk); the second round
    hits the prefix cache (the head's own prefix cache holds its rows for it); a small cache
    preempts; a sampled row and a LoRA row share the steps (the LoRA row's states are the
    adapted target's: the head has no adapter)."""
    from transformers import AutoModelForCausalLM

    target, head = ckpt
    hf = AutoModelForCausalLM.from_pretrained(target.name, dtype=torch.float32)
    adapter = make_adapter(hf, tmp_path / "a", seed=7, scale=0.3, r=4, target_modules=["o_proj"])
    sampled = {**requests()[0], "temperature": 0.8, "seed": 3}
    batch = [*requests(), {**requests()[1], "adapter": "a"}, sampled]
    cfg = {"num_kv_blocks": 20, "block_size": 4, "max_num_batched_tokens": 8, "preemption_mode": mode}
    lora = {"max_loras": 1, "lora_modules": {"a": str(adapter)}}
    greedy = slice(0, len(batch) - 1)
    plain = make_engine(target, **cfg, **lora)
    expected = [o.token_ids for o in plain.generate(batch)][greedy]
    engine = make_engine(target, **cfg, **lora, speculative_config=eagle3_config(head, 2))
    for _ in range(2):  # the second round: prefix-cache hits
        assert [o.token_ids for o in engine.generate(batch)][greedy] == expected
    assert expected[-1] != expected[1]  # the adapter changes the output
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hit_tokens > 0
    assert 0 < stats.spec_accepted_tokens < stats.spec_proposed_tokens
    assert engine.speculation.proposer.cache.blocks.num_cached > 0
    assert_proposer_blocks_free(engine, Eagle3Proposer)


def test_sampled_output_is_reproducible_and_q_lives_on_the_heads_vocabulary(ckpt):
    target, head = ckpt
    request = {"prompt_token_ids": prompt(12, 3), "max_tokens": 16, "temperature": 0.8, "seed": 3}
    outputs = []
    for _ in range(2):
        engine = make_engine(target, speculative_config=eagle3_config(head, 3))
        rid = engine.add_request_dict(request)
        engine.step()
        proposal = engine.speculation.proposals[engine.requests[rid]]
        assert len(proposal.tokens) == 3 and proposal.probs is not None
        module = engine.speculation.proposer.executor.module
        outside = torch.ones(VOCAB, dtype=torch.bool)
        outside[torch.arange(DRAFT_VOCAB) + module.d2t] = False
        assert not proposal.probs[:, outside].any()  # target ids the head cannot propose: q = 0
        assert all(not outside[t] for t in proposal.tokens)
        outputs.append(engine.run_to_completion()[rid].token_ids)
        assert_proposer_blocks_free(engine, Eagle3Proposer)
    assert outputs[0] == outputs[1] and len(outputs[0]) == 16


def test_rejection_sampling_keeps_the_target_distribution_when_q_misses_tokens():
    """A head's q is zero on the target ids outside its vocabulary, where p is not: the first
    emitted token is still distributed as p (the residual max(p - q, 0) carries those ids)."""
    p = torch.tensor([[0.1, 0.4, 0.2, 0.25, 0.05], [0.2, 0.2, 0.2, 0.2, 0.2]])
    q = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2]])  # ids 0 and 2 are outside the head's vocabulary
    g, trials, first = torch.Generator().manual_seed(0), 10_000, torch.zeros(5)
    for _ in range(trials):
        first[accept_sampled([int(torch.multinomial(q[0], 1, generator=g))], p, g, q)[0]] += 1
    assert (first / trials - p[0]).abs().max() < 4 * (0.25 / trials) ** 0.5


def test_rollback_leaves_no_stale_eagle3_kv(ckpt):
    """After rejections, the head's cache holds only rows the target's states wrote
    (`hidden_state_proposers.assert_rollback_leaves_no_stale_kv`)."""
    target, head = ckpt

    def make(k: int) -> Engine:
        return make_engine(target, block_size=4, speculative_config=eagle3_config(head, k))

    assert_rollback_leaves_no_stale_kv(make, requests(40)[3], _kv_rows)


def _kv_rows(engine: Engine, state, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    cache = engine.speculation.proposer.executor.kv_cache
    slots = cache.block_slots(state.block_table, n)
    k, v = cache.layer(0)
    return k[slots], v[slots]


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_the_head_matches_an_independent_float32_computation(tmp_path: Path, norm_before_residual: bool):
    """One pass of a random head (its own embedding, layers 0, 2 and 3 of the target) over a
    prompt's positions against the EAGLE-3 layer written here from the checkpoint tensors, fed
    the states HF's model reports entering those layers, which the executor's taps must equal."""
    from transformers import AutoModelForCausalLM

    target = make_target(tmp_path / "target", agree=False)
    head = make_head(tmp_path / "head", target, agree=False, aux=[0, 2, 3])
    config = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps({**config, "norm_before_residual": norm_before_residual}))
    hf = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    ids = prompt(19, seed=4)
    with torch.no_grad():
        states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    aux = [states[j][0] for j in (0, 2, 3)]  # hidden_states[j]: what enters layer j
    next_ids, positions = torch.tensor(ids[1:]), torch.arange(len(ids) - 1)
    expected, expected_out = _reference_head(head, [a[:-1] for a in aux], next_ids, positions)

    loaded = load_model(str(target), torch.float32, torch.device("cpu"))
    engine = make_engine(loaded, speculative_config=eagle3_config(head, 1))
    forward(engine, [(new_sequence(engine, len(ids)), ids, 1)])
    kept = engine.executor.hidden
    assert isinstance(kept, list) and len(kept) == 3
    for got, want in zip(kept, aux, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert kept[0].data_ptr() != kept[1].data_ptr()
    proposer = engine.speculation.proposer
    assert proposer.executor.module.embed_tokens.weight is not loaded.module.model.embed_tokens.weight
    state = proposer.cache.allocate()
    assert proposer.cache.reserve(state, len(next_ids))
    batch = proposer.builder.build([StepItem(state, next_ids.tolist(), len(next_ids))])
    logits, out = proposer.executor.run_head(batch, proposer.fuse(kept)[:-1])
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out, expected_out, rtol=1e-4, atol=1e-4)
    assert logits.argmax(-1).tolist() == expected.argmax(-1).tolist()


def _reference_head(
    head: Path, aux: list[torch.Tensor], next_ids: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits over the target's vocabulary, pre-norm output) of an EAGLE-3 head at each
    position p (token p + 1, the target's states at p), in float32, from the checkpoint."""
    cfg = json.loads((head / "config.json").read_text())
    t = {k: v.float() for k, v in load_file(str(head / "model.safetensors")).items() if k != "d2t"}
    eps, heads, dim, n = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["head_dim"], len(positions)

    def rms(x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * t[name + ".weight"]

    def proj(x: torch.Tensor, name: str) -> torch.Tensor:
        return (x @ t[f"midlayer.self_attn.{name}.weight"].T).view(n, heads, dim)

    g = torch.cat(aux, dim=-1) @ t["fc.weight"].T
    hidden = rms(g, "midlayer.hidden_norm")
    residual = hidden if cfg.get("norm_before_residual") else g
    x = torch.cat((rms(t["embed_tokens.weight"][next_ids], "midlayer.input_layernorm"), hidden), dim=-1)
    angles = positions[:, None].float() / cfg["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim)
    cos, sin = torch.cat((angles, angles), -1).cos()[:, None], torch.cat((angles, angles), -1).sin()[:, None]

    def rope(y: torch.Tensor) -> torch.Tensor:
        return y * cos + torch.cat((-y[..., dim // 2 :], y[..., : dim // 2]), -1) * sin

    q, k, v = rope(proj(x, "q_proj")), rope(proj(x, "k_proj")), proj(x, "v_proj")
    scores = torch.einsum("thd,shd->hts", q, k) / dim**0.5 + torch.full((n, n), float("-inf")).triu(1)
    attn = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(n, -1)
    a = attn @ t["midlayer.self_attn.o_proj.weight"].T + residual
    m = rms(a, "midlayer.post_attention_layernorm")
    mlp = torch.nn.functional.silu(m @ t["midlayer.mlp.gate_proj.weight"].T) * (
        m @ t["midlayer.mlp.up_proj.weight"].T
    )
    y = mlp @ t["midlayer.mlp.down_proj.weight"].T + a
    logits = torch.full((n, VOCAB), float("-inf"))
    logits[:, torch.nonzero(t["t2d"]).flatten()] = rms(y, "norm") @ t["lm_head.weight"].T  # t2d: sorted ids
    return logits, y


def test_the_speculators_format_loads_as_the_same_head(ckpt, tmp_path: Path):
    """vLLM speculators' checkpoints: the layer config under `transformer_layer_config`, the
    layer's tensors as `layers.0.*`; the same weights give the same tokens."""
    target, head = ckpt
    flat = head_config(norm_before_residual=True)
    layer = {k: v for k, v in flat.items() if k not in ("architectures", "draft_vocab_size")}
    config = {"architectures": ["Eagle3Speculator"], "draft_vocab_size": DRAFT_VOCAB,
              "norm_before_residual": True, "transformer_layer_config": layer,
              "speculators_config": {"algorithm": "eagle3"}}  # fmt: skip
    tensors = load_file(str(head / "model.safetensors"))
    other = tmp_path / "speculators"
    other.mkdir()
    save_file(
        {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}, str(other / "model.safetensors")
    )
    (other / "config.json").write_text(json.dumps(config))
    want = make_engine(target, speculative_config=eagle3_config(head, 2)).generate(requests(8)[:2])
    engine = make_engine(target, speculative_config=eagle3_config(other, 2))
    assert [o.token_ids for o in engine.generate(requests(8)[:2])] == [o.token_ids for o in want]
    assert engine.speculation.accepted > 0


def _break(head: Path, tmp_path: Path, tensors=None, config=None) -> Path:
    """A copy of `head` with its tensors and config changed by the given functions."""
    bad = tmp_path / "bad"
    bad.mkdir()
    t = load_file(str(head / "model.safetensors"))
    save_file(tensors(t) if tensors else t, str(bad / "model.safetensors"))
    c = json.loads((head / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(config(c) if config else c))
    return bad


MALFORMED = {
    "not an eagle3 head": ({}, {"architectures": ["LlamaForCausalLM"]}, "is not an EAGLE-3 head"),
    "no fc": ({"drop": "fc.weight"}, {}, "missing tensor 'fc.weight'"),
    "d2t of the wrong length": ({"d2t": torch.zeros(5, dtype=torch.long)}, {}, "'d2t' has shape"),
    "d2t past the vocabulary": ({"d2t": torch.full((DRAFT_VOCAB,), VOCAB)}, {}, "outside the target"),
    "no d2t for a reduced vocabulary": ({"drop": "d2t"}, {}, "no 'd2t'"),
    "an auxiliary layer past the target's": (
        {},
        {"eagle_aux_hidden_state_layer_ids": [1, 2, 9]},
        "has 4 layers",
    ),
    "another vocabulary": ({}, {"vocab_size": 999}, "vocabulary of 999"),
    "another hidden width": ({}, {"target_hidden_size": 32}, "width 32"),
    "an EAGLE-1 head": ({}, {"eagle_config": {"use_aux_hidden_state": False}}, "EAGLE-1/2"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_heads_are_refused_with_a_message(ckpt, tmp_path: Path, case: str):
    target, head = ckpt
    change, fields, message = MALFORMED[case]

    def tensors(t: dict) -> dict:
        t = {k: v for k, v in t.items() if k != change.get("drop")}
        return t | {k: v for k, v in change.items() if k != "drop"}

    bad = _break(head, tmp_path, tensors, lambda c: c | fields)
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        make_engine(target, speculative_config=eagle3_config(bad, 2))


def test_the_speculative_config_needs_the_heads_model():
    assert SpeculativeConfig.from_json('{"method": "eagle3", "model": "x"}').is_eagle3
    with pytest.raises(InvalidRequestError, match='method "eagle3" needs "model"'):
        SpeculativeConfig.from_json('{"method": "eagle3", "num_speculative_tokens": 2}')


def test_a_config_naming_only_a_head_is_read_as_eagle3_and_a_draft_head_is_refused(ckpt, tmp_path: Path):
    """vLLM infers method "eagle3" from a head's config (its architecture, or the speculators
    format's algorithm); read as a draft model, the head failed with "missing tensor
    'model.embed_tokens.weight'"."""
    target, head = ckpt
    speculators = tmp_path / "speculators"
    speculators.mkdir()
    cfg = {"architectures": ["SomethingNew"], "speculators_config": {"algorithm": "eagle3"}}
    (speculators / "config.json").write_text(json.dumps(cfg))
    for model in (head, speculators):
        spec = SpeculativeConfig.from_json(json.dumps({"model": str(model), "num_speculative_tokens": 2}))
        assert spec is not None and spec.is_eagle3
    assert SpeculativeConfig.from_json(json.dumps({"model": target.name})).is_draft
    engine = make_engine(target, speculative_config=json.dumps({"model": str(head)}))
    assert isinstance(engine.speculation.proposer, Eagle3Proposer)
    with pytest.raises(ModelLoadError, match=r'is an EAGLE-3 head.*use method "eagle3"'):
        make_engine(target, speculative_config=json.dumps({"method": "draft", "model": str(head)}))


def test_an_eagle_1_2_head_is_refused_as_one_whichever_method_names_it(ckpt, tmp_path: Path):
    """EAGLE-1/2 heads (yuhuili/EAGLE-LLaMA3-Instruct-8B's layout: a Llama config of one layer,
    `fc` over [embedding; hidden], `layers.0.*`, `embed_tokens`) are not supported: named as a
    draft model the load failed on "missing tensor 'model.embed_tokens.weight'"."""
    target, head = ckpt
    old = tmp_path / "eagle1"
    old.mkdir()
    tensors = load_file(str(head / "model.safetensors"))
    midlayer = {k: t for k, t in tensors.items() if k.startswith("midlayer.") and "hidden_norm" not in k}
    layer = {"layers.0." + k.removeprefix("midlayer."): t for k, t in midlayer.items()}
    fc = {"fc.weight": torch.zeros(64, 128), "embed_tokens.weight": torch.zeros(VOCAB, 64)}
    save_file(layer | fc, str(old / "model.safetensors"), metadata={"format": "pt"})
    config = head_config() | {"architectures": ["LlamaForCausalLM"]}
    (old / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "draft_vocab_size"}))
    with pytest.raises(ModelLoadError, match=r"is an EAGLE-1/2 head \(an fc over"):
        make_engine(target, speculative_config=json.dumps({"model": str(old)}))
    with pytest.raises(ModelLoadError, match="is an EAGLE-1/2 head, which is not supported"):
        make_engine(target, speculative_config=eagle3_config(old, 2))


def test_generate_takes_an_eagle3_config(ckpt, tmp_path: Path, capsys: pytest.CaptureFixture):
    target, head = ckpt
    request = requests(12)[1]
    reqs = tmp_path / "reqs.jsonl"
    reqs.write_text(json.dumps(request) + "\n")
    argv = ["generate", "--model", target.name, "--requests", str(reqs), "--json", "--device", "cpu"]
    assert main([*argv, "--dtype", "float32", "--speculative-config", eagle3_config(head, 3)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == make_engine(target).generate([request])[0].token_ids


def test_a_head_with_pickle_weights_only_is_refused_with_how_to_convert(ckpt, tmp_path: Path):
    target, head = ckpt
    bad = tmp_path / "pickled"
    bad.mkdir()
    (bad / "config.json").write_text((head / "config.json").read_text())
    (bad / "pytorch_model.bin").write_bytes(b"")  # never opened: pickle files can run code
    with pytest.raises(ModelLoadError, match=r"only pickle weights: pytorch_model\.bin"):
        make_engine(target, speculative_config=eagle3_config(bad, 2))
