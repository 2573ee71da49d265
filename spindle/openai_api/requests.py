"""OpenAI's request bodies -> the `GenerateRequest` a gRPC caller would send.

Every field OpenAI or vLLM defines that Spindle serves maps onto a `GenerateRequest` /
`SamplingParams` field of the same meaning; values are checked by the engine as for gRPC, so
both APIs accept the same requests. Fields Spindle cannot honour are refused with a 400 that
names them (never silently dropped); fields it has no use for (`user`, `metadata`, `store`, ...)
and unknown ones are ignored, as vLLM does.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from spindle.openai_api.errors import bad_request
from spindle.v1 import generation_pb2 as pb

# OpenAI name -> SamplingParams field (float), then vLLM's extras by their vLLM names.
_SAMPLING_FLOATS = (
    "temperature",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "min_p",
    "repetition_penalty",
)
_SAMPLING_BOOLS = ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output")
# Fields that would change what the answer is, which Spindle cannot do: refused, not ignored.
_REFUSED = {
    "tools": "tool calling is not supported",
    "functions": "function calling is not supported",
    "logit_bias": "logit_bias is not supported",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    # vLLM's extras that Spindle does not serve (each set to anything but its default)
    "min_tokens": "min_tokens is not supported",
    "use_beam_search": "beam search is not supported here",
    "allowed_token_ids": "allowed_token_ids is not supported",
    "bad_words": "bad_words is not supported",
    "prompt_logprobs": "prompt_logprobs is not supported",
    "truncate_prompt_tokens": "truncate_prompt_tokens is not supported",
    "continue_final_message": "continue_final_message is not supported",
    "chat_template": "a request's own chat_template is not supported",
    "chat_template_kwargs": "chat_template_kwargs is not supported",
}
# Refused fields whose zero asks for something too: vLLM's `prompt_logprobs: 0` is each prompt
# token's own logprob (its top 0), not "off".
_ZERO_ASKS = frozenset({"prompt_logprobs"})
# Structured output, in OpenAI's and vLLM's spellings (see `structured_output`).
STRUCTURED_FIELDS = (
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
)  # fmt: skip


@dataclass(frozen=True)
class Call:
    """What the response needs to know about the request besides the GenerateRequest."""

    model: str
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    logprobs: bool


def structured_output(body: dict[str, Any], request: pb.GenerateRequest) -> None:
    """Structured output, the one place its fields are read: OpenAI's `response_format`
    (`json_object`; `json_schema` with its `schema`, enforced strictly whatever `strict` says)
    and vLLM's `structured_outputs` / `guided_json|regex|choice|grammar`, onto
    `sampling.structured_output` as generation.proto maps them. At most one form; the schema,
    regex or grammar itself is checked by the pod's grammar engine (a 400 with its message)."""
    forms = [
        (name, _structured_form(name, body[name])) for name in STRUCTURED_FIELDS if body.get(name) is not None
    ]
    forms = [(name, form) for name, form in forms if form is not None]  # response_format text: free text
    if len(forms) > 1:
        names = ", ".join(name for name, _ in forms)
        raise bad_request(f"give one structured-output form, not several ({names})", forms[1][0])
    if forms:
        request.sampling.structured_output.CopyFrom(forms[0][1])


def _structured_form(name: str, value: Any) -> pb.StructuredOutput | None:
    """One structured-output field of the body as a StructuredOutput (None: free text)."""
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs":  # vLLM's object: exactly one of its forms
        given = {k: v for k, v in value.items() if v not in (None, False)} if isinstance(value, dict) else {}
        if len(given) != 1 or next(iter(given)) not in _VLLM_FORMS:
            raise bad_request(f"`structured_outputs` must set exactly one of {', '.join(_VLLM_FORMS)}", name)
        ((key, value),) = given.items()
        return _form(f"structured_outputs.{key}", _VLLM_FORMS[key], value)
    return _form(name, _GUIDED_FORMS[name], value)


def _response_format(value: Any) -> pb.StructuredOutput | None:
    """OpenAI's `response_format` (None: free text). `{"type": "json_object", "schema": {...}}`,
    the form Together's API and llama.cpp's server take (LangChain's ChatTogetherAI sends it), is
    that schema: answering it with any JSON object would drop the caller's schema silently."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object" and value.get("schema") is None:
        return pb.StructuredOutput(json_object=True)
    schema = value.get("schema") if kind == "json_object" else None
    if kind == "json_schema" and isinstance(value.get("json_schema"), dict):
        schema = value["json_schema"].get("schema")
    if not isinstance(schema, dict):
        raise bad_request(
            '`response_format` must be {"type": "text"}, {"type": "json_object"} or '
            '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}',
            "response_format",
        )
    return pb.StructuredOutput(json_schema=json.dumps(schema))


def _form(where: str, form: str, value: Any) -> pb.StructuredOutput:
    """`value` as StructuredOutput's `form` (json_schema, json_object, regex, choice, grammar)."""
    if form == "json_schema" and isinstance(value, dict):
        return pb.StructuredOutput(json_schema=json.dumps(value))
    if form == "json_object" and value is True:
        return pb.StructuredOutput(json_object=True)
    if form == "choice" and isinstance(value, list) and value and all(isinstance(c, str) for c in value):
        return pb.StructuredOutput(choice=pb.Choices(choices=value))
    if form in ("json_schema", "regex", "grammar") and isinstance(value, str):
        return pb.StructuredOutput(**{form: value})
    raise bad_request(f"`{where}` must be {_STRUCTURED_KINDS[form]}", where)


# vLLM's spellings -> the StructuredOutput field each one sets.
_VLLM_FORMS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
               "json_object": "json_object"}  # fmt: skip
_GUIDED_FORMS = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}  # fmt: skip
_STRUCTURED_KINDS = {
    "json_schema": "a JSON Schema (an object, or its JSON text)",
    "regex": "a regular expression (a string)",
    "choice": "a non-empty list of strings",
    "grammar": "a grammar (Lark or GBNF text)",
    "json_object": "true",
}


def chat_request(body: dict[str, Any], base_models: Collection[str]) -> tuple[pb.GenerateRequest, Call]:
    """POST /v1/chat/completions."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("`messages` must be a non-empty list of {role, content} objects", "messages")
    req = pb.GenerateRequest(chat=pb.ChatMessages(messages=[_message(m, i) for i, m in enumerate(messages)]))
    logprobs = _typed(body, "logprobs", bool) or False
    top = _typed(body, "top_logprobs", int)
    if top is not None and not logprobs:
        raise bad_request("`top_logprobs` needs `logprobs: true`", "top_logprobs")
    if logprobs:
        req.logprobs = top or 0
    _no_forced_tool_call(body)
    if _typed(body, "add_generation_prompt", bool) is False:  # the template always adds it
        raise bad_request("`add_generation_prompt: false` is not supported", "add_generation_prompt")
    call = _common(body, req, base_models, logprobs)
    _max_tokens(body, req, "max_completion_tokens", "max_tokens")
    return req, call


def _no_forced_tool_call(body: dict[str, Any]) -> None:
    """`tool_choice` / `function_call` that demand a call ("required", a named function) cannot be
    honoured without tool calling: refused, not answered with text the client takes for a
    tool-less reply. "none" and "auto" (no tools given) ask for text, so they are served."""
    for name in ("tool_choice", "function_call"):
        if body.get(name) not in (None, "none", "auto"):
            raise bad_request(f"`{name}` {body[name]!r}: tool calling is not supported", name)


def completion_request(body: dict[str, Any], base_models: Collection[str]) -> tuple[pb.GenerateRequest, Call]:
    """POST /v1/completions."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        req = pb.GenerateRequest(text=prompt)
    elif isinstance(prompt, list) and prompt and _token_ids(prompt):
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt))
    else:
        raise bad_request(
            "`prompt` must be one string or one list of token ids (send several prompts as several requests)",
            "prompt",
        )
    for name in ("echo", "suffix"):
        if body.get(name):
            raise bad_request(f"`{name}` is not supported", name)
    if (_typed(body, "best_of", int) or 1) > 1:
        raise bad_request("`best_of` > 1 is not supported", "best_of")
    logprobs = _typed(body, "logprobs", int)
    if logprobs is not None:
        req.logprobs = logprobs
    call = _common(body, req, base_models, logprobs is not None)
    _max_tokens(body, req, "max_tokens")
    return req, call


def _common(
    body: dict[str, Any], req: pb.GenerateRequest, base_models: Collection[str], logprobs: bool
) -> Call:
    """The fields both endpoints share: model, stream, n, stop, seed, sampling."""
    model = _typed(body, "model", str) or ""
    if model in base_models:
        req.model = model
    elif model:
        req.adapter = model  # vLLM's convention: a LoRA adapter is named as the model
    for name, why in _REFUSED.items():
        value = body.get(name)
        if value or (name in _ZERO_ASKS and value is not None):
            raise bad_request(why, name)
    if _typed(body, "n", int) not in (None, 1):  # n: 0 too (it asks for no choice at all)
        raise bad_request("`n` other than 1 is not supported: send n requests (with different seeds)", "n")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise bad_request("`stop` must be a string or a list of strings", "stop")
    req.stop.extend(stop or [])
    seed = _typed(body, "seed", int)
    if seed is not None:
        req.seed = seed
    s = req.sampling
    for name in _SAMPLING_FLOATS:
        value = _typed(body, name, float)
        if value is not None:
            setattr(s, name, value)
    for name in _SAMPLING_BOOLS:
        value = _typed(body, name, bool)
        if value is not None:
            setattr(s, name, value)
    top_k = _typed(body, "top_k", int)
    if top_k is not None:
        s.top_k = 0 if top_k == -1 else top_k  # vLLM's -1 and Spindle's 0 both mean off
    stop_ids = _typed(body, "stop_token_ids", list) or []
    if not _token_ids(stop_ids):
        raise bad_request("`stop_token_ids` must be a list of token ids", "stop_token_ids")
    s.stop_token_ids.extend(stop_ids)
    structured_output(body, req)
    stream = _typed(body, "stream", bool) or False
    options = _typed(body, "stream_options", dict)
    if options is not None and not stream:
        raise bad_request("`stream_options` is only allowed with `stream: true`", "stream_options")
    include_usage = (options or {}).get("include_usage")
    if include_usage not in (None, True, False):  # "false" would read as true: a chunk no one expects
        raise bad_request("`stream_options.include_usage` must be true or false", "stream_options")
    named = model or next(iter(sorted(base_models)), "")  # unset: the base model
    return Call(model=named, stream=stream, include_usage=bool(include_usage), logprobs=logprobs)


def _max_tokens(body: dict[str, Any], req: pb.GenerateRequest, *names: str) -> None:
    """The first of `names` the body sets (chat: max_completion_tokens, then the older max_tokens)."""
    for name in names:
        value = _typed(body, name, int)
        if value is not None:
            req.max_tokens = value
            return


def _token_ids(values: list[Any]) -> bool:
    """Every value a token id the wire can carry (int32, not negative)."""
    return all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in values)


def _message(m: Any, i: int) -> pb.ChatMessage:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise bad_request(f"messages[{i}] must be an object with a `role`", "messages")
    role = "system" if m["role"] == "developer" else m["role"]  # OpenAI's newer name for system
    if role not in ("system", "user", "assistant"):
        raise bad_request(f"messages[{i}]: role {m['role']!r} is not supported (system, user, assistant)")
    content = m.get("content")
    if isinstance(content, list):
        content = _text_parts(content, i)
    if content is not None and not isinstance(content, str):
        raise bad_request(f"messages[{i}].content must be a string or a list of text parts", "messages")
    return pb.ChatMessage(role=role, content=content or "")


def _text_parts(parts: list[Any], i: int) -> str:
    """Content parts as one text: text parts only, joined by newlines as vLLM does (joined
    without a separator, ["Hello", "world"] would read "Helloworld")."""
    if not all(isinstance(p, dict) and p.get("type") == "text" for p in parts):
        raise bad_request(f"messages[{i}]: only text content parts are supported", "messages")
    if not all(isinstance(p.get("text"), str) for p in parts):
        raise bad_request(f"messages[{i}]: a text content part needs a `text` string", "messages")
    return "\n".join(p["text"] for p in parts)


def _typed(body: dict[str, Any], name: str, kind: type) -> Any:
    """body[name] when it is a `kind` (an int passes for a float); None when absent or null."""
    value = body.get(name)
    if value is None:
        return None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise bad_request(f"`{name}` must be {_KINDS[kind]}, got {str(value)[:100]!r}", name)
    bits = 64 if name == "seed" else 32  # the proto field's width
    if kind is int and not -(2 ** (bits - 1)) <= value < 2 ** (bits - 1):
        raise bad_request(f"`{name}` is out of range ({bits}-bit integer): {str(value)[:100]}", name)
    return value


_KINDS = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
    list: "a list",
    dict: "an object",
}
