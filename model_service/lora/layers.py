"""LoRA as layer wrappers over the model's fused projections, reading one adapter arena.

`wrap_lora_layers` replaces each `PackedLinear` of a model (q/k/v fused, o, gate/up fused,
down) by a `LoraLinear`. Every resident adapter's weights live in one flat device tensor, the
arena, at the adapter's own rank and only for the modules it targets: an adapter takes its
bytes, not a padded `[max_rank, in]` slot per projection (a rank-8 q/v adapter of the 8B shape
is 6.8 MB; a padded slot was 335 MB). The pool (lora/pool.py) decides where in the arena an
adapter goes; `LoraLayers` copies it there and writes its row of the model-wide tables: for each
projection and part, where A and B start and their rank (0 = not targeted). The arena and the
tables never move, so a CUDA graph or a batched kernel can read any adapter of any layer, and a
request's rows pick their adapter by the per-token slot index (its table row) of the step batch.

On CUDA the delta is two Triton launches per projection for all rows of all adapters
(kernels/lora.py), graph-capturable.
Steps with long runs of one adapter (prefill chunks) take the row-tile kernels instead
(kernels/lora_grouped.py), which read each adapter's weights once per tile, not once per row.
The torch path below loops over the slots present in the step (SGMV's segments), each at its
exact rank. The models know nothing of LoRA: wrapping happens once, at load, by module type.
"""

from __future__ import annotations

import contextlib
import itertools
import re
from collections.abc import Iterable, Iterator

import numpy as np
import torch
from torch import nn

from model_service.kernels.fp8_gemm import ActivationQuant, QuantizedRows, plain
from model_service.kernels.fused import silu_and_mul
from model_service.kernels.lora import (
    AdapterTable,
    arena_views,
    few_rows_split,
    lora_expand,
    lora_shrink,
    shrink_arrivals,
    silu_mul_lora_rows,
)
from model_service.kernels.lora_grouped import lora_expand_tiles, lora_shrink_tiles, lora_tiles
from model_service.lora.adapter import LoraAdapter, in_buffer, laid_out
from model_service.models.layers import PackedLinear
from model_service.models.step import StepBatch, to_device

# A decoder layer's own projections (`layers.3.self_attn.qkv_proj`), not those nested deeper (an
# MoE layer's shared expert), which PEFT adapters cannot name.
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.\w+(?:\.inner)?$")  # .inner: RowParallel

# A compaction copies an adapter in chunks of at most this many elements (a whole-adapter
# temporary could need hundreds of MB at once), and at most `_MAX_MOVE_COPIES` chunks without one.
_MOVE_CHUNK = 1 << 24
_MAX_MOVE_COPIES = 16


class LoraStepPlan:
    """Which rows each slot serves this step; shared by every `LoraLinear` of a model. With
    kernels, the per-token slots on the device (`slots`, a static buffer under CUDA graphs) and,
    on steps with long runs of one adapter (prefill chunks), those runs cut into row tiles
    (`tiles`); without kernels, the rows of each slot present (`segments`, planned on the host)."""

    # A prefill chunk of this many rows with an adapter makes the step take the tile kernels:
    # below it the per-row kernels, tuned for decode, read the weights about as often.
    TILE_MIN_RUN = 16

    def __init__(self, use_kernels: bool) -> None:
        self.use_kernels = use_kernels
        self.enabled = False  # some row of this step uses an adapter
        # Which kinds of projection (q/k/v, o, gate/up, down: a bit each) some row's adapter
        # targets; the others run no LoRA kernel at all, so PEFT's default q/v adapters cost o,
        # gate_up and down nothing (8B shape, 64 rows: 57 -> ~13 us of LoRA a layer).
        self.kinds = 0
        self.all_kinds = 0
        self.slot_kinds: np.ndarray | None = None  # per slot, its adapter's kinds (`LoraLayers`)
        self.slots = torch.empty(0, dtype=torch.long)
        self.tiles: torch.Tensor | None = None
        self.lead = 0  # with tiles: the step's leading decode rows, which the per-row kernels serve
        self.static = False  # a piecewise graph's: both kinds of kernels over fixed buffers (`for_pieces`)
        self.segments: list[tuple[int, torch.Tensor]] = []
        self.arrivals: torch.Tensor | None = None  # the split shrinks' counters (`_arrivals`)

    def kinds_of(self, host_slots: np.ndarray) -> int:
        """The kinds of projection the adapters of these rows target (0: no adapter row)."""
        used = np.unique(host_slots[host_slots >= 0])
        if not used.size:
            return 0
        if self.slot_kinds is None:  # a plan no model's layers own (kernel benchmarks): all of them
            return -1
        return int(np.bitwise_or.reduce(self.slot_kinds[used]))

    def for_capture(self, slots: torch.Tensor, kinds: int) -> None:
        """A CUDA graph reads the rows' slots from a static buffer, with the per-row kernels of
        the projections `kinds` names (a graph is captured for each set a step needs)."""
        self.enabled, self.kinds, self.slots, self.tiles, self.static = kinds != 0, kinds, slots, None, False

    def for_pieces(self, slots: torch.Tensor, tiles: torch.Tensor) -> None:
        """A piecewise graph cannot know which rows a step's tiles take, so it records both
        kinds of kernels over static buffers: the per-row kernels over the bucket's first
        `len(slots)` rows (the leading decode rows' slots, -1 after them) and the tile kernels
        over a fixed number of tiles (`tiles`, unused ones empty) for every other LoRA row. The
        step fills both (`engine/piecewise_graphs.py`)."""
        self.enabled, self.kinds, self.static = True, self.all_kinds, True
        self.slots, self.tiles = slots, tiles

    def prepare(self, batch: StepBatch) -> None:
        self.enabled, self.static = batch.uses_lora, False
        self.kinds = self.kinds_of(batch.host_lora_slots) if self.enabled else 0
        if self.use_kernels:
            self.slots = batch.lora_slots
            self.lead = batch.num_leading_decodes if batch.max_query_len > 1 else 0
            self.tiles = self._tiles(batch) if self.enabled else None
            return
        slots = batch.host_lora_slots
        device = batch.input_ids.device
        self.segments = [
            (int(slot), torch.from_numpy(np.flatnonzero(slots == slot)).to(device))
            for slot in np.unique(slots[slots >= 0])
        ]

    def _tiles(self, batch: StepBatch) -> torch.Tensor | None:
        """Row tiles for the rows after `lead` on a step with a long prefill chunk through an
        adapter, else None. The leading decode rows keep the per-row kernels: as tiles, each of
        another adapter was a 64-row tile with one live row (8B shape, 64 decode rows of 64
        adapters beside a 2,048-token chunk: 404 -> 286 us of LoRA a layer, `bench/lora_kernels.py`).
        Decode rows of many sequences with one adapter form runs too, but decode steps keep the
        per-row kernels, tuned for them."""
        if batch.max_query_len < self.TILE_MIN_RUN:
            return None
        tiles = lora_tiles(batch.host_lora_slots[self.lead :])
        if tiles.size == 0 or int((tiles[:, 1] - tiles[:, 0]).max()) < self.TILE_MIN_RUN:
            return None  # TILE_MIN_RUN <= TILE_ROWS
        tiles[:, :2] += self.lead
        return to_device(tiles, batch.input_ids.device)

    def shrink(self, x: torch.Tensor, table: AdapterTable) -> torch.Tensor:
        arrivals = self._arrivals(x.device)
        if self.tiles is None:
            return lora_shrink(x, table, self.slots, arrivals)
        if self.static:  # the per-row rows are few (decode rows): split their input dimension
            rows, split = len(self.slots), max(2, few_rows_split(x.shape[1]))
            width = table.parts * table.max_rank
            xa = torch.zeros(x.shape[0], width, dtype=torch.float32, device=x.device)
            lora_shrink(x[:rows], table, self.slots, arrivals, out=xa[:rows], split_k=split)
            return lora_shrink_tiles(x, table, self.tiles, out=xa)  # zeroed: the tiles may add partial sums
        xa = lora_shrink_tiles(x, table, self.tiles)
        if self.lead:
            lora_shrink(x[: self.lead], table, self.slots[: self.lead], arrivals, out=xa[: self.lead])
        return xa

    def _arrivals(self, device: torch.device) -> torch.Tensor:
        """The split shrinks' counters, shared by every projection (one kernel at a time on the
        stream, each leaving them zeroed), made on first use."""
        if self.arrivals is None:
            self.arrivals = shrink_arrivals(device)
        return self.arrivals

    def expand(self, xa: torch.Tensor, y: torch.Tensor, table: AdapterTable, starts: tuple[int, ...]) -> None:
        if self.tiles is None:
            lora_expand(xa, y, table, self.slots, starts)
            return
        lora_expand_tiles(xa, y, table, self.tiles, starts)
        if self.static:
            rows = len(self.slots)
            lora_expand(xa[:rows], y[:rows], table, self.slots, starts)
        elif self.lead:
            d = self.lead
            lora_expand(xa[:d], y[:d], table, self.slots[:d], starts)


class LoraLinear(nn.Module):
    def __init__(
        self, base: PackedLinear, table: AdapterTable, host: tuple[np.ndarray, np.ndarray], plan: LoraStepPlan
    ) -> None:
        """`table`: this projection's view of the arena and the tables; `host`: the same tables'
        host copies (entries [slots, parts, 3], scaling [slots, parts]), which the torch path
        reads without a device sync."""
        super().__init__()
        self.base, self.table, self.plan = base, table, plan
        self.host_entries, self.host_scaling = host
        self.kind = 0  # its bit in `LoraStepPlan.kinds` (`LoraLayers.wrap`)
        bounds = np.cumsum((0, *base.output_sizes))
        self.starts = tuple(int(lo) for lo in bounds[:-1])  # each part's first output column
        self.columns = [(int(lo), int(hi)) for lo, hi in itertools.pairwise(bounds)]

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        """The base projection's output plus each row's adapter delta, taken from x in the compute
        dtype (an FP8 base may get x quantized by its producer: `input_quant`)."""
        if self.plan.use_kernels:
            return self._forward_kernels(x) if self._applies() else self.base(x)
        y, x = self.base(x), plain(x)
        for slot, rows in self.plan.segments:
            xs = None
            for part, (lo, hi) in enumerate(self.columns):
                ab = arena_views(self.table.weights, self.host_entries[slot, part], x.shape[1], hi - lo)
                if ab is None:
                    continue
                xs = x[rows] if xs is None else xs
                delta = (xs @ ab[0].T) @ ab[1].T
                y[:, lo:hi].index_add_(0, rows, delta, alpha=float(self.host_scaling[slot, part]))
        return y

    def input_quant(self, x: torch.Tensor) -> ActivationQuant | None:
        """The base projection's wish (`Fp8Linear.input_quant`): the delta reads the unquantized x."""
        return self.base.input_quant(x)

    def _forward_kernels(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        xa, y = self._shrink_and_base(x)
        self.plan.expand(xa, y, self.table, self.starts)
        return y

    def forward_silu_mul(
        self, x: torch.Tensor | QuantizedRows, quant: ActivationQuant | None = None
    ) -> torch.Tensor | QuantizedRows:
        """silu(gate) * up of this gate_up projection (SwiGLU's `MLP`). On decode steps and in
        decode graphs (the per-row kernels) each row's delta is added inside the activation
        (`silu_mul_lora_rows`): the expand's read and write of the 2I-wide output and a launch a
        layer are not paid (8B shape, 64 rows: 25.0 -> 19.7 us a layer). Steps with row tiles
        keep the expand: a fused kernel over tiles of every row measured slower in the serving
        run (single decode rows each took a whole tile; docs/performance-notes.md, session m).
        `quant` as `PackedLinear.forward_silu_mul`'s, honoured where the plain SiLU-mul runs."""
        plan = self.plan
        if not (plan.use_kernels and self._applies()) or plan.tiles is not None:
            return silu_and_mul(self(x), quant)
        assert self.columns == [(0, self.columns[0][1]), (self.columns[0][1], 2 * self.columns[0][1])]
        xa, y = self._shrink_and_base(x)
        return silu_mul_lora_rows(y, xa, self.table, plan.slots)

    def _applies(self) -> bool:
        """Whether this step's kernels run here: some row's adapter targets this kind of projection."""
        return self.plan.enabled and bool(self.plan.kinds & self.kind)

    def _shrink_and_base(self, x: torch.Tensor | QuantizedRows) -> tuple[torch.Tensor, torch.Tensor]:
        """The shrink, then the base GEMM, on one stream. A side stream for the shrink beside
        the GEMM won 79 -> 60 us a layer in a kernel benchmark, but lost in serving (8B shape,
        `bench/rotation.py`: one adapter 0.85 -> 0.91x, r8-qv 0.88 -> 0.92x, r16-all 0.68 ->
        0.72x without it): the GEMM holds every SM, so the shrink waited for it anyway and the
        join delayed the expand."""
        return self.plan.shrink(plain(x), self.table), self.base(x)


class LoadStream:
    """Where adapter loads copy their bytes on a GPU: a stream of their own, so a load's
    transfer runs beside the step in flight instead of after it (issue 30: a load into free
    memory does not wait for the async pipeline). Two orders keep it safe. The compute stream
    waits for the load before any step queued after it, which is the first that can read the
    adapter. And a load waits for the compute stream's work queued before the latest release
    (an eviction or a compaction move): a step in flight may still read bytes an idle adapter
    left, so a copy over freed memory must not start before that step ends. A load into memory
    free since before the step in flight was queued waits for nothing. Without a GPU, a no-op."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self._release = torch.cuda.Event() if self.stream is not None else None

    def released(self) -> None:
        """Memory was freed: later loads wait for the work queued before this point."""
        if self._release is not None:
            self._release.record(torch.cuda.current_stream(self.stream.device))

    @contextlib.contextmanager
    def copying(self) -> Iterator[None]:
        """Device work issued inside runs on the load stream, in the two orders above."""
        if self.stream is None:
            yield
            return
        compute = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_event(self._release)
        with torch.cuda.stream(self.stream):
            yield
        compute.wait_stream(self.stream)


class LoraLayers:
    """The wrapped projections of one model and the adapter arena they read.

    `targets` maps (layer, PEFT module name) to (projection index, part). The device tables
    `entries` [slots, projections, parts, 3] (A offset, B offset, rank) and `scaling` [slots,
    projections, parts] have a host copy each; a slot's row is written whole, in one transfer, so
    a load is one copy of the adapter's bytes plus two small ones, whatever it targets."""

    def __init__(
        self, plan: LoraStepPlan, weights: torch.Tensor, num_slots: int, projections: int, parts: int
    ) -> None:
        self.plan, self.weights = plan, weights
        self.targets: dict[tuple[int, str], tuple[int, int]] = {}
        # The host copies are page-locked on a GPU, so a row's copy is asynchronous: a
        # synchronous one from pageable memory would wait for the step in flight.
        pin = weights.device.type == "cuda"
        shape = (num_slots, projections, parts)
        self._pinned_entries = torch.zeros((*shape, 3), dtype=torch.long, pin_memory=pin)
        self._pinned_scaling = torch.zeros(shape, dtype=torch.float32, pin_memory=pin)
        self.host_entries, self.host_scaling = self._pinned_entries.numpy(), self._pinned_scaling.numpy()
        self.entries = torch.zeros(self.host_entries.shape, dtype=torch.long, device=weights.device)
        self.scaling = torch.zeros(self.host_scaling.shape, dtype=torch.float32, device=weights.device)
        self.extents: dict[int, tuple[int, int]] = {}  # slot -> (offset, elements) in the arena
        self._loads = LoadStream(weights.device)
        self.kind_bits: dict[tuple[str, ...], int] = {}  # a projection's PEFT parts -> its kind's bit
        self.index_kinds = np.zeros(projections, dtype=np.int64)  # each projection's kind bit
        plan.slot_kinds = np.zeros(num_slots, dtype=np.int64)

    def wrap(self, base: PackedLinear, index: int, layer: int, max_rank: int) -> LoraLinear:
        """The wrapper of `base`, projection `index` of the tables, in decoder layer `layer`."""
        parts = len(base.parts)
        table = AdapterTable(
            self.weights, self.entries[:, index, :parts], self.scaling[:, index, :parts], max_rank
        )
        host = (self.host_entries[:, index, :parts], self.host_scaling[:, index, :parts])
        for part, peft_name in enumerate(base.parts):
            self.targets[(layer, peft_name)] = (index, part)
        wrapper = LoraLinear(base, table, host, self.plan)
        wrapper.kind = self.kind_bits.setdefault(base.parts, 1 << len(self.kind_bits))
        self.index_kinds[index] = wrapper.kind
        self.plan.all_kinds |= wrapper.kind
        return wrapper

    def kinds_of_targets(self, targets: Iterable[str]) -> int:
        """The kinds of projection (`LoraStepPlan.kinds`) of an adapter with weights on these
        PEFT modules, in any layers."""
        names, kinds = set(targets), 0
        for parts, bit in self.kind_bits.items():
            kinds |= bit if names & set(parts) else 0
        return kinds

    def load_slot(self, slot: int, adapter: LoraAdapter, offset: int) -> None:
        """Copy `adapter`'s weights into the arena at `offset` (elements; the pool found the
        room) and point `slot`'s table row at them (quiescent points only). A packed adapter
        (`adapter.HostForm`, laid out as the arena is) crosses in one asynchronous transfer,
        on the load stream (`LoadStream`): beside the step in flight, before the next."""
        entries = np.zeros(self.host_entries.shape[1:], dtype=np.int64)
        scaling = np.zeros(self.host_scaling.shape[1:], dtype=np.float32)
        places, size = adapter.layout
        for (key, w), (a, b) in zip(adapter.modules.items(), places, strict=True):
            index, part = self.targets[key]
            entries[index, part] = (offset + a, offset + b, w.a.shape[0])
            scaling[index, part] = w.scaling
        with self._loads.copying():
            self._copy_weights(adapter, offset, places, size)
            self.extents[slot] = (offset, size)
            self._set_row(slot, entries, scaling)

    def clear_slot(self, slot: int) -> None:
        """Forget `slot`'s adapter: its table row says rank 0 everywhere (its bytes stay until
        reused, and a load's copy over them waits for the steps already queued)."""
        self.extents.pop(slot, None)
        self._set_row(slot, np.zeros_like(self.host_entries[slot]), np.zeros_like(self.host_scaling[slot]))
        self._loads.released()

    def move_slot(self, slot: int, offset: int) -> None:
        """Move `slot`'s adapter to `offset` (compaction, at a quiescent point). The pool moves
        adapters towards the arena's start in address order, so the destination never covers
        an adapter not moved yet; within the adapter's own range, a forward copy of chunks no
        longer than the distance never overwrites bytes not yet copied. Only a short distance
        over a long adapter (too many such chunks) bounces through a temporary copy."""
        old, size = self.extents[slot]
        chunk = min(old - offset, _MOVE_CHUNK)
        bounce = chunk * _MAX_MOVE_COPIES < size
        chunk = _MOVE_CHUNK if bounce else chunk
        for start in range(0, size, chunk):
            n = min(chunk, size - start)
            source = self.weights[old + start : old + start + n]
            self.weights[offset + start : offset + start + n].copy_(source.clone() if bounce else source)
        entries = self.host_entries[slot].copy()
        live = entries[..., 2] > 0
        entries[..., :2][live] += offset - old
        self.extents[slot] = (offset, size)
        self._set_row(slot, entries, self.host_scaling[slot].copy())
        self._loads.released()

    def _copy_weights(
        self, adapter: LoraAdapter, offset: int, places: list[tuple[int, int]], size: int
    ) -> None:
        arena, packed = self.weights[offset : offset + size], adapter.packed
        if packed is not None and adapter.packed_layout is not None:
            arena.copy_(packed, non_blocking=True)  # laid out as the arena is, page-locked: one transfer
            return
        arena.zero_()  # B's padding columns must read as zeros (kernels/lora.py)
        staged = packed.to(arena.device, non_blocking=True) if packed is not None else None

        def moved(t: torch.Tensor) -> torch.Tensor:
            if staged is None or not in_buffer(t, packed):
                return t  # a tensor-parallel shard's own copy, or a parsed adapter's tensor
            return staged.as_strided(t.shape, t.stride(), t.storage_offset() - packed.storage_offset())

        copies = [
            (dst, moved(src))
            for w, (a, b) in zip(adapter.modules.values(), places, strict=True)
            for dst, src in zip(laid_out(arena, w, a, b), (w.a, w.b), strict=True)
        ]
        local = [(d, s) for d, s in copies if s.device == d.device]
        if local:
            torch._foreach_copy_([d for d, _ in local], [s for _, s in local])
        for dst, src in copies:
            if src.device != dst.device:
                dst.copy_(src)

    def _set_row(self, slot: int, entries: np.ndarray, scaling: np.ndarray) -> None:
        self.host_entries[slot], self.host_scaling[slot] = entries, scaling
        targeted = self.index_kinds[(entries[..., 2] > 0).any(axis=1)]
        self.plan.slot_kinds[slot] = int(np.bitwise_or.reduce(targeted)) if targeted.size else 0
        # A later write of this row before the copy runs is copied too: the last one issued wins.
        self.entries[slot].copy_(self._pinned_entries[slot], non_blocking=True)
        self.scaling[slot].copy_(self._pinned_scaling[slot], non_blocking=True)


def wrap_lora_layers(
    module: nn.Module, num_slots: int, max_rank: int, arena_elements: int, use_kernels: bool
) -> LoraLayers:
    """Replace every `PackedLinear` inside a decoder layer of `module` by a `LoraLinear` over one
    arena of `arena_elements` (the model's dtype) and tables of `num_slots` rows."""
    found = _projections(module)
    param = next(module.parameters())
    weights = torch.empty(arena_elements, dtype=param.dtype, device=param.device)
    parts = max((len(sub.parts) for _, sub, _ in found), default=1)
    lora = LoraLayers(LoraStepPlan(use_kernels), weights, num_slots, len(found), parts)
    for index, (name, sub, layer) in enumerate(found):
        owner_name, _, attr = name.rpartition(".")
        setattr(module.get_submodule(owner_name), attr, lora.wrap(sub, index, layer, max_rank))
    return lora


# Table rows (resident adapters) are at most this many: the tables cost 77 MB at this size on the
# 8B shape (224 projections), and a larger arena is not the common case.
MAX_RESIDENT_SLOTS = 4096
# The smallest adapter the rows are sized for: this rank on the narrowest part of each layer.
# An arena full of such adapters runs out of rows before memory; anything larger runs out of memory.
_SMALLEST_RANK = 4


def resident_slots(module: nn.Module, arena_elements: int) -> int:
    """Rows of the LoRA tables for an arena of `arena_elements`: as many adapters as it can hold
    of the smallest size worth serving (rank 4 on one projection of every layer), at most
    `MAX_RESIDENT_SLOTS`. So residency is set by the adapters' bytes, not by a slot count."""
    narrowest: dict[int, int] = {}
    for _, sub, layer in _projections(module):
        size = sub.in_features + min(sub.output_sizes)
        narrowest[layer] = min(size, narrowest.get(layer, size))
    smallest = _SMALLEST_RANK * sum(narrowest.values())
    return max(1, min(MAX_RESIDENT_SLOTS, arena_elements // max(smallest, 1)))


def full_adapter_elements(module: nn.Module, max_rank: int) -> int:
    """Elements of an adapter of `max_rank` on every projection `wrap_lora_layers` would wrap in
    `module`: the arena's default is room for `--max-loras` of them (what padded slots took)."""
    return sum(
        max_rank * (len(sub.parts) * sub.in_features + sub.out_features) for _, sub, _ in _projections(module)
    )


def _projections(module: nn.Module) -> list[tuple[str, PackedLinear, int]]:
    """(name, projection, decoder layer) of every projection a PEFT adapter can target."""
    found = []
    for name, sub in module.named_modules():
        match = _LAYER.search(name)
        if isinstance(sub, PackedLinear) and match is not None:
            found.append((name, sub, int(match.group(1))))
    return found
