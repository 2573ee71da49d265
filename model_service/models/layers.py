"""Building blocks shared by model architectures."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in float32 as the reference implementations do; bf16 variance drifts.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class PackedLinear(nn.Linear):
    """Projections of one input fused into one matmul: q/k/v, or gate/up, or a single one.

    `parts` are the checkpoint (and PEFT) names of the fused projections, `output_sizes` their
    widths in output order: the loader concatenates checkpoint tensors by them, and the LoRA
    layers apply each part's adapter to its own output columns.
    """

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.parts, self.output_sizes = tuple(parts), tuple(parts.values())


def checkpoint_layout(module: nn.Module) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """Each parameter of `module` -> the checkpoint tensors (name, shape) it is made of, in order.

    A `PackedLinear` parameter is the concatenation of its parts' tensors along dim 0; every other
    parameter is one checkpoint tensor of its own name.
    """
    layout = {name: [(name, tuple(t.shape))] for name, t in module.state_dict().items()}
    for prefix, sub in module.named_modules():
        if not isinstance(sub, PackedLinear):
            continue
        owner = prefix.rpartition(".")[0]
        for pname, param in (("weight", sub.weight), ("bias", sub.bias)):
            if param is None:
                continue
            rest = tuple(param.shape[1:])
            layout[f"{prefix}.{pname}"] = [
                (f"{owner}.{part}.{pname}", (size, *rest))
                for part, size in zip(sub.parts, sub.output_sizes, strict=True)
            ]
    return layout


def checkpoint_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """`module`'s weights under checkpoint names: fused projections split back into their parts."""
    state = module.state_dict()
    out: dict[str, torch.Tensor] = {}
    for name, parts in checkpoint_layout(module).items():
        pieces = state[name].split([shape[0] for _, shape in parts])
        out.update({part: piece for (part, _), piece in zip(parts, pieces, strict=True)})
    return out
