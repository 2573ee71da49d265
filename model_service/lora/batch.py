"""The per-step LoRA context: which rows use which slot, and the batched delta.

Rows of one step are grouped by slot once per step (not per layer); each layer's projection
then adds, for every slot present, (x_rows @ A^T) @ B^T * scaling into its output rows: a
gather and two batched matmuls per adapter segment -- the torch reference of the SGMV kernel
(Punica / S-LoRA). Base-model rows (slot -1) are untouched, so base and adapter requests
share one forward pass.
"""

from __future__ import annotations

import torch

from model_service.lora.pool import LoraPool


class LoraBatch:
    def __init__(self, pool: LoraPool, row_slots: list[int], device: torch.device) -> None:
        self.pool = pool
        slots = torch.tensor(row_slots, dtype=torch.long)
        self.segments = [
            (slot, torch.nonzero(slots == slot).flatten().to(device))
            for slot in sorted(set(row_slots))
            if slot >= 0
        ]

    def add_delta(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y += LoRA(x) for the rows of each adapter that targets `module` in `layer`."""
        for slot, rows in self.segments:
            w = self.pool.weights(slot, layer, module)
            if w is not None:
                y.index_add_(0, rows, (x[rows] @ w.a.T) @ w.b.T, alpha=w.scaling)
        return y
