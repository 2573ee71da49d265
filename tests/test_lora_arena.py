"""The adapter arena: extents placed by bytes, eviction of idle adapters until one fits,
compaction, and the device copy kept in step with the pool's bookkeeping (CPU)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from model_service.kernels.lora import arena_views
from model_service.lora.adapter import LoraAdapter, LoraWeights
from model_service.lora.arena import ALIGN, ArenaSpace
from model_service.lora.layers import wrap_lora_layers
from model_service.lora.pool import LoraPool, SlotsBusyError
from model_service.models.config import ModelConfig
from model_service.models.layers import PackedLinear

IN, SIZES = 64, {"q_proj": 64, "k_proj": 32, "v_proj": 32}


def test_extents_go_first_fit_and_compaction_closes_the_gaps():
    space = ArenaSpace(10 * ALIGN)
    assert [space.place(s, 2 * ALIGN) for s in range(4)] == [0, 2 * ALIGN, 4 * ALIGN, 6 * ALIGN]
    assert space.place(9, 3 * ALIGN) is None  # 2 units left
    space.release(1)
    assert space.place(5, 2 * ALIGN + 1) is None and space.free == 4 * ALIGN  # 2 + 2 units, apart
    assert space.place(6, ALIGN) == 2 * ALIGN  # the first gap that holds it
    space.release(6)
    assert space.compaction() == [(2, 2 * ALIGN), (3, 4 * ALIGN)]
    assert space.place(5, 3 * ALIGN) == 6 * ALIGN and space.free == ALIGN


class RecordingWriter:
    def __init__(self) -> None:
        self.at: dict[int, int] = {}
        self.moves: list[tuple[int, int]] = []

    def load_slot(self, slot: int, adapter: LoraAdapter, offset: int) -> None:
        self.at[slot] = offset

    def clear_slot(self, slot: int) -> None:
        self.at.pop(slot)

    def move_slot(self, slot: int, offset: int) -> None:
        self.moves.append((slot, offset))
        self.at[slot] = offset


def _config() -> ModelConfig:
    """A base model whose layer 0 has the q/k/v shapes of `SIZES` (the pool parses nothing here)."""
    return ModelConfig(
        family="llama", vocab_size=32, hidden_size=IN, intermediate_size=128, num_layers=1, num_heads=4,
        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=64,
    )  # fmt: skip


def _adapter(name: str, rank: int, targets: tuple[str, ...], seed: int) -> LoraAdapter:
    g = torch.Generator().manual_seed(seed)
    modules = {
        (0, t): LoraWeights(torch.randn(rank, IN, generator=g), torch.randn(SIZES[t], rank, generator=g), 0.5)
        for t in targets
    }
    return LoraAdapter(name, seed + 1, None, modules)


def _pool(writer, elements: int, slots: int = 16) -> LoraPool:
    return LoraPool(_config(), slots, 10_000, 64, writer, (elements, 4))


def _offer(pool: LoraPool, adapter: LoraAdapter) -> None:
    pool.host[adapter.name] = adapter  # as if registered and parsed


def test_residency_is_set_by_bytes_and_only_idle_adapters_make_room():
    """A pool with 16 slots but memory for about three rank-8 q/v adapters: small ones all fit
    until memory runs out; a bigger one evicts the least recently used idle ones, never one in
    use; when only busy adapters hold the memory, the load waits (SlotsBusyError)."""
    small = [_adapter(f"s{i}", 8, ("q_proj", "v_proj"), i) for i in range(4)]
    big = _adapter("big", 8, ("q_proj", "k_proj", "v_proj"), 9)  # 1.4x a small one
    writer = RecordingWriter()
    pool = _pool(writer, 3 * small[0].numel + ALIGN)
    for a in [*small, big]:
        _offer(pool, a)
    slots = [pool.load(a.name)[0] for a in small[:3]]
    assert pool.memory_used_bytes == 3 * small[0].numel * 4 <= pool.memory_capacity_bytes
    held = pool.acquire(slots[0])  # s0 in use
    pool.load("s1")  # s1 more recently used than s2
    slot, evicted = pool.load("s3")
    assert evicted == ["s2"] and pool.slot_of("s2") is None
    slot, evicted = pool.load("big")
    assert set(evicted) == {"s1", "s3"} and pool.slot_of("s0") == held  # s0 kept: in use
    pool.acquire(slot)  # now every resident adapter is in use
    with pytest.raises(SlotsBusyError, match="held by adapters in use or pinned"):
        pool.load("s2")
    assert pool.slot_of("s2") is None and pool.slot_of("big") == slot  # a failed load evicts nothing busy


def test_an_adapter_larger_than_the_arena_is_refused_with_the_flag_to_raise():
    pool = _pool(RecordingWriter(), 100 * ALIGN)
    _offer(pool, _adapter("huge", 64, ("q_proj", "k_proj", "v_proj"), 1))
    with pytest.raises(Exception, match="--lora-memory-bytes"):
        pool.load("huge")


def test_random_loads_and_evictions_keep_every_resident_adapter_intact_in_the_arena():
    """Mixed ranks and targets through a real arena (one q/k/v projection), a few adapters'
    worth of memory, random loads, uses and evictions: after each operation every resident
    adapter reads back from the arena exactly as its host copy, and extents never overlap
    (loads into gaps and compactions move the bytes and the tables together)."""
    base = PackedLinear(IN, SIZES, bias=False)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].self_attn = torch.nn.Module()
    model.layers[0].self_attn.qkv_proj = base
    elements = 40 * IN * 8
    lora = wrap_lora_layers(model, 12, 32, elements, use_kernels=False)
    pool = _pool(lora, elements, slots=12)
    rng = random.Random(0)
    targets = [("q_proj",), ("q_proj", "v_proj"), ("q_proj", "k_proj", "v_proj"), ("k_proj",)]
    names = []
    for i in range(30):
        a = _adapter(f"a{i}", rng.choice([1, 4, 8, 16, 32]), rng.choice(targets), i)
        _offer(pool, a)
        names.append(a.name)
    held: list[int] = []
    layer = model.layers[0].self_attn.qkv_proj
    for _ in range(300):
        op = rng.random()
        if op < 0.6:
            try:
                slot, _ = pool.load(rng.choice(names))
            except SlotsBusyError:
                continue
            if rng.random() < 0.3:
                held.append(pool.acquire(slot))
        elif op < 0.8 and held:
            pool.release(held.pop(rng.randrange(len(held))))
        else:
            resident = [s.adapter.name for s in pool.slots if s.adapter is not None]
            victim = rng.choice(resident) if resident else None
            if victim is not None and not pool._busy(pool.slot_of(victim)):
                pool.evict(victim)
        spans = sorted(lora.extents.values())
        assert all(a[0] + a[1] <= b[0] for a, b in itertools.pairwise(spans))
        for slot, s in enumerate(pool.slots):
            if s.adapter is None:
                assert not lora.host_entries[slot].any()
                continue
            for (_, module), w in s.adapter.modules.items():
                part = list(SIZES).index(module)
                a, b = arena_views(lora.weights, layer.host_entries[slot, part], IN, SIZES[module])
                assert torch.equal(a, w.a) and torch.equal(b, w.b)


@pytest.mark.parametrize("distance", ["beyond", "within", "short"])
def test_a_move_within_the_adapters_own_range_keeps_its_bytes(monkeypatch, distance):
    """Compaction moves an adapter towards the start, possibly onto part of its own range:
    direct chunk copies no longer than the distance, or (a short distance over a long adapter)
    a temporary; either way the adapter reads back as its host copy at its new place."""
    from model_service.lora import layers

    monkeypatch.setattr(layers, "_MOVE_CHUNK", 2048)  # several chunks even for a small adapter
    base = PackedLinear(IN, SIZES, bias=False)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].self_attn = torch.nn.Module()
    model.layers[0].self_attn.qkv_proj = base
    lora = wrap_lora_layers(model, 2, 32, 40 * IN * 8, use_kernels=False)
    adapter = _adapter("a", 16, tuple(SIZES), 0)
    shift = {"beyond": adapter.numel + ALIGN, "within": adapter.numel // 4, "short": ALIGN}[distance]
    lora.weights.fill_(float("nan"))
    lora.load_slot(0, adapter, shift)
    lora.move_slot(0, 0)
    layer = model.layers[0].self_attn.qkv_proj
    for (_, module), w in adapter.modules.items():
        a, b = arena_views(lora.weights, layer.host_entries[0, list(SIZES).index(module)], IN, SIZES[module])
        assert torch.equal(a, w.a) and torch.equal(b, w.b)
