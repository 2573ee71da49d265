"""The `Executor` protocol the engine drives, and `build_executor`, which picks its implementation.

Two classes implement it: `ModelExecutor` (engine/executor.py), one device, and
`TensorParallelExecutor` (distributed/executor.py), rank 0 in front of every rank of a group,
which runs a `ModelExecutor` on each rank's shard. This module sits above both, so that the
single-device executor never imports the tensor-parallel one that is built on it (no cycle).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from model_service.attention.kv_cache import KVCache
from model_service.distributed.executor import start_tensor_parallel
from model_service.engine.cache_manager import KVMover
from model_service.engine.config import EngineConfig
from model_service.engine.executor import ModelExecutor, kv_layout, lora_arena_elements, recurrent_state_bytes
from model_service.errors import ModelLoadError
from model_service.lora.pool import SlotWriter
from model_service.models.config import ModelConfig
from model_service.models.loader import LoadedModel
from model_service.models.step import StepBatch

log = logging.getLogger(__name__)


class Executor(KVMover, SlotWriter, Protocol):
    """Runs step batches through the model and moves cache bytes and adapter weights when the cache
    manager (`KVMover`) and the LoRA pool (`SlotWriter`) ask. It keeps no per-sequence state, and
    no call depends on which calls came before it (beyond the cache and slot contents they wrote):
    what a step needs arrives with it."""

    device: torch.device  # where the batch's tensors and the logits live (rank 0's, under tensor parallelism)
    dtype: torch.dtype  # the module's compute dtype
    config: ModelConfig  # the model's (rank 0's shard's, under tensor parallelism)
    kv_cache: KVCache  # the K/V pool: its block count and layout (a shard's heads under tensor parallelism)
    max_model_len: int  # the longest sequence the pool and the positions allow
    lora_slots: int  # device-resident adapter slots (0 without LoRA)
    lora_arena: tuple[int, int]  # (elements, bytes per element) of the adapter arena
    # MTP speculation: the last step's residual stream after the last layer [T, hidden]; EAGLE-3:
    # a list of the states entering its auxiliary layers, one [T, hidden] tensor each (None
    # otherwise). A bare `list`: the protocol's members are checked with isinstance
    hidden: torch.Tensor | list | None

    def execute(self, batch: StepBatch, fed: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 logits [len(batch.logits_rows), vocab], row i for `batch.logits_rows[i]`.
        `fed`: async scheduling's in-flight tokens (engine/overlap.py), the step before's sampled
        tokens still on the device; the rows `batch.feed_index` names take theirs as input ids.
        An argument, not state an earlier call left: each call runs on what it is handed."""
        ...

    def capture_graphs(self, adapter_targets: Sequence[frozenset[str]] = ()) -> None:
        """Capture every CUDA graph now (a pod's warm-up), rather than when a step first needs one;
        `adapter_targets`: the PEFT modules the registered adapters target, most common first."""
        ...

    def on_lost(self, callback: Callable[[str], None]) -> None:
        """Call `callback(why)` (from any thread) once, if the executor can no longer run steps."""
        ...

    def teardown(self) -> None:
        """Release the devices (and any worker processes); the executor is unusable afterwards."""
        ...


def build_executor(
    loaded: LoadedModel,
    config: EngineConfig,
    draft: ModelConfig | None,
    state_slots: int,
    aux_layers: tuple[int, ...] = (),
) -> Executor:
    """The executor `config` asks for: this process's device, or rank 0 of a tensor-parallel group
    (whose `loaded` weights are on the host, to be sliced; no draft model, MTP layer or EAGLE-3
    head, no recurrent layers). `draft`: the draft model's, MTP layer's or EAGLE-3 head's config,
    whose K/V blocks share the budget; `aux_layers`: the layers whose input states EAGLE-3 reads."""
    if config.enable_expert_parallel and (config.tensor_parallel_size == 1 or not loaded.config.num_experts):
        log.warning("--enable-expert-parallel has no effect: it splits the experts of an MoE model over "
                    "--tensor-parallel-size > 1 ranks")  # fmt: skip
    if config.tensor_parallel_size > 1:
        if draft is not None:
            raise ModelLoadError(
                "speculation by a draft model, MTP layer or EAGLE-3 head does not run with "
                "--tensor-parallel-size > 1 yet"
            )
        return start_tensor_parallel(loaded, config)
    param = next(loaded.module.parameters())
    state_bytes = recurrent_state_bytes(loaded.module, state_slots)
    state_bytes += lora_arena_elements(loaded.module, config) * param.element_size()
    layout = kv_layout(loaded.config, config, param.dtype, param.device, draft, state_bytes)
    return ModelExecutor(loaded, config, *layout, state_slots, aux_layers)
