"""LoRA as layer wrappers over the model's fused projections, with stacked per-slot weights.

`wrap_lora_layers` replaces each `PackedLinear` of a model (q/k/v fused, o, gate/up fused,
down) by a `LoraLinear` that owns two preallocated buffers for every adapter slot:
A [max_loras, parts, max_rank, in] and B [max_loras, out, max_rank]. Loading an adapter into a
slot copies its weights into those buffers (a smaller rank is zero-padded); the buffers' addresses
never change, so a CUDA graph or a batched kernel can read any slot of any layer, and a request's
rows pick their adapter by the per-token slot index of the step batch.

On CUDA the delta is two Triton launches per projection for all rows of all adapters
(kernels/lora.py), graph-capturable; the shrink runs on a side stream beside the base GEMM.
Steps with long runs of one adapter (prefill chunks) take the row-tile kernels instead
(kernels/lora_grouped.py), which read each adapter's weights once per tile, not once per row.
The torch reference below loops over the slots present in the step (SGMV's segments), using
each slot's exact rank, so zero padding costs memory, not arithmetic, on the CPU. The memory it
costs: max_loras x max_rank x layers x dtype bytes x the sum over fused projections of
(parts x in + out), whatever rank the adapters have. The models know nothing of LoRA: wrapping
happens once, at load, by module type.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from model_service.kernels.fused import silu_and_mul
from model_service.kernels.lora import few_rows_split, lora_expand, lora_shrink, silu_mul_lora_rows
from model_service.kernels.lora_grouped import lora_expand_tiles, lora_shrink_tiles, lora_tiles
from model_service.lora.adapter import LoraAdapter, LoraWeights, in_buffer
from model_service.models.layers import PackedLinear
from model_service.models.step import StepBatch, to_device

# A decoder layer's own projections (`layers.3.self_attn.qkv_proj`), not those nested deeper (an
# MoE layer's shared expert), which PEFT adapters cannot name.
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.\w+(?:\.inner)?$")  # .inner: RowParallel


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
        self.slots = torch.empty(0, dtype=torch.long)
        self.tiles: torch.Tensor | None = None
        self.lead = 0  # with tiles: the step's leading decode rows, which the per-row kernels serve
        self.static = False  # a piecewise graph's: both kinds of kernels over fixed buffers (`for_pieces`)
        self.segments: list[tuple[int, torch.Tensor]] = []
        self._side: torch.cuda.Stream | None = None

    def for_capture(self, slots: torch.Tensor, enabled: bool) -> None:
        """A CUDA graph reads the rows' slots from a static buffer, with the per-row kernels."""
        self.enabled, self.slots, self.tiles, self.static = enabled, slots, None, False

    def for_pieces(self, slots: torch.Tensor, tiles: torch.Tensor) -> None:
        """A piecewise graph cannot know which rows a step's tiles take, so it records both
        kinds of kernels over static buffers: the per-row kernels over the bucket's first
        `len(slots)` rows (the leading decode rows' slots, -1 after them) and the tile kernels
        over a fixed number of tiles (`tiles`, unused ones empty) for every other LoRA row. The
        step fills both (`engine/piecewise_graphs.py`)."""
        self.enabled, self.slots, self.tiles, self.static = True, slots, tiles, True

    def side_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The stream the shrink kernels run on beside the base GEMMs (one for the model)."""
        if self._side is None:
            self._side = torch.cuda.Stream(device=device)
        return self._side

    def prepare(self, batch: StepBatch) -> None:
        self.enabled, self.static = batch.uses_lora, False
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

    def shrink(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        if self.tiles is None:
            return lora_shrink(x, a, self.slots)
        if self.static:  # the per-row rows are few (decode rows): split their input dimension
            rows, split = len(self.slots), max(2, few_rows_split(x.shape[1]))
            xa = torch.zeros(x.shape[0], a.shape[1] * a.shape[2], dtype=torch.float32, device=x.device)
            lora_shrink(x[:rows], a, self.slots, out=xa[:rows], split_k=split, zeroed=True)
            return lora_shrink_tiles(x, a, self.tiles, out=xa)  # zeroed: the tiles may add partial sums
        xa = lora_shrink_tiles(x, a, self.tiles)
        if self.lead:
            lora_shrink(x[: self.lead], a, self.slots[: self.lead], out=xa[: self.lead])
        return xa

    def expand(
        self, xa: torch.Tensor, y: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor, bounds: torch.Tensor
    ) -> None:
        if self.tiles is None:
            lora_expand(xa, y, b, scaling, self.slots, bounds)
            return
        lora_expand_tiles(xa, y, b, scaling, self.tiles, bounds)
        if self.static:
            rows = len(self.slots)
            lora_expand(xa[:rows], y[:rows], b, scaling, self.slots, bounds)
        elif self.lead:
            d = self.lead
            lora_expand(xa[:d], y[:d], b, scaling, self.slots[:d], bounds)


class LoraLinear(nn.Module):
    def __init__(self, base: PackedLinear, max_loras: int, max_rank: int, plan: LoraStepPlan) -> None:
        super().__init__()
        self.base, self.plan = base, plan
        w = base.weight
        parts = len(base.parts)
        self.register_buffer("lora_a", w.new_zeros(max_loras, parts, max_rank, base.in_features))
        self.register_buffer("lora_b", w.new_zeros(max_loras, base.out_features, max_rank))
        self.register_buffer("lora_scaling", torch.zeros(max_loras, parts, device=w.device))
        bounds = np.cumsum((0, *base.output_sizes))
        self.register_buffer("part_starts", torch.tensor(bounds[:-1], dtype=torch.long, device=w.device))
        self.columns = [(int(lo), int(hi)) for lo, hi in itertools.pairwise(bounds)]
        # Host-side per slot and part: the adapter's rank (0 = part not targeted) and its scaling.
        self.ranks = [[0] * parts for _ in range(max_loras)]
        self.scaling = [[0.0] * parts for _ in range(max_loras)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.plan.use_kernels:
            return self._forward_kernels(x) if self.plan.enabled else self.base(x)
        y = self.base(x)
        for slot, rows in self.plan.segments:
            ranks = self.ranks[slot]
            if not any(ranks):
                continue
            xs = x[rows]
            for part, (lo, hi) in enumerate(self.columns):
                r = ranks[part]
                if r:
                    delta = (xs @ self.lora_a[slot, part, :r].T) @ self.lora_b[slot, lo:hi, :r].T
                    y[:, lo:hi].index_add_(0, rows, delta, alpha=self.scaling[slot][part])
        return y

    def _forward_kernels(self, x: torch.Tensor) -> torch.Tensor:
        xa, y = self._shrink_and_base(x)
        self.plan.expand(xa, y, self.lora_b, self.lora_scaling, self.part_starts)
        return y

    def forward_silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this gate_up projection (SwiGLU's `MLP`). On decode steps and in
        decode graphs (the per-row kernels) each row's delta is added inside the activation
        (`silu_mul_lora_rows`): the expand's read and write of the 2I-wide output and a launch a
        layer are not paid (8B shape, 64 rows: 25.0 -> 19.7 us a layer). Steps with row tiles
        keep the expand: a fused kernel over tiles of every row measured slower in the serving
        run (single decode rows each took a whole tile; docs/performance.md, session m)."""
        plan = self.plan
        if not (plan.use_kernels and plan.enabled) or plan.tiles is not None:
            return silu_and_mul(self(x))
        assert self.columns == [(0, self.columns[0][1]), (self.columns[0][1], 2 * self.columns[0][1])]
        xa, y = self._shrink_and_base(x)
        return silu_mul_lora_rows(y, xa, self.lora_b, self.lora_scaling, plan.slots)

    def _shrink_and_base(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The shrink reads only `x`, so on decode steps it runs on a side stream while the base
        GEMM streams its weights: a few-microsecond kernel too small to fill the GPU hides behind
        one that does (8B shape, 64 rows, 64 adapters: 79 -> 60 us of LoRA a layer). Graph
        capture follows the fork and join. `xa` is allocated on the side stream and freed once
        the expand is queued on this one; the side stream's next work waits for this one first,
        so the allocator never hands its block out early. Prefill steps (row tiles) do not
        fork: their GEMMs fill the GPU anyway, and on an eager step the fork and join cost the
        host more than the overlap saves."""
        if self.plan.tiles is not None:
            xa = self.plan.shrink(x, self.lora_a)
            y = self.base(x)
        else:
            main = torch.cuda.current_stream(x.device)
            side = self.plan.side_stream(x.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                xa = self.plan.shrink(x, self.lora_a)
            y = self.base(x)
            main.wait_stream(side)
        return xa, y

    def slot_writes(self, slot: int, weights: dict[int, LoraWeights], writes: SlotWrites) -> None:
        """Add to `writes` what makes `slot` hold `weights`. Only the rows an adapter has are
        touched, so a load costs its size, not the slot's: each part's rows copied, what the
        previous adapter wrote beyond them zeroed, each scaling set."""
        for part, (lo, hi) in enumerate(self.columns):
            w, old = weights.get(part), self.ranks[slot][part]
            r = 0 if w is None else w.a.shape[0]
            if w is not None:
                writes.copies += [(self.lora_a[slot, part, :r], w.a), (self.lora_b[slot, lo:hi, :r], w.b)]
            if old > r:
                writes.zeros += [self.lora_a[slot, part, r:old], self.lora_b[slot, lo:hi, r:old]]
            if w is not None or old:
                self.ranks[slot][part], self.scaling[slot][part] = r, 0.0 if w is None else w.scaling
                writes.scalings.append((self.lora_scaling[slot, part : part + 1], self.scaling[slot][part]))


@dataclass
class SlotWrites:
    """A slot load's device writes, applied together: every step waits for a load, and one at a
    time they were ~1,250 launches of Python on the 8B shape (17.9 ms; docs/performance.md,
    session k). Copies whose source is already on the device (views of an adapter's packed
    buffer, moved in one transfer) go in batched launches; the rest one by one."""

    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (slot view, weights)
    zeros: list[torch.Tensor] = field(default_factory=list)
    scalings: list[tuple[torch.Tensor, float]] = field(default_factory=list)

    def apply(self, moved: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> None:
        """`moved(t)`: the weights `t` on the device, when they were moved there already."""
        copies = [(dst, moved(src)) for dst, src in self.copies]
        local = [(dst, src) for dst, src in copies if src.device == dst.device]
        if local:
            torch._foreach_copy_([d for d, _ in local], [s for _, s in local])
        for dst, src in copies:
            if src.device != dst.device:
                dst.copy_(src, non_blocking=True)  # page-locked: `adapter.host_form`
        views = self.zeros + [v for v, _ in self.scalings]
        if views:
            torch._foreach_zero_(views)
        if self.scalings:
            torch._foreach_add_([v for v, _ in self.scalings], [value for _, value in self.scalings])


@dataclass
class LoraLayers:
    """The wrapped projections of one model, by (layer, PEFT module name) -> (wrapper, part)."""

    plan: LoraStepPlan
    targets: dict[tuple[int, str], tuple[LoraLinear, int]]

    def load_slot(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy `adapter`'s weights into `slot` (quiescent points only), replacing what was there.
        A packed adapter (`adapter.host_form`) crosses to the device in one transfer first."""
        parts: dict[int, tuple[LoraLinear, dict[int, LoraWeights]]] = {
            id(m): (m, {}) for m, _ in self.targets.values()
        }
        for key, w in adapter.modules.items():
            layer, part = self.targets[key]
            parts[id(layer)][1][part] = w
        writes = SlotWrites()
        for layer, weights in parts.values():
            if weights or any(layer.ranks[slot]):
                layer.slot_writes(slot, weights, writes)
        packed = adapter.packed
        if packed is None:
            writes.apply()
            return
        device = next(iter(parts.values()))[0].lora_a.device
        staged = packed.to(device, non_blocking=True)

        def moved(t: torch.Tensor) -> torch.Tensor:
            if not in_buffer(t, packed):
                return t  # a tensor-parallel shard's own copy
            return staged.as_strided(t.shape, t.stride(), t.storage_offset() - packed.storage_offset())

        writes.apply(moved)

    def clear_slot(self, slot: int) -> None:
        writes = SlotWrites()
        for layer in {id(m): m for m, _ in self.targets.values()}.values():
            layer.slot_writes(slot, {}, writes)
        writes.apply()


def wrap_lora_layers(module: nn.Module, max_loras: int, max_rank: int, use_kernels: bool) -> LoraLayers:
    """Replace every `PackedLinear` inside a decoder layer of `module` by a `LoraLinear`."""
    plan = LoraStepPlan(use_kernels)
    targets: dict[tuple[int, str], tuple[LoraLinear, int]] = {}
    for name, sub in list(module.named_modules()):
        match = _LAYER.search(name)
        if not isinstance(sub, PackedLinear) or match is None:
            continue
        wrapper = LoraLinear(sub, max_loras, max_rank, plan)
        owner_name, _, attr = name.rpartition(".")
        setattr(module.get_submodule(owner_name), attr, wrapper)
        for part, peft_name in enumerate(sub.parts):
            targets[(int(match.group(1)), peft_name)] = (wrapper, part)
    return LoraLayers(plan, targets)
