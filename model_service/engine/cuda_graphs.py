"""CUDA graphs for decode steps, over a ladder of padded batch sizes (nano-vllm's scheme).

A decode step of n sequences replays the graph captured for the smallest ladder size >= n:
the step's per-row inputs (token ids, positions, K/V slots, LoRA slots, lengths) are copied into
`StaticRows` in one op, the attention backend copies its block table into its static buffer
(padding rows write and read nothing), the graph replays every kernel of the forward pass with
no Python in between, and the first n rows
of the static logits are the step's. A pod captures every size at start-up (`capture_all`,
largest first, so the smaller graphs fit in the memory the largest left in the shared pool);
elsewhere a size is captured the first time it is needed. A step with LoRA rows replays a graph
captured with the LoRA kernels (per-token slots in a static buffer too); without the kernels (a
rank width that is not a power of two) it runs eagerly. Graphs are keyed by the kinds of
projection the step's adapters target (`LoraStepPlan.kinds`): a step of q/v adapters replays
one that has no LoRA kernels on o, gate_up and down. The warm-up captures, beside no LoRA, q/k/v
and every kind, the kinds of the adapters registered at start-up; a step whose kinds have no
graph of its size replays the one with every kind where that exists (its kernels add nothing
for a row whose adapter has no weights on a projection) instead of stalling the pod for a
capture (~0.1-0.5 s a size on an 8B model) in the middle of serving. Steps with prefill chunks
replay graphs split at attention (engine/piecewise_graphs.py) when they are small enough, else
run eagerly.
A step of decode rows and speculative verify runs (every token a logits row) replays the graph
of its token count, each token a one-token row of its own
(`StepBatch.as_token_rows`). Models with recurrent layers (hybrids) replay the same graphs: their
linear-attention layers run the step kernels (kernels/gated_delta.py) over static state runs
(`StaticRuns`), which each replay fills from the step as it was scheduled (a verify run stays
one run of its sequence, checkpoints included), while the state stays in the executor's tensors
at fixed addresses, read and written in place.

Speculation that reads the target's hidden states (MTP, EAGLE-3) replays graphs too, on both
sides. The target's captured forward returns the states its proposer reads after the logits
(engine/executor.py: `_forward_keeping`): tensors of the graph's pool, which a replay hands out
as views, no copy, valid until the runner's next replay (its graphs share one pool, so any of
them may overwrite them; the proposer reads them within the step, and the head's graphs are
another runner's). A draft head's forward takes those states as an input after the positions: a static
buffer (`inputs`) each replay fills, like the token ids; its graphs also replay the head's first
step after a verify (the k + 1 accepted positions of each sequence fed back, only the last one's
logits wanted: `max_run`), as token rows whose outputs are gathered at the step's logits rows.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import torch

from model_service.lora.layers import LoraStepPlan
from model_service.models.context import ForwardContext
from model_service.models.recurrent import RecurrentStep, StaticRuns
from model_service.models.step import CapturableBackend, StaticRows, StepBatch

# Kinds of projection a warm-up captures for the registered adapters, beyond none, q/k/v and
# all: each is a graph a ladder size (~0.1-0.5 s each on an 8B model). Steps of other kinds
# replay the graph of all kinds (`DecodeGraphs._graph`).
EXTRA_LORA_KINDS = 4


def captured_kinds(all_kinds: int, registered: Sequence[int]) -> list[int]:
    """The kinds of projection whose decode graphs a warm-up captures: none, q/k/v (PEFT's default
    targets, the first kind the layers wrap), every kind, then the first `EXTRA_LORA_KINDS` others
    of the registered adapters' (most common first)."""
    standard = [0, 1, all_kinds]
    extra = [k for k in dict.fromkeys(registered) if k not in standard]
    return list(dict.fromkeys(standard + extra[:EXTRA_LORA_KINDS]))


def batch_ladder(max_rows: int) -> list[int]:
    sizes = [1, 2, 4, 8, *range(16, max_rows + 1, 16)]
    sizes = [s for s in sizes if s < max_rows]
    return [*sizes, max_rows]


Outputs = tuple[torch.Tensor, ...]


class DecodeGraphs:
    def __init__(
        self,
        forward: Callable[..., torch.Tensor | Outputs],
        backend: CapturableBackend,
        max_rows: int,
        max_seq_len: int,
        device: torch.device,
        lora: LoraStepPlan | None = None,
        state: list[torch.Tensor] | None = None,
        inputs: Outputs = (),
        max_run: int = 0,
    ) -> None:
        """`forward(ids, positions, *inputs, ctx)`: the logits of `ctx.logits_rows` first, then
        any outputs with a row per token (the hidden states a proposer reads). `state`: a hybrid
        model's recurrent-state tensors, which its graphs read and write. `inputs`: static buffers
        [max_rows, ...] for the forward's inputs after the positions (a draft head's hidden
        states), which each replay fills. `max_run`: steps whose runs are at most this long replay
        as token rows whatever their logits rows (a head's feed of verified runs); other steps
        only when every token is a logits row (decode rows, verify runs)."""
        self.forward, self.backend, self.lora = forward, backend, lora
        self.state = state or []
        self.runs = StaticRuns(max_rows, device) if self.state else None
        self.inputs, self.max_run = inputs, max_run
        self.ladder = batch_ladder(max_rows)
        self.static = StaticRows(max_rows, device)  # token ids, positions, K/V slots, LoRA slots, lengths
        backend.init_graph_capture(self.static, max_seq_len)
        self.rows = torch.arange(max_rows, device=device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Outputs]] = {}
        self.pool: tuple[int, int] | None = None

    def can_run(self, batch: StepBatch) -> bool:
        return (
            batch.num_tokens <= self.ladder[-1]
            and (len(batch.logits_rows) == batch.num_tokens or batch.max_query_len <= self.max_run)
            and (self.lora is not None or not batch.uses_lora)
        )

    def run(self, batch: StepBatch, *inputs: torch.Tensor) -> Outputs:
        """The step's outputs at its logits rows: the logits a tensor of their own (the next
        replay overwrites the static ones, and async scheduling reads them after it is launched),
        the others views of the graph's static outputs when every token is a logits row (valid
        until the next replay of any of these graphs: they share one pool), else gathered copies."""
        n = batch.num_tokens  # a row per token once runs are split (`can_run`)
        size = self.ladder[bisect.bisect_left(self.ladder, n)]
        scheduled = batch  # the state runs are the step's as scheduled, a verify run one run
        if batch.max_query_len > 1:
            batch = batch.as_token_rows()
        kinds = self.lora.kinds_of(batch.host_lora_slots) if self.lora is not None else 0
        graph, outputs = self._graph(size, kinds)
        if self.runs is not None:
            self.runs.prepare_for_replay(scheduled, size)
        self.static.fill(batch)
        for buffer, given in zip(self.inputs, inputs, strict=True):
            buffer[:n] = given
        self.backend.prepare_for_replay(batch)
        graph.replay()
        if len(scheduled.logits_rows) == n:  # every token, in order
            return (outputs[0][:n].clone(), *(out[:n] for out in outputs[1:]))
        return tuple(out[:n][scheduled.logits_rows] for out in outputs)

    def _graph(self, size: int, kinds: int) -> tuple[torch.cuda.CUDAGraph, Outputs]:
        """The graph of `size` rows whose LoRA kernels cover `kinds`: its own, else the one of
        every kind where that was captured, else captured now (before any static input is
        filled: a capture pads them)."""
        every = self.lora.all_kinds if self.lora is not None else 0
        if (size, kinds) not in self.graphs and (size, every) in self.graphs:
            kinds = every
        if (size, kinds) not in self.graphs:
            self.graphs[size, kinds] = self._capture(size, kinds)
        return self.graphs[size, kinds]

    def capture_all(self, kinds: Sequence[int] = ()) -> None:
        """Every ladder size, without LoRA, with LoRA on every kind of projection, with it on
        q/k/v alone (PEFT's default targets) and on the registered adapters' `kinds`
        (`captured_kinds`), now: a capture compiles the step's kernels and records them (~0.1-0.5
        s a size on an 8B model), a cost a pod pays before it reports SERVING rather than as
        stalls of its first requests. Steps whose adapters target another set of projections
        replay the graph of every kind (`_graph`)."""
        sets = captured_kinds(self.lora.all_kinds, kinds) if self.lora is not None else [0]
        for size in reversed(self.ladder):
            for kinds in sets:
                if (size, kinds) not in self.graphs:
                    self.graphs[size, kinds] = self._capture(size, kinds)

    def _capture(self, size: int, kinds: int) -> tuple[torch.cuda.CUDAGraph, Outputs]:
        self.backend.prepare_for_capture(size)
        if self.lora is not None:  # the graph records the LoRA kernels of the projections `kinds` names
            self.lora.for_capture(self.static.lora_slots[:size], kinds)
        recurrent = RecurrentStep(self.runs.for_capture(size), self.state) if self.runs is not None else None
        ctx = ForwardContext(attention=self.backend, logits_rows=self.rows[:size], recurrent=recurrent)
        ids, positions = self.static.input_ids[:size], self.static.positions[:size]
        args = (ids, positions, *(t[:size] for t in self.inputs), ctx)
        self.forward(*args)  # warm-up outside the graph: kernel compilation, allocator
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = self.forward(*args)
        if self.pool is None:
            self.pool = graph.pool()
        torch.cuda.synchronize()
        return graph, outputs if isinstance(outputs, tuple) else (outputs,)
