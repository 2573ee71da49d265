"""What a model's layers may use in one forward pass besides their activations.

Its own module because it names both the attention backend's protocol (models/step.py) and the
recurrent layers' state (models/recurrent.py, which plans from a `StepBatch`): in either of
those it would make the two import each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_service.models.recurrent import RecurrentStep
from model_service.models.step import AttentionBackend

Rope = tuple[torch.Tensor, torch.Tensor]  # a step's cos and sin, as `RotaryEmbedding` gives them
LayerOutput = tuple[torch.Tensor, torch.Tensor]  # (a layer's output, the residual stream before it)


@dataclass
class ForwardContext:
    attention: AttentionBackend  # already prepared for this step's batch
    logits_rows: torch.Tensor  # [N] rows to run the LM head on
    recurrent: RecurrentStep | None = None  # state tensors and this step's plan (hybrid models only)
