"""How a step's flat token rows map onto per-sequence recurrent state, for linear-attention layers.

A recurrence runs token by token within a sequence, but a step batch is flat rows of many
sequences (decode rows, prefill chunks, verify runs). `RecurrentPlan` lays them out once per step
as a padded [S, L] grid (L = the longest run), so every linear layer advances all sequences
together; padded steps are made identities by the layers (zero decay, zero write strength).

State lives in the executor's tensors, one per state kind and layer, [slots, ...], indexed by the
sequences' state slots. A sequence whose run starts at position 0 starts from zeros instead of
its slot, so a slot needs no clearing when it passes from one sequence to the next (a prefill
after recompute-preemption also starts there). Checkpoints (`StepBatch.host_state_snapshots`)
are copied out as the recurrence passes the token they follow.

On the GPU, a step whose runs are all short (decode rows, verify runs, short chunks) skips the
grid: the step kernels (kernels/gated_delta.py) walk each run in place from `StateRuns`, device
tensors that CUDA graphs replay over as static copies (`StaticRuns`). Longer runs take the grid and
the chunked scan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from model_service.kernels.gated_delta import StateRuns, triton
from model_service.models.step import StepBatch, to_device

# The longest run the step kernels take: they walk a run token by token, which is what decode
# and verify need; a longer chunk of prefill goes through the grid's chunked scan.
KERNEL_MAX_RUN = 16


@dataclass
class RecurrentPlan:
    slots: torch.Tensor  # [S] each sequence's state slot
    fresh: torch.Tensor  # [S] bool: the run starts at position 0 (state starts at zero)
    lengths: torch.Tensor  # [S] tokens of each run
    grid_rows: torch.Tensor  # [S, L] flat row of each grid cell (0 for padding)
    valid: torch.Tensor  # [S, L] bool: the cell is a real token
    flat_cells: torch.Tensor  # [T] grid cell (s * L + t) of each flat row
    checkpoints: dict[int, tuple[torch.Tensor, torch.Tensor]]  # step t -> (sequence indices, slots)
    max_len: int

    @classmethod
    def from_batch(cls, batch: StepBatch) -> RecurrentPlan:
        return cls.from_runs(
            batch.host_query_start, batch.host_state_snapshots, batch.state_slots, starts_fresh(batch)
        )

    @classmethod
    def from_runs(
        cls,
        host_query_start: np.ndarray,
        host_snapshots: np.ndarray,
        slots: torch.Tensor,
        fresh: torch.Tensor,
    ) -> RecurrentPlan:
        """The plan of runs given as `StateRuns` gives them (query offsets and snapshots on the host)."""
        qs = host_query_start
        lens = np.diff(qs)
        num_seqs, width = len(lens), int(lens.max())
        t = np.arange(width)
        valid = t[None, :] < lens[:, None]
        rows = np.where(valid, qs[:-1, None] + t[None, :], 0)
        seq_of_row = np.repeat(np.arange(num_seqs), lens)
        flat_cells = seq_of_row * width + (np.arange(len(seq_of_row)) - qs[seq_of_row])
        checkpoints: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        marked = np.nonzero(host_snapshots >= 0)[0]
        dev = slots.device
        for step in sorted({int(flat_cells[r] % width) for r in marked}):
            hit = [r for r in marked if flat_cells[r] % width == step]
            checkpoints[step] = (to_device(seq_of_row[hit], dev), to_device(host_snapshots[hit], dev))
        return cls(
            slots=slots,
            fresh=fresh,
            lengths=to_device(lens, dev),
            grid_rows=to_device(rows, dev),
            valid=to_device(valid, dev),
            flat_cells=to_device(flat_cells, dev),
            checkpoints=checkpoints,
            max_len=width,
        )

    def to_grid(self, x: torch.Tensor) -> torch.Tensor:
        """Flat rows [T, ...] -> [S, L, ...], zeros in padding cells."""
        grid = x[self.grid_rows]
        return grid * self.valid.view(*self.valid.shape, *([1] * (x.dim() - 1))).to(x.dtype)

    def to_flat(self, grid: torch.Tensor) -> torch.Tensor:
        """[S, L, ...] -> the flat rows [T, ...] they came from."""
        return grid.flatten(0, 1)[self.flat_cells]

    def read(self, tensor: torch.Tensor) -> torch.Tensor:
        """Each sequence's state from `tensor` [slots, ...] (zeros for fresh sequences)."""
        state = tensor[self.slots]
        return torch.where(self.fresh.view(-1, *([1] * (state.dim() - 1))), 0.0, state)


class StaticRuns:
    """Fixed-address `StateRuns` for CUDA graphs (engine/cuda_graphs.py), as the attention backend
    keeps its metadata: a graph records the step kernels reading these buffers, and every replay
    first copies its step's runs in, so a graph never replays over another step's slots."""

    def __init__(self, max_rows: int, device: torch.device) -> None:
        self.query_start = torch.arange(max_rows + 1, device=device)
        self.slots = torch.full((max_rows,), -1, dtype=torch.long, device=device)
        self.fresh = torch.ones(max_rows, dtype=torch.bool, device=device)
        self.snapshots = torch.full((max_rows,), -1, dtype=torch.long, device=device)
        # Up to which size the buffers hold one-token runs and no checkpoints (query starts
        # 0..plain, snapshots -1), as a decode step leaves them: the next such step copies nothing.
        self.plain = 0

    def for_capture(self, size: int) -> StateRuns:
        """`size` one-token padding runs (they write no state), over the buffers' first rows."""
        self.query_start[: size + 1] = torch.arange(size + 1, device=self.slots.device)
        self.slots[:size] = self.snapshots[:size] = -1
        return StateRuns(
            self.query_start[: size + 1], self.slots[:size], self.fresh[:size], self.snapshots[:size]
        )

    def prepare_for_replay(self, batch: StepBatch, size: int) -> None:
        """`batch`'s runs as they are (a verify run stays one run of its sequence, whatever rows
        attention sees), then one-token padding runs over rows T..size-1, then empty ones: `size`
        runs in all, as captured. No host sync: the host offsets go over in one copy, and none
        for a decode step without checkpoints whose runs the buffers hold already (`plain`)."""
        seqs, rows = batch.num_seqs, batch.num_tokens
        plain = seqs == rows and not (batch.host_state_snapshots >= 0).any()
        if not (plain and size <= self.plain):
            host = np.concatenate([
                batch.host_query_start, np.arange(rows + 1, size + 1), np.full(rows - seqs, size),
                batch.host_state_snapshots, np.full(size - rows, -1),
            ])  # fmt: skip
            copied = to_device(host.astype(np.int64), self.slots.device)
            self.query_start[: size + 1] = copied[: size + 1]
            self.snapshots[:size] = copied[size + 1 :]
            self.plain = size if plain else 0
        self.slots[:seqs] = batch.state_slots
        if size > seqs:  # each device op, even of no elements, costs the host ~10-20 us a step
            self.slots[seqs:size] = -1
        if plain:  # one-token runs: fresh where the token is the sequence's first (no diff op)
            torch.eq(batch.seq_lens, 1, out=self.fresh[:seqs])
        else:
            starts_fresh(batch, out=self.fresh[:seqs])


@dataclass
class RecurrentStep:
    """What linear-attention layers get in `ForwardContext.recurrent`: the grid plan (torch), or
    the runs the step kernels read."""

    plan: RecurrentPlan | StateRuns
    tensors: list[torch.Tensor]  # the executor's state tensors, [slots, ...] each

    def layer_state(self, index: int, per_layer: int) -> list[torch.Tensor]:
        """The `per_layer` state tensors of the `index`-th recurrent layer."""
        return self.tensors[index * per_layer : (index + 1) * per_layer]


@runtime_checkable
class RecurrentModel(Protocol):
    """A model with recurrent layers: the executor allocates one float32 tensor [slots, *shape] per
    shape listed, in order, and passes them back in every step's `ForwardContext.recurrent`."""

    def recurrent_state_shapes(self) -> list[tuple[int, ...]]: ...


def recurrent_step(batch: StepBatch, tensors: list[torch.Tensor]) -> RecurrentStep:
    """The step's runs for the step kernels where they run (CUDA, with Triton) and every run is
    short; the grid plan otherwise."""
    kernels = triton is not None and batch.state_slots.is_cuda
    if not (kernels and batch.max_query_len <= KERNEL_MAX_RUN):
        return RecurrentStep(RecurrentPlan.from_batch(batch), tensors)
    snapshots = to_device(batch.host_state_snapshots, batch.state_slots.device)
    return RecurrentStep(
        StateRuns(batch.query_start, batch.state_slots, starts_fresh(batch), snapshots), tensors
    )


def starts_fresh(batch: StepBatch, out: torch.Tensor | None = None) -> torch.Tensor:
    """[S] bool: the sequence's run starts at position 0, so its state starts at zero, whatever
    its slot holds (on the device: no sync); written into `out` where given (no copy op)."""
    return torch.eq(batch.seq_lens, batch.query_start.diff(), out=out)
