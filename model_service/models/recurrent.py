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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from model_service.models.step import StepBatch, to_device


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
        qs = batch.host_query_start
        lens = np.diff(qs)
        num_seqs, width = len(lens), int(lens.max())
        t = np.arange(width)
        valid = t[None, :] < lens[:, None]
        rows = np.where(valid, qs[:-1, None] + t[None, :], 0)
        seq_of_row = np.repeat(np.arange(num_seqs), lens)
        flat_cells = seq_of_row * width + (np.arange(len(seq_of_row)) - qs[seq_of_row])
        checkpoints: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        marked = np.nonzero(batch.host_state_snapshots >= 0)[0]
        dev = batch.input_ids.device
        for step in sorted({int(flat_cells[r] % width) for r in marked}):
            hit = [r for r in marked if flat_cells[r] % width == step]
            checkpoints[step] = (
                to_device(seq_of_row[hit], dev),
                to_device(batch.host_state_snapshots[hit], dev),
            )
        q_lens = to_device(lens, dev)
        return cls(
            slots=batch.state_slots,
            fresh=batch.seq_lens == q_lens,
            lengths=q_lens,
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


@dataclass
class RecurrentStep:
    """What linear-attention layers get in `ForwardContext.recurrent`."""

    plan: RecurrentPlan
    tensors: list[torch.Tensor]  # the executor's state tensors, [slots, ...] each

    def layer_state(self, index: int, per_layer: int) -> list[torch.Tensor]:
        """The `per_layer` state tensors of the `index`-th recurrent layer."""
        return self.tensors[index * per_layer : (index + 1) * per_layer]


@runtime_checkable
class RecurrentModel(Protocol):
    """A model with recurrent layers: the executor allocates one float32 tensor [slots, *shape] per
    shape listed, in order, and passes them back in every step's `ForwardContext.recurrent`."""

    def recurrent_state_shapes(self) -> list[tuple[int, ...]]: ...
