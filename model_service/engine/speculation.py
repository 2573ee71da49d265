"""Speculative decoding: propose a few tokens cheaply, verify them all in one forward pass.

A decode row with proposals runs as k + 1 query tokens (its last token and the k proposals) and
asks for k + 1 logits rows; row i predicts the token after input i. Greedy acceptance keeps the
proposals while each equals the target's own choice from the row before it, then adds the
target's token from the first row that disagreed (or the row after the last proposal): so the
output is exactly what plain greedy decoding produces, and every step emits at least one token.
The K/V of rejected proposals is cut off with `CacheManager.truncate` before the prefix cache
sees it.

Proposers: prompt lookup (n-gram): the continuation of the most recent earlier occurrence of the
sequence's last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`), no extra
model. The `Proposer` protocol leaves room for a draft model or MTP heads.

Sampled rows (temperature > 0) verify by rejection sampling, which keeps the target
distribution exactly: the n-gram proposal is a point mass q = one-hot(d), so proposal d is
accepted with probability p(d) (the target's filtered probability), and on rejection the token
is drawn from p with d removed, renormalized (max(p - q, 0) / its sum); after k acceptances a
bonus token is drawn from the last row. Each request's own generator draws the uniforms, so a
seeded request stays reproducible (its stream differs from a run without speculation).

Which rows speculate: rows without penalties or logprobs (penalties would change between the
rows of one verify), and no beams.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from model_service.engine.sampling_params import SamplingParams
from model_service.errors import InvalidRequestError


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1

    @classmethod
    def from_json(cls, text: str | dict[str, Any] | None) -> SpeculativeConfig | None:
        """vLLM's `--speculative-config` JSON, e.g. {"method": "ngram", "num_speculative_tokens": 4}."""
        if text in (None, "", {}):
            return None
        try:
            raw = json.loads(text) if isinstance(text, str) else dict(text)
            config = cls(**raw)
        except (json.JSONDecodeError, TypeError) as e:
            raise InvalidRequestError(
                f"--speculative-config: {e}; expected JSON such as "
                '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
            ) from e
        if config.method != "ngram":
            raise InvalidRequestError(f"--speculative-config: method {config.method!r}; supported: 'ngram'")
        if not 1 <= config.num_speculative_tokens <= 16:
            raise InvalidRequestError("--speculative-config: num_speculative_tokens must be 1..16")
        if not 1 <= config.prompt_lookup_min <= config.prompt_lookup_max:
            raise InvalidRequestError(
                "--speculative-config: need 1 <= prompt_lookup_min <= prompt_lookup_max"
            )
        return config


class Proposer(Protocol):
    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to `k` tokens likely to follow `token_ids` (fewer, or none, when unsure)."""


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.max_n, self.min_n = config.prompt_lookup_max, config.prompt_lookup_min

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        length = len(token_ids)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            tail = token_ids[-n:]
            for start in range(length - n - 1, -1, -1):  # the most recent earlier occurrence
                if token_ids[start : start + n] == tail:
                    return token_ids[start + n : start + n + k]
        return []


def can_speculate(params: SamplingParams) -> bool:
    return not params.needs_penalties and params.logprobs is None


def accept_greedy(proposals: list[int], logits: torch.Tensor) -> list[int]:
    """The tokens a verify step emits: logits [k + 1, vocab] for inputs (last, proposals...)."""
    targets = logits.argmax(dim=-1).tolist()
    accepted = 0
    while accepted < len(proposals) and proposals[accepted] == targets[accepted]:
        accepted += 1
    return targets[: accepted + 1]


def accept_sampled(proposals: list[int], probs: torch.Tensor, generator: torch.Generator | None) -> list[int]:
    """The tokens a verify step emits for a sampled row: probs [k + 1, vocab], each row the
    target's filtered distribution for the token after inputs (last, proposals...)."""
    out: list[int] = []
    for i, d in enumerate(proposals):
        p = probs[i]
        u = torch.rand((), generator=generator, device=p.device)
        if u < p[d]:
            out.append(d)
            continue
        residual = p.clone()
        residual[d] = 0.0
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(probs[len(proposals)], 1, generator=generator)))
    return out
