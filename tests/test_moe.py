"""Sparse MoE models (Qwen3-MoE, Qwen2-MoE with a shared expert, Mixtral) against HF transformers
on tiny random checkpoints, both checkpoint layouts of the experts, LoRA on an MoE model against
PEFT, and the expert computation itself: routing by hand, the grouped path against the reference."""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from model_service.distributed.sharding import Partition, _moe_share
from model_service.errors import ModelLoadError
from model_service.kernels.experts import (
    experts_grouped,
    experts_reference,
    grouped_experts_apply,
)
from model_service.lora.adapter import AdapterError, load_peft_adapter
from model_service.models.config import ModelConfig
from model_service.models.fp8_linear import quantize_online
from model_service.models.layers import checkpoint_tensors
from model_service.models.loader import load_model
from model_service.models.moe import SparseMoeBlock, route
from model_service.models.quantization import ONLINE_SCHEMES
from tests.conftest import assert_all_blocks_free, make_engine
from tests.test_lora import make_adapter, peft_greedy
from tests.test_tiny_models import (
    PROMPTS,
    Case,
    Variant,
    _one_torch_thread,  # noqa: F401 (the module fixture)
    last_token_logits,
    random_prompt,
    rel_err,
    request,
    save_checkpoint,
)

MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}
VARIANTS: dict[str, Variant] = {
    # Layer 1 dense (mlp_only_layers), 0 and 2 sparse; top-k renormalized.
    "qwen3-moe": Variant(
        "qwen3_moe",
        {**MOE, "num_experts": 8, "num_hidden_layers": 3, "mlp_only_layers": [1], "norm_topk_prob": True},
    ),
    # Every second layer sparse (decoder_sparse_step), raw softmax weights, a shared expert.
    "qwen2-moe-shared": Variant(
        "qwen2_moe",
        {**MOE, "num_experts": 8, "decoder_sparse_step": 2, "shared_expert_intermediate_size": 48},
    ),
    # A gated shared expert twice the experts' width (Qwen1.5-MoE's is 4 x 1,408): two slots of
    # the experts' stack (`moe.shared_expert_slots`), its weights moved there at load.
    "qwen2-moe-shared-slots": Variant(
        "qwen2_moe",
        {**MOE, "num_experts": 8, "decoder_sparse_step": 2, "shared_expert_intermediate_size": 64},
    ),
    "mixtral": Variant(
        "mixtral", {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32}
    ),
}


@pytest.fixture(scope="module", params=list(VARIANTS), ids=list(VARIANTS))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    return Case(save_checkpoint(VARIANTS[request.param], tmp_path_factory.mktemp(request.param)))


def hf_sparse_layers(hf) -> list[bool]:
    return [hasattr(layer.mlp, "experts") for layer in hf.model.layers]


def test_sparse_layers_and_weights_match_hf(case: Case):
    """The variants exercise what they are named for, and every HF parameter (stacked experts
    included) is ours exactly."""
    cfg = case.ours.config
    assert [k.moe for k in cfg.layer_kinds] == hf_sparse_layers(case.hf)
    assert any(k.moe for k in cfg.layer_kinds)
    assert cfg.num_experts == 8 and cfg.num_experts_per_tok == 2
    ours = checkpoint_tensors(case.ours.module)
    hf_params = dict(case.hf.named_parameters())
    assert set(ours) == set(hf_params)
    for name, p in hf_params.items():
        torch.testing.assert_close(ours[name], p, rtol=0, atol=0)


def test_logits_and_greedy_tokens_match_hf(case: Case):
    for ids in (PROMPTS[0], PROMPTS[4]):
        with torch.no_grad():
            ref = case.hf(torch.tensor([ids])).logits[0, -1]
        assert rel_err(last_token_logits(case.ours, ids), ref) < 1e-4
    engine = make_engine(case.ours)
    outs = engine.generate([request(ids) for ids in PROMPTS])  # batched: experts see mixed rows
    assert [o.token_ids for o in outs] == [case.hf_greedy(i) for i in range(len(PROMPTS))]
    assert_all_blocks_free(engine)


@pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="torch without grouped_mm")
def test_grouped_experts_path_gives_hf_tokens(case: Case, monkeypatch: pytest.MonkeyPatch):
    """The whole model with its experts on the grouped path (torch's CPU grouped_mm, float32)."""
    import model_service.kernels.experts as experts

    calls = []

    def grouped(*args: torch.Tensor) -> torch.Tensor:
        calls.append(args[0].shape[0])
        return experts_grouped(*args)

    monkeypatch.setattr(experts, "grouped_experts_apply", lambda dtype, device: True)
    monkeypatch.setattr(experts, "experts_grouped", grouped)
    engine = make_engine(case.ours)
    outs = engine.generate([request(ids) for ids in PROMPTS[:3]])
    assert [o.token_ids for o in outs] == [case.hf_greedy(i) for i in range(3)]
    assert calls and max(calls) > 1  # prefill and decode steps both went through it


def test_transformers5_stacked_layout_loads_the_same_weights(case: Case, tmp_path: Path):
    """`save_pretrained(save_original_format=False)` writes the experts stacked (and Mixtral's
    `block_sparse_moe` as `mlp`); it loads to the same module as the per-expert hub layout."""
    hub = load_file(str(case.path / "model.safetensors"))
    assert any(".experts.0." in k for k in hub)
    case.hf.save_pretrained(tmp_path, save_original_format=False)
    stacked = load_file(str(tmp_path / "model.safetensors"))
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in stacked)
    assert not any(".experts.0." in k for k in stacked)
    loaded = load_model(str(tmp_path), torch.float32, torch.device("cpu"))
    want = case.ours.module.state_dict()
    got = loaded.module.state_dict()
    assert set(got) == set(want)
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, rtol=0, atol=0)


def _rewrite(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory) -> Path:
    return save_checkpoint(VARIANTS["qwen3-moe"], tmp_path_factory.mktemp("qwen3_moe_errors"))


def test_broken_expert_checkpoints_are_refused_by_name(qwen3_moe_dir: Path, tmp_path: Path):
    expert = "model.layers.2.mlp.experts.5.up_proj.weight"

    def drop(t):
        del t[expert]

    def extra(t):
        t["model.layers.0.mlp.experts.8.up_proj.weight"] = torch.zeros(32, 64)

    def both_layouts(t):
        t["model.layers.0.mlp.experts.down_proj"] = torch.zeros(8, 64, 32)

    def misshapen(t):
        t[expert] = torch.zeros(33, 64)

    cases = {
        "drop": (drop, "missing tensor 'model.layers.2.mlp.experts.5.up_proj.weight'"),
        "extra": (extra, "model.layers.0.mlp.experts.8.up_proj.weight"),
        "both": (both_layouts, "both stacked"),
        "shape": (misshapen, "do not all have the same shapes"),
    }
    for name, (edit, message) in cases.items():
        path = _rewrite(qwen3_moe_dir, tmp_path / name, edit)
        with pytest.raises(ModelLoadError, match=message.replace("(", r"\(")):
            load_model(str(path), torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("layout", ["hub", "transformers5"])
def test_a_shared_expert_wider_than_its_config_is_refused_by_name(layout: str, tmp_path: Path):
    """config.json's shared_expert_intermediate_size (here 48: three slots of the experts' 16)
    against a shared expert 32 wide: the loader names the shared expert's tensor and both shapes,
    as for any tensor. Its split into slots blamed the routed experts' shapes (in the hub layout)
    or escaped as torch's RuntimeError (in transformers 5's stacked one, as did stacked experts
    of another width than the config's moe_intermediate_size)."""
    from transformers import AutoModelForCausalLM

    sizes = {"num_experts": 4, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32}
    path = save_checkpoint(Variant("qwen2_moe", {**sizes, "num_hidden_layers": 1}), tmp_path)
    if layout == "transformers5":
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        hf.save_pretrained(path, save_original_format=False)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "shared_expert_intermediate_size": 48}))
    name = "model.layers.0.mlp.shared_expert.gate_proj.weight"
    with pytest.raises(ModelLoadError, match=rf"{name}' has shape \(32, 64\), expected \(48, 64\)"):
        load_model(str(path), torch.float32, torch.device("cpu"))
    if layout == "transformers5":  # experts 16 wide, the config's 8 (the shared expert: 4 slots)
        (path / "config.json").write_text(json.dumps({**config, "moe_intermediate_size": 8}))
        with pytest.raises(ModelLoadError, match=r"experts.gate_up_proj' has shape \(4, 32, 64\)"):
            load_model(str(path), torch.float32, torch.device("cpu"))


def test_missing_moe_config_field_is_named():
    raw = {
        "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
        "num_attention_heads": 2, "num_hidden_layers": 1, "num_experts": 4, "num_experts_per_tok": 2,
    }  # fmt: skip
    with pytest.raises(ModelLoadError, match="moe_intermediate_size"):
        ModelConfig.from_hf(raw)
    with pytest.raises(ModelLoadError, match="num_experts_per_tok 5"):
        ModelConfig.from_hf({**raw, "moe_intermediate_size": 4, "num_experts_per_tok": 5})


def attention_adapter(checkpoint: Path, out: Path):
    """(HF's load of `checkpoint`, a random PEFT adapter on its four attention projections at `out`)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    adapter = make_adapter(
        hf, out, seed=7, scale=0.3, r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    return hf, adapter


def test_lora_on_attention_of_an_moe_model_matches_peft(qwen3_moe_dir: Path, tmp_path: Path):
    hf, adapter = attention_adapter(qwen3_moe_dir, tmp_path / "attn")
    loaded = load_model(str(qwen3_moe_dir), torch.float32, torch.device("cpu"))
    engine = make_engine(loaded, max_loras=1, lora_modules={"attn": str(adapter)})
    want = peft_greedy(hf, adapter, PROMPTS[:3], 16, eos=None)
    outs = engine.generate([{**request(ids), "adapter": "attn"} for ids in PROMPTS[:3]])
    assert [o.token_ids for o in outs] == want
    base = [o.token_ids for o in engine.generate([request(ids) for ids in PROMPTS[:3]])]
    assert base != want, "the adapter does not change the output"
    assert_all_blocks_free(engine)
    # PEFT turns MLP targets on an MoE model into LoRA on the stacked experts: refused by name.
    experts = make_adapter(
        hf, tmp_path / "mlp", seed=8, r=4, target_modules=["gate_proj", "up_proj", "down_proj"]
    )
    with pytest.raises(AdapterError, match="adapts mixture-of-experts experts"):
        load_peft_adapter("mlp", experts, loaded.config, max_lora_rank=8)


def test_lora_on_a_sparse_layer_mlp_is_refused(qwen3_moe_dir: Path, tmp_path: Path):
    """A gate_proj adapter for layer 0 (sparse) names a projection that layer does not have; the
    same projection of the dense layer 1 is fine."""
    cfg = load_model(str(qwen3_moe_dir), torch.float32, torch.device("cpu")).config
    tmp_path.joinpath("adapter_config.json").write_text('{"peft_type": "LORA", "r": 2, "lora_alpha": 2}')

    def write(layer: int) -> None:
        prefix = f"base_model.model.model.layers.{layer}.mlp.gate_proj"  # dense intermediate: 128
        tensors = {f"{prefix}.lora_A.weight": torch.zeros(2, 64)}
        tensors[f"{prefix}.lora_B.weight"] = torch.zeros(128, 2)
        save_file(tensors, str(tmp_path / "adapter_model.safetensors"))

    write(0)
    with pytest.raises(AdapterError, match="layer 0, a mixture-of-experts layer"):
        load_peft_adapter("x", tmp_path, cfg, max_lora_rank=8)
    write(1)
    assert load_peft_adapter("x", tmp_path, cfg, max_lora_rank=8).modules.keys() == {(1, "gate_proj")}


def test_routing_by_hand():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0], [0.0, 0.0, 5.0, 5.0]])
    weights, ids = route(logits, top_k=2, renormalize=False)
    total = 1 + math.e + math.e**2 + math.e**3
    assert ids[0].tolist() == [2, 1]
    torch.testing.assert_close(weights[0], torch.tensor([math.e**3 / total, math.e**2 / total]))
    assert sorted(ids[1].tolist()) == [2, 3]
    torch.testing.assert_close(weights[1], torch.full((2,), math.e**5 / (2 + 2 * math.e**5)))
    weights, ids = route(logits, top_k=2, renormalize=True)
    torch.testing.assert_close(weights[0], torch.tensor([1 / (1 + math.e**-1), 1 / (1 + math.e)]))
    torch.testing.assert_close(weights[1], torch.tensor([0.5, 0.5]))
    assert weights.dtype == torch.float32


def _experts_case(tokens: int, experts: int, top_k: int, hidden: int, inter: int, seed: int, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    down = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), dim=-1)
    return [t.to(device) for t in (x, gate_up, down, ids, weights)]


def test_reference_experts_equal_the_per_token_formula():
    x, gate_up, down, ids, weights = _experts_case(9, 6, 3, 16, 8, seed=0)
    want = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            gate, up = (gate_up[ids[t, k]] @ x[t]).chunk(2)
            want[t] += weights[t, k] * (down[ids[t, k]] @ (F.silu(gate) * up))
    torch.testing.assert_close(experts_reference(x, gate_up, down, ids, weights), want)


@pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="torch without grouped_mm")
def test_grouped_experts_equal_the_reference_on_cpu():
    """torch's CPU grouped_mm runs float32: the grouped path's sort, offsets and combine are
    checked here; the CUDA kernel below."""
    for tokens in (1, 5, 40):
        x, gate_up, down, ids, weights = _experts_case(tokens, 8, 2, 16, 8, seed=tokens)
        want = experts_reference(x, gate_up, down, ids, weights)
        torch.testing.assert_close(experts_grouped(x, gate_up, down, ids, weights), want)
        # Experts held elsewhere (ids outside 0..E) add nothing, on either path.
        remote = ids - 3
        want = experts_reference(x, gate_up, down, remote, weights)
        torch.testing.assert_close(experts_grouped(x, gate_up, down, remote, weights), want)


def test_expert_ranges_sum_to_the_whole_block():
    """The expert-parallel contract: blocks holding disjoint expert ranges add up to the block."""
    cfg = ModelConfig("qwen3_moe", 16, 16, 32, 1, 2, 2, 8, 1e-6, 64, num_experts=8, num_experts_per_tok=3,
                      moe_intermediate_size=8, norm_topk_prob=True)  # fmt: skip
    torch.manual_seed(0)
    whole = SparseMoeBlock(cfg)
    for p in whole.parameters():
        torch.nn.init.normal_(p, 0, 0.3)
    parts = [SparseMoeBlock(cfg, range(0, 3)), SparseMoeBlock(cfg, range(3, 8))]
    for part in parts:
        r = part.expert_range
        part.gate.weight.data = whole.gate.weight.data
        part.experts.gate_up_proj.data = whole.experts.gate_up_proj.data[r.start : r.stop]
        part.experts.down_proj.data = whole.experts.down_proj.data[r.start : r.stop]
    x = torch.randn(11, 16)
    with torch.no_grad():
        torch.testing.assert_close(parts[0](x) + parts[1](x), whole(x))
    with pytest.raises(ValueError, match="contiguous"):
        SparseMoeBlock(cfg, range(0, 9))


@pytest.mark.parametrize("fp8", [False, True], ids=["float", "online-fp8"])
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_a_fused_shared_expert_is_split_over_every_rank(expert_parallel: bool, fp8: bool):
    """The shared expert as the stack's last slots (`shared_expert_slots`), sharded over two
    ranks: the shares sum to the block, and every rank computes half of the shared expert (its
    slots' columns under tensor parallelism; an MLP split by columns again under expert
    parallelism, where held whole it would be one rank's work for every token). Under
    `--quantization fp8` the slots were quantized with the experts (e4m3 and scales): the MLP
    taken out of them computes the same dequantized weights (it was given bare e4m3 weights)."""
    sizes = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8, "norm_topk_prob": True}
    sizes["shared_expert_intermediate_size"] = 16
    cfg = ModelConfig("qwen2_moe", 16, 16, 32, 1, 2, 2, 8, 1e-6, 64, **sizes)
    torch.manual_seed(0)
    whole = SparseMoeBlock(cfg)
    assert whole.shared_slots == 2
    for p in whole.parameters():
        torch.nn.init.normal_(p, 0, 0.3)
    if fp8:  # as the loader's `--quantization fp8`: the built module quantized, then the config marked
        cfg.quantization = ONLINE_SCHEMES["fp8"]
        quantize_online(whole, cfg.quantization)
    x = torch.randn(5, 16)
    shares = []
    for rank in range(2):
        part = Partition.of(cfg, rank, 2, expert_parallel=expert_parallel)
        share = _moe_share(copy.deepcopy(whole), part, torch.device("cpu"), cfg)
        shared_columns = share.shared_mlp().down_proj.weight.shape[1] if share.shared_mlp() else 0
        slot_columns = share.shared_slots * share.experts.down_proj.shape[2]
        assert shared_columns + slot_columns == 8  # half of the shared expert's 16 on each rank
        shares.append(share)
    with torch.no_grad():
        torch.testing.assert_close(shares[0](x) + shares[1](x), whole(x))


@pytest.mark.parametrize("tokens", [1, 7, 64, 513])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_experts_match_the_reference_on_cuda(tokens: int):
    """bf16 at Qwen3-30B-A3B's expert shapes (fewer experts): the CUTLASS grouped kernel against
    the float32 reference on the same bf16 weights, and inside a CUDA graph (`fused_experts` takes
    the fused kernels for decode sizes: tests/test_fused_moe.py)."""
    x, gate_up, down, ids, weights = _experts_case(tokens, 32, 8, 2048, 768, seed=tokens, device="cuda")
    x, gate_up, down = (t.to(torch.bfloat16) for t in (x, gate_up, down))
    assert grouped_experts_apply(gate_up.dtype, x.device)
    want = experts_reference(x.float(), gate_up.float(), down.float(), ids, weights)
    got = experts_grouped(x, gate_up, down, ids, weights)
    assert got.dtype == torch.bfloat16
    assert ((got.float() - want).norm() / want.norm()).item() < 1e-2
    graph = torch.cuda.CUDAGraph()
    experts_grouped(x, gate_up, down, ids, weights)  # warm up outside the capture
    with torch.cuda.graph(graph):
        captured = experts_grouped(x, gate_up, down, ids, weights)
    ids.copy_(ids.flip(0))
    graph.replay()
    torch.testing.assert_close(captured, experts_grouped(x, gate_up, down, ids, weights), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_moe_engine_on_cuda(qwen3_moe_dir: Path):
    """float32 on CUDA (the fused expert kernels, decode in CUDA graphs) gives the CPU engine's
    tokens; bf16 decode steps replayed from CUDA graphs give the eager bf16 steps' tokens."""
    reqs = [request(ids) for ids in PROMPTS]
    cpu = load_model(str(qwen3_moe_dir), torch.float32, torch.device("cpu"))
    want = [o.token_ids for o in make_engine(cpu).generate(reqs)]
    cuda32 = load_model(str(qwen3_moe_dir), torch.float32, torch.device("cuda"))
    engine = make_engine(cuda32, device="cuda")
    assert engine.executor.graphs is not None
    torch.backends.cuda.matmul.allow_tf32 = False
    assert [o.token_ids for o in engine.generate(reqs)] == want
    bf16 = load_model(str(qwen3_moe_dir), torch.bfloat16, torch.device("cuda"))
    graphs = make_engine(bf16, device="cuda", dtype="bfloat16")
    assert graphs.executor.graphs is not None
    eager = make_engine(bf16, device="cuda", dtype="bfloat16", enforce_eager=True)
    for req in reqs:  # one at a time: the graph's batch is then unpadded, every GEMM the same shape
        assert graphs.generate([req])[0].token_ids == eager.generate([req])[0].token_ids


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_moe_prefill_and_mixed_steps_replay_piecewise_graphs(case: Case, monkeypatch: pytest.MonkeyPatch):
    """Prefill chunks and mixed steps of MoE models replay piecewise graphs: the routing kernel
    (Qwen2-MoE's shared-expert gate inside it), the fused experts and, in bf16 above 512 tokens
    (8 experts of top-2), the grouped path, all captured. float32 (fused at every size) gives
    the CPU engine's tokens over chunked prompts beside decodes, with every bucket captured and
    with the first alone (larger steps eager between its replays); in bf16 a prefill step of
    900 tokens (the 1,024 bucket: padding rows route to experts too, and must not change the
    real rows' sums) gives each prompt's first-token logprobs as an eager engine does."""
    from model_service.engine import piecewise_graphs
    from model_service.engine.piecewise_graphs import PiecewiseGraphs
    from model_service.kernels import experts

    replayed: list[int] = []
    captured: list[str] = []
    run, grouped = PiecewiseGraphs.run, experts.experts_grouped

    def counted(self: PiecewiseGraphs, batch) -> torch.Tensor:
        replayed.append(batch.num_tokens)
        return run(self, batch)

    def recorded(*args: torch.Tensor) -> torch.Tensor:
        captured.extend(["grouped"] if torch.cuda.is_current_stream_capturing() else [])
        return grouped(*args)

    monkeypatch.setattr(PiecewiseGraphs, "run", counted)
    monkeypatch.setattr(experts, "experts_grouped", recorded)
    torch.backends.cuda.matmul.allow_tf32 = False
    # four at a time, finishing at different steps: the long prompts share a first step of
    # 1,100 tokens, then the rest are prefilled beside decodes, the last ones in 16-token steps
    config = {"num_kv_blocks": 512, "max_num_seqs": 4, "max_num_batched_tokens": 1100}
    prompts = [*(random_prompt(n, seed=n) for n in (280, 300, 450, 490)), *PROMPTS, [5, 9, 11], [7] * 9]
    reqs = [{**request(ids), "max_tokens": 3 + 5 * (i % 4)} for i, ids in enumerate(prompts)]
    want = [o.token_ids for o in make_engine(case.ours, **config).generate(reqs)]
    cuda32 = load_model(str(case.path), torch.float32, torch.device("cuda"))
    for tight in (False, True):
        engine = make_engine(cuda32, device="cuda", **config)
        with monkeypatch.context() as m:
            if tight:  # room for the first bucket only
                m.setattr(piecewise_graphs, "capture_reserve", lambda total: torch.cuda.mem_get_info()[0] - 1)
            engine.warm_up()
        pieces = engine.executor.pieces
        assert {size for size, _ in pieces.buckets} == ({16} if tight else set(pieces.ladder))
        replayed.clear()
        assert [o.token_ids for o in engine.generate(reqs)] == want
        assert replayed and (max(replayed) <= 16 if tight else max(replayed) > 512), replayed

    bf16 = load_model(str(case.path), torch.bfloat16, torch.device("cuda"))
    firsts = [
        {
            "prompt_token_ids": random_prompt(300, seed=10 + i),
            "max_tokens": 1,
            "logprobs": 5,
            "temperature": 0,
        }
        for i in range(3)
    ]
    tops = {}
    for mode in ("pieces", "eager"):
        engine = make_engine(
            bf16, device="cuda", dtype="bfloat16", piecewise_graphs=mode == "pieces", **config
        )
        engine.warm_up()
        replayed.clear()
        tops[mode] = [dict(o.new_logprobs[0].top) for o in engine.generate(firsts)]
        assert (replayed == [900]) == (mode == "pieces"), replayed
    assert "grouped" in captured  # the bf16 buckets of 768+ tokens
    for got, eager in zip(tops["pieces"], tops["eager"], strict=True):
        assert max(got, key=got.get) == max(eager, key=eager.get)
        assert all(abs(got[t] - eager[t]) < 0.1 for t in got.keys() & eager.keys()), (got, eager)
