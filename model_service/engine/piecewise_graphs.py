"""CUDA graphs for prefill and mixed steps of up to 4,096 tokens, split at every attention call.

A step that carries a prefill chunk cannot replay a decode graph: its attention kernel's grid
and metadata follow the chunk lengths, planned on the host. Run eagerly, it pays the host's
launch cost for every kernel (~400 a step on a 32-layer model, 15-60 us each on a slow host),
and a small step is host-bound. Here everything but attention is captured, once per padded token
count (a ladder of buckets), as one graph per stretch between two attention calls (vLLM's
piecewise graphs): the forward runs once under capture with a `_SplitAtAttention` backend that
ends the current graph at each attention call, keeps that call's q / k / v / RoPE (tensors of the
graph pool: fixed addresses) and hands back a static output buffer, then begins the next graph.
A replay runs graph 0, the real attention on the step's rows (eager: `backend.prepare` planned
it), copies its output into the static buffer, graph 1, ... and the LM head on the step's logits
rows last, eagerly. Padding rows (id 0, KV slot -1) compute garbage nobody reads.

With the LoRA kernels on, every bucket is captured twice: without LoRA, and with both kinds of
LoRA kernels over static buffers (`LoraStepPlan.for_pieces`: per-row slots for the step's
leading decode rows, row tiles for every LoRA row after them, at most `tile_capacity` tiles;
`piece_tiles`). An eager mixed step with LoRA rows paid ~20 ms of Triton launches on the host,
more than the device time of a few-hundred-token step (8B shape, 64 adapters:
docs/performance-notes.md, session k). The per-row kernels cover only the bucket's first `max_num_seqs` rows
(there is at most one decode row a sequence): over all 512 rows of the largest bucket they
started ~200,000 programs a layer that had nothing to do.

Every replay writes each pooled tensor before reading it, so all buckets share one pool; each
bucket keeps its attention calls' q / k / v, and more: ~0.65 MB a token of the bucket stays
allocated on the 8B shape (0.9 with an output buffer per call, before they shared one; measured
per bucket: docs/performance-notes.md, session l, lead 3), ~5 GB for the ladder of a 2,048-token
budget, twice that with the LoRA buckets. Buckets are captured only by
`capture_all`, in the pod's warm-up (`Engine.warm_up`), smallest first and only while they fit
in the device memory the K/V pool left (`capture_reserve` kept free for eager steps): a card
with less headroom captures fewer buckets instead of failing to start. Steps without a bucket
(before the warm-up, larger than the ladder or than the buckets captured, with more tiles than
the bucket holds) run eagerly, as do models without decode graphs.
"""

from __future__ import annotations

import bisect
import logging

import numpy as np
import torch

from model_service.attention.triton_backend import TritonBackend
from model_service.kernels.lora_grouped import TILE_ROWS, lora_tiles
from model_service.kernels.paged_attention import HeadNorms
from model_service.lora.layers import LoraStepPlan
from model_service.models.context import ForwardContext
from model_service.models.llama import DecoderModel
from model_service.models.step import StepBatch, to_device

Rope = tuple[torch.Tensor, torch.Tensor] | None
Norms = HeadNorms | None
log = logging.getLogger(__name__)


# The largest bucket. Steps of a full token budget (2,048 by default: a prefill chunk beside the
# decode rows, most steps of a busy pod) ran eagerly when the ladder stopped at 512, and in FP8
# the host's launches outlasted the device (8B shape: ~43 ms a step against ~31 of kernels).
LADDER_TOP = 4096


def token_ladder(max_tokens: int) -> list[int]:
    """Padded token counts: every 16 up to 128, every 64 up to 512, then 768, 1,024 and every
    512 up to `max_tokens` (at most `LADDER_TOP`). Coarser steps above 512 keep the ladder's
    memory (~0.9 MB a bucket token on the 8B shape) and capture time in check; their padding
    costs a large step at most a third more rows."""
    top = min(max_tokens, LADDER_TOP)
    sizes = [*range(16, 129, 16), *range(192, 513, 64), 768, *range(1024, top + 1, 512)]
    return sorted({*(s for s in sizes if s < top), top})


def tile_capacity(size: int) -> int:
    """LoRA row tiles a bucket of `size` tokens records: full tiles for every row plus one
    partial tile for each of 16 runs (prefill chunks of distinct adapters); a step with more
    runs of tile length runs eagerly."""
    return -(-size // TILE_ROWS) + 16


def piece_tiles(batch: StepBatch) -> tuple[int, np.ndarray]:
    """(leading decode rows, row tiles of every LoRA row after them) of a step a LoRA bucket
    replays: the per-row kernels serve the first, the tile kernels the rest, short runs too."""
    lead = batch.num_leading_decodes
    tiles = lora_tiles(batch.host_lora_slots[lead:])
    tiles[:, :2] += lead
    return lead, tiles


def capture_reserve(total_bytes: int) -> int:
    """Device memory the capture leaves free for eager steps (a 2,048-token chunk's activations
    and logits on the 8B shape take well under 1 GiB): 1 GiB, or 5% of larger cards."""
    return max(1 << 30, total_bytes // 20)


class _Pieces:
    """One bucket's graphs and the attention calls between them."""

    def __init__(self) -> None:
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.calls: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, Rope, Norms, torch.Tensor]] = []
        self.hidden: torch.Tensor | None = None


class _SplitAtAttention:
    """The attention backend a bucket's forward sees while it is captured: every call closes the
    graph so far and opens the next one; with `capturing` off (the warm-up) it only returns an
    output buffer.

    Every call of every bucket returns rows of one buffer (`outputs`, by dtype and row shape,
    outside the pool): a layer's output is read only by the graph right after it (o_proj, its
    LoRA), before the next attention call writes the buffer again, and one bucket replays at a
    time. A buffer per call and bucket was ~0.26 MB a bucket token on the 8B shape."""

    def __init__(
        self, pieces: _Pieces, pool: tuple[int, int] | None, capturing: bool, outputs: dict, rows: int
    ) -> None:
        self.pieces, self.pool, self.capturing = pieces, pool, capturing
        self.outputs, self.rows = outputs, rows

    def begin(self) -> None:
        if self.capturing:
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=self.pool)
            self.pieces.graphs.append(graph)

    def end(self) -> None:
        if self.capturing:
            self.pieces.graphs[-1].capture_end()
            self.pool = self.pool or self.pieces.graphs[-1].pool()

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: Rope = None,
        norms: Norms = None,
    ) -> torch.Tensor:
        self.end()
        key = (q.dtype, tuple(q.shape[1:]))
        if key not in self.outputs:  # outside the pool: persists
            self.outputs[key] = torch.zeros(self.rows, *q.shape[1:], dtype=q.dtype, device=q.device)
        out = self.outputs[key][: q.shape[0]]
        if self.capturing:
            self.pieces.calls.append((layer, q, k, v, rope, norms, out))
        self.begin()
        return out


class PiecewiseGraphs:
    def __init__(
        self,
        module: DecoderModel,
        backend: TritonBackend,
        max_tokens: int,
        device: torch.device,
        lora: LoraStepPlan | None,
        max_lead_rows: int,
    ) -> None:
        self.module, self.backend, self.lora = module, backend, lora
        self.max_lead_rows = max_lead_rows  # decode rows a step can open with: one a sequence
        self.ladder = token_ladder(max_tokens)
        self.input_ids = torch.zeros(self.ladder[-1], dtype=torch.long, device=device)
        self.positions = torch.zeros(self.ladder[-1], dtype=torch.long, device=device)
        self.stream = torch.cuda.Stream(device=device)
        top = self.ladder[-1]
        self.lora_slots = torch.full((min(top, max_lead_rows),), -1, dtype=torch.long, device=device)
        self.lora_tiles = torch.zeros(tile_capacity(top), 3, dtype=torch.int32, device=device)
        self._planned: tuple[StepBatch, int, np.ndarray] | None = None  # `piece_tiles` of the last step
        self.buckets: dict[tuple[int, bool], _Pieces] = {}
        self.pool: tuple[int, int] | None = None
        self.outputs: dict = {}  # the attention calls' output buffers (`_SplitAtAttention`)

    @property
    def with_lora(self) -> bool:
        return self.lora is not None and self.lora.use_kernels

    def can_run(self, batch: StepBatch) -> bool:
        """A step with LoRA rows needs its tiles to fit the bucket."""
        if batch.num_tokens > self.ladder[-1] or (batch.uses_lora and not self.with_lora):
            return False
        size = self._bucket(batch)
        if (size, batch.uses_lora) not in self.buckets:
            return False
        if not batch.uses_lora:
            return True
        lead, tiles = self._plan(batch)
        return lead <= self.max_lead_rows and len(tiles) <= tile_capacity(size)

    def run(self, batch: StepBatch) -> torch.Tensor:
        n, size = batch.num_tokens, self._bucket(batch)
        pieces = self.buckets[size, batch.uses_lora]
        self.input_ids[:n] = batch.input_ids
        self.positions[:n] = batch.positions
        self.input_ids[n:size] = 0
        self.positions[n:size] = 0
        if batch.uses_lora:
            self._lora_rows(batch, size)
        self.backend.prepare(batch)  # the real step's attention metadata, for the eager calls
        for graph, call in zip(pieces.graphs, [*pieces.calls, None], strict=True):
            graph.replay()
            if call is not None:
                layer, q, k, v, rope, norms, out = call
                rows = rope if rope is None else (rope[0][:n], rope[1][:n])
                out[:n] = self.backend.forward(layer, q[:n], k[:n], v[:n], rows, norms)
        assert pieces.hidden is not None
        return self.module.logits(pieces.hidden[:n], batch.logits_rows)

    def _bucket(self, batch: StepBatch) -> int:
        return self.ladder[bisect.bisect_left(self.ladder, batch.num_tokens)]

    def _plan(self, batch: StepBatch) -> tuple[int, np.ndarray]:
        if self._planned is None or self._planned[0] is not batch:
            self._planned = (batch, *piece_tiles(batch))
        return self._planned[1], self._planned[2]

    def _lora_rows(self, batch: StepBatch, size: int) -> None:
        """The static LoRA buffers for this step: the leading decode rows' slots (-1 after them),
        the tiles of the other LoRA rows, empty tiles after those."""
        lead, tiles = self._plan(batch)
        self.lora_slots[:lead] = batch.lora_slots[:lead]
        self.lora_slots[lead : min(size, self.max_lead_rows)] = -1
        if len(tiles):
            self.lora_tiles[: len(tiles)] = to_device(tiles, self.lora_tiles.device)
        self.lora_tiles[len(tiles) : tile_capacity(size)] = 0

    def capture_all(self) -> None:
        """Capture the buckets now, before serving. A bucket costs two forward passes and ~33
        graph instantiations (~0.65 s on the 8B shape); paid lazily, the first time a step of its
        size showed up, that halved short-prompt serving (3,738 against 7,225 out tok/s eager at
        concurrency 64), so there is no lazy capture. Smallest first, each size without LoRA
        then with it, while the next bucket's memory (extrapolated per token from those
        captured) leaves `capture_reserve` free: where memory runs short, the large buckets are
        the ones left out, whose steps are the least host-bound (a 2,048-token bf16 step on the
        8B shape is device-bound even eager; a LoRA step of a few hundred tokens is not).

        The base buckets capture with the LoRA plan off: the decode graphs' capture leaves it on
        (its last graph has the LoRA kernels over a static slot buffer of one row), and buckets
        captured after them recorded those kernels reading slots far past that buffer: wrong
        tokens, then an illegal address on an H200, in base-model steps."""
        device = self.input_ids.device
        free, total = torch.cuda.mem_get_info(device)
        start, tokens = free, 0
        kinds = (False, True) if self.with_lora else (False,)
        for size, with_lora in ((size, with_lora) for size in self.ladder for with_lora in kinds):
            need = (start - free) * size // tokens if tokens else 0
            if free - need < capture_reserve(total):
                log.warning(
                    "piecewise graphs: %.1f GiB of device memory left; buckets of %d+ tokens not "
                    "captured (those steps run eagerly; a lower --gpu-memory-utilization leaves "
                    "room for them)", free / 2**30, size,
                )  # fmt: skip
                return
            self.buckets[size, with_lora] = self._capture(size, with_lora)
            tokens += size
            free = torch.cuda.mem_get_info(device)[0]

    def _capture(self, size: int, with_lora: bool) -> _Pieces:
        ids, pos = self.input_ids[:size], self.positions[:size]
        pieces = _Pieces()
        if with_lora:  # the buffers hold no work now (slots -1, empty tiles): warm-up runs safely
            rows = min(size, self.max_lead_rows)
            self.lora.for_pieces(self.lora_slots[:rows], self.lora_tiles[: tile_capacity(size)])
        elif self.lora is not None:  # base rows only: the plan's state is whatever the last step
            self.lora.for_capture(ids[:0], kinds=0)  # or decode capture left (`capture_all`)
        with torch.cuda.stream(self.stream):
            for capturing in (False, True):  # a warm-up first: kernel compilation, allocator, cuBLAS
                torch.cuda.synchronize()
                split = _SplitAtAttention(pieces, self.pool, capturing, self.outputs, self.ladder[-1])
                split.begin()
                hidden = self.module.hidden_states(ids, pos, ForwardContext(attention=split, logits_rows=ids))
                split.end()
                self.pool = split.pool
        torch.cuda.synchronize()
        pieces.hidden = hidden
        return pieces
