"""Reading a reasoning model's thinking out of its output text, as it streams (vLLM's
`--reasoning-parser`).

Reasoning models (DeepSeek-R1 and its distills, QwQ, Qwen3) think before they answer: `<think>
... </think>`, then the answer. Their chat templates often open the `<think>` in the prompt, so the
output starts inside the thinking and only `</think>` is generated. A `ThinkReader` turns the text,
fed piece by piece as the pod streams it, into `Thought`s (the reasoning, OpenAI-compatible
servers' `reasoning_content`) and content text, never any of the markup: a tag split across
pieces is held back until it is known to be one. The whole response is the same reader fed once,
so a streamed answer and a whole one always agree.

`openai_gptoss` (gpt-oss) reads OpenAI's Harmony format, whose reasoning is a message on the
analysis channel and whose answer and calls are other messages: tool_parsers.py's `HarmonyReader`
reads it, calls and all.

`deepseek_r1` and `qwen3` read alike, as vLLM's parsers of those names do with thinking on (its
qwen3's default): a `<think>` the output opens with is dropped, everything before `</think>` is
reasoning, and an output with no `</think>` (cut by `max_tokens`, or a model that never closed its
thinking) is all reasoning. The whitespace the templates put around the thinking (`<think>\\n`,
`\\n</think>\\n\\n`) is dropped, as the templates drop it when they render the turn again.
"""

from __future__ import annotations

from spindle.openai_api.tool_parsers import HarmonyReader, Thought, partial_suffix

PARSERS = ("none", "deepseek_r1", "openai_gptoss", "qwen3")  # --reasoning-parser's choices
__all__ = ["PARSERS", "READERS", "HarmonyReader", "ThinkReader", "Thought", "reader", "reads_special_tokens"]


class _Trimmed:
    """Text with its leading whitespace dropped (and its trailing whitespace, when `trailing`),
    streamed: trailing whitespace is held until text follows it."""

    def __init__(self, trailing: bool) -> None:
        self.trailing, self.started, self.pending = trailing, False, ""

    def text(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
            self.started = bool(text)
        if not self.trailing:
            return text
        held = self.pending + text
        body = held.rstrip()
        self.pending = held[len(body) :]
        return body


class ThinkReader:
    """One response's output text -> `Thought`s then content strings; `feed` as text arrives,
    `finish` at its end."""

    START, END = "<think>", "</think>"
    markup_is_special = False  # `<think>` is an added token, but not a special one (Qwen3's, R1's)

    def __init__(self) -> None:
        self.buffer, self.state = "", "start"  # state: "start", "thinking", "content"
        self.reasoning, self.content = _Trimmed(trailing=True), _Trimmed(trailing=False)

    def feed(self, text: str) -> list[Thought | str]:
        self.buffer += text
        if self.state == "start":
            head = self.buffer.lstrip()
            if self.START.startswith(head) and head != self.START:
                return []  # whitespace, or a part of "<think>": not known yet
            self.state = "thinking"
            if head.startswith(self.START):
                self.buffer = head[len(self.START) :]
        if self.state == "thinking":
            return self._thinking()
        return self._content(self._take(len(self.buffer)))

    def finish(self) -> list[Thought | str]:
        """The rest: what is held is reasoning (an output that ends before `</think>`)."""
        rest, self.buffer = self.buffer, ""
        if self.state == "content":
            return self._content(rest)
        self.state = "content"
        return self._thought(rest)

    def read(self, text: str) -> list[Thought | str]:
        """A whole output at once."""
        return self.feed(text) + self.finish()

    def _thinking(self) -> list[Thought | str]:
        end = self.buffer.find(self.END)
        if end < 0:
            return self._thought(self._take(len(self.buffer) - partial_suffix(self.buffer, self.END)))
        out = self._thought(self._take(end))
        self.buffer, self.state = self.buffer[len(self.END) :], "content"
        return out + self._content(self._take(len(self.buffer)))

    def _take(self, n: int) -> str:
        taken, self.buffer = self.buffer[:n], self.buffer[n:]
        return taken

    def _thought(self, text: str) -> list[Thought | str]:
        text = self.reasoning.text(text)
        return [Thought(text)] if text else []

    def _content(self, text: str) -> list[Thought | str]:
        text = self.content.text(text)
        return [text] if text else []


READERS: dict[str, type[ThinkReader] | type[HarmonyReader]] = {
    "deepseek_r1": ThinkReader,
    "openai_gptoss": HarmonyReader,
    "qwen3": ThinkReader,
}


def reads_special_tokens(parser: str) -> bool:
    """Whether `parser`'s markup is special tokens, which the pod must then decode (it skips them
    by default): Harmony's `<|channel|>`, `<|message|>`, `<|end|>` are, and without them an answer
    reads "analysisThinking...assistantfinalThe answer.", all content. vLLM keeps them so too."""
    return parser in READERS and READERS[parser].markup_is_special


def reader(parser: str, calls: bool) -> ThinkReader | HarmonyReader | None:
    """A new reader of one response under --reasoning-parser `parser` (None: "none"). Harmony's
    calls are in the messages its reasoning is read from, so its reader reads them too, when the
    request's calls are read (`calls`: tool_choice "auto"); else a call is content."""
    if parser == "none":
        return None
    return HarmonyReader(calls=calls) if parser == "openai_gptoss" else ThinkReader()
