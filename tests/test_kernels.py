"""GPU kernels against their torch references (on CUDA), and the references against the engine's
reference attention backend (everywhere, so CI checks what the kernels are checked against)."""

from __future__ import annotations

import pytest
import torch

from model_service.attention.kv_cache import KVCache
from model_service.attention.reference import TorchReferenceBackend
from model_service.engine.batch_builder import BatchBuilder, StepItem
from model_service.engine.cuda_graphs import batch_ladder
from model_service.engine.seq_state import SequenceState
from model_service.kernels.paged_attention import (
    paged_decode_attention,
    paged_decode_attention_reference,
    store_kv,
    store_kv_reference,
)
from model_service.models.config import attention_layers

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _decode_case(
    num_seqs: int, heads: int, kv_heads: int, dim: int, bs: int, device: str, dtype: torch.dtype, seed: int
):
    """A pool with random K/V, sequences of random lengths in shuffled blocks, one query each."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 300, (num_seqs,), generator=g)
    blocks_needed = [-(-int(n) // bs) for n in lens]
    perm = torch.randperm(sum(blocks_needed) + 3, generator=g).tolist()
    table = torch.zeros(num_seqs, max(blocks_needed), dtype=torch.long)
    at = 0
    for i, nb in enumerate(blocks_needed):
        table[i, :nb] = torch.tensor(perm[at : at + nb])
        at += nb
    slots = (len(perm)) * bs
    k_cache = torch.randn(slots, kv_heads, dim, generator=g).to(device, dtype)
    v_cache = torch.randn(slots, kv_heads, dim, generator=g).to(device, dtype)
    q = torch.randn(num_seqs, heads, dim, generator=g).to(device, dtype)
    return q, k_cache, v_cache, table.to(device), lens.to(device)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("window", [None, 37])
def test_decode_reference_matches_the_reference_backend(window):
    """The kernels' reference computes what the engine's reference backend computes for a decode
    step (each sequence's new K/V already in the pool)."""
    bs, heads, kv_heads, dim = 4, 4, 2, 16
    q, k_cache, v_cache, table, lens = _decode_case(5, heads, kv_heads, dim, bs, "cpu", torch.float32, 0)
    want = paged_decode_attention_reference(q, k_cache, v_cache, table, lens, bs, dim**-0.5, window)
    num_blocks = k_cache.shape[0] // bs
    cache = KVCache(
        attention_layers([window]), num_blocks, bs, kv_heads, dim, torch.float32, torch.device("cpu")
    )
    cache.data[0, 0, : k_cache.shape[0]] = k_cache
    cache.data[0, 1, : v_cache.shape[0]] = v_cache
    items = []
    for i, n in enumerate(lens.tolist()):
        state = SequenceState(seq_id=i, block_table=table[i].tolist()[: -(-n // bs)], num_computed=n - 1)
        items.append(StepItem(state, [0], 1))
    batch = BatchBuilder(bs, torch.device("cpu")).build(items)
    backend = TorchReferenceBackend(cache, [window], dim)
    backend.prepare(batch)
    last = (
        torch.stack([k_cache[s] for s in batch.slot_mapping]),
        torch.stack([v_cache[s] for s in batch.slot_mapping]),
    )
    got = backend.forward(0, q, *last)
    assert _rel(got, want) < 1e-5


def test_store_kv_reference_skips_padding_rows():
    k_cache, v_cache = torch.zeros(8, 2, 4), torch.zeros(8, 2, 4)
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    store_kv_reference(k, v, k_cache, v_cache, torch.tensor([5, -1, 0]))
    assert torch.equal(k_cache[5], k[0]) and torch.equal(v_cache[0], v[2])
    assert k_cache[[1, 2, 3, 4, 6, 7]].abs().sum() == 0


def test_batch_ladder_covers_every_size_up_to_the_maximum():
    assert batch_ladder(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_ladder(1) == [1]
    for n in range(1, 300):
        assert any(s >= n for s in batch_ladder(300))


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 32, 8, 128), (7, 9, 3, 64), (33, 12, 4, 64), (64, 32, 8, 128)])
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("splits", [1, 4, 16])
def test_triton_decode_attention_matches_reference(shape, window, splits):
    num_seqs, heads, kv_heads, dim = shape
    for seed in range(2):  # fresh random inputs each time
        q, k_cache, v_cache, table, lens = _decode_case(
            num_seqs, heads, kv_heads, dim, 16, "cuda", torch.bfloat16, seed + 10 * splits
        )
        want = paged_decode_attention_reference(q, k_cache, v_cache, table, lens, 16, dim**-0.5, window)
        got = paged_decode_attention(q, k_cache, v_cache, table, lens, 16, dim**-0.5, window, splits)
        assert torch.isfinite(got).all()
        assert _rel(got, want) < 1e-2


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("kv_heads, dim", [(8, 128), (3, 64)])  # 3 x 64: a row that is not a power of 2
def test_triton_store_kv_matches_reference_and_skips_padding(kv_heads, dim):
    k, v = (
        torch.randn(50, kv_heads, dim, device="cuda", dtype=torch.bfloat16),
        torch.randn(50, kv_heads, dim, device="cuda", dtype=torch.bfloat16),
    )
    slots = torch.randperm(400, device="cuda")[:50]
    slots[::7] = -1
    caches = [torch.full((400, kv_heads, dim), 7.0, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    store_kv(k, v, caches[0], caches[1], slots)
    store_kv_reference(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
