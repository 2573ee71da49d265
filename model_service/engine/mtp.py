"""MTP speculation: the checkpoint's own multi-token-prediction layer (models/mtp.py) proposes k
tokens per decoding sequence from the target's hidden states, chained k times, all sequences
batched.

Where the hidden states come from: with method "mtp" the target's executor keeps each step's
residual stream after the last layer (`ModelExecutor.hidden`, the tensor the LM head's norm
reads; no copy), and the engine hands each sequence's rows of it to `on_forward` before the step
is sampled: prefill chunks, decode rows and verify runs alike. A sequence keeps them (views) until
its next proposal, as `_Follow.pending`.

The MTP layer at position p reads h_p and token p + 1, so it can run a position once the token
after it is known: at `propose`, a sequence whose tokens number L feeds positions
[`confirmed`, L - 1) with the target's rows for them (the rows of rejected verify tokens are past
L - 2 and are dropped), which writes the layer's own K/V (one MLA latent row per position) and
predicts the first proposal from the last; each further proposal is one more step at the next
position, the layer's own output standing in for the target's hidden state and its last proposal
for the token. Those chained positions are not the target's: `on_verified` (and the next
`propose`) truncates the MTP cache back to `confirmed`, so its K/V always holds exactly the
positions computed from the target's states (the rollback that goes with the target's).

The MTP cache is a paged cache of its own (`CacheManager`, as many blocks as the target's, in the
same budget), one layer, with a prefix cache of its own: blocks are published once every position
in them was fed from the target's states, under the same keys as the target's (tokens and
adapter), so a request whose target skips a cached prefix finds the MTP rows for it there too.
(A reused block's last row was made with the next token of the request that published it, which
may differ: that changes proposals, never output.) A sequence keeps its MTP K/V through
preemption (a swapped or recomputed target continues where it was). A sequence whose target hit
reaches past the MTP cache's hit, or whose MTP blocks ran out (preempted sequences keep theirs,
so under memory pressure the MTP cache can run out before the target's), decodes without
proposals from then on: the layer cannot attend over positions it has no states for.

Sampled rows draw each proposal from the layer's filtered distribution q (as a draft model's) and
hand q to the rejection sampler.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from model_service.attention.kv_cache import cache_bytes_per_block
from model_service.engine.batch_builder import BatchBuilder, StepItem
from model_service.engine.block_manager import BlockManager
from model_service.engine.cache_manager import CacheManager
from model_service.engine.config import EngineConfig
from model_service.engine.executor import ModelExecutor
from model_service.engine.seq_state import SequenceState
from model_service.engine.sequence import Sequence
from model_service.engine.speculation import Drafting, Proposal, draw_next, proposals_of
from model_service.models.loader import LoadedModel
from model_service.models.mtp import MtpLayer


@dataclass
class _Follow:
    """The MTP layer's K/V for one sequence: positions [0, `confirmed`) from the target's states,
    then any chained positions of the last proposal; and the target's rows not yet fed, for
    positions `confirmed` on."""

    seq: Sequence
    state: SequenceState
    confirmed: int = 0
    pending: list[torch.Tensor] = field(default_factory=list)

    @property
    def num_pending(self) -> int:
        return sum(len(rows) for rows in self.pending)

    def keep_pending(self, n: int) -> None:
        """Keep the first `n` pending rows (those after are of rejected verify tokens)."""
        kept, left = [], n
        for rows in self.pending:
            if left <= 0:
                break
            kept.append(rows[:left])
            left -= len(rows)
        self.pending = kept

    def take(self, m: int, n: int) -> torch.Tensor:
        """The first `m` of the `n` pending rows due now, to feed; the other n - m stay (any
        after them are of rejected verify tokens)."""
        rows = torch.cat(self.pending)[:n]
        self.pending = [rows[m:]] if n > m else []
        return rows[:m]


@dataclass(kw_only=True)
class _Row(Drafting):
    """A sequence drafting this step, its MTP K/V, and the hidden state its next chained step
    reads (the layer's output at its last position)."""

    follow: _Follow
    hidden: torch.Tensor


class MtpProposer:
    """Implements `speculation.Proposer` with the target checkpoint's MTP layer."""

    def __init__(
        self, layer: MtpLayer, target: LoadedModel, config: EngineConfig, num_blocks: int, max_model_len: int
    ) -> None:
        mc = target.config.mtp_layer_config()
        loaded = LoadedModel(f"{target.name} (MTP layer)", mc, layer, None)
        eager = dataclasses.replace(config, max_loras=0, enforce_eager=True, speculative_config=None)
        self.executor = ModelExecutor(loaded, eager, num_blocks, max_model_len)
        blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.cache = CacheManager(blocks, self.executor, cache_bytes_per_block(mc, 1, self.executor.dtype))
        self.builder = BatchBuilder(config.block_size, self.executor.device)
        self.token_budget = config.max_num_batched_tokens
        self.follows: dict[str, _Follow] = {}  # by request id
        self.unaided: set[str] = set()  # request ids the layer cannot follow (module docstring)

    def on_forward(self, seq: Sequence, start: int, hidden: torch.Tensor) -> None:
        if seq.request_id in self.unaided:
            return
        follow = self.follows.get(seq.request_id) or self._start(seq, start)
        if follow is None:
            return
        held = follow.confirmed + follow.num_pending
        if start > held:  # a gap the target computed without us (cannot happen in order)
            self._give_up(follow)
            return
        follow.keep_pending(max(start - follow.confirmed, 0))  # rows from `start` on are new
        follow.pending.append(hidden[max(follow.confirmed - start, 0) :])

    def _start(self, seq: Sequence, start: int) -> _Follow | None:
        """Follow `seq` from the target's first computed position `start`: after a target
        prefix-cache hit, from the MTP cache's own hit, which must reach as far (else `seq` is
        unaided: the layer has no states for the positions between)."""
        follow = self.follows[seq.request_id] = _Follow(seq, self.cache.allocate())
        if start > 0:
            if self.cache.take_cached_prefix(follow.state, seq.token_ids, seq.admission.adapter_id) < start:
                self._give_up(follow)
                return None
            self.cache.truncate(follow.state, start)
            follow.confirmed = start
        return follow

    def propose(self, seqs: list[Sequence], room: list[int]) -> list[Proposal]:
        rows = active = self._catch_up(seqs, room)
        while active := [r for r in active if len(r.tokens) < r.room]:
            items = [StepItem(r.follow.state, [r.tokens[-1]], 1) for r in active]
            hidden = torch.cat([r.hidden for r in active])
            logits, out = self._forward(items, hidden)
            for r, h in zip(active, out.split(1), strict=True):
                r.hidden = h
            draw_next(active, logits)
        return proposals_of(rows, len(seqs))

    def on_verified(self, seq: Sequence, num_accepted: int) -> None:
        follow = self.follows.get(seq.request_id)
        if follow is not None:
            self._rollback(follow)

    def on_finished(self, seq: Sequence) -> None:
        self.unaided.discard(seq.request_id)
        follow = self.follows.pop(seq.request_id, None)
        if follow is not None:
            self.cache.free(follow.state)

    def _catch_up(self, seqs: list[Sequence], room: list[int]) -> list[_Row]:
        """Feed each sequence the positions whose next token is now known, from the target's
        rows, all in one pass of at most the step's token budget; those fed to their end get
        their first proposal from their last position (a long prompt catches up over a few
        steps, as a draft model's does)."""
        fed: list[tuple[int, Sequence, int, _Follow]] = []
        items: list[StepItem] = []
        hidden: list[torch.Tensor] = []
        published: list[_Follow] = []
        budget = self.token_budget
        for i, (seq, k) in enumerate(zip(seqs, room, strict=True)):
            follow = self.follows.get(seq.request_id)
            if k <= 0 or follow is None or budget <= 0:
                continue
            self._rollback(follow)
            n = len(seq.token_ids) - 1 - follow.confirmed  # positions to feed
            if n <= 0 or follow.num_pending < n:
                continue  # nothing new (its target rows have not come yet)
            m = min(n, budget)
            if not self._reserve(follow, follow.confirmed + m + (k - 1 if m == n else 0)):
                continue
            start = follow.confirmed
            items.append(StepItem(follow.state, seq.token_ids[start + 1 : start + 1 + m], int(m == n)))
            hidden.append(follow.take(m, n))
            follow.confirmed, budget = start + m, budget - m
            published.append(follow)
            if m == n:
                fed.append((i, seq, k, follow))
        if not items:
            return []
        logits, out = self._forward(items, torch.cat(hidden))
        for follow in published:  # all target-made rows (chained ones come after)
            self.cache.register_full_blocks(
                follow.state, follow.seq.token_ids, follow.seq.admission.adapter_id
            )
        if not fed:  # only partial catch-ups this step
            return []
        rows = [_Row(i, s, k, follow=f, hidden=h) for (i, s, k, f), h in zip(fed, out.split(1), strict=True)]
        draw_next(rows, logits)
        return rows

    def _forward(self, items: list[StepItem], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP pass: each item's last position's logits and the layer's output there."""
        batch = self.builder.build(items)
        logits, out = self.executor.run_eager(batch, hidden)
        for item in items:
            self.cache.commit(item.state, len(item.tokens))
        return logits, out[batch.logits_rows]

    def _reserve(self, follow: _Follow, num_tokens: int) -> bool:
        """Room for `num_tokens` positions in private blocks; else `follow` gives up."""
        if self.cache.make_writable(follow.state) and self.cache.reserve(follow.state, num_tokens):
            return True
        self._give_up(follow)
        return False

    def _rollback(self, follow: _Follow) -> None:
        """Cut the chained positions: the MTP cache keeps only what the target's states made."""
        if follow.state.num_computed > follow.confirmed:
            self.cache.truncate(follow.state, follow.confirmed)

    def _give_up(self, follow: _Follow) -> None:
        self.on_finished(follow.seq)
        self.unaided.add(follow.seq.request_id)
