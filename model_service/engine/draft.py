"""Draft-model speculation: a second, smaller model with the target's tokenizer proposes k tokens
for every decoding sequence, k forward passes of the draft per step, all sequences batched.

The draft has its own executor and paged K/V cache (with its own prefix cache), built from the
same parts as the target's, and runs without adapters: the target verifies every proposal with
the request's adapter, so a draft that ignores it only proposes worse.

Keeping the draft's K/V in step with the target: per sequence the draft holds K/V for a prefix of
the sequence's tokens, then the proposals it fed itself (`_Draft.fed`). Before it proposes again
(and right after a verify, through `on_verified`) it keeps the fed proposals that match the
tokens the sequence actually got and truncates the rest; so accepted, rejected and dropped
proposals (the scheduler drops them when the token budget is short) all come out right. Then
it feeds what it has not seen (the target's bonus token; the whole prompt the first time, in
chunks of the step's token budget, so a long prompt catches up over a few steps and speculation
starts when it has) and proposes. Past the draft's own context length a sequence decodes without
proposals.

The draft's embedding table may be larger or smaller than the target's (padding rows differ
between sizes of one family); its logits are cut or padded to the target's width, and a sequence
holding a token past a smaller draft's table gets no proposals.

The draft's blocks are freed exactly once: when the sequence finishes or is aborted
(`on_finished`), when it is found preempted (not running) at the next `propose`, or when the
draft's cache runs out of blocks for it (it starts again later, mostly from the draft's prefix
cache).

Sampled rows draw each proposal from the draft's filtered distribution q (the request's own
temperature, top-k/p, min-p and generator) and hand q to the rejection sampler, which keeps the
target distribution exact.
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
from model_service.engine.sequence import Sequence, Status
from model_service.engine.speculation import Drafting, Proposal, SpeculativeConfig, draw_next, proposals_of
from model_service.errors import ModelLoadError
from model_service.models.eagle3 import is_eagle3_head, is_eagle_1_2_head
from model_service.models.loader import LoadedModel, load_model, resolve_model_path


def load_draft(
    spec: SpeculativeConfig | None, config: EngineConfig, target: LoadedModel
) -> LoadedModel | None:
    """The draft model of a "draft" config, checked against the target. A draft naming the
    target's own file reuses its weights (self-drafting: a test and benchmark setup)."""
    if spec is None or not spec.is_draft:
        return None
    assert spec.model is not None
    if _same_file(spec.model, target.name):
        draft = target
    elif is_eagle3_head(spec.model):
        raise ModelLoadError(
            f"draft model {spec.model!r} is an EAGLE-3 head, which reads the target's hidden states: "
            'use method "eagle3"'
        )
    else:
        draft = _load_draft_model(spec.model, config)
        check_same_vocab(target, draft)
    # A hybrid drafting itself too: the draft's cache has no state slots (every request failed).
    if draft.config.num_state_layers:
        raise ModelLoadError(
            f"draft model {draft.name!r} has recurrent layers, whose state cannot be rolled back to "
            "the accepted tokens yet; use an attention-only draft model"
        )
    return draft


def _load_draft_model(name: str, config: EngineConfig) -> LoadedModel:
    """The draft checkpoint, loaded as a model of its own; an EAGLE-1/2 head there (which fails
    that load on a tensor name) is refused as what it is."""
    try:
        return load_model(name, config.torch_dtype(), config.torch_device())
    except ModelLoadError as e:
        if is_eagle_1_2_head(resolve_model_path(name)):
            raise ModelLoadError(
                f"draft model {name!r} is an EAGLE-1/2 head (an fc over the target's hidden states), "
                "not a model of its own; EAGLE-1/2 heads are not supported, EAGLE-3 heads are "
                '(method "eagle3")'
            ) from e
        raise


def _same_file(a: str, b: str) -> bool:
    """Whether two model names (aliases, paths) name one file; False when either names none."""
    if a == b:
        return True
    try:
        return resolve_model_path(a).resolve() == resolve_model_path(b).resolve()
    except ModelLoadError:
        return False


def check_same_vocab(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft must map every token to the target's id: its proposals are target token ids. The
    embedding tables may differ in padding rows (as Qwen2.5's 0.5B and 7B do)."""
    names = f"draft model {draft.name!r} and target model {target.name!r}"
    if target.tokenizer is not None and draft.tokenizer is not None:
        tv, dv = target.tokenizer.hf.get_vocab(), draft.tokenizer.hf.get_vocab()
        differ = sum(1 for tok, i in tv.items() if dv.get(tok) != i) + len(dv.keys() - tv.keys())
        if differ:
            raise ModelLoadError(
                f"{names} have different tokenizers ({differ} of {len(tv)} tokens differ); "
                "a draft model must share the target's tokenizer"
            )
    elif target.config.vocab_size != draft.config.vocab_size:
        raise ModelLoadError(
            f"{names} have different vocabularies ({draft.config.vocab_size} vs "
            f"{target.config.vocab_size} tokens); a draft model must share the target's tokenizer"
        )


def proposer_model(
    loaded: LoadedModel,
    config: EngineConfig,
    num_blocks: int,
    max_model_len: int,
    head_rows: int = 0,
    **overrides: object,
) -> tuple[ModelExecutor, CacheManager, BatchBuilder]:
    """A proposer's own model on the target's device (a draft model, an MTP layer, an EAGLE-3
    head): its executor (no adapters: the target verifies with them; `head_rows` for a head over
    the target's hidden states, `ModelExecutor`'s; `overrides` for the rest of `config`), a paged
    cache of `num_blocks` blocks with its own prefix cache, and a batch builder."""
    config = dataclasses.replace(config, max_loras=0, **overrides)
    executor = ModelExecutor(loaded, config, num_blocks, max_model_len, head_rows=head_rows)
    blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
    cache = CacheManager(blocks, executor, cache_bytes_per_block(loaded.config, 1, executor.dtype))
    return executor, cache, BatchBuilder(config.block_size, executor.device)


@dataclass
class _Draft:
    """The draft's K/V for one sequence: a prefix of its tokens, then the proposals `fed` after it."""

    seq: Sequence
    state: SequenceState
    fed: list[int] = field(default_factory=list)


@dataclass(kw_only=True)
class _Row(Drafting):
    """A sequence drafting this step, and the draft's K/V for it."""

    draft: _Draft


class DraftProposer:
    """Implements `speculation.Proposer` with a draft model."""

    def __init__(
        self, loaded: LoadedModel, config: EngineConfig, num_blocks: int, max_model_len: int, vocab_size: int
    ) -> None:
        mc = loaded.config
        self.max_len = min(max_model_len, mc.scaled_positions)
        self.executor, self.cache, self.builder = proposer_model(loaded, config, num_blocks, self.max_len)
        self.token_budget = config.max_num_batched_tokens
        self.vocab_size = vocab_size  # the target's: proposals and q are over its vocabulary
        self.draft_vocab_size = mc.vocab_size
        self.embeds_all = mc.vocab_size >= vocab_size  # else a rare target token may be past its table
        self.drafts: dict[str, _Draft] = {}  # by request id

    def propose(self, seqs: list[Sequence], room: list[int]) -> list[Proposal]:
        self._release_preempted()
        rows = active = self._catch_up(seqs, room)
        while active := [r for r in active if len(r.tokens) < r.room]:
            for r in active:
                r.draft.fed.append(r.tokens[-1])
            draw_next(active, self._forward([StepItem(r.draft.state, [r.tokens[-1]], 1) for r in active]))
        return proposals_of(rows, len(seqs))

    def on_verified(self, seq: Sequence, num_accepted: int) -> None:
        draft = self.drafts.get(seq.request_id)
        if draft is not None:
            self._rollback(draft)

    def on_finished(self, seq: Sequence) -> None:
        draft = self.drafts.pop(seq.request_id, None)
        if draft is not None:
            self.cache.free(draft.state)

    def on_forward(self, runs: list[tuple[Sequence, int, torch.Tensor]]) -> None:
        pass

    def _catch_up(self, seqs: list[Sequence], room: list[int]) -> list[_Row]:
        """Feed each sequence the tokens the draft has not seen, within the step's token budget;
        the sequences fed to their end get their first proposal."""
        rows, items, fed, budget = [], [], [], self.token_budget
        for i, (seq, k) in enumerate(zip(seqs, room, strict=True)):
            k = min(k, self.max_len - len(seq.token_ids))
            if k <= 0 or budget <= 0:
                continue
            draft = self._draft_for(seq)
            start = draft.state.num_computed
            n = min(len(seq.token_ids) - start, budget)
            if not self.embeds_all and max(seq.token_ids[start : start + n]) >= self.draft_vocab_size:
                self.on_finished(seq)  # a token past the draft's table: this sequence decodes unaided
                continue
            done = start + n == len(seq.token_ids)
            if not self._reserve(draft, start + n + (k - 1 if done else 0)):
                continue
            items.append(StepItem(draft.state, seq.token_ids[start : start + n], int(done)))
            fed.append(draft)
            if done:
                rows.append(_Row(i, seq, k, draft=draft))
            budget -= n
        if not items:
            return []
        logits = self._forward(items)
        for draft in fed:
            self.cache.register_full_blocks(draft.state, draft.seq.token_ids, 0)
        draw_next(rows, logits)
        return rows

    def _draft_for(self, seq: Sequence) -> _Draft:
        draft = self.drafts.get(seq.request_id)
        if draft is None:
            state = self.cache.allocate()
            self.cache.take_cached_prefix(state, seq.token_ids, 0)
            draft = self.drafts[seq.request_id] = _Draft(seq, state)
        else:
            self._rollback(draft)
        return draft

    def _rollback(self, draft: _Draft) -> None:
        """Keep the fed proposals the sequence really got; cut the rest off. At least the last
        token is left to feed: its logits give the next proposal."""
        tokens, state = draft.seq.token_ids, draft.state
        keep = state.num_computed - len(draft.fed)
        for token in draft.fed:
            if keep >= len(tokens) or tokens[keep] != token:
                break
            keep += 1
        keep = min(keep, len(tokens) - 1)
        if keep < state.num_computed:
            self.cache.truncate(state, keep)
        draft.fed = []

    def _reserve(self, draft: _Draft, num_tokens: int) -> bool:
        if self.cache.make_writable(draft.state) and self.cache.reserve(draft.state, num_tokens):
            return True
        self.on_finished(draft.seq)  # out of draft blocks: it starts over later
        return False

    def _release_preempted(self) -> None:
        for draft in [d for d in self.drafts.values() if d.seq.status is not Status.RUNNING]:
            self.on_finished(draft.seq)

    def _forward(self, items: list[StepItem]) -> torch.Tensor:
        """Logits over the target's vocabulary (padding rows of either table never win)."""
        logits = self.executor.execute(self.builder.build(items))
        for item in items:
            self.cache.commit(item.state, len(item.tokens))
        extra = self.vocab_size - logits.shape[1]
        if extra > 0:
            return torch.nn.functional.pad(logits, (0, extra), value=float("-inf"))
        return logits[:, : self.vocab_size] if extra < 0 else logits
