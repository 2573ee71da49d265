"""Turns sampled tokens into a request's text and decides when it stops.

Stop conditions, in order: a stop token (EOS or `stop_token_ids`; its text is part of the
answer only with `include_stop_str_in_output`), a stop string (searched only where the new text
could complete one, and only after `min_tokens` output tokens), a structured output that is
complete (its grammar allows nothing but EOS: "stop"), `max_tokens`, the context length
("length": a structured output may be cut short). A constrained sequence's matcher takes every
token appended here (a refused one raises `GrammarError`). The caller frees what finished.
"""

from __future__ import annotations

from model_service.engine.prompt_logprobs import pending
from model_service.engine.requests import Resume
from model_service.engine.sampler import TokenLogprobs
from model_service.engine.sequence import RequestOutput, Sequence, Status
from model_service.errors import InvalidRequestError


class OutputProcessor:
    def __init__(self, eos_token_ids: set[int], max_model_len: int) -> None:
        self.eos_token_ids, self.max_model_len = eos_token_ids, max_model_len

    def append(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None) -> bool:
        """Add `token` to `seq`; True when that finished it (`seq.output.finish_reason` says why)."""
        ids, out = seq.token_ids, seq.output
        ids.append(token)
        grammar = seq.sampling.constraint
        if grammar is not None and grammar.ready:  # else it takes the output once compiled
            grammar.accept(token)
        if logprobs is not None:
            out.logprobs.append(logprobs)
        p = seq.params
        stop_token = token in p.stop_token_ids or (token in self.eos_token_ids and not p.ignore_eos)
        has_text = not stop_token or p.include_stop_str_in_output  # a stop token's text is not the answer's
        if has_text and self._add_text(seq, out.detokenizer.push(token)):
            return True
        ending = self._ending(seq, token if stop_token else None)
        if ending is None:
            return False
        # The output ends here: text held back for a character no token will now complete is
        # the output's too (as `decode` spells it), and may complete a stop string.
        return self._add_text(seq, out.detokenizer.flush()) or _stop(seq, *ending)

    def _add_text(self, seq: Sequence, delta: str) -> bool:
        """Append `delta` to `seq`'s text; True when that completed a stop string (which ended it)."""
        if not delta:
            return False
        seq.output.text += delta
        # vLLM's min_tokens: text of the first min_tokens output tokens ends nothing (a stop string
        # completed later may still start in it)
        searched = seq.params.stop and seq.num_output_tokens > seq.params.min_tokens
        return bool(searched) and self._match_stop_string(seq, len(delta))

    def _ending(self, seq: Sequence, stop_token: int | None) -> tuple[str, int | None] | None:
        """Why `seq` ends after its last token besides a stop string (finish and stop reason), if it does."""
        grammar = seq.sampling.constraint
        if stop_token is not None:
            return "stop", stop_token
        if grammar is not None and grammar.done:
            return "stop", None
        ids, p = seq.token_ids, seq.params
        if len(ids) - seq.num_prompt_tokens >= p.max_tokens or len(ids) >= self.max_model_len:
            return "length", None
        return None

    def replay(self, seq: Sequence, resume: Resume) -> bool:
        """Append a resumed request's output as if sampled here (stop strings, penalties and
        seeded noise see the same history) and mark what the caller has as sent; True when that
        output finished the request (`seq.output.finish_reason` says why)."""
        ids = resume.output_token_ids
        for i, token in enumerate(ids):
            if self.append(seq, token, None) and i + 1 < len(ids):
                raise InvalidRequestError(
                    f"resume.output_token_ids goes on after output token {i}, where this request stops"
                )
        out = seq.output
        if resume.text_chars > len(out.text):
            raise InvalidRequestError(
                f"resume.text_chars is {resume.text_chars} but its output tokens make {len(out.text)} "
                "characters of text"
            )
        out.sent_tokens, out.sent_chars = seq.num_output_tokens, resume.text_chars
        if ids:  # the caller had its first output, and with it any prompt logprobs: not scored again
            out.prompt_logprobs = None
        return out.finish_reason is not None

    @staticmethod
    def _match_stop_string(seq: Sequence, new_chars: int) -> bool:
        # A stop string can only end inside the new text, so it starts at most len(stop)-1 before it.
        out, longest = seq.output, max(map(len, seq.params.stop))
        search_from = max(0, len(out.text) - new_chars - longest + 1)
        hits = [(out.text.find(s, search_from), s) for s in seq.params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        i, s = min(hits)
        out.text = out.text[: i + len(s)] if seq.params.include_stop_str_in_output else out.text[:i]
        return _stop(seq, "stop", s)


def _stop(seq: Sequence, reason: str, stop_reason: str | int | None) -> bool:
    seq.output.finish_reason, seq.output.stop_reason = reason, stop_reason
    return True


def take_output(seq: Sequence) -> RequestOutput:
    """`seq`'s output since the last call, marked sent. Text that could still become a stop
    string is held back."""
    out, finished, stop = seq.output, seq.status is Status.FINISHED, seq.params.stop
    hold = max(map(len, stop)) - 1 if stop and not finished else 0
    end = max(out.sent_chars, len(out.text) - hold)
    ids, first = seq.token_ids, seq.num_prompt_tokens
    result = RequestOutput(
        seq.request_id,
        ids[first + out.sent_tokens :],
        out.text[out.sent_chars : end],
        (ids, first, len(ids)),
        out.text,
        finished,
        out.finish_reason,
        first,
        out.logprobs[out.sent_logprobs :],
        out.stop_reason,
        out.error,
        seq.admission.first_scheduled_at,
        _unsent_prompt_logprobs(seq),
    )
    out.sent_tokens, out.sent_chars, out.sent_logprobs = len(ids) - first, end, len(out.logprobs)
    return result


def _unsent_prompt_logprobs(seq: Sequence) -> tuple[list[int], list[TokenLogprobs]] | None:
    """`seq`'s prompt and prompt logprobs, the first time an output is taken with all of them
    (its first token's output, or a prompt-only request's final one); else None."""
    out = seq.output
    if out.prompt_logprobs is None or out.prompt_logprobs_sent or pending(seq):
        return None
    out.prompt_logprobs_sent = True
    return seq.token_ids[: seq.num_prompt_tokens], out.prompt_logprobs
