"""Engine settings. Names follow vLLM's flags so operators can guess them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class EngineConfig:
    model: str = "smollm2-135m-instruct"
    device: str = "auto"  # auto = cuda when available
    dtype: str = "auto"  # auto = float32 on CPU, bfloat16 on CUDA
    block_size: int = 16
    num_kv_blocks: int | None = None  # overrides the memory budget below
    kv_cache_memory_bytes: int | None = None  # default: 1 GiB on CPU, 90% of free memory on CUDA
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = 2048  # token budget of one step (prefill chunk size)
    max_num_seqs: int = 256
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_waiting_requests: int = 1024  # beyond this, new requests get RESOURCE_EXHAUSTED
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"  # or "swap": preempted KV goes to host memory
    swap_space_bytes: int = 4 << 30  # host memory for swapped KV; beyond it, recompute
    max_loras: int = 4  # adapters resident on the compute device (GPU slots)
    max_cpu_loras: int = 16  # parsed adapters kept in host memory
    max_lora_rank: int = 64
    lora_modules: dict[str, str] = field(
        default_factory=dict
    )  # name -> PEFT adapter dir, registered at start
    enforce_eager: bool = False  # CUDA: no CUDA graphs for decode steps (debugging, profiling)
    adapter_wait_timeout_s: float = 30.0  # a request waits this long for its adapter to get a slot

    def __post_init__(self) -> None:
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.block_size < 1 or self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("block_size, max_num_batched_tokens and max_num_seqs must be positive")

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        try:
            return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
                self.dtype
            ]
        except KeyError:
            raise ValueError(
                f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            ) from None
