"""The fused MoE kernels (kernels/fused_moe.py) against the torch they replace: the device-side
alignment against `align_reference`, the experts against `experts_reference` (kernels/experts.py),
the routing kernel against `models.moe.route`.

On the CPU the kernels run under Triton's interpreter when it is installed, in float32 (its bf16
`tl.dot` is unreliable): `TRITON_INTERPRET=1 pytest tests/test_fused_moe.py`. On CUDA, bf16 at
Qwen3-30B-A3B's shapes and CUDA graph replay: `pytest --noconftest -m gpu tests/test_fused_moe.py`
(no conftest fixtures here, so that runs).
"""

from __future__ import annotations

import os

import pytest
import torch

from model_service.kernels import fused_moe as fused_moe_module
from model_service.kernels.expert_gemv import ExpertGemvTiling, expert_gemv, expert_gemv_applies
from model_service.kernels.experts import (
    FUSED_MAX_ROWS_PER_EXPERT,
    experts_path,
    experts_reference,
    fused_experts,
)
from model_service.kernels.fp8_gemm import dequantize_groups
from model_service.kernels.fused_moe import (
    ExpertBiases,
    ExpertScales,
    FusedMoeConfig,
    RouterLaunch,
    align,
    align_reference,
    fused_counters,
    fused_moe,
    fused_moe_config,
    max_blocks,
    route_hidden,
    route_topk,
    router_launch,
    triton,
)
from model_service.models.config import ClampedSwiGLU, ModelConfig, Routing
from model_service.models.fp8_linear import quantize_stack
from model_service.models.moe import SparseMoeBlock, route, with_shared_slots

interpreter = pytest.mark.skipif(
    triton is None or os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter"
)
cuda = pytest.mark.skipif(not torch.cuda.is_available() or triton is None, reason="needs CUDA and Triton")


def _ids(
    tokens: int, experts: int, top_k: int, gen: torch.Generator, used: int | None = None
) -> torch.Tensor:
    """Each token's top_k distinct experts, drawn from the first `used` (so the rest get none)."""
    used = experts if used is None else used
    return torch.stack([torch.randperm(used, generator=gen)[:top_k] for _ in range(tokens)])


def _case(
    tokens: int, experts: int, top_k: int, hidden: int, inter: int, seed: int, used: int | None = None
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    down = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    ids = _ids(tokens, experts, top_k, gen, used)
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=-1)
    return x, gate_up, down, ids, weights


def _fp8(
    gate_up: torch.Tensor, down: torch.Tensor, group: int = 0
) -> tuple[torch.Tensor, torch.Tensor, ExpertScales]:
    """The experts in e4m3 with their scales: per row as `--quantization fp8` stores them, or
    (`group` 128) per row and 128 columns as block-quantized checkpoints keep them."""
    (q_gate_up, gate_up_scale), (q_down, down_scale) = (
        quantize_stack(gate_up, group),
        quantize_stack(down, group),
    )
    return q_gate_up, q_down, ExpertScales(gate_up_scale, down_scale, group)


def _check_alignment(
    sorted_pairs: torch.Tensor, block_expert: torch.Tensor, ids: torch.Tensor, experts: int, bm: int
):
    """The layout's contract: every local pair exactly once, in a block of its own expert, experts
    in order and pairs in order within one, padding rows the sentinel, blocks past the end -1."""
    pairs = ids.numel()
    flat = ids.flatten()
    assert sorted_pairs.numel() == block_expert.numel() * bm == max_blocks(*ids.shape, experts, bm) * bm
    rows = sorted_pairs.view(-1, bm)
    live = sorted_pairs[sorted_pairs < pairs]
    local = ((flat >= 0) & (flat < experts)).nonzero().flatten()
    assert sorted(live.tolist()) == local.tolist()
    for b, e in enumerate(block_expert.tolist()):
        in_block = rows[b][rows[b] < pairs].long()
        if e < 0:
            assert in_block.numel() == 0
        else:
            assert in_block.numel() > 0 and bool((flat[in_block] == e).all())
    assert (sorted_pairs[sorted_pairs >= pairs] == pairs).all()
    assert flat[live.long()].diff().ge(0).all()  # experts ascending
    used = block_expert[block_expert >= 0]
    assert used.diff().ge(0).all() and (block_expert[used.numel() :] == -1).all()


@pytest.mark.parametrize(
    "tokens, experts, top_k, bm", [(1, 8, 2, 16), (37, 16, 4, 16), (70, 8, 3, 32), (3, 128, 8, 16)]
)
def test_alignment_reference_keeps_the_layouts_contract(tokens, experts, top_k, bm):
    ids = _ids(tokens, experts, top_k, torch.Generator().manual_seed(tokens))
    ids[0, 0] = -1  # a remote expert (expert parallelism): left out
    _check_alignment(*align_reference(ids, experts, bm), ids, experts, bm)


def test_decode_tiles_fill_the_gpu_with_sixteen_row_blocks_and_prefill_tiles_read_longer_runs():
    """At Qwen3-30B-A3B's shapes (128 experts, top-8, H 2048, I 768) on 132 SMs."""
    one = fused_moe_config(1, 8, 128, 2048, 768)
    assert one.block_m == 16 and max_blocks(1, 8, 128, 16) == 8  # one block an expert: read once
    assert (one.gate_up_block_n, one.down_block_n, one.block_k) == (64, 64, 128)  # the sweep's best
    assert fused_moe_config(64, 8, 128, 2048, 768, item_bytes=4).block_k == 64  # float32: the same bytes
    assert fused_moe_config(64, 8, 128, 2048, 768).block_m == 16  # 4 rows an expert
    # K split only where the launch leaves SMs idle, for e4m3 tiles (bf16's fill an SM's shared
    # memory): 96 programs at one token -> 3 slices, 288 programs
    splits = [
        fused_moe_config(t, 8, 128, 2048, 768, item_bytes=b).gate_up_split for t in (1, 64) for b in (1, 2)
    ]
    assert splits == [3, 1, 1, 1]
    warps = {
        (t, b): fused_moe_config(t, 8, 128, 2048, 768, item_bytes=b).num_warps
        for t in (1, 64)
        for b in (1, 2)
    }
    assert warps == {(1, 1): 8, (1, 2): 4, (64, 1): 8, (64, 2): 4}  # e4m3: 8 warps widen its tiles faster
    assert [fused_moe_config(t, 8, 128, 2048, 768).block_m for t in (256, 1024, 4096)] == [16, 32, 64]
    assert max_blocks(64, 8, 128, 16) == (512 + 128 * 15 + 15) // 16
    # prefill chunks: 16-bit weights in K runs of 64 over 4 stages (the 2,048-token sweep); e4m3 and
    # float32 as before
    prefill = {b: fused_moe_config(2048, 8, 128, 2048, 768, item_bytes=b) for b in (1, 2, 4)}
    assert {b: (c.block_m, c.block_k, c.num_stages) for b, c in prefill.items()} == {
        1: (64, 32, 3),
        2: (64, 64, 4),
        4: (64, 32, 3),
    }


def test_few_rows_an_expert_take_the_fused_path_only_on_cuda():
    """Decode steps and prefill chunks of at most FUSED_MAX_ROWS_PER_EXPERT rows an expert on
    average take the fused kernels; past it bf16 takes grouped_mm where it runs (sm90 / sm100),
    and every other dtype the fused kernels still."""
    cpu = torch.device("cpu")
    assert experts_path(1, 8, 128, torch.float32, cpu) == "reference"
    if torch.cuda.is_available() and triton is not None and torch.cuda.get_device_capability()[0] >= 8:
        gpu = torch.device("cuda")
        most = FUSED_MAX_ROWS_PER_EXPERT * 128 // 8  # Qwen3-30B-A3B: 128 experts, top-8
        assert experts_path(1, 8, 128, torch.bfloat16, gpu) == "fused"
        assert experts_path(most, 8, 128, torch.bfloat16, gpu) == "fused"
        past = "grouped" if torch.cuda.get_device_capability()[0] in (9, 10) else "fused"
        assert experts_path(most + 1, 8, 128, torch.bfloat16, gpu) == past
        assert experts_path(most // 16 + 1, 2, 8, torch.bfloat16, gpu) == past  # Mixtral's 8 experts, top-2
        assert experts_path(most + 1, 8, 128, torch.float32, gpu) == "fused"  # no grouped_mm


@interpreter
@pytest.mark.parametrize(
    "tokens, experts, top_k, bm, used",
    [
        (1, 8, 2, 16, None),
        (5, 8, 2, 16, 3),
        (37, 16, 4, 16, None),
        (70, 8, 3, 32, None),
        (130, 128, 8, 16, 40),
        (9, 513, 11, 16, None),  # Qwen3-Next's 512 experts + its fused shared slot: 8 warps
        (300, 8, 8, 16, None),  # 64 pairs a program (`align_tiles`; the others take 16 or 32)
    ],
)
def test_alignment_kernel_matches_the_reference(tokens, experts, top_k, bm, used):
    ids = _ids(tokens, experts, top_k, torch.Generator().manual_seed(tokens), used)
    if tokens > 1:
        ids[1, 0], ids[-1, -1] = -1, experts + 3  # remote experts on both sides of the range
    got = align(ids, experts, bm)
    want = align_reference(ids, experts, bm)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    _check_alignment(*got, ids, experts, bm)


@interpreter
@pytest.mark.parametrize(
    "tokens, experts, top_k, hidden, inter, used",
    [
        (1, 8, 2, 64, 32, None),  # decode: one block a pair, no alignment
        (1, 16, 4, 48, 40, None),  # hidden and inter no multiple of the tiles
        (5, 8, 2, 64, 32, 3),  # five experts with no tokens
        (37, 16, 4, 80, 48, None),  # 148 pairs, no multiple of BLOCK_M
        (40, 4, 2, 32, 16, None),  # 20 rows an expert: two blocks each
    ],
)
def test_fused_experts_match_the_reference_under_the_interpreter(tokens, experts, top_k, hidden, inter, used):
    x, gate_up, down, ids, weights = _case(
        tokens, experts, top_k, hidden, inter, seed=tokens + hidden, used=used
    )
    want = experts_reference(x, gate_up, down, ids, weights)
    torch.testing.assert_close(fused_moe(x, gate_up, down, ids, weights), want, rtol=1e-5, atol=1e-5)
    wide = FusedMoeConfig(block_m=32, gate_up_block_n=64, down_block_n=32, block_k=32, num_stages=2)
    torch.testing.assert_close(fused_moe(x, gate_up, down, ids, weights, wide), want, rtol=1e-5, atol=1e-5)


@interpreter
@pytest.mark.parametrize("tokens, slots", [(1, 1), (1, 2), (6, 1), (40, 2)])
def test_the_shared_expert_as_the_stacks_last_slots_matches_its_mlp_under_the_interpreter(tokens, slots):
    """The shared expert fused into the experts (`moe.shared_expert_slots`): Qwen3-Next's top-10
    plus one slot (16 GEMV slots, 5 of them padding) and DeepSeek's two ungated ones, at one token
    (GEMVs) and more (tiles, where every token hits the shared slots): routed experts plus the
    shared MLP, scaled by its gate, computed apart; the loader's split of a wide MLP into slots
    included (`expert_weights._shared_slots`: down's columns a slot each)."""
    experts, top_k, hidden, inter = 24, 10 if slots == 1 else 4, 48, 16
    x, gate_up, down, ids, weights = _case(tokens, experts, top_k, hidden, inter, seed=tokens + slots)
    gen = torch.Generator().manual_seed(slots)
    mlp_up = torch.randn(2, slots * inter, hidden, generator=gen) / hidden**0.5  # its gate_proj, up_proj
    mlp_down = torch.randn(hidden, slots * inter, generator=gen) / (slots * inter) ** 0.5
    gate = torch.sigmoid(torch.randn(tokens, generator=gen)) if slots == 1 else None
    shared = torch.nn.functional.silu(x @ mlp_up[0].T) * (x @ mlp_up[1].T) @ mlp_down.T
    want = experts_reference(x, gate_up, down, ids, weights) + shared * (gate[:, None] if slots == 1 else 1)
    stacked_up = torch.cat([gate_up, torch.cat([m.unflatten(0, (slots, -1)) for m in mlp_up], dim=1)])
    stacked_down = torch.cat([down, torch.stack(mlp_down.chunk(slots, dim=1))])
    all_weights, all_ids = with_shared_slots(weights, ids, slots, experts, gate)
    got = fused_moe(x, stacked_up, stacked_down, all_ids, all_weights)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@interpreter
def test_one_token_runs_the_experts_as_gemvs_under_the_interpreter(monkeypatch):
    """Batch-1 decode takes the GEMV kernels (kernels/expert_gemv.py; e4m3 ones
    in the FP8 tests): the reference's result to float32 rounding with K no multiple of the
    tile, a remote slot and a strided x, the same as the tiled kernels; wider batches keep the
    tiles, and weights not contiguous along K too; top_k 6 (a tile of 8 slots) and tilings
    that step along K more than once."""
    assert fused_moe_config(1, 8, 128, 2048, 768, item_bytes=1).gemv  # e4m3 experts at one token
    assert fused_moe_config(1, 8, 128, 2048, 768).gemv  # bf16 too (H100, 2026-12-07 ai: +2.5%)
    assert not fused_moe_config(2, 8, 128, 2048, 768, item_bytes=1).gemv
    x, gate_up, down, ids, weights = _case(1, 16, 6, 48, 40, seed=5)
    ids[0, 2] = 16  # another rank's expert
    strided = torch.randn(1, 96)[:, ::2]
    strided.copy_(x)
    calls = []
    monkeypatch.setattr(fused_moe_module, "expert_gemv", lambda *a: calls.append(1) or expert_gemv(*a))
    want = experts_reference(x, gate_up, down, ids, weights)
    gemv = FusedMoeConfig(16, 64, 64, block_k=16, num_stages=2, gemv=True)
    got = fused_moe(strided, gate_up, down, ids, weights, gemv)
    assert calls == [1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    tiled = FusedMoeConfig(16, 64, 64, block_k=16, num_stages=2)
    torch.testing.assert_close(fused_moe(x, gate_up, down, ids, weights, tiled), got, rtol=1e-5, atol=1e-5)
    for n, k in ((2, 16), (8, 32)):
        tilings = (ExpertGemvTiling(n, k), ExpertGemvTiling(n, k, num_warps=2))
        torch.testing.assert_close(expert_gemv(x, gate_up, down, ids, weights, tilings=tilings), got)
    assert not expert_gemv_applies(1, gate_up.transpose(1, 2).contiguous().transpose(1, 2), down)
    assert calls == [1]


def test_the_reference_runs_fp8_experts_as_their_dequantized_weights():
    """What CI checks of the FP8 experts' oracle: e4m3 weights with their scales give the
    reference's output on the dequantized float weights, and the fused path refuses e4m3
    weights without scales (and scales with float weights) by name."""
    x, gate_up, down, ids, weights = _case(9, 8, 2, 64, 32, seed=3, used=5)
    q_gate_up, q_down, scales = _fp8(gate_up, down)
    dequantized = (q_gate_up.float() * scales.gate_up, q_down.float() * scales.down)
    want = experts_reference(x, *dequantized, ids, weights)
    torch.testing.assert_close(experts_reference(x, q_gate_up, q_down, ids, weights, scales), want)
    assert experts_path(9, 2, 8, q_gate_up.dtype, torch.device("cpu")) == "reference"
    with pytest.raises(ValueError, match="e4m3 expert weights need their scales"):
        fused_moe(x, q_gate_up, q_down, ids, weights)
    with pytest.raises(ValueError, match="e4m3 expert weights need their scales"):
        fused_moe(x, gate_up, down, ids, weights, scales=scales)


@interpreter
@pytest.mark.parametrize(
    "tokens, experts, top_k, hidden, inter, used", [(1, 8, 2, 64, 32, None), (37, 16, 4, 80, 48, 9)]
)
def test_fp8_experts_in_the_kernels_match_the_reference_under_the_interpreter(
    tokens, experts, top_k, hidden, inter, used
):
    """e4m3 weights widened in the tiles, the sums scaled per column: the reference on the
    dequantized weights, to float32 rounding, at decode (direct) and aligned blocks, two tilings."""
    x, gate_up, down, ids, weights = _case(tokens, experts, top_k, hidden, inter, seed=tokens, used=used)
    q_gate_up, q_down, scales = _fp8(gate_up, down)
    want = experts_reference(x, q_gate_up, q_down, ids, weights, scales)
    got = fused_moe(x, q_gate_up, q_down, ids, weights, scales=scales)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    wide = FusedMoeConfig(block_m=32, gate_up_block_n=64, down_block_n=32, block_k=32, num_stages=2)
    split = FusedMoeConfig(16, 32, 32, block_k=16, num_stages=2, gate_up_split=3)  # K in three slices
    for config in (wide, split):
        got = fused_moe(x, q_gate_up, q_down, ids, weights, config, scales=scales)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@interpreter
@pytest.mark.parametrize("tokens", [1, 21])
def test_block_scaled_fp8_experts_in_the_kernels_match_the_reference_under_the_interpreter(tokens):
    """Scales per 128 input columns (DeepSeek's and Qwen's block-FP8 checkpoints): each K tile
    scaled by its group's scale; K of 256 and 160 (a partial last group), two tilings; a tiling
    whose K tile would cross a group is refused."""
    x, gate_up, down, ids, weights = _case(tokens, 8, 2, 256, 160, seed=11)
    q_gate_up, q_down, scales = _fp8(gate_up, down, group=128)
    s_gate_up, s_down = scales.gate_up, scales.down
    assert s_gate_up.shape == (8, 320, 2) and s_down.shape == (8, 256, 2)
    want = experts_reference(x, q_gate_up, q_down, ids, weights, scales)
    deq = experts_reference(
        x, dequantize_groups(q_gate_up.flatten(0, 1), s_gate_up.flatten(0, 1), 128).view(gate_up.shape),
        dequantize_groups(q_down.flatten(0, 1), s_down.flatten(0, 1), 128).view(down.shape), ids, weights,
    )  # fmt: skip
    torch.testing.assert_close(want, deq)
    torch.testing.assert_close(
        fused_moe(x, q_gate_up, q_down, ids, weights, scales=scales), want, rtol=1e-5, atol=1e-5
    )
    wide = FusedMoeConfig(block_m=32, gate_up_block_n=64, down_block_n=32, block_k=32, num_stages=2)
    split = FusedMoeConfig(16, 64, 64, block_k=128, num_stages=2, gate_up_split=2)  # a group a slice
    for config in (wide, split):
        got = fused_moe(x, q_gate_up, q_down, ids, weights, config, scales=scales)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    crossing = FusedMoeConfig(block_m=16, gate_up_block_n=64, down_block_n=64, block_k=256, num_stages=2)
    with pytest.raises(ValueError, match="crosses the scales' groups"):
        fused_moe(x, q_gate_up, q_down, ids, weights, crossing, scales=scales)


def _gpt_oss_extras(experts: int, hidden: int, inter: int, seed: int) -> tuple[ExpertBiases, ClampedSwiGLU]:
    """Biases large enough to matter and a clamp low enough to bind on most sums (limit 0.3)."""
    gen = torch.Generator().manual_seed(seed)
    biases = ExpertBiases(
        torch.randn(experts, 2 * inter, generator=gen), torch.randn(experts, hidden, generator=gen)
    )
    return biases, ClampedSwiGLU(alpha=1.702, limit=0.3)


def test_the_reference_computes_gpt_oss_experts_as_hf():
    """The oracle's biases and clamped SwiGLU are HF's `GptOssExperts` (gate and up interleaved
    there, split here): the same weights give HF's output, the down bias weighted with the rest."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    x, gate_up, down, ids, weights = _case(5, 4, 2, 16, 8, seed=2)
    biases, act = _gpt_oss_extras(4, 16, 8, seed=2)
    hf = GptOssExperts(
        GptOssConfig(num_local_experts=4, hidden_size=16, intermediate_size=8, swiglu_limit=0.3)
    )
    with torch.no_grad():
        interleave = torch.stack(gate_up.chunk(2, dim=1), dim=2).flatten(1, 2)  # [E, 2I, H]: g0 u0 g1 u1 ..
        hf.gate_up_proj.copy_(interleave.transpose(1, 2))
        hf.gate_up_proj_bias.copy_(torch.stack(biases.gate_up.chunk(2, dim=1), dim=2).flatten(1, 2))
        hf.down_proj.copy_(down.transpose(1, 2))
        hf.down_proj_bias.copy_(biases.down)
        want = hf(x, router_indices=ids, routing_weights=weights)
    got = experts_reference(x, gate_up, down, ids, weights, biases=biases, swiglu=act)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@interpreter
@pytest.mark.parametrize("tokens, used", [(1, None), (6, 3), (37, None)])
def test_gpt_oss_experts_in_the_kernels_match_the_reference_under_the_interpreter(tokens, used):
    """Biases on gate_up and down and the clamped SwiGLU (gpt-oss), with a remote slot: the
    GEMVs at one token, the tiles at one (direct) and several (aligned, wider blocks, K split),
    each the reference to float32 rounding; SiLU with biases alone too. e4m3 experts are refused
    with them by name."""
    x, gate_up, down, ids, weights = _case(tokens, 8, 3, 48, 40, seed=tokens, used=used)
    ids[0, 1] = 8  # another rank's expert
    biases, act = _gpt_oss_extras(8, 48, 40, seed=tokens)
    want = experts_reference(x, gate_up, down, ids, weights, biases=biases, swiglu=act)
    assert not torch.allclose(want, experts_reference(x, gate_up, down, ids, weights, biases=biases))
    tiles = FusedMoeConfig(16, 32, 32, block_k=16, num_stages=2)
    split = FusedMoeConfig(32, 32, 32, block_k=16, num_stages=2, gate_up_split=2)
    for config in (None, tiles, split):
        got = fused_moe(x, gate_up, down, ids, weights, config, biases=biases, swiglu=act)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    silu = experts_reference(x, gate_up, down, ids, weights, biases=biases)
    torch.testing.assert_close(
        fused_moe(x, gate_up, down, ids, weights, biases=biases), silu, rtol=1e-5, atol=1e-5
    )
    q_gate_up, q_down, scales = _fp8(gate_up, down)
    with pytest.raises(ValueError, match="gpt-oss's experts stay unquantized"):
        fused_moe(x, q_gate_up, q_down, ids, weights, scales=scales, biases=biases, swiglu=act)


@interpreter
def test_remote_experts_add_nothing_under_the_interpreter():
    """Ids outside [0, E) (experts of another rank) and a strided x (a view, as layers pass it)."""
    x, gate_up, down, ids, weights = _case(6, 8, 3, 64, 32, seed=7)
    ids[0, 1], ids[2, 0], ids[5, 2] = -1, 8, 11
    wide_x = torch.randn(6, 80)
    wide_x[:, :64] = x
    want = experts_reference(x, gate_up, down, ids, weights)
    torch.testing.assert_close(
        fused_moe(wide_x[:, :64], gate_up, down, ids, weights), want, rtol=1e-5, atol=1e-5
    )
    one = fused_moe(x[:1], gate_up, down, ids[:1], weights[:1])  # decode, a remote slot
    torch.testing.assert_close(one, want[:1], rtol=1e-5, atol=1e-5)


@interpreter
@pytest.mark.parametrize("tokens", [1, 6, 40])
def test_down_kernel_sums_each_token_once_and_leaves_the_counters_zeroed(tokens):
    """The combine inside the down kernel: a token whose slots are all remote gets zeros (only the
    remote slots' programs arrive for it), caller-owned counters come back zeroed, and a second
    call on them gives the same bits. Also with gate_up's K split in four slices (its counters too)."""
    x, gate_up, down, ids, weights = _case(tokens, 8, 3, 64, 32, seed=tokens)
    ids[tokens // 2] = torch.tensor([-1, 8, 9])
    arrivals = torch.zeros(fused_counters(tokens, 64), dtype=torch.int32)
    split = FusedMoeConfig(16, 32, 32, block_k=16, num_stages=2, gate_up_split=4)
    for config in (None, split):
        got = fused_moe(x, gate_up, down, ids, weights, config, arrivals=arrivals)
        want = experts_reference(x, gate_up, down, ids, weights)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert not got[tokens // 2].any() and not arrivals.any()
        torch.testing.assert_close(
            fused_moe(x, gate_up, down, ids, weights, config, arrivals=arrivals), got, rtol=0, atol=0
        )


@interpreter
@pytest.mark.parametrize(
    "tokens, experts, top_k, renormalize", [(1, 8, 2, True), (5, 128, 8, True), (3, 60, 4, False)]
)
def test_routing_kernel_matches_route_under_the_interpreter(tokens, experts, top_k, renormalize):
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(experts))
    weights, ids = route_topk(logits, top_k, renormalize, Routing(scaling_factor=2.5), first_expert=2)
    want_w, want_ids = route(logits, top_k, renormalize)
    torch.testing.assert_close(ids.long(), want_ids - 2, rtol=0, atol=0)
    torch.testing.assert_close(weights, want_w * 2.5, rtol=1e-6, atol=1e-7)


@interpreter
@pytest.mark.parametrize(
    "tokens, experts, hidden, top_k, dtype, transposed",
    [
        (1, 128, 256, 8, torch.float32, True),  # Qwen3's 128 experts, the weight as the engine stores it
        (5, 60, 200, 4, torch.float32, False),  # no power of two; K not a multiple of the tile
        (3, 256, 96, 8, torch.float16, True),  # float32 logits from a half-precision x (DeepSeek's)
        (2, 512, 2000, 10, torch.float32, True),  # Qwen3-Next's 512 experts: slices of 2 tiles, one short
    ],
)
@pytest.mark.parametrize("launch", [None, RouterLaunch(), RouterLaunch(max_slices=64, min_rows=16, warps=8)])
def test_router_logits_kernel_matches_route_under_the_interpreter(
    tokens, experts, hidden, top_k, dtype, transposed, launch
):
    """`route_hidden` against `route` on the torch logits, twice (the counters are left zeroed,
    and the result is the same bit for bit), under the engine's launch (`router_launch`) and
    others (`bench/router.py` sweeps them)."""
    gen = torch.Generator().manual_seed(tokens + experts)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    gate = torch.randn(experts, hidden, generator=gen) / hidden**0.5
    gate = gate.t().contiguous().t() if transposed else gate
    routing = Routing(scaling_factor=2.5, float32_logits=dtype != torch.float32)
    arrivals = torch.zeros(16, dtype=torch.int32)
    weights, ids = route_hidden(x, gate, top_k, True, arrivals, routing, first_expert=3, launch=launch)
    want_w, want_ids = route(torch.nn.functional.linear(x.float(), gate.float()), top_k, True)
    torch.testing.assert_close(ids.long(), want_ids - 3, rtol=0, atol=0)
    torch.testing.assert_close(weights, want_w * 2.5, rtol=1e-5, atol=1e-6)
    assert not arrivals.any()
    again = route_hidden(x, gate, top_k, True, arrivals, routing, first_expert=3, launch=launch)
    for g, a in zip((weights, ids), again, strict=True):
        torch.testing.assert_close(a, g, rtol=0, atol=0)


@pytest.mark.parametrize(
    "tokens, experts, slices",
    [
        (1, 128, 128),
        (2, 128, 64),
        (8, 128, 32),
        (1, 512, 32),
        (8, 512, 16),
        (16, 512, 16),
        (1, 256, 64),
        (4, 256, 32),
    ],
)
def test_the_router_launch_fills_a_wave_and_bounds_the_last_programs_sum(tokens, experts, slices):
    """About one wave of programs (132 SMs / tokens slices a token), at most 16,384 partial logits
    for the last program to sum, at least 32 slices (16 at 512 experts): the launch that was within
    0.5 us of the best in every cell of `bench/router.py`'s H100 sweep (Qwen3-235B at one token
    64 slices, not 32; Qwen3-Next at 8-16 tokens 16 slices: 15.2 -> 13.6 and 27.6 -> 16.8 us)."""
    assert router_launch(tokens, experts, 132).max_slices == slices


@interpreter
@pytest.mark.parametrize("tokens, experts, hidden", [(3, 60, 200), (2, 512, 2000)])
def test_router_kernel_gives_the_shared_experts_gate_under_the_interpreter(tokens, experts, hidden):
    """Qwen's `shared_expert_gate` in the routing launch: sigmoid(x @ w.T) as the linear and
    the sigmoid give it, and the routing itself unchanged by the extra dot product."""
    gen = torch.Generator().manual_seed(experts)
    x = torch.randn(tokens, hidden, generator=gen)
    gate = (torch.randn(experts, hidden, generator=gen) / hidden**0.5).t().contiguous().t()
    shared = torch.randn(1, hidden, generator=gen) / hidden**0.5
    arrivals = torch.zeros(16, dtype=torch.int32)
    scale = torch.full((tokens,), float("nan"))
    weights, ids = route_hidden(x, gate, 4, True, arrivals, shared_gate=(shared, scale))
    torch.testing.assert_close(scale, torch.sigmoid(torch.nn.functional.linear(x, shared))[:, 0])
    want_w, want_ids = route_hidden(x, gate, 4, True, arrivals)
    torch.testing.assert_close((weights, ids), (want_w, want_ids), rtol=0, atol=0)
    assert not arrivals.any()
    # The shared expert fused into the stack: its slot's id and, as its weight, the gate's sigmoid.
    gated = {"shared_gate": (shared, scale), "shared_slots": 1, "shared_id": experts}
    fused = route_hidden(x, gate, 4, True, arrivals, **gated)
    want = with_shared_slots(want_w, want_ids, 1, experts, scale)
    torch.testing.assert_close(fused, want, rtol=0, atol=0)
    # DeepSeek's ungated shared experts, two slots of weight 1 from id 7 on (a rank's local ids).
    fused = route_hidden(x, gate, 4, True, arrivals, first_expert=3, shared_slots=2, shared_id=7)
    want = with_shared_slots(want_w, want_ids - 3, 2, 7, None)
    torch.testing.assert_close(fused, want, rtol=0, atol=0)
    assert not arrivals.any()


DEEPSEEK_ROUTINGS = {
    "v2-greedy": Routing(scaling_factor=16.0),
    "v2-group-limited": Routing(group_score="max", num_groups=4, topk_groups=2, scaling_factor=16.0),
    "v3-noaux-tc": Routing(
        scoring="sigmoid", group_score="top2_sum", num_groups=8, topk_groups=4, correction_bias=True,
        scaling_factor=2.5, float32_logits=True,
    ),
}  # fmt: skip


def _deepseek_case(name: str, tokens: int, experts: int, hidden: int, seed: int):
    """(routing, x, gate, bias or None) with DeepSeek's float32 router weight and V3's bias."""
    gen = torch.Generator().manual_seed(seed)
    routing = DEEPSEEK_ROUTINGS[name]
    x = torch.randn(tokens, hidden, generator=gen)
    gate = torch.randn(experts, hidden, generator=gen) / hidden**0.5
    bias = torch.rand(experts, generator=gen) * 0.3 if routing.correction_bias else None
    return routing, x, gate, bias


@interpreter
@pytest.mark.parametrize("name", list(DEEPSEEK_ROUTINGS))
@pytest.mark.parametrize("experts, renormalize", [(16, False), (64, True), (48, True)])
def test_deepseek_routing_in_the_kernels_matches_route_under_the_interpreter(name, experts, renormalize):
    """Groups, sigmoid scores and the correction bias: `route_topk` on the logits and
    `route_hidden` on the hidden states against `route` (48 experts: groups of 6 and 12)."""
    routing, x, gate, bias = _deepseek_case(name, 5, experts, 96, seed=experts)
    logits = x @ gate.T
    want_w, want_ids = route(logits, 4, renormalize, routing, bias)
    arrivals = torch.zeros(16, dtype=torch.int32)
    for weights, ids in (
        route_topk(logits, 4, renormalize, routing, bias, first_expert=1),
        route_hidden(x, gate.t().contiguous().t(), 4, renormalize, arrivals, routing, bias, first_expert=1),
    ):
        torch.testing.assert_close(ids.long(), want_ids - 1, rtol=0, atol=0)
        torch.testing.assert_close(weights, want_w, rtol=1e-5, atol=1e-6)


# --- CUDA ---------------------------------------------------------------------------------------

QWEN = {"experts": 128, "top_k": 8, "hidden": 2048, "inter": 768}


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize(
    "tokens, dtype",
    [(t, torch.bfloat16) for t in (1, 7, 64, 256, 2048)]
    + [(t, d) for t in (1, 64) for d in (torch.float16, torch.float32)]
    + [(2048, torch.float16)],
)
def test_fused_experts_match_the_reference_on_cuda(tokens, dtype):
    """Qwen3-30B-A3B's expert shapes: the kernels on bf16/fp16 weights against the float32
    reference on the same weights (relative error of the output), float32 to rounding; 2,048
    tokens (128 rows an expert) are a prefill chunk's 64-row tiles."""
    torch.backends.cuda.matmul.allow_tf32 = False
    x, gate_up, down, ids, weights = (
        t.cuda() for t in _case(tokens, QWEN["experts"], QWEN["top_k"], QWEN["hidden"], QWEN["inter"], tokens)
    )
    x, gate_up, down = (t.to(dtype) for t in (x, gate_up, down))
    want = experts_reference(x.float(), gate_up.float(), down.float(), ids, weights)
    got = fused_experts(x, gate_up, down, ids, weights)
    assert experts_path(tokens, QWEN["top_k"], QWEN["experts"], dtype, x.device) == "fused"
    assert got.dtype == dtype
    err = ((got.float() - want).norm() / want.norm()).item()
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), err
    again = fused_experts(x, gate_up, down, ids, weights)
    torch.testing.assert_close(again, got, rtol=0, atol=0)  # no atomics: bit for bit


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_fused_experts_replay_from_a_cuda_graph_with_new_inputs(tokens):
    """Captured once with caller-owned counters, replayed on other tokens, experts (some remote)
    and weights written into the same tensors: the replay equals an eager call on the new inputs,
    a second replay the first, and the counters are left zeroed."""
    experts, top_k, hidden, inter = 64, 8, 1024, 256
    make = [t.cuda() for t in _case(tokens, experts, top_k, hidden, inter, seed=1)]
    x, gate_up, down, ids, weights = make
    x, gate_up, down = (t.to(torch.bfloat16) for t in (x, gate_up, down))
    arrivals = torch.zeros(fused_counters(tokens, hidden), dtype=torch.int32, device="cuda")
    fused_moe(x, gate_up, down, ids, weights, arrivals=arrivals)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused_moe(x, gate_up, down, ids, weights, arrivals=arrivals)
    new_x, _, _, new_ids, new_weights = (
        t.cuda() for t in _case(tokens, experts, top_k, hidden, inter, seed=2)
    )
    new_ids[0, -1] = -1  # a remote slot
    x.copy_(new_x.to(torch.bfloat16))
    ids.copy_(new_ids)
    weights.copy_(new_weights)
    graph.replay()
    first = captured.clone()
    graph.replay()  # the counters the first replay left zeroed
    torch.testing.assert_close(captured, first, rtol=0, atol=0)
    assert not arrivals.any()
    torch.testing.assert_close(captured, fused_moe(x, gate_up, down, ids, weights), rtol=0, atol=0)
    want = experts_reference(x.float(), gate_up.float(), down.float(), ids, weights)
    assert ((captured.float() - want).norm() / want.norm()).item() < 1e-2


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("block", [False, True], ids=["per-row", "block-128"])
@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
def test_fp8_experts_match_the_reference_on_cuda_and_replay_from_a_graph(tokens, block):
    """Qwen3-30B-A3B's expert shapes in e4m3 (W8A16, bf16 activations; a scale per row, or per
    row and 128 columns) against the float32 reference on the dequantized weights; past
    FUSED_MAX_ROWS_PER_EXPERT the fused path still runs (no grouped GEMM takes e4m3); a graph replay
    equals the eager call bit for bit."""
    torch.backends.cuda.matmul.allow_tf32 = False
    x, gate_up, down, ids, weights = (
        t.cuda() for t in _case(tokens, QWEN["experts"], QWEN["top_k"], QWEN["hidden"], QWEN["inter"], tokens)
    )
    q_gate_up, q_down, scales = _fp8(gate_up, down, group=128 if block else 0)
    x = x.to(torch.bfloat16)
    assert experts_path(tokens, QWEN["top_k"], QWEN["experts"], q_gate_up.dtype, x.device) == "fused"
    got = fused_experts(x, q_gate_up, q_down, ids, weights, scales=scales)
    want = experts_reference(x.float(), q_gate_up, q_down, ids, weights, scales)
    assert got.dtype == torch.bfloat16
    assert ((got.float() - want).norm() / want.norm()).item() < 1e-2
    arrivals = torch.zeros(fused_counters(tokens, QWEN["hidden"]), dtype=torch.int32, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused_moe(x, q_gate_up, q_down, ids, weights, arrivals=arrivals, scales=scales)
    graph.replay()
    torch.testing.assert_close(captured, got, rtol=0, atol=0)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize(
    "tokens, shared", [(1, 0), (16, 0), (1, 256), (5, 256), (20, 256), (1, 384), (5, 384)]
)
def test_moe_block_replays_from_a_cuda_graph(tokens, shared):
    """The whole block (router linear, the routing kernel, the experts; with `shared`, Qwen's
    gated shared expert, its gate computed in the routing kernel: as the stack's last expert at
    the experts' width 256, `moe.shared_expert_slots`, a separate MLP at 384) captured and
    replayed on new hidden states: the replay equals the eager block, and both the torch
    arithmetic (`route` on the same logits, the float32 reference on the same bf16 weights, the
    gated shared MLP)."""
    cfg = ModelConfig(
        family="qwen3_moe", vocab_size=32, hidden_size=512, intermediate_size=1024, num_layers=1,
        num_heads=4, num_kv_heads=4, head_dim=128, num_experts=32, num_experts_per_tok=4,
        moe_intermediate_size=256, norm_topk_prob=True, rms_norm_eps=1e-6, max_position_embeddings=64,
        shared_expert_intermediate_size=shared,
    )  # fmt: skip
    torch.manual_seed(0)
    block = SparseMoeBlock(cfg).to("cuda", torch.bfloat16)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, p.shape[-1] ** -0.5)
    x = torch.randn(tokens, 512, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        block(x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = block(x)
        x.copy_(torch.randn(tokens, 512, device="cuda"))
        graph.replay()
        eager = block(x)
        weights, ids = route(block.gate(x), cfg.num_experts_per_tok, True)
        if block.shared_slots:
            gate = torch.sigmoid(block.shared_expert_gate(x))[:, 0]
            weights, ids = with_shared_slots(weights, ids, block.shared_slots, cfg.num_experts, gate)
        experts = block.experts
        want = experts_reference(
            x.float(), experts.gate_up_proj.float(), experts.down_proj.float(), ids, weights
        )
        if block.shared_mlp() is not None:
            want += (torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)).float()
    torch.testing.assert_close(captured, eager, rtol=0, atol=0)
    assert ((captured.float() - want).norm() / want.norm()).item() < 1e-2


@cuda
@pytest.mark.gpu
def test_routing_kernel_matches_route_on_cuda():
    """bf16 router logits without ties (a permutation of k / 16 per row, exact in bf16): random
    bf16 logits tie often over 128 experts, and the kernel and torch's top-k need not break a tie
    alike (both are right; 18 of 512 choices differed on the first run)."""
    order = torch.stack([torch.randperm(128) for _ in range(64)])
    logits = ((order - 64).float() / 16).to("cuda", torch.bfloat16)
    weights, ids = route_topk(logits, 8, True)
    want_w, want_ids = route(logits, 8, True)
    torch.testing.assert_close(ids.long(), want_ids, rtol=0, atol=0)
    torch.testing.assert_close(weights, want_w, rtol=1e-5, atol=1e-6)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("tokens, dtype", [(1, torch.bfloat16), (16, torch.bfloat16), (4, torch.float32)])
def test_router_logits_kernel_matches_route_on_cuda(tokens, dtype):
    """Qwen3-30B-A3B's router (2,048 -> 128, stored transposed as the engine keeps it) on integer
    data whose logits are distinct multiples of 1/16, exact in bf16 whatever the order of the sums
    (so the kernel and cuBLAS cannot round them apart), inside a CUDA graph: ids exactly, weights
    to rounding, the same bits on a second replay."""
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randint(-1, 2, (tokens, 2048), generator=gen).float()
    x[:, :tokens] = torch.eye(tokens)  # column t sets token t's logits
    gate = torch.randint(-1, 2, (128, 2048), generator=gen).float()
    target = torch.stack([torch.randperm(128, generator=gen) for _ in range(tokens)]).float() - 64
    gate[:, :tokens] = target.t() - gate[:, tokens:] @ x[:, tokens:].t()
    x, gate = x.to("cuda", dtype), (gate / 16).to("cuda", dtype).t().contiguous().t()
    arrivals = torch.zeros(16, dtype=torch.int32, device="cuda")
    route_hidden(x, gate, 8, True, arrivals)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = route_hidden(x, gate, 8, True, arrivals)
    graph.replay()
    first = weights.clone(), ids.clone()
    graph.replay()
    want_w, want_ids = route(torch.nn.functional.linear(x, gate), 8, True)
    torch.testing.assert_close(ids.long(), want_ids, rtol=0, atol=0)
    torch.testing.assert_close(weights, want_w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close((weights, ids), first, rtol=0, atol=0)
    assert not arrivals.any()


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("name", list(DEEPSEEK_ROUTINGS))
@pytest.mark.parametrize("tokens", [1, 16, 64])
def test_deepseek_routing_in_the_kernels_matches_route_on_cuda(name, tokens):
    """DeepSeek-V3's router shapes (7,168 -> 256 experts, float32 weight, top-8 in 4 of 8 groups)
    in float32: `route_hidden` up to 16 rows, `route_topk` on the torch logits at any count. The
    seeds' data has no near-ties: the k-th and next choice (and the groups at the group cut)
    differ by 4e-6 or more, far above float32's differences between the kernels and torch."""
    torch.backends.cuda.matmul.allow_tf32 = False
    routing, x, gate, bias = (
        t.cuda() if isinstance(t, torch.Tensor) else t
        for t in _deepseek_case(name, tokens, 256, 7168, tokens)
    )
    logits = x @ gate.T
    want_w, want_ids = route(logits, 8, True, routing, bias)
    got = [route_topk(logits, 8, True, routing, bias)]
    if tokens <= 16:
        arrivals = torch.zeros(16, dtype=torch.int32, device="cuda")
        got.append(route_hidden(x, gate.t().contiguous().t(), 8, True, arrivals, routing, bias))
    for weights, ids in got:
        torch.testing.assert_close(ids.long(), want_ids, rtol=0, atol=0)
        torch.testing.assert_close(weights, want_w, rtol=1e-5, atol=1e-6)
