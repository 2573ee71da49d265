"""Per-request generation settings, named as vLLM and the gRPC request name them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from model_service.engine.structured_output import StructuredOutput
from model_service.errors import InvalidRequestError

# Temperatures below this sample greedily (as vLLM does): dividing logits by a near-zero
# temperature overflows to inf, and softmax of inf is NaN.
_GREEDY_BELOW = 1e-5
# Every stop string is searched for, and every stop token id looked up, after each token of the
# request, on the engine thread all requests of the pod share: without a bound one request of a
# million stop strings (14 MB of JSON) held each step of every caller back by half a second.
# (OpenAI allows 4 stop strings, TGI 4 by default.)
MAX_STOP_STRINGS = 128
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
# The logits processors' entries are paid for at every step of the request (host lists copied to
# the device, bad words matched against the output): bounded as stop tokens are.
MAX_LOGIT_BIAS = 1024
MAX_ALLOWED_TOKEN_IDS = 1024
MAX_BAD_WORDS = 128  # and each at most MAX_STOP_STRING_CHARS; their tokens (logits_processors.py) 1,024


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0  # 0 (or below 1e-5) = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 (vLLM's spelling) = off; above the vocabulary = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF semantics, over prompt and output tokens
    presence_penalty: float = 0.0  # OpenAI semantics, over output tokens
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None = off; N = sampled token plus the top N
    # None = off; N = each prompt token after the first: its own logprob given the tokens before
    # it, plus the top N (raw model logprobs, as `logprobs`). Such a request may ask for
    # max_tokens 0 (the prompt scored, nothing generated: finish "length").
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    num_beams: int = 1  # > 1: beam search (deterministic: temperature, top-k/p, min-p, seed are ignored)
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never", as in HF generate
    # The language the output must be in (JSON Schema, regex, choice, grammar); None = free text.
    # A request's dict gives it as {"json_schema": {...}} (or regex, choice, grammar, json_object).
    structured_output: StructuredOutput | None = None
    # Logits processors (engine/logits_processors.py), before the penalties as in HF and vLLM:
    # OpenAI's token id -> bias in [-100, 100]; vLLM's ids the output is limited to (empty: all),
    # its output length before which EOS and stop tokens cannot end it, and its words that may
    # not be generated. A request's dict may give logit_bias's ids as strings (OpenAI's JSON).
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0
    bad_words: list[str] = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """Build from request fields, ignoring unrelated keys (prompt, adapter, ...)."""
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names and v is not None}
        if isinstance(kwargs.get("stop"), str):
            kwargs["stop"] = [kwargs["stop"]]
        if "structured_output" in kwargs and not isinstance(kwargs["structured_output"], StructuredOutput):
            kwargs["structured_output"] = StructuredOutput.from_dict(kwargs["structured_output"])
        if isinstance(kwargs.get("logit_bias"), dict):
            kwargs["logit_bias"] = _token_keyed(kwargs["logit_bias"])
        p = cls(**kwargs)
        p.validate()
        return p

    def validate(self, vocab_size: int | None = None) -> None:
        def bad(msg: str) -> None:
            raise InvalidRequestError(msg)

        least = 0 if self.prompt_logprobs is not None else 1  # 0: only the prompt's logprobs
        if not _is_int(self.max_tokens) or self.max_tokens < least:
            bad(f"max_tokens must be an integer >= {least}, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            bad(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k) or self.top_k < -1:
            bad(f"top_k must be an integer >= -1 (0 or -1 disables it), got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0.0 < self.repetition_penalty < float("inf"):
            bad(f"repetition_penalty must be finite and > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0 or not -2.0 <= self.frequency_penalty <= 2.0:
            bad("presence_penalty and frequency_penalty must be in [-2, 2]")
        # (a float here would pass the range check and then fail the whole batch in the sampler)
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= 20):
            bad(f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= 20
        ):
            bad(f"prompt_logprobs must be an integer in [0, 20], got {self.prompt_logprobs!r}")
        for problem in (self._stop_problem(), self._processors_problem(vocab_size)):
            if problem:
                bad(problem)
        beam_problem = self._beam_search_problem()
        if beam_problem:
            bad(beam_problem)
        if self.structured_output is not None:
            if not isinstance(self.structured_output, StructuredOutput):
                bad(f"structured_output must be a StructuredOutput, got {self.structured_output!r}")
            _ = self.structured_output.grammar  # raises with llguidance's message
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            bad(f"seed must be an integer in [0, 2^63), got {self.seed!r}")
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in self.stop_token_ids):
            bad(f"stop_token_ids must be in [0, {vocab_size})")

    def _processors_problem(self, vocab_size: int | None) -> str | None:
        """What is wrong with the logits processors' fields: kinds, ranges, ids in the vocabulary
        (when known), and the bounds on their per-step cost."""
        bias, allowed = self.logit_bias, self.allowed_token_ids
        if not isinstance(bias, dict) or not all(_is_number(v) for v in bias.values()):
            return "logit_bias must map token ids to numbers"
        if len(bias) > MAX_LOGIT_BIAS:
            return f"logit_bias has {len(bias):,} entries; at most {MAX_LOGIT_BIAS:,} are allowed"
        if not all(-100.0 <= v <= 100.0 for v in bias.values()):  # NaN fails too
            return f"logit_bias values must be in [-100, 100], got {_outside(bias.values())}"
        if not isinstance(allowed, list) or len(allowed) > MAX_ALLOWED_TOKEN_IDS:
            return f"allowed_token_ids must be a list of at most {MAX_ALLOWED_TOKEN_IDS:,} token ids"
        top = vocab_size if vocab_size is not None else 2**31
        for name, ids in (("logit_bias", list(bias)), ("allowed_token_ids", allowed)):
            outside = [t for t in ids if not _is_int(t) or not 0 <= t < top]
            if outside:
                return f"{name} has token ids outside the vocabulary [0, {top}): {outside[:5]}"
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            most = self.max_tokens
            return f"min_tokens must be an integer in [0, max_tokens ({most})], not {self.min_tokens!r}"
        words = self.bad_words
        if not isinstance(words, list) or any(not isinstance(w, str) or not w.strip() for w in words):
            return "bad_words must be a list of non-empty strings"
        if len(words) > MAX_BAD_WORDS or max(map(len, words), default=0) > MAX_STOP_STRING_CHARS:
            return f"at most {MAX_BAD_WORDS} bad_words of at most {MAX_STOP_STRING_CHARS:,} characters each"
        return None

    def _stop_problem(self) -> str | None:
        """What is wrong with `stop` and `stop_token_ids`: their kinds, and the bounds on their
        per-token cost (MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS, MAX_STOP_TOKEN_IDS)."""
        if any(not isinstance(s, str) or not s for s in self.stop):
            return "stop strings must be non-empty strings"
        if len(self.stop) > MAX_STOP_STRINGS:
            return f"{len(self.stop):,} stop strings; at most {MAX_STOP_STRINGS} are allowed"
        longest = max(map(len, self.stop), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            return f"a stop string is {longest:,} characters long; at most {MAX_STOP_STRING_CHARS:,} allowed"
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            return f"{len(self.stop_token_ids):,} stop_token_ids; at most {MAX_STOP_TOKEN_IDS} are allowed"
        return None

    def _beam_search_problem(self) -> str | None:
        """What is wrong with the beam-search fields, or with a field beam search cannot honour."""
        if not _is_int(self.num_beams) or not 1 <= self.num_beams <= 32:
            return f"num_beams must be in [1, 32], got {self.num_beams!r}"
        if self.early_stopping not in (True, False, "never"):
            return f'early_stopping must be true, false or "never", got {self.early_stopping!r}'
        if not _is_number(self.length_penalty) or not math.isfinite(self.length_penalty):
            return f"length_penalty must be a finite number, got {self.length_penalty!r}"
        if self.num_beams == 1:
            return None
        if self.stop or self.logprobs is not None or self.prompt_logprobs is not None:
            return "stop strings, logprobs and prompt_logprobs are not supported with num_beams > 1"
        if self.needs_penalties:  # HF's beam search applies repetition_penalty: ignored, the answer differs
            return "repetition, presence and frequency penalties are not supported with num_beams > 1"
        if self.structured_output is not None:
            return "structured_output is not supported with num_beams > 1 (beam search)"
        if self.needs_processors:
            return "logit_bias, allowed_token_ids, min_tokens, bad_words are not supported with num_beams > 1"
        return None

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_BELOW

    @property
    def truncates(self) -> bool:
        """Whether top-k, top-p or min-p remove tokens before the draw (a sort per row)."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    @property
    def needs_processors(self) -> bool:
        """Whether a logits processor changes this request's rows (engine/logits_processors.py)."""
        return bool(self.logit_bias or self.allowed_token_ids or self.min_tokens or self.bad_words)

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _token_keyed(bias: dict[Any, Any]) -> dict[Any, Any]:
    """`logit_bias` with its ids as ints: OpenAI's JSON spells them as strings (\"50256\"); a key
    that is not a decimal id stays as it is, for `validate` to name."""
    return {int(k) if isinstance(k, str) and k.strip().isdecimal() else k: v for k, v in bias.items()}


def _outside(values: Any) -> Any:
    return next(v for v in values if not -100.0 <= v <= 100.0)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
