"""Incremental detokenization that never emits half a UTF-8 character.

Decoding token by token breaks multi-byte characters split across tokens, and decoding the
whole output each step is quadratic. With a fast tokenizer, tokenizers' own streaming decoder
does it (`Tokenizer.stream_decoder`: it holds a token back until its text is whole; a push costs
under a microsecond, which at 256 sequences a step is most of the difference between the host
keeping up with the GPU or not). Otherwise, as vLLM does, we decode a small window: the text of
tokens [prefix_offset, read_offset) is what was already emitted at the window's start;
whatever the window's full decode adds beyond it is new, unless it ends in U+FFFD (an
incomplete character), in which case we wait for the next token.

A prompt of token ids may end inside a character (its text ends in U+FFFD). The output tokens
that complete that character emit it whole, so that the prompt's text without its trailing
U+FFFD, followed by the output's text, is the text of prompt and output decoded together. The
streaming decoder cannot do this (it would emit the prompt's text again, or nothing), so such a
request takes the window until its first text, and streams from there.

A byte-fallback tokenizer's decode is not always a prefix of its decode one token on: a run of
<0x..> byte tokens that is not valid UTF-8 decodes to one U+FFFD per byte, so "j" (<0x6A>)
becomes U+FFFD once <0xFD> follows it. The streaming decoder raises there ("Invalid prefix").
The stream is only the fast way to `decode`; where it cannot go on, the window (which never
raises) takes that token, as for a prompt that ends inside a character, and streams again after.

Text held back waits for a token that completes its character; once the output has ended
(`flush`), none will, and it comes out as `decode` spells it, U+FFFD for the cut character.
"""

from __future__ import annotations

from collections.abc import Callable

from model_service.models.tokenizer import Tokenizer

_WINDOW = 6
_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Tokenizer | None, prompt_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stream: Callable[[int], str] | None = None
        self._continue_after(list(prompt_ids[-_WINDOW:]), held=0, settling=None)

    def _continue_after(self, ids: list[int], held: int, settling: bool | None) -> None:
        """Decode on from `ids`, whose text is emitted (or the prompt's) but for its last `held`
        tokens: by the window while `settling` (None: while the emitted text ends inside a
        character, as a prompt's may), else by the stream."""
        self.ids, self.prefix_offset, self.read_offset = ids, 0, len(ids) - held
        self.held = held  # tokens pushed since the last text, the stream's to count
        if settling is None:
            settling = self.tokenizer is not None and self.tokenizer.decode(
                ids, self.skip_special_tokens
            ).endswith(_INCOMPLETE)
        self.settling = settling
        self.stream = self._stream_decoder() if not settling else None

    def _stream_decoder(self) -> Callable[[int], str] | None:
        return self.tokenizer.stream_decoder(self.ids, self.skip_special_tokens) if self.tokenizer else None

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text it completes (possibly empty)."""
        if self.stream is not None:
            return self._push_stream(token_id)
        if self.tokenizer is None:
            return ""
        delta = self._push_window(token_id)
        if delta and self.settling:  # the prompt's last character is whole: stream from here
            self._continue_after(self.ids, held=0, settling=False)
        return delta

    def flush(self) -> str:
        """The text of the tokens still held back, as `decode` spells it (U+FFFD for a cut
        character): for the end of the output, where no token can complete it. Without it, that
        text was lost, and with it what a byte-level token glues before a cut character (" \xe6":
        the space)."""
        if self.tokenizer is None or not (self.held if self.stream is not None else self._pending):
            return ""
        if self.stream is not None:
            self._continue_after(self.ids[-(_WINDOW + self.held) :], self.held, settling=True)
        full, start = self._window_text()
        self._continue_after(self.ids, held=0, settling=None)
        return full[start:]

    @property
    def _pending(self) -> bool:
        return self.read_offset < len(self.ids)

    def _push_stream(self, token_id: int) -> str:
        assert self.stream is not None
        try:
            delta = self.stream(token_id)
        except Exception:  # "Invalid prefix": the decode of the tokens so far changed (see above)
            self._continue_after(self.ids[-(_WINDOW + self.held) :], self.held, settling=True)
            return self.push(token_id)
        self.ids.append(token_id)  # the recent tokens, should the window have to take over
        self.held = 0 if delta else self.held + 1
        if len(self.ids) > 4 * _WINDOW + self.held:
            del self.ids[: -(_WINDOW + self.held)]
        return delta

    def _push_window(self, token_id: int) -> str:
        assert self.tokenizer is not None
        self.ids.append(token_id)
        full, start = self._window_text()
        if len(full) <= start or full.endswith(_INCOMPLETE):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        # Keep the window short so each push costs O(window), not O(output).
        if self.prefix_offset > _WINDOW:
            drop = self.prefix_offset - _WINDOW
            self.ids = self.ids[drop:]
            self.prefix_offset -= drop
            self.read_offset -= drop
        return full[start:]

    def _window_text(self) -> tuple[str, int]:
        """The window's text and where its new part starts."""
        assert self.tokenizer is not None
        prefix = self.tokenizer.decode(
            self.ids[self.prefix_offset : self.read_offset], self.skip_special_tokens
        )
        full = self.tokenizer.decode(self.ids[self.prefix_offset :], self.skip_special_tokens)
        # Emitted text ends whole; a prompt's may not, and the character completing it is new.
        return full, _shared_length(prefix, full) if prefix.endswith(_INCOMPLETE) else len(prefix)


def _shared_length(a: str, b: str) -> int:
    """The length of the longest common prefix of `a` and `b`."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
