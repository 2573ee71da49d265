"""The executor: one per device (later one per tensor-parallel rank). It owns the module, the K/V
pool and recurrent-state tensors, the attention backend and the LoRA layers, and does two things:
run a `StepBatch` through the model, and move cache bytes when the cache manager asks
(`KVMover`). It keeps no per-sequence bookkeeping: that is the cache manager's.
"""

from __future__ import annotations

import copy
import gc
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from model_service.attention.kv_cache import KVCache, cache_bytes_per_block, cache_dtype
from model_service.attention.reference import TorchReferenceBackend
from model_service.attention.triton_backend import TritonBackend
from model_service.attention.triton_latent import TritonLatentBackend
from model_service.engine.config import DEFAULT_LORA_ROOM, EngineConfig
from model_service.engine.cuda_graphs import DecodeGraphs
from model_service.engine.hidden_taps import HiddenTaps
from model_service.engine.piecewise_graphs import PiecewiseGraphs
from model_service.engine.speculation import SpeculativeConfig
from model_service.kernels.mla_decode import mla_kernel_applies
from model_service.kernels.paged_attention import triton
from model_service.lora.adapter import LoraAdapter
from model_service.lora.layers import LoraLayers, full_adapter_elements, resident_slots, wrap_lora_layers
from model_service.models.config import ModelConfig
from model_service.models.context import ForwardContext
from model_service.models.layers import store_weights_transposed
from model_service.models.llama import DecoderModel
from model_service.models.loader import LoadedModel
from model_service.models.moe import Experts
from model_service.models.recurrent import RecurrentModel, recurrent_step
from model_service.models.step import AttentionBackend, CapturableBackend, StepBatch

_DEFAULT_CPU_KV_BYTES = 1 << 30


def kv_blocks_for_budget(
    config: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    budget: int | None,
    gpu_memory_utilization: float,
    draft: ModelConfig | None = None,
    state_bytes: int = 0,
    unstored: int = 0,
) -> int:
    """How many K/V blocks fit: `budget` bytes, else a share of free GPU memory less what is
    allocated beside the pool (`state_bytes`: recurrent state tensors, the adapter arena), else
    1 GiB on CPU. With a draft
    model (or an MTP layer: `draft` is its config), each block of the target's pool comes with
    one of the draft's. A model with no attention layer (only recurrent ones) stores nothing in
    a block, whose table still counts positions: it gets `unstored` blocks."""
    per_block = sum(
        cache_bytes_per_block(c, block_size, dtype) for c in [config, *([draft] if draft is not None else [])]
    )
    if per_block == 0:
        return unstored
    if budget is None:
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            budget = int(free - total * (1 - gpu_memory_utilization)) - state_bytes
        else:
            budget = _DEFAULT_CPU_KV_BYTES
    return max(budget // per_block, 0)


def lora_arena_elements(module: nn.Module, config: EngineConfig) -> int:
    """Elements of the adapter arena (lora/layers.py) for `module`: `--lora-memory-bytes`, else
    room for `DEFAULT_LORA_ROOM` adapters of `--max-lora-rank` on every projection (what the
    default's fixed, padded slots took before the arena)."""
    if config.max_loras == 0:
        return 0
    if config.lora_memory_bytes is not None:
        return config.lora_memory_bytes // next(module.parameters()).element_size()
    return DEFAULT_LORA_ROOM * full_adapter_elements(module, config.max_lora_rank)


def recurrent_state_bytes(module: nn.Module, num_slots: int) -> int:
    """Device bytes of the float32 state tensors `ModelExecutor` allocates for `num_slots` slots."""
    if not isinstance(module, RecurrentModel):
        return 0
    return 4 * num_slots * sum(math.prod(shape) for shape in module.recurrent_state_shapes())


def kv_layout(
    model: ModelConfig,
    config: EngineConfig,
    dtype: torch.dtype,
    device: torch.device,
    draft: ModelConfig | None = None,
    state_bytes: int = 0,
) -> tuple[int, int]:
    """(K/V blocks, context length) for a module already on `device` whose K/V is shaped by `model`
    and computed in `dtype` (stored as `config.kv_cache_dtype` says)."""
    longest = model.context_length(config.max_model_len)
    num_blocks = config.num_kv_blocks or kv_blocks_for_budget(
        model,
        config.block_size,
        cache_dtype(config.kv_cache_dtype, dtype, device),
        device,
        config.kv_cache_memory_bytes,
        config.gpu_memory_utilization,
        draft,
        state_bytes,
        unstored=config.max_num_seqs * -(-longest // config.block_size),
    )
    max_model_len = min(longest, num_blocks * config.block_size)
    return num_blocks, max_model_len


def own_module_tree(module: nn.Module) -> nn.Module:
    """A copy of `module`'s structure over the same weight tensors. Wrapping layers for LoRA
    replaces submodules; this keeps that from changing a module another engine may be running."""
    memo = {id(t): t for t in itertools.chain(module.parameters(), module.buffers())}
    return copy.deepcopy(module, memo)


class ModelExecutor:
    """Implements `KVMover` and the LoRA `SlotWriter` for one device."""

    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig,
        num_blocks: int,
        max_model_len: int,
        num_state_slots: int = 0,
        aux_layers: tuple[int, ...] = (),
        head_rows: int = 0,
    ) -> None:
        """`aux_layers`: the layers whose input states each step keeps (EAGLE-3's). `head_rows`:
        for a draft head's executor (an MTP layer, an EAGLE-3 head: its module takes the target's
        hidden states after the positions, `run_head`), the most rows a sequence brings to one of
        its steps (k + 1: a verified run fed back); 0 for a model of its own."""
        self.max_model_len, self.head_rows = max_model_len, head_rows
        spec = SpeculativeConfig.from_json(config.speculative_config)
        # MTP and EAGLE-3 speculation read each step's hidden states (`hidden`): MTP the residual
        # stream after the last layer, EAGLE-3 the states entering `aux_layers` (a list, one per
        # layer); views of a decode graph's static outputs when the step replays one.
        self.keeps_hidden = spec is not None and spec.keeps_hidden
        self.hidden: torch.Tensor | list[torch.Tensor] | None = None
        own = config.max_loras > 0 or bool(aux_layers)  # wrapping layers must not touch a shared tree
        self.module = own_module_tree(loaded.module) if own else loaded.module
        self.taps = HiddenTaps(self.module, aux_layers) if aux_layers else None
        self.config = loaded.config
        param = next(self.module.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.kv_cache = self._kv_cache(config, num_blocks)
        self.lora_arena = (lora_arena_elements(self.module, config), param.element_size())
        self.lora_slots = resident_slots(self.module, self.lora_arena[0]) if config.max_loras > 0 else 0
        self.lora = self._wrap_lora(config)
        self.state_tensors = self._state_tensors(num_state_slots)  # before the graphs, which read them
        self.attention, self.graphs, self.pieces = self._attention(config)
        if self.device.type == "cuda":
            store_weights_transposed(self.module)  # before any graph is captured (lazily)

    def _kv_cache(self, config: EngineConfig, num_blocks: int) -> KVCache:
        dtype = cache_dtype(config.kv_cache_dtype, self.dtype, self.device)
        return KVCache.for_model(self.config, num_blocks, config.block_size, dtype, self.device)

    def _wrap_lora(self, config: EngineConfig) -> LoraLayers | None:
        """The module's projections wrapped for `lora_slots` resident adapters (none without
        `--max-loras`); with the LoRA kernels where the rank width is a power of two, as they need."""
        if config.max_loras == 0:
            return None
        rank = config.max_lora_rank
        use_kernels = self._kernels_apply() and rank & (rank - 1) == 0
        return wrap_lora_layers(self.module, self.lora_slots, rank, self.lora_arena[0], use_kernels)

    def _attention(
        self, config: EngineConfig
    ) -> tuple[AttentionBackend, DecodeGraphs | None, PiecewiseGraphs | None]:
        """The attention backend, and the CUDA graphs that replay steps over it (the Triton
        backends' only: the reference backend cannot be captured). Soft-capped attention logits
        (Gemma 2) and attention sinks (gpt-oss) are switches of the Triton kernels (gpt-oss's
        experts keep its steps eager: `_graphs_apply`)."""
        cfg = self.config
        if cfg.latent_attention is not None:
            return self._latent_attention(config)
        args = (self.kv_cache, cfg.sliding_windows, cfg.head_dim, cfg.softmax_scale)  # Granite's, Gemma's own
        if not self._kernels_apply():
            return TorchReferenceBackend(*args, cfg.attn_logit_softcapping), None, None
        backend = TritonBackend(*args, cfg.attn_logit_softcapping)
        if config.enforce_eager or not self._graphs_apply():
            return backend, None, None
        # the pieces hand out no hidden states: a step that keeps them and replays no decode graph is eager
        pieces = None if self.keeps_hidden else self._piecewise_graphs(config, backend)
        return backend, self._decode_graphs(config, backend), pieces

    def _latent_attention(
        self, config: EngineConfig
    ) -> tuple[AttentionBackend, DecodeGraphs | None, PiecewiseGraphs | None]:
        """MLA: the torch reference off CUDA; on CUDA decode rows through the latent kernel, and
        decode graphs where the kernel applies (no piecewise graphs: prefill is in torch)."""
        cfg = self.config
        args = (self.kv_cache, cfg.sliding_windows, cfg.head_dim, cfg.softmax_scale)
        if self.device.type != "cuda" or triton is None:
            return TorchReferenceBackend(*args), None, None
        backend = TritonLatentBackend(*args)
        latent = cfg.latent_attention.kv_lora_rank if cfg.latent_attention is not None else 0
        if config.enforce_eager or not self._graphs_apply() or not mla_kernel_applies(self.device, latent):
            return backend, None, None
        return backend, self._decode_graphs(config, backend), None

    def _state_tensors(self, num_slots: int) -> list[torch.Tensor]:
        """Float32 tensors [slots, ...], as many per recurrent layer as the model lists; none for
        attention-only models."""
        if not isinstance(self.module, RecurrentModel) or num_slots == 0:
            return []
        shapes = self.module.recurrent_state_shapes()
        return [torch.zeros(num_slots, *shape, dtype=torch.float32, device=self.device) for shape in shapes]

    def capture_graphs(self, adapter_targets: Sequence[frozenset[str]] = ()) -> None:
        """Capture every piecewise bucket and every decode graph (nothing without graphs: CPU,
        eager); after `__init__`, once the weights have their final layout. `adapter_targets`:
        the PEFT modules of the registered adapters, most common first: the decode graphs of
        their kinds of projection are captured too (`cuda_graphs.captured_kinds`)."""
        if self.pieces is not None:
            self.pieces.capture_all()
        if self.graphs is not None:
            layers = self.lora
            kinds = [layers.kinds_of_targets(t) for t in adapter_targets] if layers is not None else []
            self.graphs.capture_all(kinds)

    def _piecewise_graphs(self, config: EngineConfig, backend: TritonBackend) -> PiecewiseGraphs | None:
        """Dense and MoE models (every expert path that `_graphs_apply` admits is capturable at any
        token count); not hybrids, whose prefill runs the chunked scan over a plan built on the
        host each step."""
        attention_only = not self.config.num_state_layers
        if not (config.piecewise_graphs and attention_only and isinstance(self.module, DecoderModel)):
            return None
        plan = self.lora.plan if self.lora is not None else None
        return PiecewiseGraphs(
            self.module, backend, config.max_num_batched_tokens, self.device, plan, config.max_num_seqs
        )

    def _decode_graphs(self, config: EngineConfig, backend: CapturableBackend) -> DecodeGraphs:
        plan = self.lora.plan if self.lora is not None and self.lora.plan.use_kernels else None
        spec = SpeculativeConfig.from_json(config.speculative_config)
        rows_per_seq = self.head_rows or 1 + (spec.num_speculative_tokens if spec is not None else 0)
        max_rows = config.max_num_seqs * rows_per_seq  # verify runs replay with a row per token
        forward, inputs = self._graph_forward(max_rows)
        return DecodeGraphs(
            forward, backend, max_rows, self.max_model_len, self.device, plan, self.state_tensors,
            inputs, self.head_rows,
        )  # fmt: skip

    def _graph_forward(self, max_rows: int) -> tuple[Callable[..., Any], tuple[torch.Tensor, ...]]:
        """What the decode graphs capture, and the static buffers of its inputs after the ids and
        positions: a draft head's forward over a buffer of the target's hidden states, the
        target's forward that keeps its hidden states (MTP, EAGLE-3), or the module's."""
        if self.head_rows:
            hidden = torch.zeros(max_rows, self.config.hidden_size, dtype=self.dtype, device=self.device)
            return self.module, (hidden,)
        return (self._forward_keeping if self.keeps_hidden else self.module), ()

    def _forward_keeping(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, ...]:
        """The logits of `ctx.logits_rows`, then the states the proposer reads, one row per
        token: the residual stream after the last layer (MTP), or those the taps kept entering
        EAGLE-3's layers. The pass's own tensors, no copies (under a graph: of its pool)."""
        hidden = self.module.hidden_states(input_ids, positions, ctx)
        kept = self.taps.take() if self.taps is not None else [hidden]
        return (self.module.logits(hidden, ctx.logits_rows), *kept)

    def _kernels_apply(self) -> bool:
        """The Triton backend runs on CUDA for power-of-two head sizes (every common model)."""
        dim = self.config.head_dim
        return self.device.type == "cuda" and triton is not None and dim >= 16 and dim & (dim - 1) == 0

    def _graphs_apply(self) -> bool:
        """MoE experts are capturable where each says so (`Experts.capturable`): on their fused
        (CUDA with Triton, sm80+; sm89+ in FP8) or grouped path (bf16, sm90+), gpt-oss's on the
        fused path alone (biases and clamped SwiGLU); elsewhere the expert loop reads token
        counts on the host, so decode steps run eagerly. Hybrid models' recurrent layers run their
        decode and verify steps through the step kernels, over static state runs (`StaticRuns`):
        captured as dense ones."""
        experts = [m for m in self.module.modules() if isinstance(m, Experts)]
        return all(m.capturable(self.device) for m in experts)

    @torch.inference_mode()
    def execute(self, batch: StepBatch, fed: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 logits [len(batch.logits_rows), vocab], row i for `batch.logits_rows[i]`; `fed`
        (async scheduling): the step before's sampled tokens, still on the device, which the rows
        `batch.feed_index` names take as input ids (queued after the step that samples them)."""
        index = batch.feed_index
        if fed is not None and index is not None and index.shape[1]:
            # Two plain ops: the advanced-indexing assignment cost the host ~80 us a step (py-spy
            # of a batch-1 hybrid decode on an H100, 2026-12-07 am).
            batch.input_ids.index_copy_(0, index[0], fed.index_select(0, index[1]).to(batch.input_ids.dtype))
        # Each path sets up what it reads: a replay's LoRA kernels read the static buffers `run`
        # fills (slots; the pieces' tiles too), never the LoRA plan, which only an eager pass reads.
        if self.graphs is not None and self.graphs.can_run(batch):
            logits, *kept = self.graphs.run(batch)
        elif self.pieces is not None and self.pieces.can_run(batch):
            return self.pieces.run(batch)
        else:
            logits, *kept = self._run_eager(batch)
        if self.keeps_hidden:
            self.hidden = kept if self.taps is not None else kept[0]
        return logits

    def _run_eager(self, batch: StepBatch) -> tuple[torch.Tensor, ...]:
        if self.lora is not None:
            self.lora.plan.prepare(batch)
        self.attention.prepare(batch)
        recurrent = recurrent_step(batch, self.state_tensors) if self.state_tensors else None
        ctx = ForwardContext(attention=self.attention, logits_rows=batch.logits_rows, recurrent=recurrent)
        if self.keeps_hidden:
            return self._forward_keeping(batch.input_ids, batch.positions, ctx)
        return (self.module(batch.input_ids, batch.positions, ctx),)

    @torch.inference_mode()
    def run_head(self, batch: StepBatch, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A draft head's step (`head_rows`): `batch` with the target's hidden states [T, H] (or
        the head's own, chained) beside its ids. Returns the float32 logits and the head's output
        states at `batch.logits_rows`; replayed from a decode graph where one can run it (the
        output then a view of the graph's, valid until the head's next step), else eager. No LoRA, no
        recurrent state."""
        if self.graphs is not None and self.graphs.can_run(batch):
            logits, out = self.graphs.run(batch, hidden)
            return logits, out
        self.attention.prepare(batch)
        ctx = ForwardContext(attention=self.attention, logits_rows=batch.logits_rows)
        logits, out = self.module(batch.input_ids, batch.positions, hidden, ctx)
        return logits, out[batch.logits_rows]

    # --- KVMover ------------------------------------------------------------------------

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        bs, kv = self.kv_cache.block_size, self.kv_cache.movable
        for src, dst in pairs:
            kv[:, :, dst * bs : (dst + 1) * bs] = kv[:, :, src * bs : (src + 1) * bs]

    def save_blocks(self, blocks: list[int], num_tokens: int) -> torch.Tensor:
        return self.kv_cache.movable[:, :, self.kv_cache.block_slots(blocks, num_tokens)].to("cpu")

    def load_blocks(self, saved: torch.Tensor, blocks: list[int]) -> None:
        slots = self.kv_cache.block_slots(blocks, saved.shape[2])
        self.kv_cache.movable[:, :, slots] = saved.to(self.device)

    def copy_state(self, src: int, dst: int) -> None:
        for t in self.state_tensors:
            t[dst] = t[src]

    def save_state(self, slot: int) -> torch.Tensor:
        """Every state tensor's row `slot`, flattened into one float32 host tensor (their shapes differ)."""
        if not self.state_tensors:
            return torch.empty(0)
        return torch.cat([t[slot].reshape(-1) for t in self.state_tensors]).to("cpu")

    def load_state(self, saved: torch.Tensor, slot: int) -> None:
        sizes = [t[0].numel() for t in self.state_tensors]
        for t, part in zip(self.state_tensors, saved.to(self.device).split(sizes), strict=True):
            t[slot] = part.view(t.shape[1:])

    # --- LoRA SlotWriter -----------------------------------------------------------------

    def load_slot(self, slot: int, adapter: LoraAdapter, offset: int) -> None:
        assert self.lora is not None, "max_loras is 0: this executor has no LoRA slots"
        self.lora.load_slot(slot, adapter, offset)

    def clear_slot(self, slot: int) -> None:
        assert self.lora is not None, "max_loras is 0: this executor has no LoRA slots"
        self.lora.clear_slot(slot)

    def move_slot(self, slot: int, offset: int) -> None:
        assert self.lora is not None, "max_loras is 0: this executor has no LoRA slots"
        self.lora.move_slot(slot, offset)

    def on_lost(self, callback: Callable[[str], None]) -> None:
        """One device has no peer to lose: `callback` is never called (see the tensor-parallel executor)."""

    def teardown(self) -> None:
        """Release device memory; the executor is unusable afterwards. The graphs go first: a
        graph that recorded NCCL collectives keeps the communicator busy, and destroying the
        process group under it hangs (pytorch/pytorch#115388)."""
        self.graphs = self.pieces = None
        gc.collect()  # a graph in a reference cycle would outlive the line above
        self.kv_cache.data = torch.empty(0)
        self.module.to("meta")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
