"""Incremental detokenization that never emits half a UTF-8 character.

Decoding token by token breaks multi-byte characters split across tokens, and decoding the
whole output each step is quadratic. With a fast tokenizer, tokenizers' own streaming decoder
does it (`Tokenizer.stream_decoder`: it holds a token back until its text is whole; a push costs
under a microsecond, which at 256 sequences a step is most of the difference between the host
keeping up with the GPU or not). Otherwise, as vLLM does, we decode a small window: the text of
tokens [prefix_offset, read_offset) is what was already emitted at the window's start;
whatever the window's full decode adds beyond it is new, unless it ends in U+FFFD (an
incomplete character), in which case we wait for the next token.
"""

from __future__ import annotations

from model_service.models.tokenizer import Tokenizer

_WINDOW = 6


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Tokenizer | None, prompt_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids[-_WINDOW:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stream = tokenizer.stream_decoder(self.ids, skip_special_tokens) if tokenizer else None

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text it completes (possibly empty)."""
        if self.stream is not None:
            return self.stream(token_id)
        if self.tokenizer is None:
            return ""
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(
            self.ids[self.prefix_offset : self.read_offset], self.skip_special_tokens
        )
        full = self.tokenizer.decode(self.ids[self.prefix_offset :], self.skip_special_tokens)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        # Keep the window short so each push costs O(window), not O(output).
        if self.prefix_offset > _WINDOW:
            drop = self.prefix_offset - _WINDOW
            self.ids = self.ids[drop:]
            self.prefix_offset -= drop
            self.read_offset -= drop
        return full[len(prefix) :]
