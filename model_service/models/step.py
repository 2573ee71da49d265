"""What one forward pass receives, and the seam between a model and its attention backend.

`StepBatch` is backend-neutral: flat token rows of many sequences (decode rows, prefill
chunks, verify runs; any order), described the way paged-attention kernels want them
(`query_start` offsets, `seq_lens`, a block table), plus which rows' logits are wanted (any
number per sequence), each sequence's recurrent-state slot (and the slots that keep copies of it after given
tokens) and each token's LoRA slot. The
engine builds it once per step (engine/batch_builder.py); every layer reads the same one.

A model never builds attention masks or gathers context itself: its layers call
`ctx.attention.forward(layer, q, k, v)`, and the backend keeps whatever metadata it derived from
the batch in `prepare`. Backends that can be captured in CUDA graphs also implement
`GraphCapturable`, whose hooks the executor calls around capture and replay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np
import torch

if TYPE_CHECKING:
    from model_service.kernels.paged_attention import HeadNorms


def to_device(
    host: np.ndarray | list[int] | list[float], device: torch.device, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """A host-planned array (kernel tile tables, grids, sampling parameters) on `device` without
    waiting for it. A copy from pageable memory returns only once every kernel queued before it
    has run, which stalls an overlapped host (async scheduling) until the step before is done; on
    CUDA the copy goes through pinned memory instead, in stream order (the caching host allocator
    keeps the pinned block until the copy is done)."""
    tensor = torch.as_tensor(host, dtype=dtype)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


@dataclass
class StepBatch:
    """One step's inputs on the compute device (T tokens, S sequences, N logits rows)."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T] absolute position of each token in its sequence
    slot_mapping: torch.Tensor  # [T] KV pool slot (block * block_size + offset) each token writes
    query_start: torch.Tensor  # [S + 1] first row of each sequence's run; cu_seqlens_q / qo_indptr
    seq_lens: torch.Tensor  # [S] context length of each sequence once this step's tokens are in
    block_table: torch.Tensor  # [S, max_blocks] block ids of each sequence (0-padded)
    logits_rows: torch.Tensor  # [N] rows whose logits the caller wants, in output order
    state_slots: torch.Tensor  # [S] recurrent-state slot of each sequence (-1 for none)
    lora_slots: torch.Tensor  # [T] LoRA slot serving each token (-1 = base model)
    max_query_len: int  # host copies of the sizes, so backends plan without a device sync
    max_seq_len: int
    host_lora_slots: np.ndarray  # [T] the same LoRA slots on the host (segment planning)
    host_query_start: np.ndarray  # [S + 1] the same query offsets on the host (kernel grids)
    # [T] state slot that receives each token's recurrent state once the token is in (-1: none):
    # the per-position checkpoints of verify rows and the prefix cache's block-boundary snapshots.
    host_state_snapshots: np.ndarray
    # Async scheduling (engine/overlap.py): [2, K] the rows of `input_ids` whose token the step
    # before sampled and is still on the device, and each one's index among that step's tokens;
    # the executor writes those tokens in (`Executor.execute`'s `fed`). None: no such rows.
    feed_index: torch.Tensor | None = None
    # [len(ROW_FIELDS), T]: those fields as the rows of one strided view, where the batch builder
    # laid them out so (a step of one-token rows): a graph replay copies them in with one op.
    row_block: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def uses_lora(self) -> bool:
        return bool((self.host_lora_slots >= 0).any())

    @property
    def num_leading_decodes(self) -> int:
        """How many one-token sequences open the step (the scheduler puts decode rows first):
        a mixed step sends these rows through the per-row kernels tuned for decode (attention,
        LoRA) and only the rest through the tile kernels."""
        longer = np.flatnonzero(np.diff(self.host_query_start) != 1)
        return int(longer[0]) if longer.size else len(self.host_query_start) - 1

    def as_token_rows(self) -> StepBatch:
        """The same step with every token as a one-token sequence of its own, attending to its
        sequence's context up to itself. For a step whose every token is a logits row (decode
        rows and speculative verify runs) this is a decode step, which the decode kernel and its
        CUDA graphs run: a verify step replays a graph instead of launching every kernel from
        Python. Recurrent layers read their runs from the step as scheduled (`StaticRuns`)."""
        num_tokens = self.num_tokens
        seqs = torch.arange(self.num_seqs, device=self.seq_lens.device)
        seq_of = torch.repeat_interleave(seqs, self.query_start.diff(), output_size=num_tokens)
        rows = torch.arange(num_tokens, device=self.seq_lens.device)
        return StepBatch(
            input_ids=self.input_ids,
            positions=self.positions,
            slot_mapping=self.slot_mapping,
            query_start=torch.arange(num_tokens + 1, device=rows.device),
            seq_lens=self.positions + 1,
            block_table=self.block_table[seq_of],
            logits_rows=rows,
            state_slots=self.state_slots[seq_of],
            lora_slots=self.lora_slots,
            max_query_len=1,
            max_seq_len=self.max_seq_len,
            host_lora_slots=self.host_lora_slots,
            host_query_start=np.arange(num_tokens + 1),
            host_state_snapshots=self.host_state_snapshots,  # per token already
        )


@runtime_checkable
class AttentionBackend(Protocol):
    """Attention over the paged KV pool for the layers of one model."""

    def prepare(self, batch: StepBatch) -> None:
        """Derive this backend's own metadata from `batch`; called once per step, before any layer."""

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        norms: HeadNorms | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write this step's K/V of `layer` into the pool, then attend each token to its own
        sequence's context. q: [T, H, D]; k, v: [T, KVH, D]; returns [T, H, D]. With `rope`
        ((cos, sin), [T, D] each), q and k get full-width RoPE first: a backend can fuse it with
        the K/V write. A model with another rotation applies it itself and passes none. With
        `norms` (Qwen3's q_norm and k_norm), q's and k's heads are RMS-normalized before anything
        else: a backend can fuse that with the rotation. With `sinks` [H] (gpt-oss), each head's
        softmax has one more logit, of no value: a backend that cannot add it raises, never drops it."""


@runtime_checkable
class LatentAttentionBackend(Protocol):
    """Attention over a pool of MLA latents (models/deepseek.py): one row per token and layer."""

    def forward_latent(
        self,
        layer: int,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        cache_row: torch.Tensor,
        kv_up: torch.Tensor,
    ) -> torch.Tensor:
        """Write this step's rows of `layer` (cache_row [T, latent + rope]: the normalized latent,
        then the rotated rotary key), then attend each token over its sequence's cached rows,
        a prefix-cache hit's included. q_nope [T, H, Dn]; q_rope [T, H, R], rotated; kv_up
        [H, Dn + Dv, latent]: each head's rows of `kv_b_proj`, which make its key's non-rotary
        part and its value from a latent. Returns [T, H, Dv]."""


# The per-row fields of a decode step that every captured graph reads, and the value a padding
# row holds in each (its K/V slot -1 and length 0: it writes and reads nothing).
ROW_FIELDS = ("input_ids", "positions", "slot_mapping", "lora_slots", "seq_lens")
ROW_PADDING = (0, 0, -1, -1, 0)


class StaticRows:
    """`ROW_FIELDS` of up to `max_rows` decode rows at fixed addresses, for CUDA graphs: the rows
    of one int64 tensor, so a replay copies a step's rows in with one op where the batch holds
    them as one block (`StepBatch.row_block`), and resets rows a bigger step left with one
    more. Each op, even of no elements, costs the host ~10-20 us, and a batch-1 step is ~0.7 ms
    of host time (py-spy on an H100, 2026-12-07 am): five copies and two fills a step were the
    largest part of a replay's own cost."""

    def __init__(self, max_rows: int, device: torch.device) -> None:
        self.padding = torch.tensor(ROW_PADDING, dtype=torch.long, device=device).view(-1, 1)
        # Rows 128 bytes apart, as the batch builder aligns its regions: Triton compiles a kernel
        # once per alignment of its pointer arguments.
        self.data = self.padding.expand(len(ROW_FIELDS), -(-max_rows // 16) * 16).clone()
        # Views of its rows, in `ROW_FIELDS`' order: what captured graphs read.
        self.input_ids, self.positions, self.slot_mapping, self.lora_slots, self.seq_lens = self.data
        self.dirty = 0  # rows at and past this hold padding

    def for_capture(self) -> None:
        """Padding in every row, as a capture records them."""
        self._pad(0)

    def fill(self, batch: StepBatch) -> None:
        """`batch`'s rows (one per token), padding in every row after them, as a graph of any
        size wants its padding rows."""
        n = batch.num_tokens
        if batch.row_block is not None:
            self.data[:, :n].copy_(batch.row_block)
        else:
            for row, name in zip(self.data, ROW_FIELDS, strict=True):
                row[:n] = getattr(batch, name)
        self._pad(n)
        self.dirty = n

    def _pad(self, n: int) -> None:
        """Padding in rows n.. where an earlier step left its own."""
        if self.dirty > n:
            self.data[:, n : self.dirty] = self.padding
            self.dirty = n


@runtime_checkable
class GraphCapturable(Protocol):
    """A backend whose `forward` can be recorded in a CUDA graph over fixed-address buffers."""

    def init_graph_capture(self, rows: StaticRows, max_seq_len: int) -> None:
        """Allocate the static metadata buffers every captured graph reads beside `rows` (the
        graphs' per-row inputs, K/V slots and lengths among them, filled by the graph runner)."""

    def prepare_for_capture(self, num_seqs: int) -> None:
        """Fill the static buffers with a dummy decode batch of `num_seqs` rows before capture."""

    def prepare_for_replay(self, batch: StepBatch) -> None:
        """Copy `batch`'s metadata beyond `rows` into the static buffers."""


@runtime_checkable
class CapturableBackend(AttentionBackend, GraphCapturable, Protocol):
    """An attention backend a CUDA-graph runner can capture."""
