"""OpenAI's request bodies -> the `GenerateRequest` a gRPC caller would send.

Every field OpenAI or vLLM defines that Spindle serves maps onto a `GenerateRequest` /
`SamplingParams` field of the same meaning; values are checked by the engine as for gRPC, so
both APIs accept the same requests. Fields Spindle cannot honour are refused with a 400 that
names them (never silently dropped); fields it has no use for (`user`, `metadata`, `store`, ...)
and unknown ones are ignored, as vLLM does.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from spindle.openai_api import reasoning_parsers
from spindle.openai_api.errors import bad_request
from spindle.openai_api.responses_store import ToKeep
from spindle.openai_api.tools import ToolUse, read_tools, tool_calls
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
    "functions": "`functions` (OpenAI's deprecated form) is not supported: send `tools`",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    # vLLM's extras that Spindle does not serve (each set to anything but its default)
    "use_beam_search": "beam search is not supported here",
    "truncate_prompt_tokens": "truncate_prompt_tokens is not supported",
    "continue_final_message": "continue_final_message is not supported",
    "chat_template": "a request's own chat_template is not supported",
    "logits_processors": "logits_processors are not supported",
}
# Structured output, in OpenAI's and vLLM's spellings (see `structured_output`).
STRUCTURED_FIELDS = (
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
)  # fmt: skip


# A chat that sets no max tokens runs to EOS or the context, as OpenAI's and vLLM's do (the
# engine's default, 256, would cut the answer of every client that leaves it out): the engine ends
# a request at its context whatever max_tokens says, so the field's largest value is "no limit".
TO_THE_CONTEXT = 2**31 - 1

# The most generations one HTTP request may fan out to (prompts x `best_of`, or x `n`): each is a
# request on the pods, so one request cannot queue thousands of them.
MAX_CHOICES = 128

# A chat's `top_logprobs` (OpenAI's 0-20): the engine's bound on `logprobs`, which it carries.
MAX_TOP_LOGPROBS = 20

Prompt = str | tuple[int, ...]  # a completion's prompt: its text or its token ids


@dataclass(frozen=True)
class Call:
    """What the response needs to know about the request besides the GenerateRequest."""

    model: str
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    logprobs: bool
    tools: ToolUse | None = None  # how the output is read for tool calls (None: as text)
    reasoning: str = "none"  # the --reasoning-parser its output is read with ("none": no reasoning)
    include_reasoning: bool = True  # vLLM's `include_reasoning`: false drops the reasoning read
    n: int = 1  # choices per prompt
    best_of: int = 1  # generations per prompt the n choices are the best of (>= n)
    echo: bool = False  # a completion's text starts with its prompt's (its logprobs too, with logprobs)
    prompt_logprobs: bool = False  # vLLM's `prompt_logprobs`: the response carries the prompt's
    # A completion's prompts, one GenerateRequest each (the request parsed holds the first);
    # empty for a chat, whose one prompt is the request's.
    prompts: tuple[Prompt, ...] = ()
    # The request's settings its response restates (the Responses API's `tools`, `metadata`, ...).
    restated: Mapping[str, Any] = field(default_factory=dict)
    # The Responses API's `include: ["reasoning.encrypted_content"]`: reasoning items carry their blob.
    sealed_reasoning: bool = False
    # What of a Responses API response is stored (responses_store.py); None: nothing is.
    kept: ToKeep | None = None

    @property
    def generations(self) -> int:
        """How many requests the pods run for this one."""
        return max(1, len(self.prompts)) * self.best_of


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


def chat_request(
    body: dict[str, Any],
    base_models: Collection[str],
    tool_parser: str = "none",
    reasoning_parser: str = "none",
) -> tuple[pb.GenerateRequest, Call]:
    """POST /v1/chat/completions; `tool_parser`, `reasoning_parser`: the server's --tool-call-parser
    and --reasoning-parser."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("`messages` must be a non-empty list of {role, content} objects", "messages")
    tools, use, forced = read_tools(body, tool_parser)
    chat = pb.ChatMessages(messages=[_message(m, i) for i, m in enumerate(messages)], tools=tools)
    template_kwargs = _template_kwargs(body)
    if template_kwargs:  # the pod checks the names against its template's call
        chat.template_kwargs = json.dumps(template_kwargs)
    req = pb.GenerateRequest(chat=chat)
    logprobs = _typed(body, "logprobs", bool) or False
    top = _typed(body, "top_logprobs", int)
    if top is not None and not logprobs:
        raise bad_request("`top_logprobs` needs `logprobs: true`", "top_logprobs")
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:  # the engine's bound, named as sent
        raise bad_request(f"`top_logprobs` must be in [0, {MAX_TOP_LOGPROBS}], got {top}", "top_logprobs")
    if logprobs:
        req.logprobs = top or 0
    _no_function_call(body)
    _no_chat_echo(body, chat)
    _special_tokens(body, added=False)
    if _typed(body, "add_generation_prompt", bool) is False:  # the template always adds it
        raise bad_request("`add_generation_prompt: false` is not supported", "add_generation_prompt")
    call = _common(body, req, base_models, logprobs)
    if forced is not None:
        if req.sampling.HasField("structured_output"):
            raise bad_request("`tool_choice` forces the output to a call: give no structured-output form too",
                              "tool_choice")  # fmt: skip
        req.sampling.structured_output.json_schema = forced
    if not _max_tokens(body, req, "max_completion_tokens", "max_tokens"):
        req.max_tokens = TO_THE_CONTEXT
    if (_typed(body, "best_of", int) or 1) > call.n:  # a completions field (OpenAI's chat has none)
        raise bad_request("`best_of` is not supported in chat completions (send it to /v1/completions)",
                          "best_of")  # fmt: skip
    reasoning = _reasoning(req, reasoning_parser, template_kwargs or {})
    include_reasoning = _typed(body, "include_reasoning", bool) is not False  # vLLM's: false drops it
    if _harmony_unread(req, use, tool_parser, reasoning):
        reasoning, include_reasoning = "openai_gptoss", False
    if (use is not None and use.reads_special_tokens) or reasoning_parsers.reads_special_tokens(reasoning):
        req.sampling.skip_special_tokens = False
    call = replace(call, tools=use, reasoning=reasoning, include_reasoning=include_reasoning)
    _bounded(call)
    return req, call


def _template_kwargs(body: dict[str, Any]) -> dict[str, Any] | None:
    """`chat_template_kwargs`, and OpenAI's `reasoning_effort` as the template variable of that name:
    gpt-oss's template writes it into the system message ("Reasoning: high"; "medium" when unset),
    so dropping it served every effort asked for as medium. A template that does not read it renders
    as before; a `reasoning_effort` the request's own `chat_template_kwargs` sets wins."""
    kwargs = _typed(body, "chat_template_kwargs", dict)
    effort = _typed(body, "reasoning_effort", str)
    return kwargs if effort is None else {"reasoning_effort": effort, **(kwargs or {})}


# Chat-template switches that turn thinking off (Qwen3's `enable_thinking`, DeepSeek-V3.1's
# `thinking`): the template closes the thinking in the prompt, so the output is all answer.
THINKING_SWITCHES = ("enable_thinking", "thinking")


def _reasoning(req: pb.GenerateRequest, parser: str, template_kwargs: dict[str, Any]) -> str:
    """How the output is read for reasoning: by the server's parser, but for an output forced to a
    schema (structured output, a forced tool call), which is the schema's from its first token
    (the engine forces it through what would have been thinking), and for a chat whose template
    variables turn thinking off (as vLLM's qwen3 parser reads them): read as reasoning, either
    answer, having no `</think>`, would be all reasoning and its content null."""
    thinking_off = any(template_kwargs.get(switch) is False for switch in THINKING_SWITCHES)
    return "none" if req.sampling.HasField("structured_output") or thinking_off else parser


def _harmony_unread(req: pb.GenerateRequest, use: ToolUse | None, tool_parser: str, reasoning: str) -> bool:
    """Whether the output is Harmony (`--tool-call-parser openai`: gpt-oss) that neither a tool
    use nor a reasoning parser reads: a chat without tools, or with `tool_choice` "none", on a
    server without --reasoning-parser. It is read as the openai parser reads a chat with tools
    (final and commentary channels the content, the analysis dropped); read as text, its markers
    skipped, it came as "analysisThinking...assistantfinalThe answer.". An output forced to a
    schema is the schema's from its first token, no Harmony."""
    forced = req.sampling.HasField("structured_output")
    return tool_parser == "openai" and use is None and reasoning == "none" and not forced


def _no_function_call(body: dict[str, Any]) -> None:
    """OpenAI's deprecated `function_call` that demands a call cannot be honoured (its `functions`
    are refused): refused, not answered with text the client takes for a function-less reply.
    "none" and "auto" ask for no call, so they are served."""
    if body.get("function_call") not in (None, "none", "auto"):
        raise bad_request(
            f"`function_call` {body['function_call']!r} is not supported: send `tools` and `tool_choice`",
            "function_call",
        )


def _no_chat_echo(body: dict[str, Any], chat: pb.ChatMessages) -> None:
    """vLLM's chat `echo` starts the answer with the last message when that is the assistant's:
    not served here, so refused rather than answered without it. After any other message it
    changes nothing (vLLM's too), so it is served."""
    if _typed(body, "echo", bool) and chat.messages[-1].role == "assistant":
        raise bad_request("`echo` of a final assistant message is not supported in chat completions", "echo")


def _special_tokens(body: dict[str, Any], added: bool) -> None:
    """vLLM's `add_special_tokens`: a text prompt is tokenized with the tokenizer's special tokens
    (a BOS), a chat's with none but its template's. A request asking otherwise would be answered
    from other tokens than it asked for (a prompt that already holds its BOS would get two)."""
    if _typed(body, "add_special_tokens", bool) not in (None, added):
        raise bad_request(
            f"`add_special_tokens: {str(not added).lower()}` is not supported here", "add_special_tokens"
        )


def completion_request(body: dict[str, Any], base_models: Collection[str]) -> tuple[pb.GenerateRequest, Call]:
    """POST /v1/completions: the request of its first prompt, and the Call with all of them."""
    prompts = _prompts(body.get("prompt"))
    req = pb.GenerateRequest()
    set_prompt(req, prompts[0])
    if any(isinstance(p, str) for p in prompts):
        _special_tokens(body, added=True)
    if body.get("suffix"):
        raise bad_request("`suffix` is not supported", "suffix")
    if body.get("chat_template_kwargs"):
        raise bad_request("`chat_template_kwargs` is for chat completions (a prompt has no template)",
                          "chat_template_kwargs")  # fmt: skip
    logprobs = _typed(body, "logprobs", int)
    if logprobs is not None:
        req.logprobs = logprobs
    echo = _echo(body, prompts, req)
    call = _common(body, req, base_models, logprobs is not None)
    best_of = _best_of(body, call)
    _max_tokens(body, req, "max_tokens")
    _echoed_logprobs(req, echo, logprobs)
    call = replace(call, best_of=best_of, echo=echo, prompts=prompts)
    _bounded(call)
    return req, call


def set_prompt(req: pb.GenerateRequest, prompt: Prompt) -> None:
    """A completion's prompt onto its GenerateRequest: `text`, or `token_ids`."""
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.CopyFrom(pb.TokenIds(ids=prompt))


def _prompts(prompt: Any) -> tuple[Prompt, ...]:
    """`prompt`: a string, a list of token ids, or a non-empty list of either (several prompts)."""
    if isinstance(prompt, str):
        return (prompt,)
    if isinstance(prompt, list) and prompt and _token_ids(prompt):
        return (tuple(prompt),)
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return tuple(prompt)
    if isinstance(prompt, list) and prompt and all(_token_list(p) for p in prompt):
        return tuple(tuple(p) for p in prompt)
    raise bad_request(
        "`prompt` must be a string, a list of token ids, or a non-empty list of strings or of token-id lists",
        "prompt",
    )


def _echo(body: dict[str, Any], prompts: tuple[Prompt, ...], req: pb.GenerateRequest) -> bool:
    """`echo`: each choice's text starts with its prompt: a text prompt as given, token ids (what
    lm-eval sends by default) as the pod's tokenizer decodes them (`echo_prompt`: the HTTP layer
    has no tokenizer)."""
    echo = _typed(body, "echo", bool) or False
    if echo and not isinstance(prompts[0], str):  # one kind of prompt throughout (`_prompts`)
        req.echo_prompt = True
    return echo


def _echoed_logprobs(req: pb.GenerateRequest, echo: bool, logprobs: int | None) -> None:
    """`echo` with `logprobs: k`: the choice's logprobs start with the prompt's (the first token's
    null), k alternatives each, so the pods compute them (`prompt_logprobs: k`); lm-eval's
    loglikelihood sends it with `max_tokens: 0`, which is served only so: an echo without
    logprobs and no output has its prompt scored too (k = 0), the scores unsent."""
    prompt_only = req.HasField("max_tokens") and req.max_tokens == 0
    if not echo or (logprobs is None and not prompt_only):
        return
    k = logprobs or 0
    if req.HasField("prompt_logprobs") and req.prompt_logprobs != k:
        raise bad_request(
            f"`prompt_logprobs` ({req.prompt_logprobs}) and `echo` with `logprobs` ({k}) ask for the "
            "prompt's logprobs twice: give the same number",
            "prompt_logprobs",
        )
    req.prompt_logprobs = k


def _best_of(body: dict[str, Any], call: Call) -> int:
    """`best_of`: generations per prompt, the n with the highest cumulative logprob returned.
    At least n; not streamed (which choices are returned is known only at the end), as OpenAI."""
    best_of = _typed(body, "best_of", int)
    if best_of is None or best_of == call.n:
        return call.n
    if best_of < call.n:
        raise bad_request(f"`best_of` ({best_of}) must be at least `n` ({call.n})", "best_of")
    if call.stream:
        raise bad_request("`best_of` > `n` cannot be streamed", "best_of")
    return best_of


def _bounded(call: Call) -> None:
    """At most MAX_CHOICES generations for one request."""
    if call.generations > MAX_CHOICES:
        given = f"{max(1, len(call.prompts))} prompt(s) x {call.best_of}"
        raise bad_request(
            f"the request asks for {call.generations} generations ({given}); at most {MAX_CHOICES} "
            "per request: split it",
            "best_of" if call.best_of > call.n else "n" if call.n > 1 else "prompt",
        )


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
        if body.get(name):
            raise bad_request(why, name)
    n = _typed(body, "n", int)
    if n is not None and n < 1:  # n: 0 asks for no choice at all
        raise bad_request(f"`n` must be at least 1, got {n}", "n")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise bad_request("`stop` must be a string or a list of strings", "stop")
    req.stop.extend(stop or [])
    for name in ("seed", "priority"):  # priority: vLLM's, lower is served first, as in gRPC
        value = _typed(body, name, int)
        if value is not None:
            setattr(req, name, value)
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
    _processors(body, s)
    structured_output(body, req)
    stream = _typed(body, "stream", bool) or False
    prompt_logprobs = _typed(body, "prompt_logprobs", int)
    if prompt_logprobs is not None:  # vLLM's: the prompt's logprobs, in the (whole) response
        if stream:
            raise bad_request("`prompt_logprobs` is not supported with `stream: true`", "prompt_logprobs")
        req.prompt_logprobs = prompt_logprobs
    options = _typed(body, "stream_options", dict)
    if options is not None and not stream:
        raise bad_request("`stream_options` is only allowed with `stream: true`", "stream_options")
    include_usage = (options or {}).get("include_usage")
    if include_usage not in (None, True, False):  # "false" would read as true: a chunk no one expects
        raise bad_request("`stream_options.include_usage` must be true or false", "stream_options")
    named = model or next(iter(sorted(base_models)), "")  # unset: the base model
    n = n or 1
    return Call(named, stream, include_usage=bool(include_usage), logprobs=logprobs, n=n, best_of=n,
                prompt_logprobs=prompt_logprobs is not None)  # fmt: skip


def _processors(body: dict[str, Any], s: pb.SamplingParams) -> None:
    """OpenAI's `logit_bias` ({"token id": bias}) and vLLM's `allowed_token_ids`, `min_tokens` and
    `bad_words` onto `s`, checked for their kinds here; their values (bias range, ids in the
    vocabulary, sizes) are checked by the pod as for gRPC."""
    bias = _typed(body, "logit_bias", dict) or {}
    ids = {k: int(k) if isinstance(k, str) and k.strip().isdecimal() else k for k in bias}
    if not _token_ids(list(ids.values())) or any(
        not isinstance(v, (int, float)) or isinstance(v, bool) for v in bias.values()
    ):
        raise bad_request("`logit_bias` must map token ids (as strings) to numbers", "logit_bias")
    s.logit_bias.update({ids[k]: float(v) for k, v in bias.items()})
    allowed = _typed(body, "allowed_token_ids", list) or []
    if not _token_ids(allowed):
        raise bad_request("`allowed_token_ids` must be a list of token ids", "allowed_token_ids")
    s.allowed_token_ids.extend(allowed)
    min_tokens = _typed(body, "min_tokens", int)
    if min_tokens is not None:
        s.min_tokens = min_tokens
    words = _typed(body, "bad_words", list) or []
    if not all(isinstance(w, str) for w in words):
        raise bad_request("`bad_words` must be a list of strings", "bad_words")
    s.bad_words.extend(words)


def _max_tokens(body: dict[str, Any], req: pb.GenerateRequest, *names: str) -> bool:
    """The first of `names` the body sets (chat: max_completion_tokens, then the older max_tokens);
    whether one was."""
    for name in names:
        value = _typed(body, name, int)
        if value is not None:
            req.max_tokens = value
            return True
    return False


def _token_list(value: Any) -> bool:
    """A non-empty list of token ids (one prompt of several)."""
    return isinstance(value, list) and bool(value) and _token_ids(value)


def _token_ids(values: list[Any]) -> bool:
    """Every value a token id the wire can carry (int32, not negative)."""
    return all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in values)


def _message(m: Any, i: int) -> pb.ChatMessage:
    """One message: its role and text, an assistant's `tool_calls` and `reasoning_content` (what a
    reasoning parser returned: sent back in a tool-calling loop), a tool result's `tool_call_id`."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise bad_request(f"messages[{i}] must be an object with a `role`", "messages")
    role = "system" if m["role"] == "developer" else m["role"]  # OpenAI's newer name for system
    if role not in ("system", "user", "assistant", "tool"):
        roles = "system, developer, user, assistant, tool"
        raise bad_request(f"messages[{i}]: role {m['role']!r} is not supported ({roles})", "messages")
    if m.get("function_call"):  # the template would render an empty turn instead
        raise bad_request(f"messages[{i}].function_call is not supported: send `tool_calls`", "messages")
    if m.get("tool_calls") and role != "assistant":
        raise bad_request(f"messages[{i}]: only an assistant message has `tool_calls`", "messages")
    content = m.get("content")
    if isinstance(content, list):
        content = _text_parts(content, i)
    if content is not None and not isinstance(content, str):
        raise bad_request(f"messages[{i}].content must be a string or a list of text parts", "messages")
    message = pb.ChatMessage(role=role, content=content or "", tool_calls=tool_calls(m, i))
    reasoning = m.get("reasoning_content", m.get("reasoning"))  # ours, and vLLM's newer name
    if reasoning is not None and role == "assistant":
        if not isinstance(reasoning, str):
            raise bad_request(f"messages[{i}].reasoning_content must be a string", "messages")
        message.reasoning_content = reasoning
    if role == "tool":
        message.tool_call_id = _tool_call_id(m, i)
        if isinstance(m.get("name"), str):
            message.name = m["name"]
    return message


def _tool_call_id(m: dict[str, Any], i: int) -> str:
    """A tool result names the call it answers (OpenAI requires it; templates that pair results
    with calls read it)."""
    call_id = m.get("tool_call_id")
    if not isinstance(call_id, str) or not call_id:
        raise bad_request(f"messages[{i}]: a `tool` message needs its `tool_call_id` (a string)", "messages")
    return call_id


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
