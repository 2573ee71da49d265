"""GPU kernels against their torch references (on CUDA), and the references against the engine's
reference attention backend (everywhere, so CI checks what the kernels are checked against)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from model_service.attention.kv_cache import KVCache
from model_service.attention.reference import TorchReferenceBackend
from model_service.attention.triton_backend import TritonBackend
from model_service.engine.batch_builder import BatchBuilder, StepItem
from model_service.engine.cuda_graphs import batch_ladder
from model_service.engine.sampler import filtered_probs
from model_service.engine.sampling_params import SamplingParams
from model_service.engine.seq_state import SequenceState
from model_service.kernels.lora import (
    AdapterTable,
    aligned_up,
    lora_delta_reference,
    lora_expand,
    lora_shrink,
    shrink_arrivals,
)
from model_service.kernels.lora_grouped import lora_expand_tiles, lora_shrink_tiles, lora_tiles
from model_service.kernels.paged_attention import (
    FP8,
    HeadNorms,
    num_splits_for,
    paged_decode_attention,
    paged_decode_attention_reference,
    store_kv,
    store_kv_reference,
    store_kv_triton,
    triton,
)
from model_service.kernels.prefill_attention import paged_prefill_attention_reference
from model_service.kernels.sampling import (
    MAX_ROUNDS,
    gumbel_max,
    gumbel_max_reference,
    philox_uniforms,
    truncated_sample,
    truncated_sample_reference,
)
from model_service.lora.adapter import LoraAdapter, LoraWeights
from model_service.lora.arena import ArenaSpace
from model_service.lora.layers import wrap_lora_layers
from model_service.models.config import attention_layers
from model_service.models.layers import PackedLinear

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
interpreter = pytest.mark.skipif(
    triton is None or os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter"
)


@pytest.fixture
def h100_sms(monkeypatch: pytest.MonkeyPatch) -> None:
    """An H100's 132 SMs for the LoRA launches that size their grids by the device (the CPU has none)."""
    from model_service.kernels import lora, lora_grouped

    for module in (lora, lora_grouped):
        monkeypatch.setattr(module, "num_sms", lambda device: 132)


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


@pytest.mark.parametrize("kv_heads", [1, 2, 3, 8, 32])
@pytest.mark.parametrize("max_rows", [8, 64, 100, 256])
def test_every_decode_split_count_a_step_can_choose_is_compiled_by_the_graph_ladder(kv_heads, max_rows):
    """The split count is a compile-time constant of the decode kernel. A mixed step's decode
    rows can number anything up to the batch, so the counts they choose must be among those of
    the graph ladder's sizes, captured (so compiled) at start-up, or a pod compiles kernels under
    traffic (~1 s each on an H200)."""
    ladder = {num_splits_for(n, kv_heads) for n in batch_ladder(max_rows)}
    chosen = {num_splits_for(n, kv_heads) for n in range(1, max_rows + 1)}
    assert chosen <= ladder and all(c & (c - 1) == 0 for c in chosen)


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


def _check_store_kv(device: str, dtype: torch.dtype, kv_heads: int, dim: int) -> None:
    """50 rows into shuffled slots of a pool of 400, every 7th a padding row (slot -1): the kernel
    writes the reference's pool exactly, the other slots keep their 7s."""
    k, v = (torch.randn(50, kv_heads, dim, device=device, dtype=dtype) for _ in range(2))
    slots = torch.randperm(400, device=device)[:50]
    slots[::7] = -1
    caches = [torch.full((400, kv_heads, dim), 7.0, device=device, dtype=dtype) for _ in range(4)]
    store_kv_triton(k, v, caches[0], caches[1], slots)
    store_kv_reference(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("kv_heads, dim", [(8, 128), (3, 64)])  # 3 x 64: a row that is not a power of 2
def test_triton_store_kv_matches_reference_and_skips_padding(kv_heads, dim):
    _check_store_kv("cuda", torch.bfloat16, kv_heads, dim)


@interpreter
@pytest.mark.parametrize("kv_heads, dim", [(8, 128), (3, 64)])
def test_store_kv_kernel_matches_reference_and_skips_padding_under_the_interpreter(kv_heads, dim):
    _check_store_kv("cpu", torch.float32, kv_heads, dim)


# Ranks of 4 slots' adapters on the three parts of a q/k/v-like projection: one on every part,
# mixed ranks with a part left out, an empty slot, and one on a single part.
_RANKS = ((8, 8, 8), (16, 0, 16), (0, 0, 0), (0, 4, 0))


def _lora_table(in_features: int, sizes: tuple[int, ...], dtype: torch.dtype, device: str, g) -> AdapterTable:
    """4 adapters (`_RANKS`) in an arena as the engine lays them out (A [rank, in] then B [out,
    rank] per targeted part, each at its own rank), with NaN between them: a kernel that reads
    outside an adapter's own elements poisons its result. The tables are strided views of
    wider ones, as each projection's are of the model's."""
    entries = torch.zeros(len(_RANKS), 2, len(sizes), 3, dtype=torch.long)
    scaling = torch.zeros(len(_RANKS), 2, len(sizes))
    pieces, cursor = [torch.full((8,), float("nan"))], 8
    for slot, ranks in enumerate(_RANKS):
        for part, (rank, size) in enumerate(zip(ranks, sizes, strict=True)):
            if rank:  # B's rows padded to `aligned_up(rank)` with zeros, A and B 8-aligned
                a, b = torch.randn(rank, in_features, generator=g), torch.randn(size, rank, generator=g)
                b = torch.cat([b, torch.zeros(size, aligned_up(rank) - rank)], dim=1)
                entries[slot, 1, part] = torch.tensor([cursor, cursor + a.numel() + 8, rank])
                scaling[slot, 1, part] = float(torch.rand(1, generator=g)) + 0.5
                gap = torch.full((8,), float("nan"))
                pieces += [a.flatten(), gap, b.flatten(), gap]
                cursor += a.numel() + b.numel() + 16
    weights = torch.cat(pieces).to(device, dtype)
    return AdapterTable(weights, entries.to(device)[:, 1], scaling.to(device)[:, 1], max_rank=16)


def _lora_case(tokens: int, device: str, dtype: torch.dtype, seed: int, in_features: int = 48):
    """A fused q/k/v-like projection (parts of 64, 32, 32 columns), the `_lora_table` adapters
    and rows spread over the slots and the base model."""
    g = torch.Generator().manual_seed(seed)
    sizes = (64, 32, 32)
    table = _lora_table(in_features, sizes, dtype, device, g)
    x = torch.randn(tokens, in_features, generator=g)
    y = torch.randn(tokens, sum(sizes), generator=g)
    slots = torch.randint(-1, 4, (tokens,), generator=g)
    return sizes, x.to(device, dtype), y.to(device, dtype), table, slots.to(device)


def _one_projection_model(base: PackedLinear) -> torch.nn.Module:
    """`base` as a decoder layer's q/k/v projection (`layers.0.self_attn.qkv_proj`)."""
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].self_attn = torch.nn.Module()
    model.layers[0].self_attn.qkv_proj = base
    return model


def _adapter(name: str, table: AdapterTable, slot: int, in_features: int, sizes) -> LoraAdapter:
    """The adapter `table` holds in `slot`, as the pool would hand it over."""
    modules = {}
    for part, name_ in enumerate(("q_proj", "k_proj", "v_proj")):
        weights = table.part_weights(slot, part, in_features, sizes[part])
        if weights is not None:
            modules[(0, name_)] = LoraWeights(*(w.clone() for w in weights), float(table.scaling[slot, part]))
    return LoraAdapter(name, slot + 1, None, modules)


def test_lora_reference_matches_the_lora_layer_over_its_arena_through_loads_moves_and_clears():
    """Adapters of mixed ranks and targets loaded into a model's arena at scattered offsets: the
    layer's torch path gives the reference's delta; after the arena is compacted (adapters
    moved) it still does; a cleared slot adds nothing."""
    sizes, x, y, table, slots = _lora_case(40, "cpu", torch.float32, 0)
    base = PackedLinear(x.shape[1], dict(zip(("q_proj", "k_proj", "v_proj"), sizes, strict=True)), bias=False)
    torch.nn.init.zeros_(base.weight)
    model = _one_projection_model(base)
    lora = wrap_lora_layers(model, 4, 16, 20_000, use_kernels=False)
    layer = model.layers[0].self_attn.qkv_proj
    space = ArenaSpace(20_000)
    space.place(99, 3_000)  # a gap before the first adapter
    for slot in range(4):
        adapter = _adapter(f"a{slot}", table, slot, x.shape[1], sizes)
        lora.load_slot(slot, adapter, space.place(slot, adapter.numel))
    lora.plan.segments = [(s, torch.nonzero(slots == s).flatten()) for s in range(4) if (slots == s).any()]
    want = torch.zeros_like(y)
    lora_delta_reference(x, want, table, slots, sizes)
    assert torch.allclose(layer(x), want, atol=1e-5)
    assert want[slots < 0].abs().sum() == 0  # base rows untouched
    space.release(99)
    moves = space.compaction()
    assert [slot for slot, _ in moves] == [0, 1, 2, 3] and moves[0][1] == 0
    for slot, offset in moves:
        lora.move_slot(slot, offset)
    assert torch.allclose(layer(x), want, atol=1e-5)
    lora.clear_slot(1)
    assert torch.allclose(layer(x)[slots == 1], torch.zeros(1), atol=0)
    assert torch.allclose(layer(x)[slots != 1], want[slots != 1], atol=1e-5)


def _check_lora_rows(device: str, dtype: torch.dtype, tokens: int, in_features: int, seed: int) -> None:
    """The per-row shrink then expand: the reference's delta; base rows and the empty slot's
    untouched; the split shrink's counters left zeroed."""
    sizes, x, y, table, slots = _lora_case(tokens, device, dtype, seed, in_features)
    want, got = y.clone(), y.clone()
    lora_delta_reference(x, want, table, slots, sizes)
    starts = (0, sizes[0], sizes[0] + sizes[1])
    arrivals = shrink_arrivals(x.device)
    lora_expand(lora_shrink(x, table, slots, arrivals), got, table, slots, starts)
    assert _rel(got, want) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert torch.equal(got[slots < 0], y[slots < 0])
    assert torch.equal(got[slots == 2], y[slots == 2])  # an empty slot adds nothing
    assert not arrivals.any()  # left zeroed for the next call


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 37, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features", [48, 2048])  # 2,048 splits the input dimension at few rows
def test_triton_lora_matches_reference(tokens, dtype, in_features):
    for seed in range(2):
        _check_lora_rows("cuda", dtype, tokens, in_features, seed)


@interpreter
@pytest.mark.usefixtures("h100_sms")
def test_lora_expand_kernel_matches_reference_under_the_interpreter():
    """Rows of every slot and of the base model (float32, CPU)."""
    _check_lora_rows("cpu", torch.float32, 12, 48, 3)


@interpreter
@pytest.mark.parametrize("split_k", [2, 9, 16])  # 9 over 5,000 columns: the chunks leave 8 slices
def test_split_shrink_adds_its_slices_in_order_under_the_interpreter(split_k):
    """The last K slice to arrive sums every slice's partial sums: the same xa as no split (float32,
    CPU: `TRITON_INTERPRET=1 pytest -k interpreter tests/test_kernels.py`)."""
    _, x, _, table, slots = _lora_case(7, "cpu", torch.float32, 1, 5000)
    arrivals = shrink_arrivals(x.device, max_rows=8)
    whole, split = (torch.full((7, table.parts * table.max_rank), float("nan")) for _ in range(2))
    lora_shrink(x, table, slots, arrivals, out=whole, split_k=1)
    lora_shrink(x, table, slots, arrivals, out=split, split_k=split_k)
    assert torch.allclose(split, whole, rtol=1e-5, atol=1e-5, equal_nan=True)  # NaN: columns not written
    assert not arrivals.any()


def test_lora_tiles_cut_runs_of_one_slot_and_skip_base_rows():
    slots = np.array([-1, -1] + [2] * 70 + [0, -1, 0, 0] + [3] * 64)
    tiles = lora_tiles(slots, tile_rows=32)
    want = [(2, 34, 2), (34, 66, 2), (66, 72, 2), (72, 73, 0), (74, 76, 0), (76, 108, 3), (108, 140, 3)]
    assert [tuple(t) for t in tiles.tolist()] == want
    assert lora_tiles(np.array([-1, -1])).shape == (0, 3)


def _gate_up_case(tokens: int, device: str, dtype: torch.dtype, seed: int):
    """A gate_up output [T, 2 * 48] before its LoRA expand, the shrink's xa [T, 2 * 16] (parts
    gate and up; NaN beyond each adapter's rank, which nothing may read), the `_lora_table`
    adapters' first two parts and per-row slots in runs."""
    g = torch.Generator().manual_seed(seed)
    inter = 48
    table = _lora_table(64, (inter, inter, 1), dtype, device, g)
    table = AdapterTable(table.weights, table.entries[:, :2], table.scaling[:, :2], table.max_rank)
    y = torch.randn(tokens, 2 * inter, generator=g)
    xa = torch.randn(tokens, 2 * 16, generator=g)
    slots = _runs_of_slots(tokens, seed)
    for t, slot in enumerate(slots.tolist()):
        for part in range(2):
            rank = _RANKS[slot][part] if slot >= 0 else 0
            xa[t, part * 16 + rank : (part + 1) * 16] = float("nan")
    return y.to(device, dtype), xa.to(device), table, slots.to(device)


def test_silu_mul_lora_reference_is_the_expand_then_silu_mul():
    """The fused activation's reference against the two steps it replaces (float32, CPU)."""
    from model_service.kernels.fused import silu_and_mul
    from model_service.kernels.lora import silu_mul_lora_reference

    y, xa, table, slots = _gate_up_case(300, "cpu", torch.float32, 0)
    full = y.clone()
    for t in torch.nonzero(slots >= 0).flatten().tolist():
        s = int(slots[t])
        for part in range(2):
            weights = table.part_weights(s, part, 64, 48)
            if weights is not None:
                b = weights[1]
                cols = slice(part * 48, (part + 1) * 48)
                full[t, cols] += b @ xa[t, part * 16 : part * 16 + b.shape[1]] * table.scaling[s, part]
    assert _rel(silu_mul_lora_reference(y, xa, table, slots), silu_and_mul(full)) < 1e-6


def _check_silu_mul_lora_rows(device: str, dtype: torch.dtype, tokens: int, seed: int) -> None:
    """Per row (adapter runs, base rows, single rows), against the reference and against the
    expand kernel followed by the SiLU-mul it replaces (the kernel on CUDA, torch's on the CPU)."""
    from model_service.kernels.fused import silu_and_mul
    from model_service.kernels.lora import silu_mul_lora_reference, silu_mul_lora_rows

    y, xa, table, slots = _gate_up_case(tokens, device, dtype, seed)
    per_row, unfused = silu_mul_lora_rows(y, xa, table, slots), y.clone()
    lora_expand(xa, unfused, table, slots, (0, 48))
    fp32 = dtype == torch.float32
    assert _rel(per_row, silu_and_mul(unfused)) < (1e-6 if fp32 else 1e-2)
    assert _rel(per_row, silu_mul_lora_reference(y, xa, table, slots)) < (1e-5 if fp32 else 1e-2)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 70, 2048])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_silu_mul_lora_matches_reference_and_the_unfused_kernels(tokens, dtype):
    for seed in range(2):
        _check_silu_mul_lora_rows("cuda", dtype, tokens, seed)


@interpreter
def test_silu_mul_lora_rows_kernel_matches_reference_and_the_unfused_expand_under_the_interpreter():
    _check_silu_mul_lora_rows("cpu", torch.float32, 64, 7)  # every slot, base rows, runs and single rows


def _runs_of_slots(tokens: int, seed: int) -> torch.Tensor:
    """Per-row slots in runs of random length (prefill chunks of requests with one adapter each),
    base-model runs and single rows among them."""
    g = torch.Generator().manual_seed(seed)
    runs, total = [], 0
    while total < tokens:
        length = int(torch.randint(1, 150, (1,), generator=g)) if len(runs) % 3 else 1
        runs.append(torch.full((min(length, tokens - total),), int(torch.randint(-1, 4, (1,), generator=g))))
        total += runs[-1].numel()
    return torch.cat(runs)


def _check_lora_tiles(device: str, dtype: torch.dtype, tokens: int, in_features: int, seed: int) -> None:
    """The tile kernels over runs of slots: the reference's delta, base rows untouched."""
    sizes, x, y, table, _ = _lora_case(tokens, device, dtype, seed, in_features)
    slots = _runs_of_slots(tokens, seed).to(device)
    want, got = y.clone(), y.clone()
    lora_delta_reference(x, want, table, slots, sizes)
    starts = (0, sizes[0], sizes[0] + sizes[1])
    tiles = torch.from_numpy(lora_tiles(slots.cpu().numpy())).to(device)
    lora_expand_tiles(lora_shrink_tiles(x, table, tiles), got, table, tiles, starts)
    assert _rel(got, want) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert torch.equal(got[slots < 0], y[slots < 0])


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [20, 300, 2048])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features", [48, 2048])
def test_triton_lora_tiles_match_reference(tokens, dtype, in_features):
    for seed in range(2):
        _check_lora_tiles("cuda", dtype, tokens, in_features, seed)


@interpreter
@pytest.mark.usefixtures("h100_sms")
@pytest.mark.parametrize("in_features", [48, 640])  # 640: the shrink split in two K slices, the last ragged
def test_lora_tile_kernels_match_reference_under_the_interpreter(in_features):
    """Runs of every slot (one a whole tile of 64 rows), single rows and a base row, float32 on the CPU."""
    _check_lora_tiles("cpu", torch.float32, 160, in_features, 7)


def _lora_mixed_batch(device: str):
    """Five decode rows of four adapters, a 40-token chunk of adapter 2, a decode row of adapter 1
    after it, a 20-token prompt on the base model: the scheduler's order of a mixed step."""
    shapes = [(9, 1, 0), (30, 1, 1), (4, 1, 2), (17, 1, 3), (12, 1, 0), (60, 40, 2), (8, 1, 1), (20, 20, -1)]
    items = []
    for i, (n, q_rows, slot) in enumerate(shapes):
        state = SequenceState(seq_id=i, block_table=list(range(i * 16, i * 16 + 16)), num_computed=n - q_rows)
        state.lora_slot = slot
        items.append(StepItem(state, [0] * q_rows, 1))
    return BatchBuilder(4, torch.device(device)).build(items)


def test_lora_plan_serves_a_mixed_steps_decode_rows_per_row_and_tiles_the_rest():
    from model_service.lora.layers import LoraStepPlan

    batch = _lora_mixed_batch("cpu")
    assert batch.num_leading_decodes == 5
    plan = LoraStepPlan(use_kernels=True)
    plan.prepare(batch)
    assert plan.lead == 5
    assert plan.tiles.tolist() == [[5, 45, 2], [45, 46, 1]]  # no tile for the decode rows or base rows
    decode = BatchBuilder(4, torch.device("cpu")).build(
        [StepItem(SequenceState(seq_id=0, block_table=[0], num_computed=2), [0], 1)]
    )
    plan.prepare(decode)
    assert (plan.lead, plan.tiles, decode.num_leading_decodes) == (0, None, 1)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features", [48, 2048])
def test_triton_lora_of_a_mixed_step_matches_reference(dtype, in_features):
    """Per-row kernels on the leading decode rows and tiles on the rest write one buffer each way:
    both halves must land, in the right rows, and base rows stay untouched."""
    from model_service.lora.layers import LoraStepPlan

    batch = _lora_mixed_batch("cuda")
    sizes, x, y, table, _ = _lora_case(batch.num_tokens, "cuda", dtype, 0, in_features)
    plan = LoraStepPlan(use_kernels=True)
    plan.prepare(batch)
    want, got = y.clone(), y.clone()
    lora_delta_reference(x, want, table, batch.lora_slots, sizes)
    starts = (0, sizes[0], sizes[0] + sizes[1])
    plan.expand(plan.shrink(x, table), got, table, starts)
    assert _rel(got, want) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert torch.equal(got[batch.lora_slots < 0], y[batch.lora_slots < 0])


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dim", [576, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_rms_norm_silu_and_rope_match_references(dim, dtype):
    from model_service.kernels.fused import (
        apply_rotary,
        apply_rotary_reference,
        rms_norm,
        rms_norm_reference,
        silu_and_mul,
    )

    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for seed in range(2):
        g = torch.Generator(device="cuda").manual_seed(seed)
        x, res = (torch.randn(37, dim, generator=g, device="cuda").to(dtype) for _ in range(2))
        w = torch.rand(dim, generator=g, device="cuda").to(dtype)
        out, summed = rms_norm(x, w, 1e-5, res)
        assert torch.equal(summed, x + res)
        assert _rel(out, rms_norm_reference(x + res, w, 1e-5)) < tol
        assert _rel(rms_norm(x, w, 1e-5)[0], rms_norm_reference(x, w, 1e-5)) < tol
        gate_up = torch.randn(37, 2 * dim, generator=g, device="cuda").to(dtype)
        gate, up = gate_up.chunk(2, dim=-1)
        assert _rel(silu_and_mul(gate_up), torch.nn.functional.silu(gate) * up) < tol
        q = torch.randn(37, 8, 128, generator=g, device="cuda").to(dtype)
        cos, sin = (torch.randn(37, 128, generator=g, device="cuda").to(dtype) for _ in range(2))
        want = apply_rotary_reference(q, cos, sin)
        assert _rel(apply_rotary(q.clone(), cos, sin), want) < tol


def _qk_views(tokens: int, heads: int, kv_heads: int, dim: int, device: str, dtype: torch.dtype):
    """q [T, H, D] and k [T, KVH, D] as `Attention` gets them: views of one qkv projection's rows,
    plus each norm's weight."""
    g = torch.Generator(device=device).manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g, device=device).to(dtype)
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    wq, wk = (torch.rand(dim, generator=g, device=device).to(dtype) + 0.5 for _ in range(2))
    return q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim), wq, wk


@interpreter
@pytest.mark.parametrize("tokens, dim", [(1, 128), (5, 64), (3, 80)])
def test_head_norm_kernel_matches_two_rms_norms_under_the_interpreter(tokens, dim):
    """Qwen3's q_norm and k_norm in one launch, on the strided heads the projection leaves, in
    float32 (HF's parity runs there): each head as `rms_norm_reference` normalizes it."""
    from model_service.kernels.fused import _head_rms_norm, rms_norm_reference

    q, k, wq, wk = _qk_views(tokens, 4, 2, dim, "cpu", torch.float32)
    got_q, got_k = _head_rms_norm(q, k, HeadNorms(wq, wk, 1e-6))
    torch.testing.assert_close(got_q, rms_norm_reference(q, wq, 1e-6), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, rms_norm_reference(k, wk, 1e-6), rtol=1e-6, atol=1e-6)


def _rope_store_reference(q, k, v, rope, slots, norms, pool_shape, dtype):
    """q normalized (with `norms`) and rotated, and the pool holding k so and v, in torch."""
    from model_service.kernels.fused import apply_rotary_reference, rms_norm_reference

    if norms is not None:
        q, k = (
            rms_norm_reference(q, norms.q_weight, norms.eps),
            rms_norm_reference(k, norms.k_weight, norms.eps),
        )
    q, k = apply_rotary_reference(q, *rope), apply_rotary_reference(k, *rope)
    caches = [torch.full(pool_shape, 7.0, dtype=dtype, device=q.device) for _ in range(2)]
    store_kv_reference(k, v, *caches, slots)
    return q, caches


@interpreter
@pytest.mark.parametrize("norm", [False, True])
def test_rope_store_kernel_matches_torch_under_the_interpreter(norm, monkeypatch):
    """The RoPE / K-V store kernel on the CPU (the device check bypassed), float32: q rotated in
    place, k rotated and v copied into their slots (padding rows skipped), with Qwen3's head
    norms applied first when given."""
    from model_service.kernels import fused

    monkeypatch.setattr(fused, "_on_gpu", lambda x: True)
    tokens, heads, kv_heads, dim = 5, 4, 2, 32
    q, k, wq, wk = _qk_views(tokens, heads, kv_heads, dim, "cpu", torch.float32)
    v = torch.randn(tokens, kv_heads, dim)
    rope = tuple(torch.randn(tokens, dim, generator=torch.Generator().manual_seed(s)) for s in range(2))
    slots = torch.tensor([3, -1, 0, 9, 4])
    norms = HeadNorms(wq, wk, 1e-6) if norm else None
    want_q, want_pool = _rope_store_reference(q, k, v, rope, slots, norms, (10, kv_heads, dim), torch.float32)
    pool = [torch.full((10, kv_heads, dim), 7.0) for _ in range(2)]
    got_q = fused.rotary_store_kv(q, k, v, rope, *pool, slots, norms)
    torch.testing.assert_close(got_q, want_q, rtol=1e-6, atol=1e-6)
    for got, want in zip(pool, want_pool, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@interpreter
def test_rope_kernel_rotates_strided_heads_in_place_under_the_interpreter(monkeypatch):
    """`apply_rotary`'s kernel on the CPU (the device check bypassed), float32, on q and k as views
    of one projection's rows (their token and head strides): each rotated in place as the
    reference rotates it."""
    from model_service.kernels import fused

    monkeypatch.setattr(fused, "_on_gpu", lambda x: True)
    q, k, _, _ = _qk_views(5, 4, 2, 32, "cpu", torch.float32)
    cos, sin = (torch.randn(5, 32, generator=torch.Generator().manual_seed(s)) for s in range(2))
    want = [fused.apply_rotary_reference(x, cos, sin) for x in (q, k)]
    got = [fused.apply_rotary(x, cos, sin) for x in (q, k)]
    for x, g, w in zip((q, k), got, want, strict=True):
        assert g is x
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_head_rms_norm_matches_two_rms_norms(tokens, dtype):
    """Qwen3-30B-A3B's heads (32 query, 4 key, 128 wide) read where the projection left them: the
    reference's values, and the bits of the row kernel (`rms_norm`) that ran each norm before."""
    from model_service.kernels.fused import head_rms_norm, rms_norm, rms_norm_reference

    q, k, wq, wk = _qk_views(tokens, 32, 4, 128, "cuda", dtype)
    got_q, got_k = head_rms_norm(q, k, HeadNorms(wq, wk, 1e-6))
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert _rel(got_q, rms_norm_reference(q, wq, 1e-6)) < tol
    assert _rel(got_k, rms_norm_reference(k, wk, 1e-6)) < tol
    assert got_q.is_contiguous() and got_k.is_contiguous()
    assert torch.equal(got_q.view(-1, 128), rms_norm(q.reshape(-1, 128), wq, 1e-6)[0])
    assert torch.equal(got_k.view(-1, 128), rms_norm(k.reshape(-1, 128), wk, 1e-6)[0])


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [False, True])
def test_triton_rotary_store_kv_matches_rope_then_store(dtype, norm):
    """q, k and v as the fused qkv projection leaves them (strided views); the fused kernel
    rotates q in place and writes rotated k and v to their slots, skipping padding rows, with
    Qwen3's head norms applied first when given."""
    from model_service.kernels.fused import apply_rotary_reference, rms_norm_reference, rotary_store_kv

    heads, kv_heads, dim, tokens = 8, 2, 64, 29
    g = torch.Generator(device="cuda").manual_seed(3)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g, device="cuda").to(dtype)
    q, k, v = qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
    q, k, v = (t.reshape(tokens, -1, dim) for t in (q, k, v))
    cos, sin = (torch.randn(tokens, dim, generator=g, device="cuda").to(dtype) for _ in range(2))
    slots = torch.randperm(100, device="cuda")[:tokens]
    slots[::5] = -1
    wq, wk = (torch.rand(dim, generator=g, device="cuda").to(dtype) + 0.5 for _ in range(2))
    norms = HeadNorms(wq, wk, 1e-6) if norm else None
    nq, nk = (rms_norm_reference(q, wq, 1e-6), rms_norm_reference(k, wk, 1e-6)) if norm else (q, k)
    want_q, want_k = apply_rotary_reference(nq, cos, sin), apply_rotary_reference(nk, cos, sin)
    caches = [torch.full((100, kv_heads, dim), 7.0, device="cuda", dtype=dtype) for _ in range(4)]
    store_kv_reference(want_k, v, caches[2], caches[3], slots)
    got_q = rotary_store_kv(q, k, v, (cos, sin), caches[0], caches[1], slots, norms)
    assert got_q.data_ptr() == q.data_ptr()  # in place
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # the kernel rounds once, torch after each op
    assert _rel(got_q, want_q) < tol and _rel(caches[0], caches[2]) < tol
    assert torch.equal(caches[1], caches[3])


def _rope_decode_step(
    device: str, dtype: torch.dtype, cache_dtype: torch.dtype, heads: int, kv_heads: int, dim: int, seed: int
):  # fmt: skip
    """A decode step as the qkv projection leaves it (q, k, v strided views of one output), its
    RoPE tables, a pool of random K/V, and a last row of padding (length 0, slot -1)."""
    _, k_cache, v_cache, table, lens = _decode_case(5, heads, kv_heads, dim, 16, "cpu", torch.float32, seed)
    lens[-1] = 0
    pos = (lens - 1).clamp(min=0)
    slots = torch.where(lens > 0, table[torch.arange(5), pos // 16] * 16 + pos % 16, -1)
    g = torch.Generator().manual_seed(seed)
    spread = 200.0 if cache_dtype == FP8 else 1.0  # FP8: some of the step's K/V saturate at 448
    q, k, v = torch.randn(5, (heads + 2 * kv_heads) * dim, generator=g).split(
        (heads * dim, kv_heads * dim, kv_heads * dim), dim=-1
    )
    qkv = torch.cat((q / spread, k * spread, v * spread), dim=-1).to(device, dtype)  # scores stay O(1)
    q, k, v = (t.reshape(5, -1, dim) for t in qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), -1))
    cos, sin = (torch.randn(5, dim, generator=g).to(device, dtype) for _ in range(2))
    pool = [c.to(device, cache_dtype) for c in (k_cache, v_cache)]
    return (q, k, v, (cos, sin)), pool, table.to(device), lens.to(device), slots.to(device)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype, cache", [(torch.float32,) * 2, (torch.bfloat16,) * 2, (torch.bfloat16, FP8)])
@pytest.mark.parametrize("shape", [(8, 2, 64), (9, 3, 64), (32, 8, 128)])  # (9, 3, 64): SmolLM2
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("splits", [1, 4, 16])
def test_triton_decode_attention_with_rope_matches_rope_then_attention(dtype, cache, shape, window, splits):
    """The decode kernel that rotates q and k itself and writes the step's K/V (the split that
    owns the new position, which attends to it from registers): the same output and pool as RoPE,
    the store and attention run apart on the CPU, padding row and its slot untouched."""
    from model_service.kernels.fused import apply_rotary_reference, rotary_decode_attention

    dim = shape[2]
    for seed in range(2):
        (q, k, v, rope), pool, table, lens, slots = _rope_decode_step("cuda", dtype, cache, *shape, seed)
        want_pool = [c.cpu() for c in pool]
        cpu_rope = [t.cpu() for t in rope]
        rotated = [apply_rotary_reference(t.cpu(), *cpu_rope) for t in (q, k)]
        store_kv_reference(rotated[1], v.cpu(), *want_pool, slots.cpu())
        args = (table.cpu(), lens.cpu(), 16, dim**-0.5, window)
        want = paged_decode_attention_reference(rotated[0], *want_pool, *args)
        got = rotary_decode_attention(
            q, k, v, rope, *pool, slots, block_table=table, seq_lens=lens, block_size=16,
            scale=dim**-0.5, window=window, num_splits=splits,
        )  # fmt: skip
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert torch.isfinite(got).all() and got[-1].abs().max() == 0
        assert _rel(got.cpu(), want) < tol
        for got_pool, want_c in zip(pool, want_pool, strict=True):  # whole pools: a stray write shows
            assert _rel(got_pool.cpu(), want_c) < tol


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 16])
def test_triton_decode_attention_with_head_norms_matches_the_norm_kernel_first(dtype, splits):
    """Qwen3-30B-A3B's heads (32 query, 4 key, 128 wide): the decode kernel normalizing q and k
    where it rotates them against `head_rms_norm` first and the kernel without norms."""
    from model_service.kernels.fused import head_rms_norm, rotary_decode_attention

    (q, k, v, rope), pool, table, lens, slots = _rope_decode_step("cuda", dtype, dtype, 32, 4, 128, 0)
    wq, wk = (
        torch.rand(128, generator=torch.Generator().manual_seed(s)).to("cuda", dtype) + 0.5 for s in range(2)
    )
    norms = HeadNorms(wq, wk, 1e-6)
    attention = {
        "block_table": table,
        "seq_lens": lens,
        "block_size": 16,
        "scale": 128**-0.5,
        "num_splits": splits,
    }
    pools = [[c.clone() for c in pool] for _ in range(2)]
    got = rotary_decode_attention(q, k, v, rope, *pools[0], slots, norms, **attention)
    want = rotary_decode_attention(*head_rms_norm(q, k, norms), v, rope, *pools[1], slots, **attention)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert _rel(got, want) < tol and got[-1].abs().max() == 0
    for got_c, want_c in zip(*pools, strict=True):
        assert _rel(got_c, want_c) < tol


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[cuda, pytest.mark.gpu])])
@pytest.mark.parametrize("norm", [False, True])
def test_a_decode_step_with_rope_through_the_backend_rotates_writes_and_attends(device, norm):
    """The backend's decode step with RoPE (the kernel's own rotation and store on CUDA, RoPE and
    the store before attention elsewhere), and with Qwen3's head norms before it, against the
    reference backend on the same pool."""
    dtype = torch.float32
    kv_heads, dim = 2, 64
    (q, k, v, rope), pool, table, lens, slots = _rope_decode_step(device, dtype, dtype, 8, kv_heads, dim, 1)
    weights = (torch.rand(dim, generator=torch.Generator().manual_seed(s)).to(device) + 0.5 for s in range(2))
    norms = HeadNorms(*weights, 1e-6) if norm else None
    items = []
    for i, n in enumerate(lens.tolist()[:-1]):  # the padding row is the kernel test's
        state = SequenceState(seq_id=i, block_table=table[i].tolist()[: -(-n // 16)], num_computed=n - 1)
        items.append(StepItem(state, [0], 1))
    batch = BatchBuilder(16, torch.device(device)).build(items)
    assert torch.equal(batch.slot_mapping, slots[:-1])
    outputs, pools = [], []
    for backend_type in (TritonBackend, TorchReferenceBackend):
        cache = KVCache(attention_layers([None]), pool[0].shape[0] // 16, 16, kv_heads, dim, dtype, q.device)
        cache.data[0, 0], cache.data[0, 1] = pool
        backend = backend_type(cache, [None], dim)
        backend.prepare(batch)
        rows = [t[:-1] for t in (q, k, v)]
        outputs.append(backend.forward(0, *rows, tuple(t[:-1] for t in rope), norms))
        pools.append(cache.data[0].clone())
    assert _rel(outputs[0], outputs[1]) < 1e-5
    assert _rel(pools[0], pools[1]) < 1e-6


MIXED = [(37, 1), (90, 70), (130, 130)]  # (context length after the step, query rows)


def _mixed_case(
    device: str, dtype: torch.dtype, seed: int, heads: int = 4, kv_heads: int = 2, dim: int = 16,
    shapes: list[tuple[int, int]] = MIXED,
):  # fmt: skip
    """A step of the given sequences (by default a decode row, a mid-prompt chunk and a whole
    prompt) over a pool of random K/V."""
    bs = 4
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-n // bs) for n, _ in shapes]
    perm = torch.randperm(sum(blocks) + 2, generator=g).tolist()
    items, at = [], 0
    for i, ((n, q_rows), nb) in enumerate(zip(shapes, blocks, strict=True)):
        state = SequenceState(seq_id=i, block_table=perm[at : at + nb], num_computed=n - q_rows)
        items.append(StepItem(state, [0] * q_rows, 1))
        at += nb
    batch = BatchBuilder(bs, torch.device(device)).build(items)
    slots = len(perm) * bs
    k_cache = torch.randn(slots, kv_heads, dim, generator=g).to(device, dtype)
    v_cache = torch.randn(slots, kv_heads, dim, generator=g).to(device, dtype)
    q = torch.randn(batch.num_tokens, heads, dim, generator=g).to(device, dtype)
    return batch, q, k_cache, v_cache, bs


@pytest.mark.parametrize("window", [None, 50])
def test_prefill_reference_matches_the_reference_backend(window):
    batch, q, k_cache, v_cache, bs = _mixed_case("cpu", torch.float32, 0)
    dim, kv_heads = q.shape[2], k_cache.shape[1]
    want = paged_prefill_attention_reference(
        q, k_cache, v_cache, batch.block_table, batch.query_start, batch.seq_lens, bs, dim**-0.5, window
    )
    cache = KVCache(
        attention_layers([window]),
        k_cache.shape[0] // bs,
        bs,
        kv_heads,
        dim,
        torch.float32,
        torch.device("cpu"),
    )
    cache.data[0, 0], cache.data[0, 1] = k_cache, v_cache
    backend = TorchReferenceBackend(cache, [window], dim)
    backend.prepare(batch)
    got = backend.forward(0, q, k_cache[batch.slot_mapping], v_cache[batch.slot_mapping])
    assert _rel(got, want) < 1e-5


# Decode rows first (the scheduler's order), a chunk, a one-token run after it, a whole prompt.
LEADING_DECODE = [(37, 1), (200, 1), (5, 1), (90, 70), (64, 1), (130, 130)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[cuda, pytest.mark.gpu])])
@pytest.mark.parametrize("window", [None, 50])
def test_mixed_step_splits_leading_decode_rows_to_the_decode_kernel(device, window):
    """A mixed step's leading one-token sequences go to the decode kernel, the rest to the prefill
    kernel's tiles, into one output; both halves must land, in the right rows."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    batch, q, k_cache, v_cache, bs = _mixed_case(device, dtype, 3, 8, 2, 64, LEADING_DECODE)
    args = (batch.block_table, batch.query_start, batch.seq_lens, bs, 64**-0.5, window)
    want = paged_prefill_attention_reference(q, k_cache, v_cache, *args)
    layers, blocks = attention_layers([window]), k_cache.shape[0] // bs
    cache = KVCache(layers, blocks, bs, 2, 64, dtype, torch.device(device))
    backend = TritonBackend(cache, [window], 64)
    backend.prepare(batch)
    assert backend.num_decode == 3
    k, v = k_cache[batch.slot_mapping], v_cache[batch.slot_mapping]  # rewrites the pool's own values
    cache.data[0, 0], cache.data[0, 1] = k_cache, v_cache
    got = backend.forward(0, q, k, v)
    assert torch.isfinite(got).all()
    assert _rel(got, want) < (1e-5 if dtype == torch.float32 else 1e-2)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 50])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads_dim", [(4, 2, 16), (32, 8, 128), (9, 3, 64)])
def test_triton_prefill_attention_matches_reference(window, dtype, heads_dim):
    from model_service.kernels.prefill_attention import paged_prefill_attention, prefill_tiles

    for seed in range(2):
        batch, q, k_cache, v_cache, bs = _mixed_case("cuda", dtype, seed, *heads_dim)
        args = (
            q,
            k_cache,
            v_cache,
            batch.block_table,
            batch.query_start,
            batch.seq_lens,
            bs,
            heads_dim[2] ** -0.5,
        )
        want = paged_prefill_attention_reference(*args, window)
        seqs, rows = prefill_tiles(batch.host_query_start)
        tiles = (torch.from_numpy(seqs).cuda(), torch.from_numpy(rows).cuda())
        got = paged_prefill_attention(*args, window, tiles)
        assert torch.isfinite(got).all()
        assert _rel(got, want) < (1e-5 if dtype == torch.float32 else 1e-2)


CUTS = [
    {"top_p": 0.7},
    {"top_k": 3},
    {"min_p": 0.2},
    {"top_k": 4, "min_p": 0.3},
    {"top_p": 0.8, "min_p": 0.1},
]


def _truncated(logits: torch.Tensor, temp: float, cut: dict) -> torch.Tensor:
    """The truncated distribution as the sorting sampler builds it."""
    return filtered_probs(logits[None], [SamplingParams(temperature=temp, **cut)])[0]


def _cut_tensors(n: int, vocab: int, device: str, cut: dict) -> tuple[torch.Tensor, ...]:
    """(top_p, top_k, min_p) per row as `truncated_sample` takes them."""
    top_k = cut.get("top_k", 0) or vocab
    return (
        torch.full((n,), cut.get("top_p", 1.0), device=device),
        torch.full((n,), top_k, dtype=torch.int32, device=device),
        torch.full((n,), cut.get("min_p", 0.0), device=device),
    )


def _softmax_frequencies(draws: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(draws.cpu(), minlength=vocab).float() / len(draws)


def test_gumbel_max_reference_draws_from_the_tempered_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -30.0])
    temps = torch.full((40_000,), 0.8)
    draws = gumbel_max_reference(logits.expand(40_000, -1), temps, torch.rand(40_000, 6).clamp_min(1e-12))
    assert (_softmax_frequencies(draws, 6) - (logits / 0.8).softmax(0)).abs().max() < 0.01


def _sampling_case(device: str, rows: int, vocab: int, spread: float, temps: tuple[float, float]):
    """Random logits [rows, vocab] times `spread`, temperatures uniform in [temps), Philox seeds."""
    g = torch.Generator(device=device).manual_seed(rows + vocab)
    logits = torch.randn(rows, vocab, device=device, generator=g) * spread
    low, high = temps
    temps = torch.rand(rows, device=device, generator=g) * (high - low) + low
    return logits, temps, torch.randint(1 << 62, (rows,), device=device, generator=g)


def _check_gumbel_max(device: str, rows: int, vocab: int) -> None:
    logits, temps, seeds = _sampling_case(device, rows, vocab, 3, (0.3, 2.0))
    want = gumbel_max_reference(logits, temps, philox_uniforms(seeds, vocab))
    assert torch.equal(gumbel_max(logits, temps, seeds), want)
    assert torch.equal(gumbel_max(logits, temps, seeds), want)  # a seed's draw repeats


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("rows, vocab", [(1, 128_256), (5, 1000), (64, 50), (64, 49_152)])
def test_triton_gumbel_max_matches_reference_on_the_same_uniforms(rows, vocab):
    _check_gumbel_max("cuda", rows, vocab)


@interpreter
@pytest.mark.parametrize("rows, vocab", [(1, 9000), (6, 50)])  # 9,000: three chunks, the last ragged
def test_gumbel_max_kernel_matches_reference_on_the_same_uniforms_under_the_interpreter(rows, vocab):
    _check_gumbel_max("cpu", rows, vocab)


@interpreter
def test_the_uniforms_are_philox_4x32_10_streams_laid_out_in_rounds_under_the_interpreter():
    """What every sampling kernel draws (`tl.rand`), read back by `philox_uniforms`: at seed 0,
    column 0, Random123's known answer for Philox4x32-10 at key 0 and counter 0 (0x6627e8d5, as
    Triton maps an int32 to [0, 1)); round r of a row at columns r * vocab + c of its seed's
    stream; the seed's high word in the key; values spread evenly over (0, 1)."""
    seeds = torch.tensor([0, 1, 1 << 40])
    rounds = philox_uniforms(seeds, 700, 3)
    stream = philox_uniforms(seeds, 2100)
    assert rounds.shape == (3, 3, 700) and torch.equal(rounds.flatten(1), stream)
    assert stream[0, 0] == torch.tensor(0x6627E8D5, dtype=torch.float32) * 4.6566127342e-10
    assert not torch.equal(stream[0], stream[2])  # seeds 0 and 1 << 40 share their low word
    assert ((stream > 0) & (stream < 1)).all()
    counts = torch.histc(stream, bins=10, min=0, max=1)  # 630 expected in each, sd ~24
    assert (counts - 630).abs().max() < 120


@cuda
@pytest.mark.gpu
def test_triton_gumbel_max_draws_from_the_tempered_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -30.0], device="cuda")
    seeds = torch.randint(1 << 62, (40_000,), device="cuda")
    draws = gumbel_max(logits.expand(40_000, -1), torch.full((40_000,), 0.8, device="cuda"), seeds)
    assert (_softmax_frequencies(draws, 6) - (logits / 0.8).softmax(0).cpu()).abs().max() < 0.01


@pytest.mark.parametrize("cut", CUTS)
def test_truncated_reference_draws_from_what_the_sorting_sampler_keeps(cut):
    logits = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.5, 0.0, -1.0, -2.0])
    n = 6000
    u = torch.rand(n, 8, 8).clamp_min(1e-12)
    temps = torch.full((n,), 0.9)
    draws = truncated_sample_reference(logits.expand(n, -1), temps, _cut_tensors(n, 8, "cpu", cut), u)
    want = _truncated(logits, 0.9, cut)
    assert set(draws.tolist()) == set(want.nonzero().flatten().tolist())
    assert (_softmax_frequencies(draws, 8) - want).abs().max() < 0.025


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize(
    "rows, vocab, cut",
    [
        (1, 128_256, {"top_p": 0.95}),
        (6, 1000, {"top_p": 0.5}),
        (64, 50, {"top_p": 0.9}),
        (3, 4097, {"top_p": 0.05}),
        (5, 32_000, {"top_k": 40}),
        (7, 128_256, {"min_p": 0.05}),
        (4, 2048, {"top_k": 1}),
        (9, 5000, {"top_p": 0.9, "min_p": 0.02, "top_k": 5000}),
    ],
)
def test_triton_truncated_sample_matches_reference_on_the_same_uniforms(rows, vocab, cut):
    _check_truncated_sample("cuda", rows, vocab, cut)


@interpreter
@pytest.mark.parametrize(
    "rows, vocab, cut",
    [
        (4, 300, {"top_p": 0.5}),
        (4, 300, {"top_k": 50}),
        (4, 300, {"min_p": 0.3}),
        (4, 300, {"top_p": 0.8, "min_p": 0.1}),
        (1, 9000, {"top_p": 0.3, "min_p": 0.3, "top_k": 5000}),  # two row blocks of 8,192, the last ragged
    ],
)
def test_truncated_kernel_matches_reference_on_the_same_uniforms_under_the_interpreter(rows, vocab, cut):
    """Flatter logits than on CUDA: with few rows, rejected candidates (and so the later rounds'
    uniforms, floors and pivots) must still decide some draws, among many eligible tokens."""
    _check_truncated_sample("cpu", rows, vocab, cut, spread=1)


def _check_truncated_sample(device: str, rows: int, vocab: int, cut: dict, spread: float = 4) -> None:
    logits, temps, seeds = _sampling_case(device, rows, vocab, spread, (0.5, 1.5))
    cuts = _cut_tensors(rows, vocab, device, cut)
    want = truncated_sample_reference(logits, temps, cuts, philox_uniforms(seeds, vocab, MAX_ROUNDS))
    assert torch.equal(truncated_sample(logits, temps, cuts, seeds), want)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("cut", CUTS)
def test_triton_truncated_sample_draws_from_what_the_sorting_sampler_keeps(cut):
    logits = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.5, 0.0, -1.0, -2.0], device="cuda")
    n = 40_000
    seeds = torch.randint(1 << 62, (n,), device="cuda")
    temps = torch.full((n,), 0.9, device="cuda")
    draws = truncated_sample(logits.expand(n, -1), temps, _cut_tensors(n, 8, "cuda", cut), seeds)
    assert (_softmax_frequencies(draws, 8) - _truncated(logits.cpu(), 0.9, cut)).abs().max() < 0.01


@cuda
@pytest.mark.gpu
def test_triton_stores_into_an_fp8_cache_round_and_saturate_as_the_reference():
    """The plain and the RoPE-fused K/V stores into an FP8 pool: e4m3 rounding, +-448 saturation
    (~2% of these values are beyond it), padding rows untouched. References on the CPU."""
    from model_service.kernels.fused import apply_rotary_reference, rotary_store_kv
    from model_service.kernels.paged_attention import FP8

    heads, kv_heads, dim, tokens = 8, 2, 64, 29
    g = torch.Generator(device="cuda").manual_seed(5)
    qkv = 200 * torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g, device="cuda")
    q, k, v = qkv.bfloat16().split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
    q, k, v = (t.reshape(tokens, -1, dim) for t in (q, k, v))
    cos, sin = (torch.randn(tokens, dim, generator=g, device="cuda").bfloat16() for _ in range(2))
    slots = torch.randperm(100, device="cuda")[:tokens]
    slots[::5] = -1
    got = [torch.zeros(100, kv_heads, dim, device="cuda", dtype=FP8) for _ in range(4)]
    store_kv(k.contiguous(), v.contiguous(), got[0], got[1], slots)
    rotary_store_kv(q.clone(), k, v, (cos, sin), got[2], got[3], slots)
    want = [torch.zeros(100, kv_heads, dim, dtype=FP8) for _ in range(4)]
    store_kv_reference(k.cpu(), v.cpu(), want[0], want[1], slots.cpu())
    rotated = apply_rotary_reference(k, cos, sin).cpu()
    store_kv_reference(rotated, v.cpu(), want[2], want[3], slots.cpu())
    for pool, expected in zip(got, want, strict=True):  # whole pools: a write to a padding slot shows
        assert torch.isfinite(pool.float()).all()
        assert _rel(pool.cpu(), expected) < 0.02  # an e4m3 step is 6-12%: a few values round the other way
    assert got[0].float().abs().max() == 448.0


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 50])
def test_triton_attention_over_an_fp8_cache_matches_the_reference(window):
    """Both attention kernels widen FP8 K/V to the query's dtype; references on the CPU over the
    same FP8 pool."""
    from model_service.kernels.paged_attention import FP8
    from model_service.kernels.prefill_attention import paged_prefill_attention, prefill_tiles

    q, k_cache, v_cache, table, lens = _decode_case(9, 8, 2, 64, 16, "cuda", torch.bfloat16, 7)
    k8, v8 = k_cache.to(FP8), v_cache.to(FP8)
    cpu = [t.cpu() for t in (q, k8, v8, table, lens)]
    want = paged_decode_attention_reference(*cpu, 16, 64**-0.5, window)
    for splits in (1, 4):
        got = paged_decode_attention(q, k8, v8, table, lens, 16, 64**-0.5, window, splits)
        assert _rel(got.cpu(), want) < 1e-2
    batch, q, k_cache, v_cache, bs = _mixed_case("cuda", torch.bfloat16, 1, 8, 2, 64, LEADING_DECODE)
    args = [q, k_cache.to(FP8), v_cache.to(FP8), batch.block_table, batch.query_start, batch.seq_lens]
    want = paged_prefill_attention_reference(*[t.cpu() for t in args], bs, 0.125, window)
    seqs, rows = prefill_tiles(batch.host_query_start)
    tiles = (torch.from_numpy(seqs).cuda(), torch.from_numpy(rows).cuda())
    got = paged_prefill_attention(*args, bs, 0.125, window, tiles)
    assert _rel(got.cpu(), want) < 1e-2


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[cuda, pytest.mark.gpu])])
def test_host_planned_arrays_reach_the_device_unchanged(device):
    """`to_device` (tile tables, grids): on CUDA through pinned memory without waiting, and the
    host array may be rewritten at once (the copy keeps the values it had); on the CPU a view."""
    from model_service.models.step import to_device

    host = np.arange(1000, dtype=np.int64).reshape(10, 100)
    moved = [to_device(host, torch.device(device)) for _ in range(3)]
    if device == "cuda":
        host[:] = -1
    for m in moved:
        assert m.device.type == device and m.dtype == torch.int64
        assert torch.equal(m.cpu(), torch.arange(1000).reshape(10, 100))


def test_token_ladder_of_piecewise_graphs():
    from model_service.engine.piecewise_graphs import token_ladder

    small = [16, 32, 48, 64, 80, 96, 112, 128, 192, 256, 320, 384, 448, 512]
    assert token_ladder(512) == small
    assert token_ladder(2048) == [*small, 768, 1024, 1536, 2048]
    assert token_ladder(1200) == [*small, 768, 1024, 1200]
    assert token_ladder(100_000)[-3:] == [3072, 3584, 4096]
    assert token_ladder(100) == [16, 32, 48, 64, 80, 96, 100]
    assert token_ladder(8) == [8]


def test_piece_tiles_leave_the_leading_decode_rows_to_the_per_row_kernels():
    """A LoRA bucket's step: decode rows first (per-row kernels), then every LoRA row after them
    as tiles, a 5-row run too (the eager plan would send a step of only short runs per row),
    base-model rows none."""
    from bench.lora_kernels import step_batch
    from model_service.engine.piecewise_graphs import piece_tiles

    batch = step_batch([0, 1, -1, 2, 1, -1], [1, 1, 1, 100, 5, 10], torch.device("cpu"))
    lead, tiles = piece_tiles(batch)
    assert lead == 3
    assert tiles.tolist() == [[3, 67, 2], [67, 103, 2], [103, 108, 1]]
    lead, tiles = piece_tiles(step_batch([3, 3], [7, 2], torch.device("cpu")))
    assert lead == 0 and tiles.tolist() == [[0, 9, 3]]  # a run of one adapter spans its sequences
