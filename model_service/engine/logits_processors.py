"""A request's logits processors: OpenAI's `logit_bias`, vLLM's `allowed_token_ids`, `min_tokens`
and `bad_words`, applied to a step's logits rows for all rows at once.

Each request's are resolved once, at admission (`resolve`: the bad words tokenized, the ids
`min_tokens` holds back gathered); each step then pays for a few host lists copied to the device
and plain torch ops on the rows (CPU and CUDA alike, outside any captured graph). The bias is
added to the raw logits before the penalties, and the bans (-inf) commute with them, so the
order is HF's and vLLM's (both apply them before the repetition penalty). HF's processors are
the oracle: `SequenceBiasLogitsProcessor` with one-token sequences for the bias,
`MinNewTokensLengthLogitsProcessor`, `NoBadWordsLogitsProcessor`, and a mask for the allowed ids.
Bad words match the output's tokens only, as vLLM's (HF's also look into the prompt).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_service.engine.sampling_params import SamplingParams
from model_service.errors import InvalidRequestError
from model_service.models import step
from model_service.models.tokenizer import Tokenizer

# The most tokens a request's bad words may come to (each word is tokenized twice, vLLM's way).
MAX_BAD_WORD_TOKENS = 1024


@dataclass(frozen=True)
class LogitsProcessors:
    """One request's processors, resolved for its engine (tokenizer, EOS ids)."""

    bias: dict[int, float]
    allowed: tuple[int, ...]  # empty: every token
    min_tokens: int
    held: tuple[int, ...]  # the ids that would end the output: banned until it has min_tokens
    bad_words: tuple[tuple[int, ...], ...]

    def banned(self, output_ids: list[int]) -> list[int]:
        """The ids this row may not take after `output_ids`: stop ids before `min_tokens`, each
        bad word's last token where the output ends with the rest of it."""
        ids = list(self.held) if len(output_ids) < self.min_tokens else []
        for word in self.bad_words:
            head = word[:-1]
            if not head or tuple(output_ids[len(output_ids) - len(head) :]) == head:
                ids.append(word[-1])
        return ids


def resolve(
    params: SamplingParams, tokenizer: Tokenizer | None, eos_token_ids: set[int]
) -> LogitsProcessors | None:
    """`params`' processors for this engine, or None when it sets none; raises
    InvalidRequestError for bad words this engine cannot tokenize or too many of their tokens."""
    if not params.needs_processors:
        return None
    held = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_token_ids)
    words = bad_word_ids(params.bad_words, tokenizer) if params.bad_words else []
    allowed = tuple(sorted(set(params.allowed_token_ids)))
    if allowed and not set(allowed) - {w[0] for w in words if len(w) == 1}:
        raise InvalidRequestError("bad_words ban every one of allowed_token_ids: no token could be generated")
    bias = {int(t): float(b) for t, b in params.logit_bias.items()}
    return LogitsProcessors(bias, allowed, params.min_tokens, tuple(sorted(held)), tuple(words))


def bad_word_ids(words: list[str], tokenizer: Tokenizer | None) -> list[tuple[int, ...]]:
    """Each word's tokens as vLLM makes them: the word (left-stripped), and again after a space
    when that is as many tokens and starts with another one (a word inside the text), so that
    both forms are banned. Special tokens are not added."""
    if tokenizer is None:
        raise InvalidRequestError("bad_words need the model's tokenizer; this model is served without one")
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        inside = spaced and spaced[0] != plain[0] and len(spaced) == len(plain)  # vLLM's condition
        out += [plain, spaced] if inside else [plain]
    if sum(map(len, out)) > MAX_BAD_WORD_TOKENS:
        raise InvalidRequestError(f"bad_words come to more than {MAX_BAD_WORD_TOKENS:,} tokens")
    return out


def add_bias(logits: torch.Tensor, processors: list[LogitsProcessors | None]) -> torch.Tensor:
    """A copy of `logits` [rows, vocab] with each row's bias added (`logits` itself when none has
    one); one copy of the (row, token, bias) triples, nothing that waits for the device."""
    triples = [(i, t, b) for i, p in enumerate(processors) if p is not None for t, b in p.bias.items()]
    if not triples:
        return logits
    rows, tokens, biases = zip(*triples, strict=True)
    device = logits.device
    index = step.to_device([*rows, *tokens], device, torch.long).view(2, -1)
    out = logits.clone()
    out[index[0], index[1]] += step.to_device(list(biases), device, logits.dtype)
    return out


def banned_mask(
    processors: list[LogitsProcessors | None], outputs: list[list[int]], vocab: int, device: torch.device
) -> torch.Tensor | None:
    """[rows, vocab] bool: the tokens each row may not take now (outside its allowed ids, held
    back by min_tokens, ending a bad word); None when no row bans any."""
    limited = [i for i, p in enumerate(processors) if p is not None and p.allowed]
    pairs = [(i, t) for i, p in enumerate(processors) if p is not None for t in p.banned(outputs[i])]
    if not limited and not pairs:
        return None
    keep = [(i, t) for i in limited for t in processors[i].allowed]  # type: ignore[union-attr]
    flat = step.to_device([i * vocab + t for i, t in keep + pairs], device, torch.long)
    mask = torch.zeros(len(processors) * vocab, dtype=torch.bool, device=device)
    if limited:
        mask.view(len(processors), vocab)[step.to_device(limited, device, torch.long)] = True
        mask[flat[: len(keep)]] = False
    mask[flat[len(keep) :]] = True
    return mask.view(len(processors), vocab)
