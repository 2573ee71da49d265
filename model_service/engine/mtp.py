"""MTP speculation: the checkpoint's own multi-token-prediction layer (models/mtp.py) proposes k
tokens per decoding sequence from the target's hidden states, chained k times, all sequences
batched.

Where the hidden states come from: with method "mtp" the target's executor keeps each step's
residual stream after the last layer (`ModelExecutor.hidden`, the tensor the LM head's norm
reads; no copy), and the engine hands each sequence's rows of it (views) to `on_forward` right
after the forward pass, before the step is sampled: prefill chunks, decode rows and verify runs
alike.

The MTP layer at position p reads h_p and token p + 1, so it runs a position once the token after
it is known, which writes the layer's own K/V there (one MLA latent row per position):
- in `on_forward`, every position whose next token is already known: a prefill chunk's, all of
  them but the prompt's last (so the layer keeps pace with the prefill, one pass a step for all
  sequences, and holds no more than a step's rows);
- in `propose`, after the step's tokens are appended: the rest (the prompt's last position; after
  a decode row its position; after a verify, the accepted positions and the one before the bonus
  token; the rows of rejected tokens are dropped), whose last position predicts the first
  proposal. Each further proposal is one more step at the next position, the layer's own output
  standing in for the target's hidden state and its last proposal for the token.
Chained positions are not the target's: `on_verified` (and the next feed) truncates the MTP
cache back to `confirmed`, so its K/V always holds exactly the positions computed from the
target's states (the rollback that goes with the target's).

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

from dataclasses import dataclass, field

import torch

from model_service.engine.batch_builder import StepItem
from model_service.engine.config import EngineConfig
from model_service.engine.draft import proposer_model
from model_service.engine.seq_state import SequenceState
from model_service.engine.sequence import Sequence
from model_service.engine.speculation import Drafting, Proposal, SpeculativeConfig, draw_next, proposals_of
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

    def own_pending(self) -> None:
        """Copy the pending rows, until now views of the target's step (under CUDA graphs of the
        graph's own output, which its next replay overwrites), to feed them after another step."""
        self.pending = [torch.cat(self.pending)] if self.pending else []

    def take(self, m: int) -> torch.Tensor:
        """Remove and return the first `m` pending rows (the rest then a copy of their own)."""
        rows = torch.cat(self.pending)
        self.pending = [rows[m:]] if len(rows) > m else []
        return rows[:m]


@dataclass(kw_only=True)
class _Row(Drafting):
    """A sequence drafting this step, its MTP K/V, and the hidden state its next chained step
    reads (the layer's output at its last position)."""

    follow: _Follow
    hidden: torch.Tensor


class HiddenStateProposer:
    """Implements `speculation.Proposer` with a one-layer head over the target's hidden states
    (`loaded.module`: (ids, positions, hidden, ctx) -> (logits, the hidden its next chained step
    reads)): the MTP layer's scheme above, which EAGLE-3's head (engine/eagle3.py) shares."""

    def __init__(
        self, loaded: LoadedModel, config: EngineConfig, num_blocks: int, max_model_len: int
    ) -> None:
        # its steps take k + 1 rows a sequence at most (a verified run fed back), one when chained
        spec = SpeculativeConfig.from_json(config.speculative_config)
        assert spec is not None, "a head proposes under a speculative config"
        rows = spec.num_speculative_tokens + 1
        self.executor, self.cache, self.builder = proposer_model(
            loaded, config, num_blocks, max_model_len, rows, speculative_config=None
        )
        self.follows: dict[str, _Follow] = {}  # by request id
        self.unaided: set[str] = set()  # request ids the layer cannot follow (module docstring)

    def on_forward(self, runs: list[tuple[Sequence, int, torch.Tensor]]) -> None:
        """Keep each sequence's new rows, then feed every position whose next token is known."""
        follows, ends = [], []
        for seq, start, rows in runs:
            follow = self._record(seq, start, rows)
            end = self._due(follow) if follow is not None else 0
            if follow is not None and end and self._reserve(follow, end):
                follows.append(follow)
                ends.append(end)
        if follows:
            self._feed(follows, ends, logits=False)

    def propose(self, seqs: list[Sequence], room: list[int]) -> list[Proposal]:
        jobs = []  # (index in seqs, room, follow) of the sequences the layer can follow
        for i, (seq, k) in enumerate(zip(seqs, room, strict=True)):
            follow = self.follows.get(seq.request_id)
            end = len(seq.token_ids) - 1  # the last token's position: it predicts the first proposal
            if k <= 0 and follow is not None:  # not fed now: in the next step's `on_forward`
                follow.own_pending()
            # fed up to `end` once all rows before it are in, then k - 1 chained positions
            if (
                k > 0
                and follow is not None
                and self._due(follow) == end
                and self._reserve(follow, end + k - 1)
            ):
                jobs.append((i, k, follow))
        if not jobs:
            return proposals_of([], len(seqs))
        follows = [f for _, _, f in jobs]
        logits, out = self._feed(follows, [len(f.seq.token_ids) - 1 for f in follows], logits=True)
        rows = active = [
            _Row(i, f.seq, k, follow=f, hidden=h) for (i, k, f), h in zip(jobs, out.split(1), strict=True)
        ]
        draw_next(rows, logits)
        while active := [r for r in active if len(r.tokens) < r.room]:
            items = [StepItem(r.follow.state, [r.tokens[-1]], 1) for r in active]
            logits, out = self._forward(items, torch.cat([r.hidden for r in active]))
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

    def _record(self, seq: Sequence, start: int, hidden: torch.Tensor) -> _Follow | None:
        """Keep `seq`'s rows for positions from `start` (replacing any pending ones from there:
        rows of rejected verify tokens); None if the layer does not follow `seq`."""
        if seq.request_id in self.unaided:
            return None
        follow = self.follows.get(seq.request_id) or self._start(seq, start)
        if follow is None:
            return None
        if start > follow.confirmed + follow.num_pending:  # a gap (a target step we never saw)
            self._give_up(follow)
            return None
        follow.keep_pending(max(start - follow.confirmed, 0))
        follow.pending.append(hidden[max(follow.confirmed - start, 0) :])
        return follow

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

    @staticmethod
    def _due(follow: _Follow) -> int:
        """How far `follow` can be fed now: to the last position whose target row has come and
        whose next token is known (0 when nothing is due)."""
        end = min(len(follow.seq.token_ids) - 1, follow.confirmed + follow.num_pending)
        return end if end > follow.confirmed else 0

    def _feed(
        self, follows: list[_Follow], ends: list[int], logits: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass of the layer over each sequence's positions [`confirmed`, end) from the target's
        rows; their full blocks are published. With `logits`, each one's last position's logits
        and the layer's output there (else empty)."""
        items, hidden = [], []
        for follow, end in zip(follows, ends, strict=True):
            tokens = follow.seq.token_ids[follow.confirmed + 1 : end + 1]
            items.append(StepItem(follow.state, tokens, int(logits)))
            hidden.append(follow.take(end - follow.confirmed))
            follow.confirmed = end
        out = self._forward(items, torch.cat(hidden))
        for f in follows:  # target-made rows only: chained ones come after
            self.cache.register_full_blocks(f.state, f.seq.token_ids, f.seq.admission.adapter_id)
        return out

    def _forward(self, items: list[StepItem], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP pass: each item's last position's logits and the layer's output there."""
        batch = self.builder.build(items)
        logits, out = self.executor.run_head(batch, hidden)
        for item in items:
            self.cache.commit(item.state, len(item.tokens))
        return logits, out

    def _reserve(self, follow: _Follow, num_tokens: int) -> bool:
        """Before a feed: cut chained rows, then room for `num_tokens` positions in private
        blocks; else `follow` gives up."""
        self._rollback(follow)
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


class MtpProposer(HiddenStateProposer):
    """Implements `speculation.Proposer` with the target checkpoint's MTP layer."""

    def __init__(
        self, layer: MtpLayer, target: LoadedModel, config: EngineConfig, num_blocks: int, max_model_len: int
    ) -> None:
        loaded = LoadedModel(f"{target.name} (MTP layer)", target.config.mtp_layer_config(), layer, None)
        super().__init__(loaded, config, num_blocks, max_model_len)
