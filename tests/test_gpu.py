"""CUDA: the same random model and adapters on CPU and CUDA (both float32) give the same tokens,
with base and adapter rows mixed, swap preemption, the prefix cache and beam search on.
Skipped without a GPU; run it on a CUDA machine with `pytest -m gpu`."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_service.engine.config import EngineConfig
from model_service.engine.engine import Engine
from model_service.models.config import ModelConfig
from model_service.models.llama import DecoderModel
from model_service.models.loader import LoadedModel
from model_service.models.step import StepBatch
from tests.random_models import random_llama

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _engine(cfg: ModelConfig, reference: DecoderModel, device: str, **config: object) -> Engine:
    model = DecoderModel(cfg)
    model.load_state_dict(reference.state_dict())
    loaded = LoadedModel("random", cfg, model.to(device).eval(), None)
    return Engine(EngineConfig(device=device, dtype="float32", **config), loaded=loaded)


def test_cuda_matches_cpu_with_adapters_swap_and_beams(tmp_path):
    from bench.lora import write_adapter

    cfg, reference = random_llama()
    adapters = {f"a{i}": write_adapter(tmp_path / f"a{i}", cfg, rank=4 + 4 * i, seed=i) for i in range(3)}
    for path in adapters.values():  # large enough deltas that a missing one changes tokens
        weights = path / "adapter_model.safetensors"
        save_file({k: v * 30 for k, v in load_file(str(weights)).items()}, str(weights))
    torch.backends.cuda.matmul.allow_tf32 = False
    requests = [
        {
            "prompt_token_ids": [(7 * i + j) % 500 + 3 for j in range(10 + i)],
            "max_tokens": 12,
            "temperature": 0,
            "ignore_eos": True,
            "adapter": [None, "a0", "a1", "a2"][i % 4],
        }
        for i in range(8)
    ]
    requests.append(
        {
            "prompt_token_ids": [5, 9, 11, 13],
            "max_tokens": 8,
            "num_beams": 3,
            "ignore_eos": True,
            "adapter": "a1",
        }
    )
    results = {}
    for device in ("cpu", "cuda"):
        engine = _engine(
            cfg,
            reference,
            device,
            num_kv_blocks=14,
            block_size=4,
            max_loras=2,
            preemption_mode="swap",
            lora_modules={k: str(v) for k, v in adapters.items()},
        )
        results[device] = [o.token_ids for o in engine.generate(requests)]
        assert engine.stats().num_preemptions > 0
        assert engine.cache.num_free_blocks == engine.cache.num_total_blocks
    assert results["cuda"] == results["cpu"]


@pytest.mark.parametrize("budget", [96, 1100])
def test_cuda_prefill_with_adapters_in_row_tiles_matches_cpu(tmp_path, monkeypatch, budget: int):
    """Prompts long enough that their prefill chunks take the LoRA tile kernels (runs of one
    adapter cut into row tiles), chunked and mixed with decode rows of other adapters: eager
    (decode steps add gate_up's delta inside the SiLU-mul), then replayed from piecewise graphs
    that record both kinds of LoRA kernels over static buffers (steps with and without tiles,
    and with leading decode rows, among them); with a budget of 1,100 tokens, LoRA buckets
    above 512 tokens too."""
    from bench.lora import write_adapter
    from model_service.engine.piecewise_graphs import PiecewiseGraphs
    from model_service.lora import layers

    replayed: list[tuple[bool, bool]] = []  # (LoRA rows, tiles) of each step the pieces ran
    sizes: list[int] = []  # tokens of each step the pieces ran with LoRA rows
    run, fused = PiecewiseGraphs.run, layers.silu_mul_lora_rows
    activations: list[int] = []  # rows of each SiLU-mul with the gate_up delta folded in

    def counted(self: PiecewiseGraphs, batch: StepBatch) -> torch.Tensor:
        eager = layers.LoraStepPlan(use_kernels=True)  # what an eager pass of this step would run
        eager.prepare(batch)
        replayed.append((batch.uses_lora, eager.tiles is not None))
        sizes.extend([batch.num_tokens] if batch.uses_lora else [])
        return run(self, batch)

    def counted_activation(y: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        activations.append(y.shape[0])
        return fused(y, *args)

    monkeypatch.setattr(PiecewiseGraphs, "run", counted)
    monkeypatch.setattr(layers, "silu_mul_lora_rows", counted_activation)

    cfg, reference = random_llama()
    adapters = {f"a{i}": write_adapter(tmp_path / f"a{i}", cfg, rank=8 * (i + 1), seed=i) for i in range(2)}
    for path in adapters.values():
        weights = path / "adapter_model.safetensors"
        save_file({k: v * 30 for k, v in load_file(str(weights)).items()}, str(weights))
    torch.backends.cuda.matmul.allow_tf32 = False
    requests = [
        {
            "prompt_token_ids": [
                (13 * i + 3 * j) % 500 + 3 for j in range(20 + (37 if budget < 512 else 187) * i)
            ],
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
            "adapter": ["a0", None, "a1", "a0", "a1"][i],
        }
        for i in range(5)
    ]
    results = {}
    for device, pieces in (("cpu", False), ("cuda", False), ("cuda", True)):
        engine = _engine(
            cfg, reference, device, max_loras=2, max_num_batched_tokens=budget,
            kv_cache_memory_bytes=64 << 20, lora_modules={k: str(v) for k, v in adapters.items()},
        )  # fmt: skip
        if pieces:
            engine.warm_up()
        short = {**requests[2], "prompt_token_ids": [7, 11, 13, 17, 19]}  # a prefill without tiles
        results[device, pieces] = [o.token_ids for wave in (requests, [short]) for o in engine.generate(wave)]
    assert {(True, True), (True, False)} <= set(replayed)
    assert budget < 512 or max(sizes) > 768  # chunks of the 1,970 prompt tokens: the 1,536 bucket
    assert activations  # the CUDA runs' decode steps with adapters took the fused activation
    assert results["cuda", False] == results["cuda", True] == results["cpu", False]


@pytest.mark.parametrize("budget", [96, 1100])
def test_piecewise_graphs_of_prefill_and_mixed_steps_match_eager_and_cpu(monkeypatch, budget: int):
    """Prefill chunks and mixed steps replay graphs split at attention (padded token counts, the
    real attention eager between them): same tokens as eager steps and the CPU, over waves that
    reuse buckets with other lengths and other blocks; with a budget of 1,100 tokens, steps of
    the buckets above 512 too (every bucket's attention calls share one output buffer)."""
    from model_service.engine import piecewise_graphs
    from model_service.engine.piecewise_graphs import PiecewiseGraphs

    replayed: list[int] = []
    run = PiecewiseGraphs.run

    def counted(self: PiecewiseGraphs, batch: StepBatch) -> torch.Tensor:
        replayed.append(batch.num_tokens)
        return run(self, batch)

    monkeypatch.setattr(PiecewiseGraphs, "run", counted)
    cfg, reference = random_llama()
    torch.backends.cuda.matmul.allow_tf32 = False
    waves = [
        [
            {
                "prompt_token_ids": [(7 * w + 3 * i + j) % 500 + 3 for j in range(5 + 41 * i + 13 * w)],
                "max_tokens": 6 + i,
                "temperature": 0,
                "ignore_eos": True,
            }
            for i in range(n)
        ]
        for w, n in enumerate((4, 7, 3))
    ]
    results = {}
    modes = ["eager", "warm-up", "decode first", "tight"]
    for device, mode in [("cpu", "eager"), *(("cuda", mode) for mode in modes)]:
        eager = mode == "eager"
        engine = _engine(cfg, reference, device, num_kv_blocks=512, block_size=4, max_num_seqs=8,
                         max_num_batched_tokens=budget, enforce_eager=eager,
                         piecewise_graphs=True)  # fmt: skip
        if mode == "decode first":  # leaves the LoRA plan on (its last graph has the LoRA kernels),
            engine.executor.graphs.capture_all()  # which buckets captured next once recorded
            engine.executor.pieces.capture_all()
        elif mode == "tight":  # room for the first bucket only: the larger steps run eagerly
            with monkeypatch.context() as m:
                m.setattr(piecewise_graphs, "capture_reserve", lambda total: torch.cuda.mem_get_info()[0] - 1)
                engine.warm_up()
            assert set(engine.executor.pieces.buckets) == {(16, False)}
        else:
            engine.warm_up()  # captures the buckets (none with enforce_eager or on the CPU)
        results[device, mode] = [[o.token_ids for o in engine.generate(wave)] for wave in waves]
    assert len({-(-n // 16) for n in replayed}) >= 3  # chunks of 96 tokens, tails, mixed: several buckets
    assert budget < 512 or max(replayed) > 768  # the second wave's prefill: the 1,024 bucket
    assert results["cuda", "warm-up"] == results["cuda", "eager"] == results["cpu", "eager"]
    assert results["cuda", "decode first"] == results["cuda", "tight"] == results["cpu", "eager"]


def test_decode_graphs_replay_over_reused_blocks_with_fresh_metadata():
    """CUDA graphs are captured once per padded batch size; later waves of requests get blocks and
    rows that earlier ones used, and every replay must re-prepare the metadata (a graph replayed
    over stale block tables would read another request's K/V). Graph, eager and CPU agree."""
    cfg, reference = random_llama()
    torch.backends.cuda.matmul.allow_tf32 = False
    waves = [
        [
            {
                "prompt_token_ids": [(11 * w + 5 * i + j) % 500 + 3 for j in range(3 + 7 * i)],
                "max_tokens": 10 + i,
                "temperature": 0,
                "ignore_eos": True,
            }
            for i in range(n)
        ]
        for w, n in enumerate((5, 3, 9))  # padded to 8, 4, 16: three graphs, reused blocks
    ]
    results = {}
    for device, eager in (("cpu", True), ("cuda", True), ("cuda", False)):
        engine = _engine(
            cfg, reference, device, num_kv_blocks=64, block_size=4, max_num_seqs=16, enforce_eager=eager
        )
        results[device, eager] = [[o.token_ids for o in engine.generate(wave)] for wave in waves]
        if device == "cuda" and not eager:
            assert engine.executor.graphs is not None and len(engine.executor.graphs.graphs) >= 3
        assert engine.cache.num_free_blocks == engine.cache.num_total_blocks
    assert results["cuda", False] == results["cuda", True] == results["cpu", True]


def test_warm_up_captures_every_decode_graph_so_serving_captures_none(tmp_path):
    """A pod warms its engine up before it reports SERVING: every size of the batch ladder, with
    the LoRA kernels and without, is captured then, so no request waits on a capture (or on the
    kernel compiles one brings); requests afterwards replay those graphs and give the CPU's tokens."""
    from bench.lora import write_adapter
    from model_service.engine.cuda_graphs import batch_ladder

    cfg, reference = random_llama()
    torch.backends.cuda.matmul.allow_tf32 = False
    adapter = str(write_adapter(tmp_path / "a", cfg, rank=8, seed=3))
    requests = [
        {"prompt_token_ids": [(5 * i + j) % 500 + 3 for j in range(4 + 3 * i)], "max_tokens": 8,
         "temperature": 0, "ignore_eos": True, "adapter": "a" if i % 2 else None}
        for i in range(6)
    ]  # fmt: skip
    results = {}
    for device in ("cpu", "cuda"):
        engine = _engine(cfg, reference, device, num_kv_blocks=64, block_size=4, max_num_seqs=24,
                         max_loras=2, max_lora_rank=8, lora_modules={"a": adapter})  # fmt: skip
        engine.warm_up()
        graphs = engine.executor.graphs
        if device == "cuda":
            assert graphs is not None
            kinds = (0, 1, engine.executor.lora.plan.all_kinds)  # none, q/k/v (PEFT's default), all
            assert set(graphs.graphs) == {(n, k) for n in batch_ladder(24) for k in kinds}
            captured = dict(graphs.graphs)
        results[device] = [o.token_ids for o in engine.generate(requests)]
    assert graphs.graphs == captured  # nothing captured while serving
    assert results["cuda"] == results["cpu"]


def _requests(adapters: list[str | None]) -> list[dict]:
    """Greedy requests of varied prompt lengths, one through each of `adapters` (None: the base)."""
    return [
        {"prompt_token_ids": [(7 * i + j) % 500 + 3 for j in range(5 + 2 * i)], "max_tokens": 6,
         "temperature": 0, "ignore_eos": True, "adapter": name}
        for i, name in enumerate(adapters)
    ]  # fmt: skip


def test_decode_graphs_run_lora_kernels_only_on_the_projections_the_step_targets(tmp_path):
    """Adapters on q/v, on the MLP, and on all seven projections, alone and together in steps:
    each step replays the graph of the projections its adapters target, captured at warm-up (q/k/v
    and all always, the MLP's as a registered adapter's kinds), or the graph of all kinds for a
    mix that has none (q/v with the MLP): nothing is captured while serving, and the tokens are
    the CPU's."""
    from bench.lora import write_adapter

    cfg, reference = random_llama()
    torch.backends.cuda.matmul.allow_tf32 = False
    targets = {"qv": ("q_proj", "v_proj"), "mlp": ("gate_proj", "up_proj", "down_proj"), "all": None}
    adapters = {n: str(write_adapter(tmp_path / n, cfg, rank=8, seed=i, targets=t))
                for i, (n, t) in enumerate(targets.items())}  # fmt: skip
    rounds = [["qv", None], ["mlp", "mlp"], ["qv", "mlp"], ["qv", "mlp", "all", None]]
    results = {}
    for device in ("cpu", "cuda"):
        engine = _engine(cfg, reference, device, num_kv_blocks=96, block_size=4, max_num_seqs=8,
                         max_loras=3, max_lora_rank=8, lora_modules=adapters)  # fmt: skip
        engine.warm_up()
        captured = dict(engine.executor.graphs.graphs) if device == "cuda" else {}
        results[device] = [[o.token_ids for o in engine.generate(_requests(names))] for names in rounds]
        if device == "cuda":
            plan = engine.executor.lora.plan
            mlp = int(plan.slot_kinds[engine.lora.slot_of("mlp")])
            assert {k for _, k in captured} == {0, 1, mlp, plan.all_kinds} and mlp & 1 == 0
            assert engine.executor.graphs.graphs == captured
    assert results["cuda"] == results["cpu"]


def test_verify_steps_replay_decode_graphs_and_keep_greedy_output(monkeypatch):
    """n-gram speculation on CUDA: verify steps (several logits rows per sequence) replay the
    decode graphs with one row per token; tokens equal the eager run's and the CPU's without
    speculation, with adapters' base rows and verify runs of different lengths in one step."""
    from model_service.engine.cuda_graphs import DecodeGraphs

    cfg, reference = random_llama()
    torch.backends.cuda.matmul.allow_tf32 = False
    context = [(13 * j) % 500 + 3 for j in range(48)]
    requests = [
        {
            "prompt_token_ids": context[: 24 + 6 * i],
            "max_tokens": 6 + 5 * i,
            "temperature": 0,
            "ignore_eos": True,
        }
        for i in range(5)
    ]
    replayed_verify = []
    run = DecodeGraphs.run

    def counting_run(self, batch):
        replayed_verify.append(batch.max_query_len > 1)
        return run(self, batch)

    monkeypatch.setattr(DecodeGraphs, "run", counting_run)
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'
    results = {}
    for device, eager, speculative in (
        ("cpu", True, None),
        ("cuda", True, spec),
        ("cuda", False, spec),
    ):
        engine = _engine(
            cfg,
            reference,
            device,
            num_kv_blocks=64,
            block_size=4,
            max_num_seqs=32,
            enforce_eager=eager,
            speculative_config=speculative,
        )
        results[device, eager] = [o.token_ids for o in engine.generate(requests)]
        assert engine.cache.num_free_blocks == engine.cache.num_total_blocks
    assert any(replayed_verify)
    assert results["cuda", False] == results["cuda", True] == results["cpu", True]


@pytest.mark.parametrize("draft", ["self", "tiny"])
def test_draft_speculation_on_cuda_matches_cpu_without_it(tmp_path, draft):
    """The draft model's own executor on CUDA (its decode rounds replay CUDA graphs of their own)
    proposes; the greedy tokens are those of plain decoding on the CPU."""
    from tests.conftest import make_tiny_checkpoint

    cfg, reference = random_llama()
    torch.backends.cuda.matmul.allow_tf32 = False
    model = (
        "random" if draft == "self" else str(make_tiny_checkpoint("llama", tmp_path / "d", vocab_size=512))
    )
    spec = f'{{"method": "draft", "model": "{model}", "num_speculative_tokens": 3}}'
    requests = [
        {
            "prompt_token_ids": [(5 * i + j) % 500 + 3 for j in range(6 + 5 * i)],
            "max_tokens": 16,
            "temperature": 0,
        }
        for i in range(6)
    ]
    results = {}
    for device, config in (("cpu", {}), ("cuda", {"speculative_config": spec})):
        engine = _engine(cfg, reference, device, num_kv_blocks=24, block_size=4, max_num_seqs=8, **config)
        results[device] = [o.token_ids for o in engine.generate(requests)]
        assert engine.cache.num_free_blocks == engine.cache.num_total_blocks
    assert results["cuda"] == results["cpu"]
    assert engine.speculation.proposed > 0 and engine.speculation.proposer.executor.graphs is not None
    if draft == "self":
        assert engine.speculation.accepted / engine.speculation.proposed > 0.9
        assert len(engine.speculation.proposer.executor.graphs.graphs) > 0


def test_async_scheduling_on_cuda_gives_the_synchronous_tokens(monkeypatch):
    """With CUDA graphs, steps launched before the previous step's tokens reach the host (input
    ids fed on the device, engine/overlap.py) give the tokens of steps that wait for them: greedy,
    seeded sampling and stop tokens, over waves that reuse rows and blocks."""
    from tests.overlap_helpers import count_launches

    cfg, reference = random_llama()
    torch.backends.cuda.matmul.allow_tf32 = False
    requests = [
        {"prompt_token_ids": [(13 * i + j) % 500 + 3 for j in range(4 + 5 * i)], "max_tokens": 6 + 3 * i,
         "temperature": 0.8 if i % 3 else 0, "seed": i, "top_p": 0.9 if i % 3 == 1 else 1.0,
         "stop_token_ids": [(13 * i) % 500 + 3] if i % 4 == 0 else []}
        for i in range(11)
    ]  # fmt: skip
    launches = count_launches(monkeypatch)
    results = {}
    for mode in ("off", "on"):
        engine = _engine(cfg, reference, "cuda", num_kv_blocks=96, block_size=4, max_num_seqs=16,
                         async_scheduling=mode)  # fmt: skip
        results[mode] = [[o.token_ids for o in engine.generate(requests)] for _ in range(2)]
        assert engine.executor.graphs is not None and engine.executor.graphs.graphs
        assert engine.cache.num_free_blocks == engine.cache.num_total_blocks
    assert launches, "no step overlapped"
    assert results["on"] == results["off"]


def test_seeded_sampling_on_cuda_does_not_depend_on_the_batch():
    """The Gumbel-max kernel (temperature only), the rejection kernel (top-p, top-k, min-p) and
    the sorting path (top-k with top-p) key a seeded row's draw by its seed and output position:
    the same request alone, in a batch of others (seeded, unseeded, greedy), and again, gives the
    same tokens; unseeded rows vary."""
    cfg, reference = random_llama()
    engine = _engine(cfg, reference, "cuda", num_kv_blocks=128, block_size=4, max_num_seqs=16)
    base = {"prompt_token_ids": [5, 9, 17, 33], "max_tokens": 24, "ignore_eos": True, "temperature": 1.3}
    cuts = [{}, {"top_p": 0.8}, {"top_k": 20}, {"min_p": 0.05}, {"top_k": 20, "top_p": 0.9}]
    probes = [base | {"seed": 7} | cut for cut in cuts]
    others = [base | {"seed": 100 + i, "temperature": 0.5 * i} for i in range(6)] + [base, base]
    alone = [engine.generate([p])[0].token_ids for p in probes]
    mixed = engine.generate([*others[:3], *probes[:2], *others[3:6], *probes[2:4], *others[6:], probes[4]])
    assert [mixed[i].token_ids for i in (3, 4, 8, 9, 12)] == alone
    assert [o.token_ids for o in engine.generate(probes)] == alone
    assert mixed[-2].token_ids != mixed[-3].token_ids  # two unseeded rows: their own draws
    # The first three differ (the cuts bite); min-p 0.05 may keep every token of this flat random
    # model, and a cut that keeps the drawn token draws what the plain row draws.
    assert len({tuple(t) for t in alone[:3]}) == 3


def _stream(engine: Engine, requests: list[dict]) -> list[tuple[list[int], list]]:
    """(token ids, logprobs) of each request, stepping the engine to the end."""
    ids = [engine.add_request_dict(r) for r in requests]
    got: dict[str, tuple[list[int], list]] = {i: ([], []) for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id][0].extend(out.new_token_ids)
            got[out.request_id][1].extend(out.new_logprobs or [])
    return [got[i] for i in ids]


def test_penalties_and_logprobs_on_cuda_match_the_cpu():
    """Penalties and logprobs are computed for all rows at once (one copy of the histories, one
    top-k): greedy rows with repetition, presence and frequency penalties and logprobs give the
    CPU's tokens, and logprobs within float tolerance."""
    cfg, reference = random_llama()
    torch.backends.cuda.matmul.allow_tf32 = False
    penalties = [
        {"repetition_penalty": 1.3 + 0.1 * i, "presence_penalty": 0.5 * (i % 2), "frequency_penalty": 0.2 * i}
        for i in range(5)
    ]
    requests = [
        {
            "prompt_token_ids": [(5 * i + j) % 500 + 3 for j in range(6 + i)] * 2,
            "max_tokens": 12,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": [0, 3, None, 5, 2, 4][i],
            **(penalties[i] if i < 5 else {}),
        }
        for i in range(6)
    ]
    devices = ("cpu", "cuda")
    results = [_stream(_engine(cfg, reference, d, num_kv_blocks=64, block_size=4), requests) for d in devices]
    for (cpu_ids, cpu_lps), (gpu_ids, gpu_lps) in zip(*results, strict=True):
        assert gpu_ids == cpu_ids
        assert len(gpu_lps) == len(cpu_lps)
        for a, b in zip(cpu_lps, gpu_lps, strict=True):
            assert abs(a.logprob - b.logprob) < 1e-4
            assert len(a.top) == len(b.top)
            assert all(abs(x[1] - y[1]) < 1e-4 for x, y in zip(a.top, b.top, strict=True))


def test_fp8_kv_cache_on_cuda_gives_the_cpu_reference_tokens():
    """The Triton stores and attention kernels over an FP8 pool (prefill, decode graphs) give the
    CPU reference backend's tokens: both compute in float32 and round the same K/V to e4m3."""
    cfg, reference = random_llama()
    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = [[(5 * i + j) % 500 + 3 for j in range(20 + 7 * i)] for i in range(4)]
    requests = [{"prompt_token_ids": p, "max_tokens": 10, "temperature": 0} for p in prompts]
    tokens = []
    for device in ("cpu", "cuda"):
        engine = _engine(cfg, reference, device, kv_cache_dtype="fp8", num_kv_blocks=64)
        tokens.append([o.token_ids for o in engine.generate(requests)])
    assert tokens[1] == tokens[0]


def test_logits_processors_on_cuda_match_the_cpu():
    """logit_bias, allowed_token_ids and min_tokens (engine/logits_processors.py; bad_words are
    these masks after tokenizing, which a random model cannot) on CUDA rows beside a plain one,
    and a bias under a penalty: the CPU's greedy tokens, each variant changing its row's tokens
    (else it tested nothing)."""
    cfg, reference = random_llama()
    torch.backends.cuda.matmul.allow_tf32 = False
    prompt = [(3 * j) % 500 + 3 for j in range(9)]
    base = {"prompt_token_ids": prompt, "max_tokens": 10, "temperature": 0}
    plain = _stream(_engine(cfg, reference, "cpu", num_kv_blocks=64, block_size=4), [base])[0][0]
    variants = [
        {},
        {"logit_bias": {plain[0]: -100, plain[2]: -50, 17: 4.0}},
        {"allowed_token_ids": [plain[1], plain[4], 300, 301]},
        {"logit_bias": {plain[3]: 40.0}, "min_tokens": 3, "stop_token_ids": [plain[3]]},
        {"repetition_penalty": 1.4, "logit_bias": {prompt[-2]: 6.0}},
    ]
    requests = [{**base, **fields} for fields in variants]
    devices = ("cpu", "cuda")
    results = [_stream(_engine(cfg, reference, d, num_kv_blocks=64, block_size=4), requests) for d in devices]
    cpu_ids, gpu_ids = ([ids for ids, _ in r] for r in results)
    assert gpu_ids == cpu_ids
    assert all(ids != plain for ids in cpu_ids[1:])
    assert len(cpu_ids[3]) == 4 and cpu_ids[3][-1] == plain[3]  # held 3 tokens, then the stop id
