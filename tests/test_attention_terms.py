"""Gemma 2's soft-capped attention logits and gpt-oss's attention sinks in the Triton attention
kernels (kernels/paged_attention.py, kernels/prefill_attention.py), against `explicit_attention`
of the engine's reference backend (HF's eager attention written out), with sliding windows.

Under Triton's interpreter (`TRITON_INTERPRET=1`, triton importable) the kernels run on the CPU in
float32: the decode kernel with one split and with several (split 0 alone carries the sink into
the merge), with the RoPE path that attends to the new token from registers, and the prefill
kernel over several query tiles. On CUDA (`pytest -m gpu`) the same cases run in bfloat16.
"""

from __future__ import annotations

import os

import pytest
import torch

from model_service.attention.reference import explicit_attention
from model_service.kernels.paged_attention import (
    DecodeTiling,
    decode_attention_triton,
    paged_decode_attention,
    store_kv_reference,
    triton,
)
from model_service.kernels.prefill_attention import (
    paged_prefill_attention,
    prefill_attention_triton,
    prefill_tiles,
)

interpreter = pytest.mark.skipif(
    triton is None or os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter"
)
cuda = pytest.mark.skipif(not torch.cuda.is_available() or triton is None, reason="needs CUDA and Triton")
HEADS, KV_HEADS, DIM, BS = 4, 2, 16, 4
SCALE = 0.5  # logits of a few units: a cap of 2 binds on most of them


def _pool(lens: list[int], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K/V pools [slots, KVH, D] and a block table [S, blocks] giving each sequence shuffled blocks."""
    needed = [max(1, -(-n // BS)) for n in lens]
    perm = torch.randperm(sum(needed) + 2, generator=gen)
    table = torch.zeros(len(lens), max(needed), dtype=torch.long)
    at = 0
    for i, nb in enumerate(needed):
        table[i, :nb] = perm[at : at + nb]
        at += nb
    slots = (sum(needed) + 2) * BS
    k_cache, v_cache = (torch.randn(slots, KV_HEADS, DIM, generator=gen) for _ in range(2))
    return k_cache, v_cache, table


def _want(
    q: torch.Tensor,  # [Q, H, D]: the rows at positions n - Q .. n - 1
    pools: tuple[torch.Tensor, torch.Tensor],
    table_row: torch.Tensor,
    n: int,
    window: int | None,
    cap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """`explicit_attention` over one sequence's first n positions: [Q, H, D]."""
    pos = torch.arange(n)
    slots = table_row[pos // BS] * BS + pos % BS
    k, v = (p[slots].transpose(0, 1)[None] for p in pools)  # [1, KVH, n, D]
    q_pos = torch.arange(n - q.shape[0], n)
    allowed = pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= pos[None, :] > q_pos[:, None] - window
    out = explicit_attention(q.transpose(0, 1)[None], k, v, allowed[None, None], SCALE, cap, sinks)
    return out[0].transpose(0, 1)


# (soft-cap, sinks, window, splits): each term alone, both off, both with a window, over splits.
CASES = [
    (None, False, None, 1),
    (2.0, False, None, 1),
    (None, True, None, 1),
    (None, True, 8, 4),
    (2.0, True, 8, 4),
    (2.0, False, 8, 4),
]


def _decode_inputs(device: str, dtype: torch.dtype, with_sinks: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    lens = [0, 5, 23, 70]  # a padding row, one tile, several tiles and splits
    k_cache, v_cache, table = _pool(lens, gen)
    q = torch.randn(len(lens), HEADS, DIM, generator=gen)
    sinks = torch.randn(HEADS, generator=gen) * 2 if with_sinks else None
    cpu = (q, k_cache, v_cache, table, lens, sinks)
    on = [t.to(device, dtype) for t in (q, k_cache, v_cache)]
    return cpu, (*on, table.to(device), torch.tensor(lens, device=device))


def _decode_want(q, k_cache, v_cache, table, lens, sinks, window, cap) -> torch.Tensor:
    pools = (k_cache, v_cache)
    rows = [_want(q[i : i + 1], pools, table[i], n, window, cap, sinks) for i, n in enumerate(lens)]
    return torch.cat(rows)


@interpreter
@pytest.mark.parametrize("cap, with_sinks, window, splits", CASES)
def test_decode_kernel_soft_cap_and_sinks_match_the_reference(cap, with_sinks, window, splits):
    cpu, (dq, dk, dv, dt, dl) = _decode_inputs("cpu", torch.float32, with_sinks, 0)
    sinks = cpu[-1]
    out = torch.empty_like(dq)
    tiling = DecodeTiling(block_n=16)  # several tiles a split at these lengths
    got = decode_attention_triton(
        dq, dk, dv, dt, dl, BS, SCALE, window, splits, out, tiling=tiling, softcap=cap, sinks=sinks
    )
    want = _decode_want(*cpu, window, cap)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got[0].abs().max() == 0  # the padding row, sink or not


@interpreter
def test_decode_kernel_with_rope_attends_to_the_new_token_with_the_cap_and_the_sink():
    """The RoPE path (q and the step's K/V as the projection left them; the split owning the new
    position attends to it from registers): its logit is capped too, and the sink joins once."""
    from model_service.kernels.fused import apply_rotary_reference

    gen = torch.Generator().manual_seed(1)
    lens = [9, 40]
    k_cache, v_cache, table = _pool(lens, gen)
    q, k, v = (torch.randn(2, h, DIM, generator=gen) for h in (HEADS, KV_HEADS, KV_HEADS))
    cos, sin = torch.randn(2, DIM, generator=gen), torch.randn(2, DIM, generator=gen)
    sinks = torch.randn(HEADS, generator=gen)
    slots = torch.stack([table[i, (n - 1) // BS] * BS + (n - 1) % BS for i, n in enumerate(lens)])
    pools = (k_cache.clone(), v_cache.clone())
    got = decode_attention_triton(
        q, *pools, table, torch.tensor(lens), BS, SCALE, 16, 4, torch.empty_like(q),
        rope_kv=(k, v, cos, sin, slots), tiling=DecodeTiling(block_n=16), softcap=2.0, sinks=sinks,
    )  # fmt: skip
    rq, rk = (apply_rotary_reference(t, cos, sin) for t in (q, k))
    store_kv_reference(rk, v, k_cache, v_cache, slots)
    want = _decode_want(rq, k_cache, v_cache, table, lens, sinks, 16, 2.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pools[0], k_cache, rtol=1e-6, atol=1e-6)


def _prefill_inputs(device: str, dtype: torch.dtype, with_sinks: bool, seed: int):
    """A chunk after 12 cached positions (5 rows) and a whole 37-token prompt: 3 tiles of 16 rows."""
    gen = torch.Generator().manual_seed(seed)
    lens, q_lens = [17, 37], [5, 37]
    k_cache, v_cache, table = _pool(lens, gen)
    q = torch.randn(sum(q_lens), HEADS, DIM, generator=gen)
    sinks = torch.randn(HEADS, generator=gen) * 2 if with_sinks else None
    starts = torch.tensor([0, q_lens[0], sum(q_lens)])
    cpu = (q, k_cache, v_cache, table, lens, starts, sinks)
    on = [t.to(device, dtype) for t in (q, k_cache, v_cache)]
    return cpu, (*on, table.to(device), torch.tensor(lens, device=device), starts.to(device))


def _prefill_want(q, k_cache, v_cache, table, lens, starts, sinks, window, cap) -> torch.Tensor:
    parts = [
        _want(q[starts[i] : starts[i + 1]], (k_cache, v_cache), table[i], n, window, cap, sinks)
        for i, n in enumerate(lens)
    ]
    return torch.cat(parts)


@interpreter
@pytest.mark.parametrize("cap, with_sinks, window", [c[:3] for c in CASES])
def test_prefill_kernel_soft_cap_and_sinks_match_the_reference(cap, with_sinks, window):
    cpu, (dq, dk, dv, dt, dl, ds) = _prefill_inputs("cpu", torch.float32, with_sinks, 2)
    tiles = tuple(torch.from_numpy(t) for t in prefill_tiles(ds.numpy(), block_m=16))
    got = prefill_attention_triton(
        dq, dk, dv, dt, ds, dl, BS, SCALE, window, tiles, torch.empty_like(dq), cap, cpu[-1], block_m=16
    )
    torch.testing.assert_close(got, _prefill_want(*cpu, window, cap), rtol=1e-5, atol=1e-5)


@interpreter
def test_soft_cap_stays_finite_for_huge_logits():
    """Logits in the thousands (cap 50, Gemma 2's): tanh saturates to +-1, no inf / inf."""
    (q, *pools, table, lens, _), (dq, dk, dv, dt, dl) = _decode_inputs("cpu", torch.float32, False, 3)
    big = 100.0
    got = decode_attention_triton(
        dq * big, dk, dv, dt, dl, BS, SCALE, None, 1, torch.empty_like(dq), tiling=DecodeTiling(block_n=16),
        softcap=50.0,
    )  # fmt: skip
    want = _decode_want(q * big, *pools, table, lens, None, None, 50.0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("cap, with_sinks, window, splits", CASES)
def test_kernels_soft_cap_and_sinks_match_the_reference_on_cuda(cap, with_sinks, window, splits):
    """The public entry points on CUDA in bfloat16 (decode at its default tiling, prefill at 64
    rows a tile) against the float32 reference."""
    cpu, gpu = _decode_inputs("cuda", torch.bfloat16, with_sinks, 4)
    sinks = cpu[-1].cuda() if with_sinks else None
    got = paged_decode_attention(*gpu, BS, SCALE, window, splits, softcap=cap, sinks=sinks)
    want = _decode_want(*_rounded(cpu), window, cap)
    torch.testing.assert_close(got.float().cpu(), want, rtol=2e-2, atol=2e-2)
    cpu, (dq, dk, dv, dt, dl, ds) = _prefill_inputs("cuda", torch.bfloat16, with_sinks, 5)
    tiles = tuple(torch.from_numpy(t).cuda() for t in prefill_tiles(ds.cpu().numpy()))
    sinks = cpu[-1].cuda() if with_sinks else None
    got = paged_prefill_attention(dq, dk, dv, dt, ds, dl, BS, SCALE, window, tiles, softcap=cap, sinks=sinks)
    want = _prefill_want(*_rounded(cpu), window, cap)
    torch.testing.assert_close(got.float().cpu(), want, rtol=2e-2, atol=2e-2)


def _rounded(case: tuple) -> list:
    """The case's q and K/V pools as bfloat16 holds them (in float32), the rest as they are."""
    return [t.to(torch.bfloat16).float() if i in (0, 1, 2) else t for i, t in enumerate(case)]
