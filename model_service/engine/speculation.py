"""Speculative decoding: propose a few tokens cheaply, verify them all in one forward pass.

A decode row with proposals runs as k + 1 query tokens (its last token and the k proposals) and
asks for k + 1 logits rows; row i predicts the token after input i. Greedy acceptance keeps the
proposals while each equals the target's own choice from the row before it, then adds the
target's token from the first row that disagreed (or the row after the last proposal): so the
output is exactly what plain greedy decoding produces, and every step emits at least one token.
The K/V of rejected proposals is cut off with `CacheManager.truncate` before the prefix cache
sees it.

Proposers (the `Proposer` protocol: a batched `propose`, and hooks after each verify and when a
sequence is done): prompt lookup (n-gram): the continuation of the most recent earlier
occurrence of the sequence's last n tokens (n from `prompt_lookup_max` down to
`prompt_lookup_min`), no extra model; a draft model (engine/draft.py); the checkpoint's own
multi-token-prediction layer (engine/mtp.py), which reads the target's hidden states
(`on_forward`); an EAGLE-3 head (engine/eagle3.py), which reads three of the target's layers'
states, fused by the head's `fc` first.

Sampled rows (temperature > 0) verify by rejection sampling, which keeps the target
distribution exactly: proposal d, drawn from the proposer's distribution q, is accepted with
probability min(1, p(d) / q(d)) (p: the target's filtered probabilities), and on rejection the
token is drawn from max(p - q, 0), renormalized; after k acceptances a bonus token is drawn from
the last row. The n-gram proposal is a point mass q = one-hot(d): accepted with probability
p(d), the residual is p without d, which is to draw from p as the sampler does and keep d if the
draw is d; so a sampled row draws each position's token exactly as it would without speculation
(a seeded row keyed by position), and its tokens do not depend on whether the step had room to
verify its proposals (other requests took the budget, a preemption dropped them). With a draft
model's q the request's own generator draws the uniforms: a seeded request is reproducible in
the same batch, its stream differs from a run without speculation. Under a grammar, proposals are
cut where it refuses one, and q is restricted to what it allows (`within_grammar`).

Which rows speculate: rows without penalties, logits processors or logprobs (penalties, and
min_tokens and bad words, would change between the rows of one verify: each row would need the
drafts before it as history), and no beams.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Protocol

import torch

from model_service.engine.sampler import AllowedTokens, SampleRow, draw, filtered_probs, sample_positions
from model_service.engine.sampling_params import SamplingParams
from model_service.engine.sequence import Sequence
from model_service.errors import InvalidRequestError
from model_service.models.eagle3 import is_eagle3_head

if TYPE_CHECKING:
    from model_service.engine.batch_builder import StepItem
    from model_service.engine.grammar import Constraint

DRAFT_METHODS = ("draft", "draft_model")  # ours and vLLM's spelling
METHODS = ("ngram", *DRAFT_METHODS, "mtp", "eagle3")
MODEL_METHODS = (*DRAFT_METHODS, "eagle3")  # those that name a model of their own
NGRAM_NAMES = ("ngram", "[ngram]")  # vLLM's, "[ngram]" its older one (then also as "model")


@dataclass
class Proposal:
    """Tokens to verify, and the distribution each was drawn from: `probs` [len(tokens), vocab]
    (row i is q for token i), or None for tokens chosen deterministically (argmax, lookup)."""

    tokens: list[int]
    probs: torch.Tensor | None = None


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None  # the draft model (method "draft"): alias, checkpoint dir or .gguf;
    # the EAGLE-3 head's checkpoint dir (method "eagle3")

    @classmethod
    def from_json(cls, text: str | dict[str, Any] | None) -> SpeculativeConfig | None:
        """vLLM's `--speculative-config` JSON, e.g. {"method": "ngram", "num_speculative_tokens": 4}
        or {"method": "draft", "model": "PATH", "num_speculative_tokens": 4}."""
        if text in (None, "", {}):
            return None
        try:
            config = cls(**_as_vllm_reads(json.loads(text) if isinstance(text, str) else text))
        except (json.JSONDecodeError, TypeError) as e:
            raise InvalidRequestError(
                f"--speculative-config: {e}; expected JSON such as "
                '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4} or '
                '{"method": "draft", "model": "PATH", "num_speculative_tokens": 4} or '
                '{"method": "eagle3", "model": "HEAD_DIR", "num_speculative_tokens": 3}'
            ) from e
        config._check_types()
        config._check_method()
        if not 1 <= config.num_speculative_tokens <= 16:
            raise InvalidRequestError("--speculative-config: num_speculative_tokens must be 1..16")
        if not 1 <= config.prompt_lookup_min <= config.prompt_lookup_max:
            raise InvalidRequestError(
                "--speculative-config: need 1 <= prompt_lookup_min <= prompt_lookup_max"
            )
        return config

    def _check_types(self) -> None:
        """JSON's types as the fields': a float or string count would pass the range checks (or
        fail them with a TypeError) and fail every request at its first proposal."""
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidRequestError(f"--speculative-config: {name} must be an integer, not {value!r}")
        for name in ("method", "model"):
            value = getattr(self, name)
            if not (isinstance(value, str) or (name == "model" and value is None)):
                raise InvalidRequestError(f"--speculative-config: {name} must be a string, not {value!r}")

    @property
    def is_draft(self) -> bool:
        return self.method in DRAFT_METHODS

    @property
    def is_mtp(self) -> bool:
        return self.method == "mtp"

    @property
    def is_eagle3(self) -> bool:
        return self.method == "eagle3"

    @property
    def keeps_hidden(self) -> bool:
        """Whether the target's executor keeps each step's hidden states for the proposer."""
        return self.is_mtp or self.is_eagle3

    def _check_method(self) -> None:
        if self.method not in METHODS:
            eagle = " (EAGLE-1/2 heads are not supported)" if self.method == "eagle" else ""
            raise InvalidRequestError(
                f"--speculative-config: method {self.method!r}{eagle}; supported: 'ngram', 'draft' "
                "('draft_model'), 'mtp' (a checkpoint with num_nextn_predict_layers), 'eagle3' "
                '(an EAGLE-3 head\'s checkpoint as "model")'
            )
        if self.is_draft and not self.model:
            raise InvalidRequestError(
                '--speculative-config: method "draft" needs "model": the draft model\'s alias or path'
            )
        if self.is_eagle3 and not self.model:
            raise InvalidRequestError(
                '--speculative-config: method "eagle3" needs "model": the EAGLE-3 head\'s '
                "checkpoint directory"
            )
        if self.method not in MODEL_METHODS and self.model:
            raise InvalidRequestError(
                f'--speculative-config: "model" is for method "draft" (or "eagle3"); method '
                f"{self.method!r} runs no model of its own"
            )


def _as_vllm_reads(raw: dict[str, Any]) -> dict[str, Any]:
    """The config with what vLLM fills in or renames: the method of a config naming only a
    `model` (an EAGLE-3 head's by its config.json, else a draft model), vLLM's older spellings
    ("[ngram]" as method or model; "deepseek_mtp" and the other per-family MTP names), and an
    unset prompt_lookup_max equal to the min given (so {"prompt_lookup_min": 5} alone is a window
    of 5, not a refusal against our default max)."""
    if not isinstance(raw, dict):
        raise TypeError(f"the config is a JSON object, not {raw!r}")
    known = [f.name for f in fields(SpeculativeConfig)]
    unknown = sorted(raw.keys() - set(known))
    if unknown:
        raise TypeError(f"unknown keys {unknown} (this engine reads {known})")
    raw = dict(raw)
    if raw.get("model") in NGRAM_NAMES and raw.get("method", "ngram") in NGRAM_NAMES:
        del raw["model"]  # vLLM's older spelling: {"model": "[ngram]"}
        raw["method"] = "ngram"
    if "model" in raw and "method" not in raw:
        raw["method"] = "eagle3" if is_eagle3_head(raw["model"]) else "draft"
    if raw.get("method") == "[ngram]":
        raw["method"] = "ngram"
    if isinstance(raw.get("method"), str) and raw["method"].endswith("_mtp"):
        raw["method"] = "mtp"
    if "prompt_lookup_min" in raw and "prompt_lookup_max" not in raw:
        raw["prompt_lookup_max"] = raw["prompt_lookup_min"]
    return raw


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], room: list[int]) -> list[Proposal]:
        """For each sequence about to decode, up to `room[i]` tokens likely to follow its
        `token_ids` (fewer, or none, when unsure); one call per step for the whole batch."""

    def on_verified(self, seq: Sequence, num_accepted: int) -> None:
        """`seq`'s proposals were verified: the first `num_accepted` were kept, the rest rejected
        (the target's own token follows them in `seq.token_ids`)."""

    def on_finished(self, seq: Sequence) -> None:
        """`seq` finished or was aborted: release whatever the proposer holds for it. Preemption
        is not reported: a proposer that holds memory finds preempted sequences by their status."""

    def on_forward(self, runs: list[tuple[Sequence, int, torch.Tensor]]) -> None:
        """The target's step computed, per (sequence, start, hidden), the sequence's positions from
        `start` on, whose residual stream after the last layer (before the final norm) is
        `hidden` [tokens, hidden size], a view of the step's (of a CUDA graph's own output when
        the step replayed one: rows kept past the target's next step must be copied); verify rows
        included, rejected or not. Called before the step's tokens are sampled, and only when the
        executor keeps hidden states (MTP, EAGLE-3)."""


class Speculation:
    """Speculative decoding in the step loop: proposals for the rows about to decode (after a
    step's tokens are appended), and each verify row's check against the target's logits (in the
    sample stage); with the counts the pod exports. The proposer is the only variable part."""

    def __init__(
        self,
        config: SpeculativeConfig,
        proposer: Proposer,
        max_model_len: int,
        vocab_size: int,
        fuse: Callable[[list[torch.Tensor]], torch.Tensor] | None = None,
    ) -> None:
        """`fuse`: for a target whose executor keeps several layers' states (EAGLE-3), what makes
        the proposer's one hidden row per position of them, for the whole step at once."""
        self.config, self.proposer, self.fuse = config, proposer, fuse
        self.max_model_len, self.vocab_size = max_model_len, vocab_size
        self.proposed = self.accepted = 0  # proposed and accepted tokens
        self.drafts = 0  # verify runs: a run emits 1 + accepted / drafts tokens on average
        # accepted proposals by their position in the run (vLLM's per-position acceptance)
        self.accepted_at = [0] * config.num_speculative_tokens
        # Each decoding sequence's proposals, to verify in its next step; the scheduler, which
        # decides whether they run, drops those that cannot (it is given this table).
        self.proposals: dict[Sequence, Proposal] = {}

    def forget_history(self) -> None:
        """Zero the counters (after the engine's warm-up)."""
        self.proposed = self.accepted = self.drafts = 0
        self.accepted_at = [0] * self.config.num_speculative_tokens

    def propose(self, seqs: list[Sequence]) -> None:
        """Proposals for each of `seqs` that can speculate, to verify in its next step; cut to
        the room left by `max_tokens` and the context, and to what its grammar allows."""
        seqs = [s for s in seqs if s.group is None and can_speculate(s.params)]
        room = [
            min(
                self.config.num_speculative_tokens,
                seq.params.max_tokens - seq.num_output_tokens - 1,
                self.max_model_len - len(seq.token_ids) - 1,
            )
            for seq in seqs
        ]
        for seq, proposal in zip(seqs, self.proposer.propose(seqs, room), strict=True):
            constraint = seq.sampling.constraint
            if constraint is not None:  # verify only what the grammar allows
                n = constraint.valid_prefix(proposal.tokens)
                probs = proposal.probs[:n] if proposal.probs is not None and n else None
                proposal = Proposal(proposal.tokens[:n], probs)
            if proposal.tokens:
                self.proposals[seq] = proposal
            else:
                self.proposals.pop(seq, None)

    def on_forward(
        self, work: list[tuple[Sequence, StepItem]], hidden: torch.Tensor | list[torch.Tensor] | None
    ) -> None:
        """The target's step ran each (sequence, its row) of `work`, their rows of `hidden` in
        that order (kept by the executor for MTP and EAGLE-3 only; None otherwise; EAGLE-3's
        several layers' states are fused first, in one pass for the step): each speculating
        sequence's rows go to the proposer (views, not copies), with the position they start at."""
        if hidden is None:
            return
        if isinstance(hidden, list):
            assert self.fuse is not None, "several layers' states kept, but no proposer fuses them"
            hidden = self.fuse(hidden)
        runs = [(seq, item.state.num_computed, len(item.tokens)) for seq, item in work]
        parts = zip(runs, hidden.split([n for _, _, n in runs]), strict=True)
        speculating = [(seq, start, rows) for (seq, start, _), rows in parts if seq.group is None]
        self.proposer.on_forward([run for run in speculating if can_speculate(run[0].params)])

    def forget(self, seq: Sequence) -> None:
        """`seq` finished or was aborted: drop its proposals and what the proposer holds for it."""
        self.proposals.pop(seq, None)
        self.proposer.on_finished(seq)

    def verify(
        self, seq: Sequence, logits: torch.Tensor, argmax: list[int] | None = None
    ) -> tuple[list[int], int]:
        """`seq`'s verify row, its logits [k + 1, vocab] (and their argmax, when the caller has
        read it already): the tokens it emits (the accepted proposals and the target's next
        token) and how many of the tokens it computed were rejected, which the caller cuts out
        of the cache before appending."""
        proposal = self.proposals.pop(seq)
        proposals, draft_probs = proposal.tokens, proposal.probs
        if seq.sampling.constraint is not None:  # p and q under the grammar, at each row
            logits, draft_probs = self._under_grammar(seq.sampling.constraint, proposal, logits)
            argmax = None  # of the logits before the grammar's mask
        if seq.params.greedy:
            emitted = accept_greedy(proposals, logits, argmax)
        elif draft_probs is None:  # point masses: the draws the request makes without speculation
            row = SampleRow(seq.params, seq.sampling.generator, seq.token_ids, seq.num_prompt_tokens)
            emitted = accept_greedy(proposals, logits, sample_positions(logits, row))
        else:
            probs = filtered_probs(logits, [seq.params] * len(logits))
            emitted = accept_sampled(proposals, probs, seq.sampling.generator, draft_probs)
        self._count(len(proposals), len(emitted) - 1)
        return emitted, len(proposals) - len(emitted) + 1

    def _count(self, proposed: int, accepted: int) -> None:
        """One verify run's proposals and how many of them (the first `accepted`) were kept."""
        self.proposed += proposed
        self.accepted += accepted
        self.drafts += 1
        for position in range(accepted):
            self.accepted_at[position] += 1

    def _under_grammar(
        self, constraint: Constraint, proposal: Proposal, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target's logits [k + 1, vocab] with what the grammar refuses at each row masked, and
        the proposal's q (if any) as the distributions its kept proposals came from."""
        bits = constraint.verify_bitmask(proposal.tokens, self.vocab_size)
        logits = AllowedTokens(list(range(len(logits))), bits).apply(logits)
        if proposal.probs is None:
            return logits, None
        return logits, within_grammar(proposal.probs, bits[: len(proposal.tokens)])


class NgramProposer:
    """Stateless: everything it needs is in the sequence's tokens."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.max_n, self.min_n = config.prompt_lookup_max, config.prompt_lookup_min

    def propose(self, seqs: list[Sequence], room: list[int]) -> list[Proposal]:
        return [
            Proposal(self.lookup(s.token_ids, k) if k > 0 else []) for s, k in zip(seqs, room, strict=True)
        ]

    def on_verified(self, seq: Sequence, num_accepted: int) -> None:
        pass

    def on_finished(self, seq: Sequence) -> None:
        pass

    def on_forward(self, runs: list[tuple[Sequence, int, torch.Tensor]]) -> None:
        pass

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest tail."""
        length = len(token_ids)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            tail = token_ids[-n:]
            for start in range(length - n - 1, -1, -1):  # the most recent earlier occurrence
                if token_ids[start : start + n] == tail:
                    return token_ids[start + n : start + n + k]
        return []


@dataclass
class Drafting:
    """A sequence a model-based proposer (draft model, MTP) drafts for this step: up to `room`
    tokens, and q for each when it samples."""

    index: int  # in the propose() batch
    seq: Sequence
    room: int
    tokens: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)


def draw_next(rows: list[Drafting], logits: torch.Tensor) -> None:
    """Each row's next proposal from its logits row: greedy rows the argmax, sampled rows a draw
    from q (the request's own temperature, top-k/p, min-p and generator), kept for the verify."""
    tokens = logits.argmax(dim=-1)
    sampled = [j for j, r in enumerate(rows) if not r.seq.params.greedy]
    if sampled:
        idx = torch.tensor(sampled, device=logits.device)
        seqs = [rows[j].seq for j in sampled]
        probs = filtered_probs(logits[idx], [s.params for s in seqs])
        tokens[idx] = draw(probs, [s.sampling.generator for s in seqs])
        for j, q in zip(sampled, probs, strict=True):
            rows[j].probs.append(q)
    for r, token in zip(rows, tokens.tolist(), strict=True):
        r.tokens.append(token)


def proposals_of(rows: list[Drafting], num_seqs: int) -> list[Proposal]:
    """The propose() answer for a batch of `num_seqs`: the drafted rows' tokens, none elsewhere."""
    out = [Proposal([]) for _ in range(num_seqs)]
    for r in rows:
        out[r.index] = Proposal(r.tokens, torch.stack(r.probs) if r.probs else None)
    return out


def can_speculate(params: SamplingParams) -> bool:
    return not params.needs_penalties and not params.needs_processors and params.logprobs is None


def accept_greedy(proposals: list[int], logits: torch.Tensor, argmax: list[int] | None = None) -> list[int]:
    """The tokens a verify step emits: logits [k + 1, vocab] for inputs (last, proposals...);
    `argmax`: their argmax, if already read, or the tokens a sampled row drew from them (for
    point-mass proposals, keeping d while the draw is d is the rejection sampler exactly: d is
    kept with probability p(d), and a draw that is not d comes from p without d)."""
    targets = logits.argmax(dim=-1).tolist() if argmax is None else argmax
    accepted = 0
    while accepted < len(proposals) and proposals[accepted] == targets[accepted]:
        accepted += 1
    return targets[: accepted + 1]


def within_grammar(draft_probs: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """The distributions a model's proposals under a grammar really come from: each row of q
    [k, vocab] restricted to the tokens the grammar allows there (`bits`, `AllowedTokens`'),
    renormalized. A proposal is kept only while the grammar allows it (`Speculation.propose` cuts
    the rest, and the token at the cut is drawn from p), so a kept proposal is a draw from q given
    that it is allowed, and the rejection sampler must weigh it by that distribution: by q itself
    the acceptance min(1, p(d) / q(d)) was too high wherever q held refused tokens, and the
    proposals came out too often (a p of 0.5 and 0.5 as 0.75 and 0.25, the named test)."""
    allowed = AllowedTokens(list(range(len(draft_probs))), bits).apply(draft_probs.log())
    return allowed.softmax(dim=-1)


def accept_sampled(
    proposals: list[int], probs: torch.Tensor, generator: torch.Generator | None, draft_probs: torch.Tensor
) -> list[int]:
    """The tokens a verify step emits for a sampled row whose proposals a model drew: probs
    [k + 1, vocab], each row the target's filtered distribution for the token after inputs
    (last, proposals...); `draft_probs` [k, vocab] the distributions the proposals were drawn from."""
    out: list[int] = []
    for i, d in enumerate(proposals):
        p = probs[i]
        u = torch.rand((), generator=generator, device=p.device)
        if u * draft_probs[i, d] < p[d]:  # u < p(d) / q(d)
            out.append(d)
            continue
        residual = (p - draft_probs[i]).clamp_(min=0.0)
        if not residual.sum() > 0:  # p == q up to rounding: rejection had probability ~0
            residual = p
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(probs[len(proposals)], 1, generator=generator)))
    return out
