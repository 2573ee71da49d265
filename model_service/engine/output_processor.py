"""Turns sampled tokens into a request's text and decides when it stops.

Stop conditions, in order: a stop token (EOS or `stop_token_ids`; its text is part of the
answer only with `include_stop_str_in_output`), a stop string (searched only where the new text
could complete one), a structured output that is complete (its grammar allows nothing but EOS:
"stop"), `max_tokens`, the context length ("length": a structured output may be cut short). A
constrained sequence's matcher takes every token appended here (a refused one raises
`GrammarError`). The caller frees what finished.
"""

from __future__ import annotations

from model_service.engine.sampler import TokenLogprobs
from model_service.engine.sequence import Sequence


class OutputProcessor:
    def __init__(self, eos_token_ids: set[int], max_model_len: int) -> None:
        self.eos_token_ids, self.max_model_len = eos_token_ids, max_model_len

    def append(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None) -> bool:
        """Add `token` to `seq`; True when that finished it (`seq.finish_reason` says why)."""
        ids = seq.token_ids
        ids.append(token)
        grammar = seq.constraint
        if grammar is not None and grammar.ready:  # else it takes the output once compiled
            grammar.accept(token)
        if logprobs is not None:
            seq.logprobs.append(logprobs)
        p = seq.params
        stop_token = token in p.stop_token_ids or (token in self.eos_token_ids and not p.ignore_eos)
        if stop_token and not p.include_stop_str_in_output:
            return _stop(seq, "stop", token)  # its text is not part of the answer
        delta = seq.detokenizer.push(token)
        if delta:
            seq.text += delta
        if stop_token:
            return _stop(seq, "stop", token)
        if p.stop and self._match_stop_string(seq, len(delta)):
            return True
        if grammar is not None and grammar.done:
            return _stop(seq, "stop", None)
        if len(ids) - seq.num_prompt_tokens >= p.max_tokens or len(ids) >= self.max_model_len:
            return _stop(seq, "length", None)
        return False

    @staticmethod
    def _match_stop_string(seq: Sequence, new_chars: int) -> bool:
        # A stop string can only end inside the new text, so it starts at most len(stop)-1 before it.
        longest = max(map(len, seq.params.stop))
        search_from = max(0, len(seq.text) - new_chars - longest + 1)
        hits = [(seq.text.find(s, search_from), s) for s in seq.params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        i, s = min(hits)
        seq.text = seq.text[: i + len(s)] if seq.params.include_stop_str_in_output else seq.text[:i]
        return _stop(seq, "stop", s)


def _stop(seq: Sequence, reason: str, stop_reason: str | int | None) -> bool:
    seq.finish_reason, seq.stop_reason = reason, stop_reason
    return True
