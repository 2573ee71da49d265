"""OpenAI's Responses API request (POST /v1/responses) -> the chat completion request it means.

A stateless Responses request is a chat: `instructions` and the `input` items are its messages
(a `function_call` item an assistant's tool call, a `function_call_output` a tool result, a
`reasoning` item the thinking an assistant turn is sent back with), its flat function tools are
chat tools, `text.format` is `response_format`, `reasoning.effort` `reasoning_effort` and
`max_output_tokens` `max_completion_tokens`.
Only the body is translated: the chat path does the rest (chat template, sampling, adapters
named as `model`, tool and reasoning parsers, structured output) and refuses what it refuses, so
the two endpoints cannot drift apart. A `previous_response_id`'s conversation (responses_store.py)
comes before the input; without a store (its flags at 0) `previous_response_id` and `store: true`
are refused. What needs state Spindle does not keep (`conversation`, `background`), built-in
tools and `include` values it cannot produce are refused with a 400 naming the field, never dropped. A
stateless client's `reasoning.encrypted_content` is served without state: the blob is the
reasoning text itself (reasoning_blob.py), restored from the item that carries it.
"""

from __future__ import annotations

import json
from typing import Any

from spindle.openai_api import reasoning_blob
from spindle.openai_api.errors import bad_request
from spindle.openai_api.responses_store import OFF

# Fields of the same name and meaning in a chat request (vLLM's sampling extras included).
_SAME = (
    "model", "stream", "temperature", "top_p", "parallel_tool_calls", "stop", "seed", "top_k", "min_p",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "stop_token_ids", "min_tokens",
    "ignore_eos", "priority", "chat_template_kwargs", "include_reasoning", "logit_bias", "allowed_token_ids",
    "bad_words", "include_stop_str_in_output", "structured_outputs", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar",
)  # fmt: skip
# What a store (responses_store.py) serves; refused when the flags keep none.
_STORED = {
    "previous_response_id": f"{OFF}: send the whole conversation as `input`",
    "store": f"{OFF}: send `store: false` (or leave it out)",
}
# Fields whose value (anything but null, false or empty) asks for what Spindle cannot do.
_REFUSED = {
    "conversation": "conversations are not supported: send `previous_response_id`, or the whole conversation",
    "background": "background responses are not supported",
    "prompt": "stored prompt templates are not supported: send `instructions` and `input`",
    "max_tool_calls": "`max_tool_calls` is not supported",
    "top_logprobs": "logprobs are not supported on /v1/responses (ask /v1/chat/completions)",
    "context_management": "`context_management` is not supported",
    "moderation": "`moderation` is not supported",
}
# Chat completion fields that change the answer, sent to /v1/responses (a client ported from the
# chat API): the Responses API spells them otherwise or has no such thing. Ignored, `max_tokens`
# ran to the context and `response_format` answered free text: refused, naming what to send.
_CHAT_ONLY = {
    "messages": "send the conversation as `input`",
    "max_tokens": "send `max_output_tokens`",
    "max_completion_tokens": "send `max_output_tokens`",
    "response_format": "send `text.format`",
    "reasoning_effort": 'send `reasoning: {"effort": ...}`',
    "n": "a response has one answer: send one request per answer",
    "best_of": "a response has one answer: send one request per answer",
    "logprobs": "logprobs are not supported on /v1/responses (ask /v1/chat/completions)",
    "prompt_logprobs": "logprobs are not supported on /v1/responses (ask /v1/chat/completions)",
    "functions": "send `tools`",
}
_DEFAULTS = {"top_logprobs": 0, "n": 1, "best_of": 1}  # a value of a refused field that asks for nothing
_TEXT_PARTS = ("input_text", "output_text")  # an assistant's earlier output is sent back as output_text
# a function tool of chat's nested form ({"function": {...}}, a client ported from chat) names none
_FLAT_TOOLS = 'tools are flat here: {"type": "function", "name": ..., "parameters": ...}, not chat\'s form'
SEALED = "reasoning.encrypted_content"  # the one `include` value served: reasoning_blob.py's blob


def chat_body(
    body: dict[str, Any], key: bytes | None = None, earlier: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """The chat completion request `body` asks for; 400s name the Responses field at fault.
    `key`: the deployment's reasoning key, which the reasoning blobs sent back are checked with;
    `earlier`: the conversation of the response `previous_response_id` names, which the input
    continues (None: no store, so `store` and `previous_response_id` are refused). Its
    `instructions` are not carried over (OpenAI's rule): this request's are the system message."""
    _refuse_stateful(body, earlier is not None)
    if body.get("store") not in (None, True, False):
        raise bad_request("`store` must be true or false", "store")
    chat = {name: body[name] for name in _SAME if name in body}
    turns = messages(body.get("input"), key, earlier or [])
    chat["messages"] = [*_instructions(body.get("instructions")), *turns]
    limit = body.get("max_output_tokens")
    if limit is not None:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise bad_request(f"`max_output_tokens` must be a positive integer, got {limit!r:.100}",
                              "max_output_tokens")  # fmt: skip
        chat["max_completion_tokens"] = limit
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    response_format = _text_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    effort = _effort(body.get("reasoning"))
    if effort is not None:
        chat["reasoning_effort"] = effort
    _metadata(body.get("metadata"))
    for name in ("user", "safety_identifier", "prompt_cache_key"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise bad_request(f"`{name}` must be a string", name)
    return chat


def _refuse_stateful(body: dict[str, Any], stored: bool) -> None:
    chat_only = {name: f"`{name}` is a chat completion field: {why}" for name, why in _CHAT_ONLY.items()}
    for name, why in {**_REFUSED, **chat_only, **({} if stored else _STORED)}.items():
        value = body.get(name)
        if not (value is None or value is False or value in ([], {}) or value == _DEFAULTS.get(name)):
            raise bad_request(why, name)
    if body.get("truncation") not in (None, "disabled"):
        why = '`truncation` "auto" is not supported: an input too long is refused'
        raise bad_request(why, "truncation")
    includes_reasoning_blobs(body.get("include"))


def includes_reasoning_blobs(given: Any) -> bool:
    """Whether `include` asks for the reasoning blobs; any other value is refused by name."""
    if given is None:
        return False
    if not isinstance(given, list):
        raise bad_request(f'`include` must be a list such as ["{SEALED}"]', "include")
    for value in given:
        if value != SEALED:
            raise bad_request(f"`include` {value!r:.100} is not supported (only {SEALED!r} can be included)",
                              "include")  # fmt: skip
    return SEALED in given


def _instructions(instructions: Any) -> list[dict[str, Any]]:
    """`instructions`: the system message the conversation starts with."""
    if instructions is None:
        return []
    if not isinstance(instructions, str):
        raise bad_request("`instructions` must be a string", "instructions")
    return [{"role": "system", "content": instructions}]


def messages(
    given: Any, key: bytes | None = None, earlier: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """`input` as chat messages, after the `earlier` conversation's items: a string is the
    user's message; items in order, an assistant's function calls joined to its turn (a turn is
    one message with its text and its calls, as the chat templates render it), a reasoning
    item's text to the assistant turn after it (a blob checked with `key`). The `earlier`
    conversation may end with a reasoning item (a response cut by `max_output_tokens` while it
    reasoned): that is the assistant's turn, which said nothing."""
    if isinstance(given, str):
        given = [{"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise bad_request("`input` must be a string or a non-empty list of items", "input")
    out: list[dict[str, Any]] = []
    thought: str | None = None  # a reasoning item's text, waiting for its assistant turn
    before = len(earlier or [])
    for i, item in enumerate([*(earlier or []), *given]):
        where = f"input[{i - before}]" if i >= before else f"previous_response_id's item {i}"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if i == before and thought is not None:  # the stored response was cut while it reasoned
            out.append({"role": "assistant", "content": "", "reasoning_content": thought})
            thought = None
        if kind == "reasoning":
            thought = _reasoning(item, where, key)
            continue
        if kind == "message":
            out.append(_message(item, where))
        elif kind == "function_call":
            call = _function_call(item, where)
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and thought is None:
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append(_call_output(item, where))
        else:
            raise bad_request(f"`{where}`: item type {kind!r:.100} is not supported (message, function_call, "
                              "function_call_output, reasoning)", where)  # fmt: skip
        if thought is not None:
            if out[-1]["role"] != "assistant":
                raise bad_request(f"`{where}`: a reasoning item must come before the assistant message or "
                                  "function call it led to", where)  # fmt: skip
            out[-1]["reasoning_content"], thought = thought, None
    if thought is not None:
        raise bad_request("`input` ends with a reasoning item: send the assistant turn it led to", "input")
    return out


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise bad_request(f"`{where}.role` must be user, assistant, system or developer, got {role!r:.100}",
                          where)  # fmt: skip
    return {"role": role, "content": _text(item.get("content"), f"{where}.content")}


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or text parts joined by newlines (as the chat path joins them)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"`{where}` must be a string or a list of content parts", where)
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise bad_request(f"`{where}[{j}]`: content part {kind!r:.100} is not supported (only text: "
                              "input_text, output_text)", where)  # fmt: skip
        if not isinstance(part.get("text"), str):
            raise bad_request(f"`{where}[{j}].text` must be a string", where)
    return "\n".join(part["text"] for part in content)


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A function_call item as a chat tool call: its call_id, name and arguments (a JSON object's text)."""
    for name in ("call_id", "name", "arguments"):
        if not isinstance(item.get(name), str):
            raise bad_request(f"`{where}.{name}` must be a string", where)
    try:
        arguments = json.loads(item["arguments"])
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        raise bad_request(f"`{where}.arguments` must be a JSON object's text, got {item['arguments']!r:.100}",
                          where)  # fmt: skip
    function = {"name": item["name"], "arguments": item["arguments"]}
    return {"id": item["call_id"], "type": "function", "function": function}


def _call_output(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A function_call_output item: the tool message answering call `call_id`."""
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise bad_request(f"`{where}.call_id` must name the call it answers", where)
    return {"role": "tool", "tool_call_id": call_id, "content": _text(item.get("output"), f"{where}.output")}


def _reasoning(item: dict[str, Any], where: str, key: bytes | None) -> str:
    """A reasoning item's text, for the assistant turn after it: its `encrypted_content` opened
    (the reasoning this server sealed, when sent back: a blob that does not open is refused),
    else its content, else its summary. An item with neither would be dropped: refused."""
    if item.get("encrypted_content") is not None:
        return reasoning_blob.opened(item["encrypted_content"], key, where)
    parts = item.get("content") or item.get("summary") or []
    texts = [p.get("text") for p in parts if isinstance(p, dict)] if isinstance(parts, list) else [None]
    if not texts or not all(isinstance(t, str) for t in texts):
        raise bad_request(f"`{where}`: a reasoning item needs its text (`content` or `summary`) or the "
                          "`encrypted_content` this server sealed", where)  # fmt: skip
    return "\n".join(texts)


def _tools(tools: Any) -> list[dict[str, Any]]:
    """The Responses API's flat function tools as chat tools; built-in tools (web_search,
    file_search, code_interpreter, mcp, ...) are refused: nothing here runs them."""
    if not isinstance(tools, list):
        raise bad_request('`tools` must be a list of {"type": "function", "name": ...}', "tools")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise bad_request(f"`tools[{i}]`: tool type {kind!r:.100} is not supported (only function tools)",
                              "tools")  # fmt: skip
        if not isinstance(tool.get("name"), str):
            raise bad_request(f"`tools[{i}].name` must be the function's name: {_FLAT_TOOLS}", "tools")
        function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> Any:
    """ "none", "auto", "required", or {"type": "function", "name": N} (the chat path's nested form)."""
    if choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    forms = '"none", "auto", "required" or {"type": "function", "name": ...}'
    raise bad_request(f"`tool_choice` must be {forms}, got {choice!r:.100}", "tool_choice")


def _text_format(text: Any) -> dict[str, Any] | None:
    """`text.format` as the chat path's `response_format` (None: free text)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad_request("`text` must be an object", "text")
    if text.get("verbosity") not in (None, "medium"):
        raise bad_request("`text.verbosity` is not supported", "text.verbosity")
    fmt = text.get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema" and isinstance(fmt.get("schema"), dict):
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", ""), "schema": fmt["schema"]}}
    raise bad_request('`text.format` must be {"type": "text"}, {"type": "json_object"} or {"type": '
                      '"json_schema", "name": ..., "schema": {...}}', "text.format")  # fmt: skip


def _effort(reasoning: Any) -> str | None:
    """`reasoning.effort`: the chat path's `reasoning_effort` (the template variable gpt-oss's
    template reads); `reasoning.summary` asks for nothing the reasoning item does not already hold."""
    if reasoning is None:
        return None
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else None
    if not isinstance(reasoning, dict) or not isinstance(effort, (str, type(None))):
        raise bad_request('`reasoning` must be an object such as {"effort": "low"}', "reasoning")
    return effort


def _metadata(metadata: Any) -> None:
    """OpenAI's rule: up to 16 string values under keys of up to 64 characters (512 a value)."""
    if metadata is None:
        return
    ok = isinstance(metadata, dict) and len(metadata) <= 16
    ok = ok and all(isinstance(k, str) and len(k) <= 64 for k in metadata)
    if not ok or not all(isinstance(v, str) and len(v) <= 512 for v in metadata.values()):
        raise bad_request("`metadata` must map up to 16 keys (64 characters) to strings (512 characters)",
                          "metadata")  # fmt: skip
