"""MTP speculation: a tiny random DeepSeek-V3-shaped checkpoint (test_deepseek's builder) with one
multi-token-prediction layer proposes, the target verifies.

The promises: the MTP layer computes what DeepSeek-V3's MTP module does (checked against a float32
computation written here from the checkpoint tensors, with HF's decoder layer as the block);
greedy output with MTP speculation is token for token the output without it, for a batch of
prompts, k = 1 and 3 (the verify guarantees it: the oracle); a seeded sampled request is
reproducible; the rollback leaves no stale MTP K/V; a checkpoint without MTP layers is refused.

Random MTP layers never agree with their target, so the checkpoint for the engine tests makes
one that partly does: the target's layers write little into the residual stream (their output
projections scaled down), so it predicts mostly from the last token, and the MTP layer's
`eh_proj` selects the embedding half (plus a little of the hidden half), with the target's last
layer as its block and the target's LM head: it proposes what the target would say after the
token it reads. About half its proposals are accepted: both the accept and the rollback paths run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_service.engine.batch_builder import StepItem
from model_service.engine.engine import Engine
from model_service.engine.mtp import MtpProposer
from model_service.engine.speculation import SpeculativeConfig
from model_service.errors import InvalidRequestError, ModelLoadError
from model_service.models.loader import LoadedModel, load_model
from spindle.cli import main
from tests.conftest import forward, make_engine, new_sequence
from tests.graph_replays import assert_graphs_equal_eager, on_the_cpu
from tests.hidden_state_proposers import assert_proposer_blocks_free, assert_rollback_leaves_no_stale_kv
from tests.hybrid_models import make_tiny_hybrid
from tests.test_deepseek import make_tiny_deepseek
from tests.test_lora import make_adapter
from tests.test_tiny_models import (  # noqa: F401 (_one_torch_thread: the module fixture, no conftest needed)
    PROMPTS,
    _one_torch_thread,
    random_prompt,
)

HIDDEN, LAST, MTP = 64, "model.layers.2.", "model.layers.3."  # the V3 shape: 3 decoder layers


def mtp_config(k: int) -> str:
    return json.dumps({"method": "mtp", "num_speculative_tokens": k})


def make_mtp_checkpoint(path: Path, agree: bool) -> Path:
    """test_deepseek's V3 checkpoint with one MTP layer (`model.layers.3.*`). `agree`: the layer
    the module docstring describes (embedding and head copies of the target's, which the loader
    shares); else a random one whose block is layer 2 of a second random checkpoint beside it
    (`path.parent / "donor"`, whose HF load gives the test its independent block) and whose head
    is its own."""
    make_tiny_deepseek("v3", path)
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    g = torch.Generator().manual_seed(7)
    if agree:
        for name, t in list(tensors.items()):
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                tensors[name] = t * 0.01
        block = {k: v for k, v in tensors.items() if k.startswith(LAST)}
        hidden_half = 0.01 * torch.randn(HIDDEN, HIDDEN, generator=g)
        eh_proj = torch.cat((torch.eye(HIDDEN), hidden_half), dim=1)
        head = tensors["lm_head.weight"].clone()
    else:
        donor = load_file(str(make_tiny_deepseek("v3", path.parent / "donor", seed=1) / "model.safetensors"))
        block = {k: v for k, v in donor.items() if k.startswith(LAST)}
        eh_proj = torch.randn(HIDDEN, 2 * HIDDEN, generator=g) * 0.2
        head = torch.randn(tensors["lm_head.weight"].shape, generator=g) * 0.2
    tensors |= {MTP + k[len(LAST) :]: v.clone() for k, v in block.items()}
    tensors |= {
        MTP + "enorm.weight": 1 + 0.3 * torch.randn(HIDDEN, generator=g),
        MTP + "hnorm.weight": 1 + 0.3 * torch.randn(HIDDEN, generator=g),
        MTP + "eh_proj.weight": eh_proj,
        MTP + "shared_head.norm.weight": tensors["model.norm.weight"].clone(),
        MTP + "shared_head.head.weight": head,
        MTP + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
    }
    save_file(tensors, str(file), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return path


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = make_mtp_checkpoint(tmp_path_factory.mktemp("mtp") / "agree", agree=True)
    return load_model(str(path), torch.float32, torch.device("cpu"))


def requests(max_tokens: int = 20) -> list[dict]:
    prompts = [*PROMPTS[:3], random_prompt(23, seed=5)]
    greedy = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return [{"prompt_token_ids": p, **greedy} for p in prompts]


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_output_is_identical_with_mtp_speculation(target: LoadedModel, k: int):
    plain = make_engine(target, block_size=4)
    expected = [o.token_ids for o in plain.generate(requests())]
    engine = make_engine(target, block_size=4, speculative_config=mtp_config(k))
    assert [o.token_ids for o in engine.generate(requests())] == expected
    stats = engine.stats()  # what the pod exports as vllm:spec_decode_* metrics
    assert 0 < stats.spec_accepted_tokens < stats.spec_proposed_tokens  # accepted, and rolled back
    assert engine.num_steps < plain.num_steps
    layer = engine.speculation.proposer.executor.module
    assert layer.shared_head.head.weight is target.module.lm_head.weight  # the checkpoint's copy: shared
    assert_proposer_blocks_free(engine, MtpProposer)


def test_mtp_speculation_over_an_online_fp8_target(tmp_path: Path):
    """`--quantization fp8` on a V3 checkpoint with its MTP layer: the layer, float on disk as the
    rest, is quantized online as the target was (its experts e4m3; its MoE's shared expert fused
    into the stack as the target's) and greedy output is the target's without speculation. Its
    load read the float tensors as an FP8 checkpoint's and refused them ("...is torch.float32,
    but the quantization_config (online) says ... float8_e4m3fn")."""
    from model_service.models.moe import SparseMoeBlock

    path = make_mtp_checkpoint(tmp_path / "agree", agree=True)
    target = load_model(str(path), torch.float32, torch.device("cpu"), quantization="fp8")
    expected = [o.token_ids for o in make_engine(target, block_size=4).generate(requests(12))]
    engine = make_engine(target, block_size=4, speculative_config=mtp_config(2))
    assert [o.token_ids for o in engine.generate(requests(12))] == expected
    moe = next(
        m for m in engine.speculation.proposer.executor.module.modules() if isinstance(m, SparseMoeBlock)
    )
    assert moe.experts.gate_up_proj.dtype == torch.float8_e4m3fn and moe.shared_slots == 1
    assert engine.stats().spec_accepted_tokens > 0


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_greedy_output_is_identical_under_preemption_chunked_prefill_and_a_lora_row(
    target: LoadedModel, tmp_path: Path, mode: str
):
    """A preempted sequence keeps its MTP K/V (swapped back, or recomputed partly from the prefix
    cache, it continues where the layer was); prompts arrive in chunks, whose states wait for the
    first proposal; a LoRA row's states are the adapted target's (the MTP layer has no adapter)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(target.name, dtype=torch.float32)
    adapter = make_adapter(hf, tmp_path / "a", seed=7, scale=0.3, r=4, target_modules=["o_proj"])
    batch = [*requests(), {**requests()[0], "adapter": "a"}]
    cfg = {"num_kv_blocks": 14, "block_size": 4, "max_num_batched_tokens": 16, "preemption_mode": mode}
    lora = {"max_loras": 1, "lora_modules": {"a": str(adapter)}}
    expected = [o.token_ids for o in make_engine(target, **cfg, **lora).generate(batch)]
    engine = make_engine(target, **cfg, **lora, speculative_config=mtp_config(2))
    assert [o.token_ids for o in engine.generate(batch)] == expected
    assert expected[-1] != expected[0]  # the adapter changes the output
    stats = engine.stats()
    assert stats.num_preemptions > 0 and 0 < stats.spec_accepted_tokens < stats.spec_proposed_tokens
    assert_proposer_blocks_free(engine, MtpProposer)


def test_a_prefix_cache_hit_finds_the_mtp_rows_in_the_mtp_prefix_cache(target: LoadedModel):
    """The target computes no hidden states for a cached prefix; the MTP cache published its rows
    for it under the same keys, so the second run of a prompt speculates as the first did, from
    the MTP layer's own hit."""
    engine = make_engine(target, block_size=4, speculative_config=mtp_config(2))
    first = engine.generate(requests()[3:])[0].token_ids
    proposed, accepted = engine.speculation.proposed, engine.speculation.accepted
    assert accepted > 0
    assert engine.generate(requests()[3:])[0].token_ids == first
    assert engine.stats().prefix_cache_hit_tokens > 0
    proposer = engine.speculation.proposer
    assert proposer.cache.blocks.num_cached > 0
    assert (engine.speculation.proposed, engine.speculation.accepted) == (2 * proposed, 2 * accepted)
    assert_proposer_blocks_free(engine, MtpProposer)


def test_sampled_output_is_reproducible_with_a_seed(target: LoadedModel):
    request = {"prompt_token_ids": PROMPTS[0], "max_tokens": 16, "temperature": 0.8, "top_k": 40, "seed": 3}
    outputs = []
    for _ in range(2):
        engine = make_engine(target, speculative_config=mtp_config(3))
        rid = engine.add_request_dict(request)
        engine.step()  # prefill: the target samples, the MTP layer proposes from its states
        proposal = engine.speculation.proposals[engine.requests[rid]]
        assert len(proposal.tokens) == 3 and proposal.probs is not None  # q for the rejection sampler
        assert all(proposal.probs[i, t] > 0 for i, t in enumerate(proposal.tokens))
        outputs.append(engine.run_to_completion()[rid].token_ids)
        assert engine.speculation.proposed > 0
        assert_proposer_blocks_free(engine, MtpProposer)
    assert outputs[0] == outputs[1] and len(outputs[0]) == 16


def test_the_mtp_layer_keeps_pace_with_a_chunked_prefill(target: LoadedModel):
    """A prefill chunk's positions have their next tokens in the prompt: the layer runs them in
    the chunk's own step, holding no rows back (only the prompt's last waits for its token)."""
    engine = make_engine(target, block_size=4, max_num_batched_tokens=8, speculative_config=mtp_config(2))
    rid = engine.add_request_dict(requests()[3])  # 23 prompt tokens: three chunks
    seq, proposer = engine.requests[rid], engine.speculation.proposer
    fed = []
    while not seq.num_output_tokens:
        engine.step()
        follow = proposer.follows[rid]
        assert not follow.pending
        fed.append(follow.confirmed)
    assert fed == [8, 16, 23]  # the last: the prompt's last position too, fed for the first proposal
    assert engine.speculation.proposals[seq].tokens


def test_rollback_leaves_no_stale_mtp_kv(target: LoadedModel):
    """After rejections, the MTP cache holds only rows the target's states wrote
    (`hidden_state_proposers.assert_rollback_leaves_no_stale_kv`)."""

    def make(k: int) -> Engine:
        return make_engine(target, block_size=4, speculative_config=mtp_config(k))

    assert_rollback_leaves_no_stale_kv(make, requests(40)[3], _mtp_rows)


def _mtp_rows(engine: Engine, state, n: int) -> torch.Tensor:
    cache = engine.speculation.proposer.executor.kv_cache
    return cache.latent(0)[cache.block_slots(state.block_table, n)]


@pytest.mark.parametrize("k", [1, 3])
def test_graph_replays_propose_and_emit_the_eager_steps_tokens(
    target: LoadedModel, k: int, monkeypatch: pytest.MonkeyPatch
):
    """The CUDA-graph path's wiring on the CPU (tests/graph_replays.py's stand-ins): the target's
    verify steps keep the last layer's states as views of the replay's output, the MTP layer's
    feeds of verified runs and chained steps replay over its static input; tokens and proposals
    are the eager steps'. The GPU test below runs real graphs."""
    expected = [o.token_ids for o in make_engine(target).generate(requests())]

    def make(eager: bool) -> Engine:
        return make_engine(target, max_num_seqs=8, speculative_config=mtp_config(k))

    assert_graphs_equal_eager(on_the_cpu(monkeypatch, make), requests(), expected, monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("k", [1, 3])
def test_mtp_graphs_give_the_eager_steps_tokens_and_proposals(
    target: LoadedModel, k: int, monkeypatch: pytest.MonkeyPatch
):
    """float32 on CUDA: the target's verify steps (keeping the last layer's states in the graph's
    own tensor) and the MTP layer's steps (feeds of verified runs, chained steps; MLA through the
    latent kernel) replayed from graphs propose and emit what the eager steps do: plain greedy's
    tokens."""
    torch.backends.cuda.matmul.allow_tf32 = False
    loaded = load_model(target.name, torch.float32, torch.device("cuda"))
    cuda = {"device": "cuda", "max_num_seqs": 8}
    expected = [o.token_ids for o in make_engine(loaded, **cuda).generate(requests())]

    def make(eager: bool) -> Engine:
        return make_engine(loaded, **cuda, enforce_eager=eager, speculative_config=mtp_config(k))

    assert_graphs_equal_eager(make, requests(), expected, monkeypatch)


def test_a_checkpoint_without_mtp_layers_is_refused(tmp_path: Path):
    plain = load_model(str(make_tiny_deepseek("v3", tmp_path / "plain")), torch.float32, torch.device("cpu"))
    with pytest.raises(ModelLoadError, match="num_nextn_predict_layers"):
        make_engine(plain, speculative_config=mtp_config(2))
    assert SpeculativeConfig.from_json(mtp_config(2)).is_mtp
    with pytest.raises(InvalidRequestError, match='"model" is for method "draft"'):
        SpeculativeConfig.from_json('{"method": "mtp", "model": "x"}')


def test_generate_takes_an_mtp_config(target: LoadedModel, tmp_path: Path, capsys: pytest.CaptureFixture):
    request = {"prompt_token_ids": PROMPTS[1], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    reqs = tmp_path / "reqs.jsonl"
    reqs.write_text(json.dumps(request) + "\n")
    argv = ["generate", "--model", target.name, "--requests", str(reqs), "--json", "--device", "cpu"]
    assert main([*argv, "--dtype", "float32", "--speculative-config", mtp_config(3)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == make_engine(target).generate([request])[0].token_ids


def test_the_mtp_layer_matches_an_independent_float32_computation(tmp_path: Path):
    """One MTP pass over a prompt's positions against DeepSeek-V3's MTP module written here from
    the checkpoint tensors: the target's hidden states from HF's model (the input of its final
    norm), HF's decoder layer (a second checkpoint's layer 2, the MTP block's donor) as the block.
    The executor's kept hidden states are HF's too."""
    from transformers import AutoModelForCausalLM

    path = make_mtp_checkpoint(tmp_path / "random", agree=False)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    donor = AutoModelForCausalLM.from_pretrained(str(tmp_path / "donor"), dtype=torch.float32).eval()
    ids = random_prompt(19, seed=4)
    captured: list[torch.Tensor] = []
    hf.model.norm.register_forward_hook(lambda _m, args, _out: captured.append(args[0][0]))
    with torch.no_grad():
        hf(torch.tensor([ids]))
    h, next_ids, positions = captured[0][:-1], torch.tensor(ids[1:]), torch.arange(len(ids) - 1)
    expected = _reference_mtp(path, donor, h, next_ids, positions)

    loaded = load_model(str(path), torch.float32, torch.device("cpu"))
    engine = make_engine(loaded, speculative_config=mtp_config(1))
    forward(engine, [(new_sequence(engine, len(ids)), ids, 1)])
    torch.testing.assert_close(engine.executor.hidden[:-1], h, rtol=1e-4, atol=1e-4)
    proposer = engine.speculation.proposer
    layer, module = proposer.executor.module, loaded.module
    assert layer.embed_tokens.weight is module.model.embed_tokens.weight  # a copy of the target's: shared
    assert layer.shared_head.head.weight is not module.lm_head.weight  # its own
    state = proposer.cache.allocate()
    assert proposer.cache.reserve(state, len(next_ids))
    batch = proposer.builder.build([StepItem(state, next_ids.tolist(), len(next_ids))])
    logits, _ = proposer.executor.run_head(batch, h)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    assert logits.argmax(-1).tolist() == expected.argmax(-1).tolist()


def _reference_mtp(
    path: Path, donor, h: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Logits of the MTP layer at each position p (token p + 1, target state h_p), in float32."""
    eps = json.loads((path / "config.json").read_text())["rms_norm_eps"]
    tensors = load_file(str(path / "model.safetensors"))

    def w(name: str) -> torch.Tensor:
        return tensors[MTP + name].float()

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    embeds = w("embed_tokens.weight")[next_ids]
    embeds[positions == 0] = 0.0  # as vLLM: position 0's embedding is masked
    x = torch.cat((rms(embeds, w("enorm.weight")), rms(h, w("hnorm.weight"))), dim=-1) @ w("eh_proj.weight").T
    n = len(positions)
    causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        rope = donor.model.rotary_emb(x[None], positions[None])
        y = donor.model.layers[2](x[None], attention_mask=causal, position_embeddings=rope)
        y = y[0] if isinstance(y, tuple) else y
    return rms(y[0], w("shared_head.norm.weight")) @ w("shared_head.head.weight").T


def test_a_qwen3_next_checkpoint_with_its_mtp_tensors_loads_and_refuses_mtp_speculation(tmp_path: Path):
    """Qwen3-Next's hub checkpoints ship their MTP layer as `mtp.*` tensors (`mtp_num_hidden_layers`
    in config.json), which HF and vLLM's target load skip: the target loads the same weights as
    without them, and method "mtp" is refused naming that layer, not as a checkpoint without one."""
    plain = make_tiny_hybrid(tmp_path / "plain")
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    tensors = load_file(str(plain / "model.safetensors"))
    layer = {
        "mtp.layers.0." + k.removeprefix(LAST): t.clone() for k, t in tensors.items() if k.startswith(LAST)
    }
    extra = {"mtp.fc.weight": torch.randn(HIDDEN, 2 * HIDDEN), "mtp.norm.weight": torch.ones(HIDDEN)}
    save_file(tensors | layer | extra, str(shipped / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((plain / "config.json").read_text()) | {"mtp_num_hidden_layers": 1}
    (shipped / "config.json").write_text(json.dumps(config))
    cpu = torch.device("cpu")
    loaded = load_model(str(shipped), torch.float32, cpu, with_tokenizer=False)
    ours = loaded.module.state_dict()
    theirs = load_model(str(plain), torch.float32, cpu, with_tokenizer=False).module.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    with pytest.raises(ModelLoadError, match=r"Qwen3-Next's MTP layer \(mtp\.\* tensors\)"):
        make_engine(loaded, speculative_config=mtp_config(1))
