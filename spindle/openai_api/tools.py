"""Tool calling's request side: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`, an
assistant message's `tool_calls` and a `tool` message's result, as vLLM serves them with
`--enable-auto-tool-choice --tool-call-parser P`.

The tools travel in `ChatMessages.tools` and the pod's chat template renders them (transformers'
`apply_chat_template(messages, tools=...)`); what the model writes is read back here, on the
HTTP side (tool_parsers.py), so a gRPC caller gets the model's text as it is.

`tool_choice`:
- "auto" (the default with tools): the model decides; its calls are read by the server's
  `--tool-call-parser` (none: refused, naming the flag, as vLLM refuses "auto" without one);
- "required": the structured-output engine forces a JSON array of one or more calls of the given
  tools (`{"name": ..., "parameters": {...}}`, vLLM's form; one at most with
  `parallel_tool_calls: false`), needing no parser;
- {"type": "function", "function": {"name": N}}: the output is forced to N's `parameters` schema,
  and is N's arguments;
- "none": the tools are still rendered (vLLM's default) and the output is plain content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from spindle.openai_api import tool_parsers
from spindle.openai_api.errors import bad_request
from spindle.openai_api.tool_parsers import Reader
from spindle.v1 import generation_pb2 as pb

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for a function's name
_NO_PARAMETERS = {"type": "object", "properties": {}}
_CHOICES = '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}'


@dataclass(frozen=True)
class ToolUse:
    """How a chat's output is read for calls: `parser` (the server's) under "auto", the forced
    JSON under "required" or a named function (`name`). `parallel`: false keeps one call. The
    calls' ids are the server parser's form under any choice (`call_id`)."""

    choice: str  # "auto", "required" or "named"
    parser: str = "none"
    name: str = ""
    parallel: bool = True

    @property
    def reads_special_tokens(self) -> bool:
        """Whether the calls' markup may be special tokens, which the pod must then decode (by
        default it skips them): some checkpoints (Hermes 2 Pro's) mark `<tool_call>` special, and
        their calls would come as bare JSON content; Mistral's `[TOOL_CALLS]` and `[ARGS]` are
        always special. vLLM's hermes and mistral parsers keep them so too."""
        return self.choice == "auto" and tool_parsers.READERS[self.parser].markup_is_special

    def call_id(self) -> str:
        return tool_parsers.call_id(self.parser)

    def reader(self) -> Reader:
        if self.choice == "named":
            return tool_parsers.NamedReader(self.name)
        if self.choice == "required":
            return tool_parsers.RequiredReader()
        return tool_parsers.READERS[self.parser]()


def read_tools(body: dict[str, Any], parser: str) -> tuple[list[pb.Tool], ToolUse | None, str | None]:
    """The request's tools (for the chat template), how its output is read (None: as text), and
    the JSON Schema its output is forced to (None: free)."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel not in (None, True, False):
        raise bad_request("`parallel_tool_calls` must be true or false", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise bad_request(f"`tool_choice` {choice!r} needs `tools` to choose from", "tool_choice")
        return [], None, None
    if not isinstance(tools, list):
        raise bad_request('`tools` must be a list of {"type": "function", "function": {...}}', "tools")
    given = [_tool(t, i) for i, t in enumerate(tools)]
    names = [t.name for t in given]
    if len(set(names)) < len(names):
        twice = sorted(n for n in set(names) if names.count(n) > 1)
        raise bad_request(f"`tools` name a function twice: {twice}", "tools")
    use, schema = _choice(choice if choice is not None else "auto", given, parser, parallel is not False)
    return given, use, schema


def _choice(
    choice: Any, tools: list[pb.Tool], parser: str, parallel: bool
) -> tuple[ToolUse | None, str | None]:
    """How the output is read, and the schema it is forced to, for this `tool_choice`."""
    if choice == "none":
        return None, None
    if choice == "auto":
        if parser == "none":
            raise bad_request(
                '`tool_choice` "auto" (the default with `tools`) needs the server to read the model\'s '
                f"calls: start it with --tool-call-parser ({', '.join(tool_parsers.PARSERS[1:])}), or send "
                '`tool_choice` "required", a named function, or "none"',
                "tool_choice",
            )
        return ToolUse("auto", parser=parser, parallel=parallel), None
    if choice == "required":
        schema = json.dumps(_calls_schema(tools, parallel))
        return ToolUse("required", parser=parser, parallel=parallel), schema
    name = _named(choice)
    tool = next((t for t in tools if t.name == name), None)
    if tool is None:
        raise bad_request(f"`tool_choice` names {name!r}, which is not one of `tools`", "tool_choice")
    return ToolUse("named", parser=parser, name=name), _parameters_text(tool)


def _named(choice: Any) -> str:
    named = isinstance(choice, dict) and choice.get("type") == "function"
    function = choice.get("function") if named else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise bad_request(f"`tool_choice` must be {_CHOICES}, got {str(choice)[:100]!r}", "tool_choice")
    return name


def _calls_schema(tools: list[pb.Tool], parallel: bool) -> dict[str, Any]:
    """vLLM's schema for "required": an array of calls, each of one given function."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t.name]},
                "parameters": json.loads(_parameters_text(t)),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _parameters_text(tool: pb.Tool) -> str:
    return tool.parameters or json.dumps(_NO_PARAMETERS)


def _tool(t: Any, i: int) -> pb.Tool:
    """One `tools[]` entry, checked: a function with a valid name, its description and parameters."""
    where = f"tools[{i}]"
    function = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
    if not isinstance(function, dict):
        raise bad_request(f'`{where}` must be {{"type": "function", "function": {{"name": ...}}}}', "tools")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise bad_request(f"`{where}.function.name` must be 1-64 letters, digits, _ or -: {name!r}", "tools")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"`{where}.function.description` must be a string", "tools")
    parameters = function.get("parameters")
    if parameters is not None and (
        not isinstance(parameters, dict) or parameters.get("type", "object") != "object"
    ):
        raise bad_request(f"`{where}.function.parameters` must be a JSON Schema of an object", "tools")
    text = json.dumps(parameters, ensure_ascii=False) if parameters is not None else ""
    return pb.Tool(name=name, description=description or "", parameters=text)


def tool_calls(m: dict[str, Any], i: int) -> list[pb.ToolCall]:
    """An assistant message's `tool_calls`, each a function call with its arguments as a JSON
    object (OpenAI sends its text; an object is taken too)."""
    calls = m.get("tool_calls") or []
    if not isinstance(calls, list):
        raise bad_request(f"messages[{i}].tool_calls must be a list", "messages")
    return [_tool_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls)]


def _tool_call(c: Any, where: str) -> pb.ToolCall:
    function = c.get("function") if isinstance(c, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request(f'{where} must be {{"id": ..., "type": "function", "function": {{"name": ..., '
                          '"arguments": ...}}}}', "messages")  # fmt: skip
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, dict):
        arguments = json.dumps(arguments, ensure_ascii=False)
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else None
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise bad_request(f"{where}.function.arguments must be a JSON object's text, got {arguments!r:.100}",
                          "messages")  # fmt: skip
    call_id = c.get("id") if isinstance(c.get("id"), str) else ""
    return pb.ToolCall(id=call_id, name=function["name"], arguments=arguments)
