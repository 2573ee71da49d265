"""What language a request's output must be in (`SamplingParams.structured_output`), and its
llguidance grammar.

Checked when the request is read (`SamplingParams.validate`, on the pod's gRPC thread before any
engine work): an invalid schema, regex or grammar, or a JSON Schema keyword llguidance cannot
enforce (it refuses those rather than ignore them), is an `InvalidRequestError` carrying the
library's own message. The check needs no tokenizer; compiling against the model's vocabulary
happens later, off the step's critical path (engine/grammar.py).

llguidance compiles a grammar's rule references by recursion, 3-10 KB of native stack a level:
a chain of a few thousand `$ref`s or Lark rules (a 30 KB request) overflowed a thread's 8 MB
stack, and the SIGSEGV took the pod and every stream on it. So a grammar is bounded
(`MAX_GRAMMAR_CHARS`, which also bounds the time its check holds the pod's event loop) and every
llguidance call that reads one runs on a thread whose stack fits the deepest grammar of that
size (`grammar_thread`): a 256 KiB chain of bare rule aliases needs 64-96 MB.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from model_service.errors import InvalidRequestError

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")

# Compact JSON, as json.dumps writes it: free whitespace lets a small model pad its output with
# newlines until max_tokens. A schema's own "x-guidance" object overrides these (llguidance's
# JSON options, applied after the defaults).
_JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# The longest grammar (llguidance's text of it: a JSON Schema's JSON, a regex, a Lark grammar) a
# request may give, and the stack of the threads that read and compile one (module docstring).
MAX_GRAMMAR_CHARS = 256 * 1024
GRAMMAR_STACK_BYTES = 256 << 20
_stack_size_lock = threading.Lock()
# A Lark rule's `temperature=` (`name[temperature=0.7]: ...`): llguidance's matcher reads it but
# leaves it to a sampler to apply, and this engine's sampler does not, so it is refused, not
# ignored (its `max_tokens=`, `stop=`, `suffix=` and `lazy` the matcher enforces).
_RULE_TEMPERATURE = re.compile(r"^\s*[?!]?\w+\s*\[[^\]\n]*\btemperature\s*=", re.MULTILINE)


def grammar_thread(name: str) -> ThreadPoolExecutor:
    """A one-thread executor whose thread has a `GRAMMAR_STACK_BYTES` stack (address space: only
    the pages a grammar's recursion touches are ever committed)."""
    worker = ThreadPoolExecutor(1, thread_name_prefix=name)
    with _stack_size_lock:  # the size applies to threads started while it is set
        previous = threading.stack_size(GRAMMAR_STACK_BYTES)
        try:
            worker.submit(int).result()  # starts the thread now, with that stack
        finally:
            threading.stack_size(previous)
    return worker


@functools.cache
def _reader() -> ThreadPoolExecutor:
    return grammar_thread("spindle-grammar-check")


@dataclass(frozen=True)
class StructuredOutput:
    """One of: `json_schema` (a JSON Schema, as a dict or JSON text), `json_object` (True: any JSON
    object), `regex` (the whole output matches it), `choice` (a list of strings: the output is
    one of them), `grammar` (llguidance's Lark syntax, or GBNF)."""

    kind: str
    spec: Any

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StructuredOutput:
        """From a request's `structured_output` object, which sets exactly one of KINDS (as
        vLLM's `structured_outputs` does); raises InvalidRequestError."""
        if not isinstance(d, dict):
            raise InvalidRequestError(
                f"structured_output must be an object with one of {list(KINDS)}, got {d!r}"
            )
        given = [k for k in d if d[k] is not None]
        unknown = [k for k in given if k not in KINDS]
        if unknown or len(given) != 1:
            raise InvalidRequestError(
                f"structured_output must set exactly one of {list(KINDS)}, got {given or 'none'}"
            )
        out = cls(given[0], d[given[0]])
        _ = out.grammar  # validates
        return out

    @functools.cached_property
    def grammar(self) -> str:
        """The llguidance grammar (its JSON top-level form), checked once; raises
        InvalidRequestError with llguidance's message."""
        return _reader().submit(self._checked_grammar).result()

    def _checked_grammar(self) -> str:
        _bounded(self.kind, self.spec)  # before reading a huge one
        text = self._grammar()
        _bounded(self.kind, text)
        problem = llguidance.LLMatcher.validate_grammar(text)
        if problem:
            raise InvalidRequestError(f"structured_output.{self.kind}: {problem.strip()}")
        return text

    def _grammar(self) -> str:
        try:
            return self._llguidance_grammar()
        except InvalidRequestError:  # ours, which name the field already
            raise
        except ValueError as e:  # llguidance's own refusals (a schema it cannot read as one)
            raise InvalidRequestError(f"structured_output.{self.kind}: {e}") from e

    def _llguidance_grammar(self) -> str:
        kind, spec, matcher = self.kind, self.spec, llguidance.LLMatcher
        if kind == "json_object":
            if spec is not True:
                raise InvalidRequestError("structured_output.json_object must be true when set")
            return matcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
        if kind == "json_schema":
            return matcher.grammar_from_json_schema(_schema(spec), defaults=_JSON_OPTIONS)
        if kind == "choice":
            if not isinstance(spec, list) or not spec or not all(isinstance(c, str) and c for c in spec):
                raise InvalidRequestError(
                    "structured_output.choice must be a non-empty list of non-empty strings"
                )
            return matcher.grammar_from_lark(_choice_lark(spec))
        if not isinstance(spec, str) or not spec:
            raise InvalidRequestError(f"structured_output.{kind} must be a non-empty string")
        if kind == "regex":
            return matcher.grammar_from_regex(spec)
        try:
            lark = any_to_lark(spec)  # GBNF is converted; Lark passes through unchanged
        except Exception as e:  # the converter raises GbnfToLarkError, bare Exception, RecursionError
            raise InvalidRequestError(f"structured_output.grammar: not Lark or GBNF: {e}") from e
        if _RULE_TEMPERATURE.search(lark):
            raise InvalidRequestError(
                "structured_output.grammar: a rule's temperature= is not supported (the request's "
                "temperature applies to its whole output)"
            )
        return matcher.grammar_from_lark(lark)

    def to_dict(self) -> dict[str, Any]:
        return {self.kind: self.spec}


def _choice_lark(options: list[str]) -> str:
    """The options as one lexeme (a terminal), not a rule with an alternative each: the lexer
    matches any number of them as one DFA, where the parser refused a rule of 2,000 alternatives
    at the first mask ("Current row has 2001 items; max is 2000")."""
    return "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in options)


def _bounded(kind: str, text: Any) -> None:
    """Refuse a spec or grammar text longer than `MAX_GRAMMAR_CHARS` (module docstring: why)."""
    if isinstance(text, str) and len(text) > MAX_GRAMMAR_CHARS:
        raise InvalidRequestError(
            f"structured_output.{kind} is {len(text):,} characters long; at most {MAX_GRAMMAR_CHARS:,} "
            "are served"
        )


def _schema(spec: Any) -> dict[str, Any]:
    """A JSON Schema given as JSON text or as an object, as an object."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except (json.JSONDecodeError, RecursionError) as e:  # RecursionError: nested too deep
            raise InvalidRequestError(f"structured_output.json_schema is not valid JSON: {e}") from e
    if not isinstance(spec, dict):
        raise InvalidRequestError(
            f"structured_output.json_schema must be a JSON Schema object, got {type(spec).__name__}"
        )
    return spec
