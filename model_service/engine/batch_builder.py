"""Builds each step's `StepBatch` on the host, into one preallocated buffer, and moves it in one copy.

Every index array of a step (token ids, positions, slot mapping, LoRA slots, query offsets,
sequence lengths, state slots, logits rows, the block table) is written into its own region, each
on a 128-byte boundary, of a single int64 host buffer (pinned on CUDA), and that prefix is copied
to a device buffer of the same layout with one `copy_`; the batch's tensors are views into it.
The buffers grow only when a step needs more than any step before, so their addresses are stable
in steady state, and each buffer's region views of a layout are made once: a GPU's batch is views
of the one device buffer, valid until the next `build` (on the CPU each batch has its own copy).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from model_service.engine.seq_state import SequenceState
from model_service.models.step import ROW_FIELDS, StepBatch

ALIGN_WORDS = 16  # int64 words: every packed region starts on a 128-byte boundary
T = TypeVar("T", np.ndarray, torch.Tensor)
V = TypeVar("V")
_MAX_CACHED_LAYOUTS = 1024  # views kept by layout (`_cached`): decode steps repeat a few


@dataclass
class StepItem:
    """`tokens` continue `state` at position `state.num_computed`. Logits are wanted for the last
    `num_logits` of them: 0 for a prefill chunk that does not end the prompt, 1 for a decode row
    or a prompt's last chunk, k + 1 to verify k speculated tokens. A prefill chunk of a request
    that asked for prompt logprobs has `prompt_rows` more just before those: the positions that
    predict a prompt token (engine/prompt_logprobs.py)."""

    state: SequenceState
    tokens: list[int]
    num_logits: int
    # Async scheduling (engine/overlap.py): the index of this one-token item's token among the
    # previous step's sampled tokens, still on the device (its `tokens` hold a placeholder); -1: none.
    fed_from: int = -1
    prompt_rows: int = 0


@dataclass(kw_only=True)
class PackedBatch(StepBatch):
    """A step batch as the builder packed it: the host int64 words every index array was copied
    from, and the sizes that lay them out. A tensor-parallel rank 0 sends these to its workers,
    which rebuild the same batch from them (`BatchBuilder.from_host`)."""

    packed: torch.Tensor
    packed_shape: tuple[int, ...]


class _Staging:
    """A host buffer batches are packed (or received) into, its region views by layout (made
    once, while it is not regrown), and the event recorded after the last copy out of it to the
    device, which must be done before the buffer is written again."""

    def __init__(self, pinned: bool) -> None:
        self.tensor, self.pinned = torch.empty(0, dtype=torch.long), pinned
        self.array = self.tensor.numpy()
        self.regions: dict[tuple[int, ...], list[np.ndarray]] = {}
        self.event: torch.cuda.Event | None = None  # one, recorded again after each copy
        self.copying = False

    def reuse(self, size: int) -> torch.Tensor:
        if self.copying:
            assert self.event is not None
            self.event.synchronize()
            self.copying = False
        if self.tensor.numel() < size:
            capacity = max(size, 2 * self.tensor.numel())
            self.tensor = torch.empty(capacity, dtype=torch.long, pin_memory=self.pinned)
            self.array, self.regions = self.tensor.numpy(), {}
        return self.tensor

    def region_views(self, shape: tuple[int, ...]) -> list[np.ndarray]:
        """`_regions` of the buffer for a batch of `shape`: ten slices a step were a tenth of a
        batch-1 `build`."""
        return _cached(self.regions, shape, lambda: _regions(self.array, shape))

    def record_copy(self) -> None:
        """The copy out of the buffer is queued: the next `reuse` waits for it."""
        if self.event is None:
            self.event = torch.cuda.Event()
        self.event.record()
        self.copying = True


class BatchBuilder:
    def __init__(self, block_size: int, device: torch.device, keep_batches: bool | None = None) -> None:
        """`keep_batches`: each batch's device tensors are its own (a fresh copy a step), as on
        the CPU by default; else views of one device buffer, valid until the next `build`."""
        self.block_size, self.device = block_size, device
        self.keep_batches = device.type == "cpu" if keep_batches is None else keep_batches
        # The device buffer's region views by layout (`_device_views`), while it is not regrown.
        self._views: dict[tuple[int, ...], list[torch.Tensor | None]] = {}
        # Two host buffers, used in turn, so that packing (or, on a tensor-parallel worker,
        # receiving) the next batch never waits for the device: the copy out of the last one may
        # still be queued behind the running step (async scheduling, engine/overlap.py; a worker
        # that does not wait for its steps). The one before that has been copied by then, but for
        # a host that ran two steps ahead, `_Staging.reuse` waits for its copy.
        pinned = device.type == "cuda"
        self._staging = (_Staging(pinned), _Staging(pinned))
        self._turn = 0
        self._host = self._staging[0].tensor
        self._device = torch.empty(0, dtype=torch.long, device=device)

    def build(self, items: list[StepItem]) -> PackedBatch:
        """Pack `items` with whole-array numpy operations: the host builds a step of 256 decode
        rows while the GPU runs the previous one, so a Python loop per row would be the step."""
        if not items:
            raise ValueError("a step batch needs at least one sequence")
        n = len(items)
        states = [it.state for it in items]
        columns = _columns(items, states)
        lens, starts, num_logits, table_lens, lora_of, state_of, has_snapshots, freed, fed_from = columns
        self._check(states, freed, table_lens, starts + lens)
        total, max_blocks = int(lens.sum()), int(table_lens.max())
        fed = (fed_from >= 0).nonzero()[0]  # array methods, not numpy's wrappers: ~1 us a call
        layout = (total, n, int(num_logits.sum()), max_blocks, len(fed))
        self._next_host(_layout(layout)[1])
        regions = self._staging[self._turn].region_views(layout)
        ids, pos, slots, lora, seq_lens, q_start, state_slots, rows, table, feed = regions
        q_start[0] = 0
        lens.cumsum(out=q_start[1:])
        np.add(starts, lens, out=seq_lens)
        table = table.reshape(n, max_blocks)
        table.fill(0)
        table[np.arange(max_blocks) < table_lens[:, None]] = _table_arrays(states)
        ids[:] = np.fromiter(itertools.chain.from_iterable(it.tokens for it in items), np.int64, total)
        pos[:] = (starts - q_start[:-1]).repeat(lens) + np.arange(total)
        seq_of = np.arange(n).repeat(lens)
        slots[:] = table[seq_of, pos // self.block_size] * self.block_size + pos % self.block_size
        lora[:] = lora_of[seq_of]
        state_slots[:] = state_of
        # Each sequence's logits rows are its last `num_logits` tokens.
        first_row = num_logits.cumsum() - num_logits
        rows[:] = (q_start[1:] - num_logits - first_row).repeat(num_logits) + np.arange(len(rows))
        feed[: len(fed)], feed[len(fed) :] = q_start[fed], fed_from[fed]
        shape = (total, n, len(rows), max_blocks, len(fed), int(lens.max()), int(seq_lens.max()))
        snapshots = self._snapshots(states, has_snapshots.nonzero()[0], starts, lens, q_start)
        return self._batch(shape, snapshots, regions)

    def _check(
        self, states: list[SequenceState], freed: np.ndarray, table_lens: np.ndarray, ends: np.ndarray
    ) -> None:
        if freed.any():
            raise RuntimeError(f"sequence {states[int(freed.argmax())].seq_id} used after free")
        short = table_lens * self.block_size < ends
        if short.any():
            raise RuntimeError(
                f"sequence {states[int(short.argmax())].seq_id} has too few KV blocks reserved for this step"
            )

    @staticmethod
    def _snapshots(
        states: list[SequenceState],
        with_snapshots: np.ndarray,
        starts: np.ndarray,
        lens: np.ndarray,
        q_start: np.ndarray,
    ) -> np.ndarray:
        """[T] the state slot that receives each token's recurrent state (-1: none): the
        checkpoints this step's tokens reach (`with_snapshots`: the rows that have any)."""
        snapshots = np.full(int(q_start[-1]), -1, dtype=np.int64)
        for i in with_snapshots.tolist():
            st = states[i]
            s, n, o = int(starts[i]), int(lens[i]), int(q_start[i])
            for length, slot in st.snapshots.items():
                if s < length <= s + n:
                    snapshots[o + length - s - 1] = slot
        return snapshots

    def host_region(self, shape: tuple[int, ...]) -> torch.Tensor:
        """The next host buffer, sized for a batch of `shape`: a tensor-parallel worker receives
        rank 0's packed batch there, then calls `from_host` (once per region)."""
        size = _layout(shape)[1]
        self._next_host(size)
        return self._host[:size]

    def from_host(self, shape: tuple[int, ...]) -> PackedBatch:
        """The batch of `shape` packed in the host buffer (by `build`, or received into `host_region`)."""
        no_snapshots = np.full(shape[0], -1, dtype=np.int64)  # no recurrent layers under TP
        return self._batch(shape, no_snapshots, self._staging[self._turn].region_views(shape))

    def _batch(self, shape: tuple[int, ...], snapshots: np.ndarray, regions: list[np.ndarray]) -> PackedBatch:
        """The batch of `shape` whose host words are `regions` (of the current host buffer)."""
        used = _layout(shape)[1]
        views = self._device_views(self._to_device(used), shape)
        return PackedBatch(
            input_ids=views[0],
            positions=views[1],
            slot_mapping=views[2],
            lora_slots=views[3],
            seq_lens=views[4],
            query_start=views[5],
            state_slots=views[6],
            logits_rows=views[7],
            block_table=views[8],
            max_query_len=shape[5],
            max_seq_len=shape[6],
            host_lora_slots=regions[3].copy(),
            host_query_start=regions[5].copy(),
            host_state_snapshots=snapshots,
            packed=self._host[:used],
            packed_shape=shape,
            feed_index=views[9],
            row_block=views[10],
        )

    def _device_views(self, flat: torch.Tensor, shape: tuple[int, ...]) -> list[torch.Tensor | None]:
        """The region views of `flat` (the device words of a batch of `shape`), the block table
        [seqs, blocks] and the feed index [2, fed], then the row block (`StepBatch.row_block`)
        where every sequence is one token. Views of the shared device buffer are made once per
        layout: ten slices and two reshapes were a quarter of a batch-1 `build`."""

        def made() -> list[torch.Tensor | None]:
            views: list[torch.Tensor | None] = list(_regions(flat, shape))
            views[8], views[9] = views[8].view(shape[1], shape[3]), views[9].view(2, shape[4])
            views.append(_row_block(flat, shape))
            return views

        return made() if self.keep_batches else _cached(self._views, shape, made)

    def _next_host(self, size: int) -> None:
        """Switch to the other host buffer, grown to `size` words, once the copy out of it is done."""
        self._turn ^= 1
        self._host = self._staging[self._turn].reuse(size)
        if self._device.numel() < size:
            capacity = max(size, 2 * self._device.numel())
            self._device = torch.empty(capacity, dtype=torch.long, device=self.device)
            self._views.clear()  # views of the buffer it replaces

    def _to_device(self, used: int) -> torch.Tensor:
        if self.keep_batches:
            flat = self._host[:used].clone()  # the next step reuses the host buffer
        else:
            flat = self._device[:used]
            flat.copy_(self._host[:used], non_blocking=True)
            if self.device.type == "cuda":
                self._staging[self._turn].record_copy()
        return flat


def _columns(items: list[StepItem], states: list[SequenceState]) -> np.ndarray:
    """[9, N] per row: tokens, start position, logits rows (prompt rows included), block-table
    length, LoRA slot, state slot, recurrent-state snapshots, freed, fed-from index. One pass
    over the rows, not one per column."""
    values = itertools.chain.from_iterable(
        (
            len(it.tokens),
            s.num_computed,
            it.num_logits + it.prompt_rows,
            len(s.block_table),
            s.lora_slot,
            s.state_slot,
            len(s.snapshots),
            s.freed,
            it.fed_from,
        )
        for it, s in zip(items, states, strict=True)
    )
    return np.fromiter(values, np.int64, 9 * len(items)).reshape(len(items), 9).T


def _table_arrays(states: list[SequenceState]) -> np.ndarray:
    """Every row's block table, concatenated, from each state's `table_array` (refreshed where the
    table grew or was rewritten): O(rows) Python work a step, not O(blocks)."""
    for st in states:
        if st.table_array is None or len(st.table_array) != len(st.block_table):
            st.table_array = np.array(st.block_table, dtype=np.int64)
    return np.concatenate([st.table_array for st in states])


def _cached(
    views: dict[tuple[int, ...], list[V]], shape: tuple[int, ...], made: Callable[[], list[V]]
) -> list[V]:
    """The views of a batch of `shape` kept in `views` by its layout, else `made()`, kept."""
    key = tuple(shape[:5])
    found = views.get(key)
    if found is None:
        if len(views) >= _MAX_CACHED_LAYOUTS:
            views.clear()
        found = views[key] = made()
    return found


def _layout(shape: tuple[int, ...]) -> tuple[tuple[tuple[int, int], ...], int]:
    """`_spans` of a batch of `shape` (its first five sizes say the layout)."""
    return _spans(tuple(shape[:5]))


@functools.lru_cache(maxsize=1024)
def _spans(sizes: tuple[int, ...]) -> tuple[tuple[tuple[int, int], ...], int]:
    """(start, size) of each region of the packed buffer of a batch of (tokens, sequences, logits
    rows, blocks per sequence, fed rows): ids, positions, slot mapping, LoRA slots, sequence
    lengths (`ROW_FIELDS`' order: where there are as many tokens as sequences, these five are
    the rows of one strided block, `_row_block`), query starts, state slots, logits rows, block
    table, feed index; and the words used. Each region starts on a 128-byte boundary: Triton
    compiles a kernel once per alignment
    of its pointer arguments, so views at arbitrary offsets would compile new variants of every
    kernel under live traffic (seen on an H200: ~20 compiles, ~17 s, in the first serving run).
    Cached: decode steps repeat their sizes, and at batch 1 computing this five times a step
    was a sixth of the host's step (`BatchBuilder.build`)."""
    total, num_seqs, num_logits, max_blocks, num_fed = sizes
    lengths = [total] * 4 + [num_seqs, num_seqs + 1, num_seqs, num_logits, num_seqs * max_blocks, 2 * num_fed]
    spans, start = [], 0
    for size in lengths:
        spans.append((start, size))
        start += -(-size // ALIGN_WORDS) * ALIGN_WORDS
    return tuple(spans), start


def _row_block(flat: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor | None:
    """`ROW_FIELDS` of a batch of one-token sequences as the rows of one view of `flat`: their
    regions are equally long, so equally far apart. None for a batch with longer runs."""
    total, num_seqs = shape[:2]
    if total != num_seqs:
        return None
    stride = _layout(shape)[0][1][0]
    return flat[: len(ROW_FIELDS) * stride].view(len(ROW_FIELDS), stride)[:, :total]


def _regions(buffer: T, shape: tuple[int, ...]) -> list[T]:
    """The region views of `buffer` (host array or device tensor) for a batch of `shape`."""
    return [buffer[start : start + size] for start, size in _layout(shape)[0]]
