"""Reading tool calls out of a chat's output text, as it streams (vLLM's tool-call parsers).

A model asked with `tools` answers in text: its own markup for a call (Hermes' and Qwen's
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, Llama 3's bare `{"name": ...,
"parameters": {...}}`, Mistral's `[TOOL_CALLS]`, Llama 3.2's Python list `[f(a=1)]`), or, under
`tool_choice` "required" or a named function, the JSON the structured-output engine forced
(requests.py's tools part builds its schema). A `Reader` turns the text, fed piece by piece as
the pod streams it, into `Piece`s: content text (never any call
markup, which is held back until it is known to be one), `CallStart` and `Arguments`. The whole
response is the same reader fed once, so a streamed answer and a whole one always agree.

A call whose JSON does not parse, or lacks a name, is not a call: its text is returned as content
(a client sees what the model wrote, never a 500).
"""

from __future__ import annotations

import ast
import json
import math
import re
import secrets
import string
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

# --tool-call-parser's choices (none: "auto" is refused)
PARSERS = ("none", "hermes", "llama3_json", "mistral", "openai", "pythonic")
_MISTRAL_ID = string.ascii_letters + string.digits


@dataclass(frozen=True)
class CallStart:
    """A new call of function `name` (its arguments follow as `Arguments` pieces)."""

    name: str


@dataclass(frozen=True)
class Arguments:
    """More of the current call's arguments (a JSON object's text, in pieces)."""

    text: str


Piece = str | CallStart | Arguments


@dataclass(frozen=True)
class Thought:
    """More of the model's reasoning (its `reasoning_content`): what reasoning_parsers.py's readers,
    and Harmony's (whose calls and reasoning are one format), read apart from content."""

    text: str


class Reader(ABC):
    """One response's output text -> pieces; `feed` as text arrives, `finish` at its end."""

    calls = 0  # calls read so far
    markup_is_special = False  # whether a checkpoint's call markup may be special tokens

    @abstractmethod
    def feed(self, text: str) -> list[Piece]: ...

    @abstractmethod
    def finish(self) -> list[Piece]: ...

    def read(self, text: str) -> list[Piece]:
        """A whole output at once."""
        return self.feed(text) + self.finish()

    def _call(self, name: str, arguments: Any) -> list[Piece]:
        self.calls += 1
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        return [CallStart(name), Arguments(text)]

    def _as_call(self, obj: Any, *argument_keys: str) -> list[Piece] | None:
        """The call a decoded JSON value states ({"name": ..., "arguments": {...}}), or None."""
        arguments = self._arguments(obj, *argument_keys)
        return None if arguments is None else self._call(obj["name"], arguments)

    @staticmethod
    def _arguments(obj: Any, *argument_keys: str) -> dict | str | None:
        """The arguments of the call a decoded JSON value states (None: it states none)."""
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None
        arguments = next((obj[k] for k in argument_keys if k in obj), {})
        return arguments if isinstance(arguments, (dict, str)) else None


class _Content:
    """Content text with the whitespace around calls dropped (a model writes "\\n" between its
    `<tool_call>` blocks): whitespace is held until text follows it, so a plain answer streams
    exactly as written. What follows a call loses its leading whitespace, but text before the
    calls and text after them keep the whitespace that parted the first from the calls ("Let me
    look.\\n<tool_call>...</tool_call>\\nDone." is "Let me look.\\nDone.", not glued together)."""

    def __init__(self) -> None:
        self.pending = ""  # trailing whitespace not yet sent
        self.after_call = False
        self.sent = False  # whether any text was sent

    def text(self, text: str) -> list[Piece]:
        if self.after_call:
            text = text.lstrip()
            if not text:
                return []
            self.after_call = False
        held = self.pending + text
        body = held.rstrip()
        self.pending = held[len(body) :]
        self.sent = self.sent or bool(body)
        return [body] if body else []

    def call(self) -> None:
        self.after_call = True
        if not self.sent:  # whitespace before the content's start
            self.pending = ""

    def end(self, called: bool) -> list[Piece]:
        rest, self.pending = self.pending, ""
        return [rest] if rest and not called else []


class HermesReader(Reader):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks among the text (Hermes 2
    Pro, Qwen 2.5 / 3): vLLM's `hermes` parser. A block ends at the first `</tool_call>` its JSON
    is whole before (one inside an argument's string, as a file-editing tool's may hold, does not
    end it); a block none ends is not a call, and ends at its first. A block the output ends
    inside (no closing tag) is a call when its JSON is whole, as vLLM reads it."""

    START, END = "<tool_call>", "</tool_call>"
    markup_is_special = True

    def __init__(self) -> None:
        self.buffer, self.in_call, self.content = "", False, _Content()
        self.tried = 0  # where the block's closing tags not yet tried start

    def feed(self, text: str) -> list[Piece]:
        self.buffer += text
        out: list[Piece] = []
        while True:
            if self.in_call:
                end = self._call_end()
                if end < 0:
                    return out
                out += self._block(self.buffer[:end], closed=True)
                self.buffer, self.in_call = self.buffer[end + len(self.END) :], False
                continue
            start = self.buffer.find(self.START)
            if start < 0:
                keep = partial_suffix(self.buffer, self.START)
                out += self.content.text(self.buffer[: len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep :]
                return out
            out += self.content.text(self.buffer[:start])
            self.buffer, self.in_call, self.tried = self.buffer[start + len(self.START) :], True, 0

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        while self.in_call and self.END in self.buffer and self._call_json(self.buffer) is None:
            end = self.buffer.find(self.END)  # no tag closes a call: the first closes what is not one
            out += self._block(self.buffer[:end], closed=True)
            self.buffer, self.in_call = self.buffer[end + len(self.END) :], False
            out += self.feed("")
        rest, self.buffer = self.buffer, ""
        out += self._block(rest, closed=False) if self.in_call else self.content.text(rest)
        return out + self.content.end(self.calls > 0)

    def _call_end(self) -> int:
        """Where the first `</tool_call>` the block's JSON is whole before starts; -1 while none
        is (each tag is tried once: the text before it never changes)."""
        at = self.buffer.find(self.END, self.tried)
        while at >= 0 and self._call_json(self.buffer[:at]) is None:
            at = self.buffer.find(self.END, at + 1)
        self.tried = at if at >= 0 else max(self.tried, len(self.buffer) - len(self.END) + 1)
        return at

    def _call_json(self, body: str) -> Any:
        """The call `body` states, decoded (None: it is not valid JSON of a call)."""
        obj = json_value(body)
        return obj if self._arguments(obj, "arguments", "parameters") is not None else None

    def _block(self, body: str, closed: bool) -> list[Piece]:
        obj = self._call_json(body)
        if obj is None:  # not a call: what the model wrote, markup and all
            return self.content.text(self.START + body + (self.END if closed else ""))
        self.content.call()
        return self._call(obj["name"], self._arguments(obj, "arguments", "parameters"))


class _WholeCallsReader(Reader):
    """An output that is either all calls or plain text, decided by how it starts: text streams
    as it comes; an output that starts like calls is held to its end, then read whole (`_read`:
    its pieces, or None for content)."""

    def __init__(self) -> None:
        self.buffer, self.mode = "", ""  # mode: "" undecided, "text", "calls"

    @abstractmethod
    def _starts_calls(self, head: str) -> bool | None:
        """Whether an output starting with `head` (no leading whitespace) is calls; None: not known yet."""

    @abstractmethod
    def _read(self, text: str) -> list[Piece] | None: ...

    def feed(self, text: str) -> list[Piece]:
        if self.mode == "text":
            return [text] if text else []
        self.buffer += text
        if self.mode == "calls":
            return []
        head = self.buffer.lstrip()
        calls = self._starts_calls(head) if head else None
        if calls is None:
            return []  # undecided yet
        self.mode = "calls" if calls else "text"
        if calls:
            return []
        out, self.buffer = self.buffer, ""
        return [out]

    def finish(self) -> list[Piece]:
        text, self.buffer = self.buffer, ""
        if self.mode == "text" or not text:
            return []
        calls = self._read(text) if self.mode == "calls" else None
        return calls if calls is not None else [text]


class Llama3JsonReader(_WholeCallsReader):
    """An output that is one or more JSON calls, `{"name": ..., "parameters": {...}}` separated by
    ";" (optionally after `<|python_tag|>`): Llama 3.1-3.3's JSON tool calling, vLLM's
    `llama3_json`. An output that starts otherwise is content, streamed as it comes; one that
    starts like a call is held to its end, then read whole (content if it is not all calls)."""

    TAG = "<|python_tag|>"

    def _starts_calls(self, head: str) -> bool | None:
        if self.TAG.startswith(head) and head != self.TAG:
            return None
        return head.startswith(("{", self.TAG))

    def _read(self, text: str) -> list[Piece] | None:
        text = text.strip().removeprefix(self.TAG).strip()
        out: list[Piece] = []
        at = 0
        while at < len(text):
            decoded = json_prefix(text, at)
            if decoded is None:
                return None
            obj, at = decoded
            call = self._as_call(obj, "parameters", "arguments")
            if call is None:
                return None
            out += call
            at = len(text) - len(text[at:].lstrip().removeprefix(";").lstrip())
        if not out:
            return None
        return out


class MistralReader(Reader):
    """Mistral's calls, after the text they follow (vLLM's `mistral`): `[TOOL_CALLS]` then a JSON
    list of `{"name": ..., "arguments": {...}}` (Mistral 7B v0.3, Mixtral: tokenizers before v11),
    or `[TOOL_CALLS]name[ARGS]{...}` per call (Mistral Small 3.1+, Ministral, Magistral: v11 and
    later, where `[CALL_ID]...` may part the name from `[ARGS]`). Both markers are special tokens,
    which the pod then keeps for it. Text before the first `[TOOL_CALLS]` is content, streamed as
    it comes; each part after one is read when the next `[TOOL_CALLS]` or the output's end closes
    it. A part that is not a call (JSON that does not parse, no name) is content, markup and all;
    text after a call's JSON is content too."""

    START = "[TOOL_CALLS]"
    NAMED = re.compile(r"\s*([a-zA-Z0-9_-]{1,64})\s*(?:\[CALL_ID\]\s*[a-zA-Z0-9]*\s*)?(?:\[ARGS\])?\s*")
    markup_is_special = True

    def __init__(self) -> None:
        self.buffer, self.in_calls, self.content = "", False, _Content()
        self.tried = 0  # where the next `[TOOL_CALLS]` is looked for (the text before has none)

    def feed(self, text: str) -> list[Piece]:
        self.buffer += text
        out: list[Piece] = []
        while (start := self.buffer.find(self.START, self.tried)) >= 0:
            before, self.buffer, self.tried = self.buffer[:start], self.buffer[start + len(self.START) :], 0
            out += self._part(before) if self.in_calls else self.content.text(before)
            self.in_calls = True
        keep = partial_suffix(self.buffer, self.START)
        if self.in_calls:
            self.tried = len(self.buffer) - keep
            return out
        out += self.content.text(self.buffer[: len(self.buffer) - keep])
        self.buffer = self.buffer[len(self.buffer) - keep :]
        return out

    def finish(self) -> list[Piece]:
        rest, self.buffer = self.buffer, ""
        out = self._part(rest) if self.in_calls else self.content.text(rest)
        return out + self.content.end(self.calls > 0)

    def _part(self, text: str) -> list[Piece]:
        """What followed one `[TOOL_CALLS]`: its calls and the text after them, or content."""
        body = text.lstrip()
        read = self._listed(body) if body.startswith(("[", "{")) else self._named(body)
        if read is None:
            return self.content.text(self.START + text)
        pieces, rest = read
        self.content.call()
        return pieces + self.content.text(rest)

    def _listed(self, body: str) -> tuple[list[Piece], str] | None:
        """Before v11: a JSON list of calls (or one call), and the text after it."""
        decoded = json_prefix(body)
        if decoded is None:
            return None
        value, end = decoded
        calls = value if isinstance(value, list) else [value]
        if not calls or any(self._arguments(c, "arguments", "parameters") is None for c in calls):
            return None
        return [p for c in calls for p in self._as_call(c, "arguments", "parameters") or ()], body[end:]

    def _named(self, body: str) -> tuple[list[Piece], str] | None:
        """v11 and later: `name[ARGS]{...}`, and the text after the arguments' JSON object."""
        named = self.NAMED.match(body)
        decoded = json_prefix(body, named.end()) if named else None
        if named is None or decoded is None or not isinstance(decoded[0], dict):
            return None
        arguments, end = decoded
        return self._call(named[1], arguments), body[end:]


class PythonicReader(_WholeCallsReader):
    """An output that is a Python list of calls, `[get_weather(city="Paris"), get_time()]` (Llama
    3.2, Llama 4 and ToolACE): vLLM's `pythonic`. The list is parsed with `ast`, never run: a call
    is a plain name with keyword arguments only, each a literal (a string, a number, True, False,
    None, or a list, tuple or string-keyed dict of them), which becomes its JSON arguments. An
    output that starts otherwise, or with a "[" no name and "(" follow, is content, streamed as it
    comes; one that starts like a call is held to its end, then read whole (content, as vLLM reads
    it, if it is not all calls: text around the list, a positional argument, an expression)."""

    HEAD = re.compile(r"\[\s*[A-Za-z_][A-Za-z0-9_]*\s*\(")  # how a list of calls starts
    UNDECIDED = re.compile(r"\[\s*(?:[A-Za-z_][A-Za-z0-9_]*\s*)?")  # a start that may become one

    def _starts_calls(self, head: str) -> bool | None:
        return None if self.UNDECIDED.fullmatch(head) else bool(self.HEAD.match(head))

    def _read(self, text: str) -> list[Piece] | None:
        calls = _python_calls(text)
        return [p for name, arguments in calls for p in self._call(name, arguments)] if calls else None


def _python_calls(text: str) -> list[tuple[str, dict[str, Any]]] | None:
    """The calls a Python list of them states, each its name and arguments (None: `text` is not
    one). `ast.parse` only parses: nothing the model wrote runs."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # deep nesting: no call either
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    try:
        return [_python_call(node) for node in tree.elts]
    except ValueError:
        return None


def _python_call(node: ast.expr) -> tuple[str, dict[str, Any]]:
    """One `name(key=literal, ...)` (ValueError: it is something else). A positional argument,
    `**kwargs` or a keyword given twice (which `ast.parse` lets through) is refused: the call
    would lose an argument it was meant to have."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        raise ValueError("not a call of a name with keyword arguments")
    keys = [k.arg for k in node.keywords]
    if None in keys or len(set(keys)) < len(keys):
        raise ValueError("**kwargs, or a keyword twice")
    return node.func.id, {k.arg: _literal(k.value) for k in node.keywords if k.arg is not None}


def _literal(node: ast.expr) -> Any:
    """The JSON value a Python literal states (ValueError: it is no literal, or has no JSON form)."""
    if isinstance(node, ast.Constant) and _is_json_scalar(node.value):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        number = _literal(node.operand)  # -1, -2.5: a negative number is an operation in Python
        if isinstance(number, (int, float)) and not isinstance(number, bool):
            return -number if isinstance(node.op, ast.USub) else number
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        keys = [k.value if isinstance(k, ast.Constant) else None for k in node.keys]  # None: `**other`
        if all(isinstance(k, str) for k in keys):
            return {k: _literal(v) for k, v in zip(keys, node.values, strict=True)}
    raise ValueError(f"not a literal: {ast.dump(node)[:100]}")


def _is_json_scalar(value: Any) -> bool:
    """Whether a constant has a JSON form (bytes, complex, ... and inf/nan have none)."""
    if isinstance(value, float):
        return math.isfinite(value)
    return value is None or isinstance(value, (str, int, bool))


class HarmonyReader(Reader):
    """OpenAI's Harmony format (gpt-oss): the output is messages, each a header then
    `<|message|>` then its text, ended by `<|end|>` (or the stop tokens `<|call|>` and `<|return|>`,
    whose text the pod drops): `<|channel|>analysis<|message|>...<|end|><|start|>assistant
    <|channel|>final<|message|>...`. The chat template's generation prompt ends with
    `<|start|>assistant`, so the first header starts at the channel (or at its ` to=` recipient).
    A message's header says what it is: the analysis channel (and a built-in tool's call, to
    `browser.*` or `python`, as vLLM reads them) is reasoning, a `to=functions.NAME` recipient
    a call of NAME whose text is its JSON arguments (`<|constrain|>json`, or `json`), the final and
    commentary channels content (a commentary message without a recipient is a preamble the user
    sees). Reasoning is read only with `thoughts` (else dropped: vLLM's `openai` tool parser keeps
    the final channel alone), calls only with `calls` (else a call is content, as the model wrote
    it). A call's text is held to its message's end: one that is no JSON object is content too.
    The markers are special tokens, which the pod then keeps for it (`markup_is_special`).

    One reader serves both of vLLM's names: `--reasoning-parser openai_gptoss` (reasoning, and the
    calls, which Harmony writes in the same messages) and `--tool-call-parser openai` (calls).
    Consecutive messages of a kind are parted by "\\n" (vLLM joins analysis messages so)."""

    MESSAGE = "<|message|>"
    ENDS = ("<|end|>", "<|call|>", "<|return|>")
    RECIPIENT = re.compile(r"to=([^\s<]+)")
    CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
    markup_is_special = True

    def __init__(self, calls: bool = True, thoughts: bool = True) -> None:
        self.read_calls, self.thoughts = calls, thoughts
        self.buffer, self.header = "", None  # header: the open message's (None: reading one)
        self.kind, self.name, self.body = "", "", ""  # the open message's kind, a call's name and text
        self.last, self.opened = "", False  # the kind that last sent text; whether this message did

    def feed(self, text: str) -> list[Thought | Piece]:
        self.buffer += text
        out: list[Thought | Piece] = []
        while True:
            if self.header is None:
                at = self.buffer.find(self.MESSAGE)
                if at < 0:
                    return out
                self._open(self.buffer[:at])
                self.buffer = self.buffer[at + len(self.MESSAGE) :]
                continue
            at, marker = min(
                ((self.buffer.find(m), m) for m in self.ENDS if m in self.buffer), default=(-1, "")
            )
            if at < 0:
                keep = max(partial_suffix(self.buffer, m) for m in self.ENDS)
                out += self._text(self.buffer[: len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep :]
                return out
            out += self._text(self.buffer[:at]) + self._close()
            self.buffer = self.buffer[at + len(marker) :]

    def finish(self) -> list[Thought | Piece]:
        """The rest: an open message ends here (a call's <|call|> is a stop token); a header the
        output was cut in says nothing, but text with no Harmony markup at all is content."""
        rest, self.buffer = self.buffer, ""
        if self.header is not None:
            return self._text(rest) + self._close()
        return [] if "<|" in rest else self._sent("content", rest)

    def _open(self, header: str) -> None:
        """A message starts: what it is, from its header."""
        recipient, channel = self.RECIPIENT.search(header), self.CHANNEL.search(header)
        to, channel_name = recipient[1] if recipient else "", channel[1] if channel else ""
        self.header, self.body, self.opened = header, "", False
        self.name = to.removeprefix("functions.") if to.startswith("functions.") else ""
        if self.name:
            self.kind = "call"
        elif to or channel_name == "analysis":
            self.kind = "reasoning"
        else:
            self.kind = "content"

    def _text(self, text: str) -> list[Thought | Piece]:
        if self.kind == "call":
            self.body += text
            return []
        if self.kind == "reasoning" and not self.thoughts:
            return []
        return self._sent(self.kind, text)

    def _sent(self, kind: str, text: str) -> list[Thought | Piece]:
        """Text of a message of `kind`, after a "\\n" when the last message sent was of its kind."""
        if not text:
            return []
        if not self.opened and self.last == kind:
            text = "\n" + text
        self.opened, self.last = True, kind
        return [Thought(text)] if kind == "reasoning" else [text]

    def _close(self) -> list[Thought | Piece]:
        """The open message ends: a call's held text is read."""
        header, self.header = self.header or "", None
        if self.kind != "call":
            return []
        arguments = self.body.strip()
        if self.read_calls and isinstance(json_value(arguments), dict):
            return self._call(self.name, arguments)
        return self._sent("content", header + self.MESSAGE + self.body)


class OpenAIReader(HarmonyReader):
    """`--tool-call-parser openai` (vLLM's, for gpt-oss): Harmony's calls, with the final and
    commentary channels as content and the analysis channel dropped (with `--reasoning-parser
    openai_gptoss` the reasoning reader reads both, and this one is not used)."""

    def __init__(self) -> None:
        super().__init__(calls=True, thoughts=False)


class NamedReader(Reader):
    """`tool_choice` naming a function: the whole output is its arguments (the structured-output
    engine held it to the function's `parameters` schema), streamed as they come."""

    def __init__(self, name: str) -> None:
        self.name = name

    def feed(self, text: str) -> list[Piece]:
        if not text:
            return []
        if self.calls:
            return [Arguments(text)]
        return self._call(self.name, text)

    def finish(self) -> list[Piece]:
        return [] if self.calls else self._call(self.name, "")


class RequiredReader(Reader):
    """`tool_choice: "required"`: the output is a JSON array of `{"name": ..., "parameters": {...}}`
    (vLLM's form, forced by the structured-output engine), read at its end. An output cut short
    (finish_reason "length") is not one: it is returned as content."""

    def __init__(self) -> None:
        self.buffer = ""

    def feed(self, text: str) -> list[Piece]:
        self.buffer += text
        return []

    def finish(self) -> list[Piece]:
        text, self.buffer = self.buffer, ""
        calls = json_value(text)
        calls = calls if isinstance(calls, list) else []
        pieces = [self._as_call(c, "parameters", "arguments") for c in calls]
        if not pieces or any(p is None for p in pieces):
            self.calls = 0
            return [text] if text else []
        return [piece for p in pieces for piece in p or ()]


_DECODER, _JSON_SPACE = json.JSONDecoder(), " \t\n\r"


def json_prefix(text: str, at: int = 0) -> tuple[Any, int] | None:
    """The JSON value that starts at `text[at]` and where it ends (None: none does). Nesting
    deeper than Python's recursion limit (a model can write 100k "[") makes json raise
    RecursionError: that is no value either, and the text is content, not a failed response."""
    try:
        return _DECODER.raw_decode(text, at)
    except (ValueError, RecursionError):
        return None


def json_value(text: str) -> Any:
    """`text` as one JSON value, whitespace around it allowed (None: it is not one, as above)."""
    decoded = json_prefix(text, len(text) - len(text.lstrip(_JSON_SPACE)))
    return decoded[0] if decoded is not None and not text[decoded[1] :].strip(_JSON_SPACE) else None


def partial_suffix(text: str, marker: str) -> int:
    """How many trailing characters of `text` could begin `marker` (held back: the rest of the
    marker may come in the next piece)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


READERS = {
    "hermes": HermesReader,
    "llama3_json": Llama3JsonReader,
    "mistral": MistralReader,
    "openai": OpenAIReader,
    "pythonic": PythonicReader,
}


def call_id(parser: str) -> str:
    """A new call's id under the server's --tool-call-parser: Mistral's chat templates refuse an
    id that is not 9 letters and digits (mistral-common's rule) when the call comes back in the
    conversation, so a `mistral` server's calls, parsed or forced, get such ids (vLLM's); others
    OpenAI's form, "call_" and 24 hex digits."""
    if parser == "mistral":
        return "".join(secrets.choice(_MISTRAL_ID) for _ in range(9))
    return "call_" + uuid.uuid4().hex[:24]
