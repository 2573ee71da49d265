"""Tokenizer and chat template, provided by HF `transformers` (the one job it has here)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from model_service.errors import InvalidRequestError

log = logging.getLogger(__name__)


class Tokenizer:
    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf = hf_tokenizer

    @classmethod
    def from_dir(cls, path: Path, gguf_file: str | None = None) -> Tokenizer | None:
        """Load from a checkpoint dir (or a GGUF file's metadata); None when the dir has no tokenizer."""
        from transformers import AutoTokenizer

        if gguf_file is None and not any(
            (path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
        ):
            return None
        try:
            if gguf_file is not None:
                return cls(_from_gguf(path / gguf_file))
            return cls(AutoTokenizer.from_pretrained(str(path)))
        except Exception as e:  # a broken tokenizer should not stop token-id serving
            log.warning("could not load tokenizer from %s: %s", path, e)
            return None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def stream_decoder(self, context: list[int], skip_special_tokens: bool) -> Callable[[int], str] | None:
        """A per-token decoder continuing after `context` (tokenizers' DecodeStream, in Rust: ~0.7
        us a token for SmolLM2 against ~6 us for two windowed `decode` calls), or None where it
        would not decode as `decode` does: no fast backend, or a tokenizer that cleans up spaces
        after decoding (DecodeStream does not)."""
        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is None or getattr(self.hf, "clean_up_tokenization_spaces", False):
            return None
        try:
            from tokenizers.decoders import DecodeStream

            stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        except (ImportError, TypeError):  # tokenizers before 0.22 has no stream with a context
            return None
        return lambda token: stream.step(backend, token) or ""

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The prompt's token ids for `messages` (and `tools`: OpenAI's `tools[]` entries, as
        transformers passes them to the template; `template_kwargs`: more template variables, as
        vLLM's `chat_template_kwargs`, e.g. Qwen3's `enable_thinking`), as HF renders and
        tokenizes them, with the generation prompt. A template that refuses the messages
        (`raise_exception("Conversation roles must alternate ...")`, Llama-2's and Mistral's) or
        cannot render them is the request's error (INVALID_ARGUMENT, a 400 as vLLM gives), not
        the server's: a 500 would have the SDKs retry it."""
        from jinja2 import TemplateError

        template_kwargs = checked_template_kwargs(template_kwargs or {})

        if not getattr(self.hf, "chat_template", None):
            raise InvalidRequestError("this model has no chat template; send `prompt` instead of `messages`")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise InvalidRequestError(f"each message needs `role` and `content`, got {m!r}")
        try:
            out = self.hf.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=True, **template_kwargs
            )
        except TemplateError as e:
            raise InvalidRequestError(f"the model's chat template refused these messages: {e}") from e
        ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
        return [int(t) for t in ids]

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token stands for: its vocabulary's longest entry (a
        byte-level entry has a character per byte, so at least one per character it decodes to)."""
        return max(map(len, self.hf.get_vocab()), default=1)

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id


# apply_chat_template's own arguments (and the variables it sets from them): a request's template
# variables may not stand in for them (`tokenize: false` would return text, `add_generation_prompt:
# false` drop the assistant's turn, `messages` replace the conversation).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})  # fmt: skip


def checked_template_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A request's chat-template variables, or InvalidRequestError naming what is wrong: an
    object of identifier names, none of `RESERVED_TEMPLATE_KWARGS`."""
    if not isinstance(kwargs, dict):
        raise InvalidRequestError(f"chat_template_kwargs must be an object, got {type(kwargs).__name__}")
    for name in kwargs:
        if not isinstance(name, str) or not name.isidentifier():
            raise InvalidRequestError(f"chat_template_kwargs: {name!r} is no template variable's name")
        if name in RESERVED_TEMPLATE_KWARGS:
            raise InvalidRequestError(
                f"chat_template_kwargs may not set {name!r}: the server sets it for every chat"
            )
    return kwargs


def _from_gguf(path: Path) -> Any:
    """The HF tokenizer of a GGUF file: rebuilt from its vocabulary (seconds), or read back from
    the conversion cache where an earlier load saved it (`gguf_cache`)."""
    from transformers import AutoTokenizer

    from model_service.models import gguf_cache

    with gguf_cache.converting(path, "tokenizer"):
        cached = gguf_cache.lookup(path, "tokenizer")
        if cached is not None:
            try:
                return AutoTokenizer.from_pretrained(str(cached))
            except Exception:  # whatever a damaged entry raises: the file itself may be fine
                gguf_cache.discard(cached)
        hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        gguf_cache.store(path, "tokenizer", hf.save_pretrained)
        return hf
