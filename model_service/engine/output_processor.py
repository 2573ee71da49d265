"""Turns sampled tokens into a request's text and decides when it stops.

Stop conditions, in order: a stop token (EOS or `stop_token_ids`; its text is part of the
answer only with `include_stop_str_in_output`), a stop string (searched only where the new text
could complete one), a structured output that is complete (its grammar allows nothing but EOS:
"stop"), `max_tokens`, the context length ("length": a structured output may be cut short). A
constrained sequence's matcher takes every token appended here (a refused one raises
`GrammarError`). The caller frees what finished.
"""

from __future__ import annotations

from model_service.engine.requests import Resume
from model_service.engine.sampler import TokenLogprobs
from model_service.engine.sequence import Sequence
from model_service.errors import InvalidRequestError


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

    def replay(self, seq: Sequence, resume: Resume) -> bool:
        """Append a resumed request's output as if sampled here (stop strings, penalties and
        seeded noise see the same history) and mark what the caller has as sent; True when that
        output finished the request (`seq.finish_reason` says why)."""
        ids = resume.output_token_ids
        for i, token in enumerate(ids):
            if self.append(seq, token, None) and i + 1 < len(ids):
                raise InvalidRequestError(
                    f"resume.output_token_ids goes on after output token {i}, where this request stops"
                )
        if resume.text_chars > len(seq.text):
            raise InvalidRequestError(
                f"resume.text_chars is {resume.text_chars} but its output tokens make {len(seq.text)} "
                "characters of text"
            )
        seq.emitted_tokens, seq.emitted_chars = seq.num_output_tokens, resume.text_chars
        return seq.finish_reason is not None

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
