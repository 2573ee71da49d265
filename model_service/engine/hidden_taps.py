"""Keeping the residual stream that enters chosen decoder layers (EAGLE-3's auxiliary states),
without the model knowing and without a copy.

A pre-norm layer's input norm is where the stream entering it is formed: `with_residual(x,
residual)` returns the sum x + residual as a tensor of its own, which the layer only reads
afterwards (layer 0's norm reads the embeddings as they are). `tap_layers` wraps those norms in
the executor's own module tree (`ResidualTap`), which keeps a reference to that tensor per step:
the same tensor the model computed, not a copy of it. Models stay free of speculation: they call
their norms as always.
"""

from __future__ import annotations

import torch
from torch import nn

from model_service.errors import ModelLoadError


class ResidualTap(nn.Module):
    """A layer's input norm that also records the stream it was handed, in `sink` at `slots`."""

    def __init__(self, norm: nn.Module, sink: list[torch.Tensor | None], slots: list[int]) -> None:
        super().__init__()
        self.norm, self.sink, self.slots = norm, sink, slots

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._keep(x)
        return self.norm(x)

    def with_residual(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, summed = self.norm.with_residual(x, residual)
        self._keep(summed)
        return out, summed

    def _keep(self, stream: torch.Tensor) -> None:
        for slot in self.slots:
            self.sink[slot] = stream


class HiddenTaps:
    """The states entering `layers` (in that order; a layer may be named twice) of each forward
    pass, read once after it with `take`."""

    def __init__(self, module: nn.Module, layers: tuple[int, ...]) -> None:
        stack = getattr(getattr(module, "model", None), "layers", None)
        if stack is None or not all(hasattr(layer, "input_layernorm") for layer in stack):
            raise ModelLoadError(
                f"{type(module).__name__} has no pre-norm decoder layers whose states EAGLE-3 can read"
            )
        self.sink: list[torch.Tensor | None] = [None] * len(layers)
        for index in sorted(set(layers)):
            layer = stack[index]
            slots = [i for i, j in enumerate(layers) if j == index]
            layer.input_layernorm = ResidualTap(layer.input_layernorm, self.sink, slots)

    def take(self) -> list[torch.Tensor]:
        """The last pass's states [T, hidden] each; the taps then hold nothing."""
        kept = [t for t in self.sink if t is not None]
        assert len(kept) == len(self.sink), "a tapped layer did not run"
        self.sink[:] = [None] * len(self.sink)
        return kept
