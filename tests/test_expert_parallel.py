"""Sparse-MoE models over two tensor-parallel ranks on the CPU (gloo, two processes): experts
tensor-parallel (the default) and expert-parallel (`--enable-expert-parallel`).

The oracle is the single-process engine over the same weights, itself checked against HF and
PEFT in test_moe.py: greedy tokens identical in float32 (with and without a LoRA adapter on the
attention projections), logits within float32 summation-order noise. One tensor-parallel engine
per process at a time, so each test tears its engine down.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from model_service.distributed.link import CommandFailedError
from model_service.distributed.sharding import Partition
from model_service.errors import ModelLoadError
from model_service.models.loader import LoadedModel, load_model
from spindle.cli import main
from tests.conftest import forward, make_engine, new_sequence, prefill_logits
from tests.test_moe import VARIANTS as MOE_VARIANTS
from tests.test_moe import attention_adapter
from tests.test_tiny_models import (
    PROMPTS,
    Variant,
    _one_torch_thread,  # noqa: F401 (the module fixture)
    request,
    save_checkpoint,
)

VARIANTS: dict[str, Variant] = {
    # Layers 0 and 2 sparse, 1 dense; 8 experts of width 32: 4 + 4 experts, or 16 + 16 rows each.
    "qwen3-moe": MOE_VARIANTS["qwen3-moe"],
    # Layer 1 sparse with a shared expert; uneven runs everywhere: 7 experts (4 + 3), expert
    # width 33 (17 + 16), shared expert width 47 (24 + 23).
    "qwen2-moe-shared": Variant(
        "qwen2_moe",
        {
            "num_experts": 7,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 33,
            "decoder_sparse_step": 2,
            "shared_expert_intermediate_size": 47,
        },
    ),
}


@dataclass
class Model:
    path: Path
    loaded: LoadedModel
    adapter: Path
    requests: list[dict]
    expected: list[list[int]]  # the single-process engine's greedy tokens for `requests`
    logits: torch.Tensor  # ... and its last-token logits of PROMPTS[0]
    wide: torch.Tensor  # ... and of `WIDE`, prefilled in one step


# Two 300-token prompts in one step: a wide prefill batch on every rank (a packed batch too large
# for a command message, whose remainder follows on gloo, is tested in test_tp_control.py).
WIDE = [torch.randint(3, 320, (300,), generator=torch.Generator().manual_seed(s)).tolist() for s in (1, 2)]


def wide_logits(engine) -> torch.Tensor:
    states = [new_sequence(engine, len(ids)) for ids in WIDE]
    logits = forward(engine, [(s, ids, 1) for s, ids in zip(states, WIDE, strict=True)])
    for s in states:
        engine.cache.free(s)
    return logits


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Model]:
    out = {}
    for name, variant in VARIANTS.items():
        root = tmp_path_factory.mktemp(name)
        path = save_checkpoint(variant, root)
        adapter = attention_adapter(path, root / "attn")[1]
        loaded = load_model(str(path), torch.float32, torch.device("cpu"))
        adapted = [{**request(ids), "adapter": "attn"} for ids in PROMPTS[:2]]
        requests = [request(ids) for ids in PROMPTS] + adapted
        engine = make_engine(loaded, max_loras=1, lora_modules={"attn": str(adapter)})
        expected = [o.token_ids for o in engine.generate(requests)]
        assert expected[:2] != expected[-2:], "the adapter does not change the output"
        logits = prefill_logits(engine, PROMPTS[0])
        out[name] = Model(path, loaded, adapter, requests, expected, logits, wide_logits(engine))
    return out


def test_partition_of_the_experts(models):
    cfg = models["qwen2-moe-shared"].loaded.config
    tp = [Partition.of(cfg, r, 2) for r in range(2)]
    assert [(p.experts, p.expert_inter, p.shared_inter) for p in tp] == [
        (range(0, 7), range(0, 17), range(0, 24)),
        (range(0, 7), range(17, 33), range(24, 47)),
    ]
    ep = [Partition.of(cfg, r, 2, expert_parallel=True) for r in range(2)]
    assert [(p.experts, p.expert_inter, p.shared_inter) for p in ep] == [
        (range(0, 4), range(0, 33), range(0, 24)),
        (range(4, 7), range(0, 33), range(24, 47)),
    ]
    wide = dataclasses.replace(cfg, num_heads=8, num_kv_heads=8)  # attention would allow 8 ranks
    with pytest.raises(ModelLoadError, match="needs at least 8 experts"):
        Partition.of(wide, 0, 8, expert_parallel=True)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["experts-tp", "expert-parallel"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_two_ranks_match_one_process(models, name: str, expert_parallel: bool):
    """Greedy tokens (base and adapter in one batch) and logits; then a command that fails on
    every rank is that command's error and the workers stay up."""
    m = models[name]
    engine = make_engine(
        m.loaded, tensor_parallel_size=2, enable_expert_parallel=expert_parallel, max_loras=1,
        lora_modules={"attn": str(m.adapter)},
    )  # fmt: skip
    try:
        cfg = m.loaded.config  # rank 0 holds its run of experts, or a slice of every expert
        sparse = next(i for i, kind in enumerate(cfg.layer_kinds) if kind.moe)
        held = engine.executor.rank.executor.module.model.layers[sparse].mlp.share.experts.down_proj
        half = (cfg.moe_intermediate_size + 1) // 2
        want = (4, cfg.moe_intermediate_size) if expert_parallel else (cfg.num_experts, half)
        assert (held.shape[0], held.shape[2]) == want
        assert [o.token_ids for o in engine.generate(m.requests)] == m.expected
        torch.testing.assert_close(prefill_logits(engine, PROMPTS[0], chunk=7), m.logits, atol=1e-4, rtol=0)
        torch.testing.assert_close(wide_logits(engine), m.wide, atol=1e-4, rtol=0)
        state = new_sequence(engine, 4)
        with pytest.raises(CommandFailedError, match="rank 1"):
            engine.executor.load_blocks(torch.zeros(1, 2, 3, 4, 5), state.block_table)
        engine.cache.free(state)
        assert [o.token_ids for o in engine.generate(m.requests[:1])] == m.expected[:1]
    finally:
        engine.executor.teardown()


def test_generate_cli_with_expert_parallel(models, tmp_path, capsys):
    m = models["qwen3-moe"]
    reqs = tmp_path / "reqs.jsonl"
    reqs.write_text("".join(json.dumps(r) + "\n" for r in m.requests[:3]))
    args = ["generate", "--model", str(m.path), "--requests", str(reqs), "--json", "--device", "cpu",
            "--dtype", "float32", "--num-kv-blocks", "64", "--tensor-parallel-size", "2",
            "--enable-expert-parallel"]  # fmt: skip
    assert main(args) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [o["token_ids"] for o in out] == m.expected[:3]
