"""EAGLE-3 speculation: a draft head trained on the target (models/eagle3.py) proposes k tokens per
decoding sequence from three of the target's layers' states, chained k times, all sequences
batched.

Where the states come from: with method "eagle3" the target's executor keeps, each step, the
residual stream entering the head's `aux_layers` (engine/hidden_taps.py: references to the
tensors the model made, no copy); right after the forward pass the step's rows go through the
head's `fc` in one pass (`fuse`, handed to `Speculation`), and each sequence's fused rows
(views) to `on_forward`. From there the head is fed exactly as the MTP layer is
(engine/mtp.py's `HiddenStateProposer`): position p runs once token p + 1 is known, a prefill
chunk's positions in the chunk's own step, the rest before proposing; the first proposal comes
from the fused target state, each further one chained on the head's own output; proposals are
over the head's reduced vocabulary, mapped to target ids by `d2t` inside the head.

Its K/V is a paged cache of its own beside the target's (one layer, as many blocks, the same
budget, its own prefix cache under the target's keys), cut back to the positions fed from the
target's states after every verify: chained rows never outlive their step, so a rejection
leaves nothing stale (a named test).
"""

from __future__ import annotations

import torch

from model_service.engine.config import EngineConfig
from model_service.engine.mtp import HiddenStateProposer
from model_service.models.eagle3 import Eagle3Config, Eagle3Draft
from model_service.models.loader import LoadedModel


class Eagle3Proposer(HiddenStateProposer):
    """Implements `speculation.Proposer` with an EAGLE-3 head."""

    def __init__(
        self,
        head: Eagle3Draft,
        head_config: Eagle3Config,
        target: LoadedModel,
        config: EngineConfig,
        num_blocks: int,
        max_model_len: int,
    ) -> None:
        loaded = LoadedModel(f"{target.name} (EAGLE-3 head)", head_config.layer, head, None)
        super().__init__(loaded, config, num_blocks, max_model_len)
        self.head = head

    @torch.inference_mode()
    def fuse(self, aux: list[torch.Tensor]) -> torch.Tensor:
        """The step's fused hidden rows [T, hidden] from the target's kept states."""
        return self.head.fuse(aux)
