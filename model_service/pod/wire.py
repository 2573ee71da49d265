"""Between the wire (spindle.v1 messages) and the engine (keywords, SamplingParams, RequestOutput).

Proto3 cannot tell an unset scalar from zero, so every sampling field is `optional` in the
proto and copied here only when `HasField` says the caller set it: an unset temperature is the
engine's default (1.0), never a silent 0 (greedy). Values are validated by the engine's own
`SamplingParams.validate`, so the wire and `spindle generate` accept exactly the same requests.
"""

from __future__ import annotations

import json
from typing import Any

from model_service.engine.requests import Resume
from model_service.engine.sampler import TokenLogprobs
from model_service.engine.sampling_params import SamplingParams
from model_service.engine.sequence import RequestOutput
from model_service.errors import InvalidRequestError
from model_service.models.tokenizer import Tokenizer
from spindle import request_ids
from spindle.v1 import generation_pb2 as pb

_REQUEST_FIELDS = ("max_tokens", "seed", "logprobs", "prompt_logprobs")
_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "num_beams",
    "length_penalty",
)
_EARLY_STOPPING = {
    pb.EARLY_STOPPING_FALSE: False,
    pb.EARLY_STOPPING_TRUE: True,
    pb.EARLY_STOPPING_NEVER: "never",
}
_FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}


def request_id(req: pb.GenerateRequest) -> str:
    """The caller's id, or a new one; raises InvalidRequestError for one metadata cannot carry."""
    rid, problem = request_ids.request_id(req.request_id)
    if problem is not None:
        raise InvalidRequestError(problem)
    return rid


def engine_request(req: pb.GenerateRequest) -> dict[str, Any]:
    """Keywords for `Engine.add_request` (all but request_id); raises InvalidRequestError."""
    which = req.WhichOneof("prompt")
    kwargs: dict[str, Any] = {}
    if which is None:
        raise InvalidRequestError("the request has no prompt: set one of `text`, `chat` or `token_ids`")
    if which == "text":
        kwargs["prompt"] = req.text
    elif which == "chat":
        kwargs["messages"] = [chat_message(m, i) for i, m in enumerate(req.chat.messages)]
        if req.chat.tools:
            kwargs["tools"] = [tool(t, i) for i, t in enumerate(req.chat.tools)]
        if req.chat.template_kwargs:
            kwargs["chat_template_kwargs"] = _json_object(req.chat.template_kwargs, "chat.template_kwargs")
    else:
        kwargs["prompt_token_ids"] = list(req.token_ids.ids)
    kwargs["params"] = sampling_params(req)
    if req.HasField("priority"):
        kwargs["priority"] = req.priority
    if req.HasField("adapter"):
        if not req.adapter:
            raise InvalidRequestError("adapter is set but empty; leave it unset to use the base model")
        kwargs["adapter"] = req.adapter
    if req.HasField("resume"):
        kwargs["resume"] = Resume(list(req.resume.output_token_ids), req.resume.text_chars)
    return kwargs


def prompt_text(req: pb.GenerateRequest, tokenizer: Tokenizer | None) -> str | None:
    """What `echo_prompt` sends in the first chunk (None when not asked, or already sent: a
    resumed request): a text prompt as given, a token-id prompt decoded as the engine's output
    is (special tokens kept, so the prompt's logprob tokens line up with it). Raises for a chat
    (its rendered template is not the caller's) and for token ids on a pod with no tokenizer."""
    if not req.echo_prompt or req.HasField("resume"):
        return None
    which = req.WhichOneof("prompt")
    if which == "text":
        return req.text
    if which == "token_ids" and tokenizer is not None:
        return tokenizer.decode(list(req.token_ids.ids), skip_special_tokens=False)
    why = "a chat prompt" if which == "chat" else "a token-id prompt on a pod with no tokenizer"
    raise InvalidRequestError(f"echo_prompt is not supported for {why}")


def chat_message(m: pb.ChatMessage, i: int) -> dict[str, Any]:
    """A message as transformers' chat templates take it: an assistant's `tool_calls` with their
    arguments as objects (templates write them with `tojson`: text would be quoted twice) and its
    `reasoning_content` (Qwen3's template renders it for the turns after the last user message),
    a tool result with its `tool_call_id` (and `name` when given)."""
    if not m.role:
        raise InvalidRequestError(f"chat.messages[{i}] has no role (system, user, assistant or tool)")
    message: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        message["tool_calls"] = [_tool_call(c, f"chat.messages[{i}].tool_calls[{j}]")
                                 for j, c in enumerate(m.tool_calls)]  # fmt: skip
    if m.tool_call_id:
        message["tool_call_id"] = m.tool_call_id
    if m.name:
        message["name"] = m.name
    if m.HasField("reasoning_content"):
        message["reasoning_content"] = m.reasoning_content
    return message


def _tool_call(c: pb.ToolCall, where: str) -> dict[str, Any]:
    arguments = _json_object(c.arguments or "{}", f"{where}.arguments")
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": arguments}}


def tool(t: pb.Tool, i: int) -> dict[str, Any]:
    """A tool as OpenAI's `tools[]` entry, the form chat templates read (`tool.function.name`)."""
    if not t.name:
        raise InvalidRequestError(f"chat.tools[{i}] has no name")
    function: dict[str, Any] = {"name": t.name}
    if t.description:
        function["description"] = t.description
    if t.parameters:  # unset: as the caller sent it (no parameters), for the template to show
        function["parameters"] = _json_object(t.parameters, f"chat.tools[{i}].parameters")
    return {"type": "function", "function": function}


def _json_object(text: str, where: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise InvalidRequestError(f"{where} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{where} must be a JSON object, got {text[:100]!r}")
    return value


def sampling_params(req: pb.GenerateRequest) -> SamplingParams:
    d: dict[str, Any] = {name: getattr(req, name) for name in _REQUEST_FIELDS if req.HasField(name)}
    if req.stop:
        d["stop"] = list(req.stop)
    s = req.sampling
    d.update({name: getattr(s, name) for name in _SAMPLING_FIELDS if s.HasField(name)})
    if s.stop_token_ids:
        d["stop_token_ids"] = list(s.stop_token_ids)
    if s.HasField("min_tokens"):
        d["min_tokens"] = s.min_tokens
    d.update(_processors(s))
    if s.HasField("structured_output"):
        d["structured_output"] = structured_output(s.structured_output)
    if s.early_stopping != pb.EARLY_STOPPING_UNSPECIFIED:
        if s.early_stopping not in _EARLY_STOPPING:
            raise InvalidRequestError(f"early_stopping has unknown value {s.early_stopping}")
        d["early_stopping"] = _EARLY_STOPPING[s.early_stopping]
    return SamplingParams.from_dict(d)


def _processors(s: pb.SamplingParams) -> dict[str, Any]:
    """The repeated and map processors' fields that are set (proto3: empty is unset); their
    values, sizes and ids are checked by `SamplingParams.validate` against the model's vocabulary."""
    d: dict[str, Any] = {}
    if s.logit_bias:
        d["logit_bias"] = dict(s.logit_bias)
    if s.allowed_token_ids:
        d["allowed_token_ids"] = list(s.allowed_token_ids)
    if s.bad_words:
        d["bad_words"] = list(s.bad_words)
    return d


def structured_output(so: pb.StructuredOutput) -> dict[str, Any]:
    """The engine's `structured_output` object (`StructuredOutput.from_dict` checks it)."""
    kind = so.WhichOneof("kind")
    if kind is None:
        raise InvalidRequestError(
            "sampling.structured_output is set but names no kind: set one of json_schema, json_object, "
            "regex, choice or grammar (or leave it unset for free text)"
        )
    return {kind: list(so.choice.choices) if kind == "choice" else getattr(so, kind)}


class TokenTexts:
    """Each token id's text decoded alone, special tokens included: what OpenAI's and vLLM's
    logprobs name a token by (a client reads the chance of "Yes" there). Computed once per id,
    on the pod's event loop, not the engine thread; None without a tokenizer."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


_NO_TEXTS = TokenTexts(None)


def chunk(outputs: list[RequestOutput], texts: TokenTexts = _NO_TEXTS) -> pb.GenerateResponse | None:
    """The tokens and text these consecutive outputs of one request add, as one message (the
    same tokens, text and logprobs as one message each), or None when they add nothing. Logprob
    tokens carry their `texts`."""
    c = pb.Chunk()
    for out in outputs:
        if out.prompt_token_ids is not None and out.prompt_logprobs is not None:
            ids = out.prompt_token_ids
            c.prompt_logprobs.append(pb.TokenLogprob(token_id=ids[0], token=texts(ids[0])))
            c.prompt_logprobs.extend(_token_logprobs(ids[1:], out.prompt_logprobs, texts))
        c.token_ids.extend(out.new_token_ids)
        c.text += out.new_text
        if out.new_logprobs and len(out.new_logprobs) == len(out.new_token_ids):
            c.logprobs.extend(_token_logprobs(out.new_token_ids, out.new_logprobs, texts))
    if not c.token_ids and not c.text and not c.prompt_logprobs:
        return None
    return pb.GenerateResponse(request_id=outputs[0].request_id, chunk=c)


def _token_logprobs(
    ids: list[int], logprobs: list[TokenLogprobs], texts: TokenTexts
) -> list[pb.TokenLogprob]:
    """The wire's logprob of each token of `ids`, with its top alternatives, named by `texts`."""
    out = []
    for token, lp in zip(ids, logprobs, strict=True):
        top = [pb.TopLogprob(token_id=t, logprob=v, token=texts(t)) for t, v in lp.top]
        out.append(pb.TokenLogprob(token_id=token, logprob=lp.logprob, top=top, token=texts(token)))
    return out


def final(out: RequestOutput) -> pb.GenerateResponse:
    f = pb.Final(
        finish_reason=_FINISH.get(out.finish_reason or "", pb.FINISH_REASON_UNSPECIFIED),
        usage=pb.Usage(prompt_tokens=out.num_prompt_tokens, completion_tokens=len(out.token_ids)),
    )
    if isinstance(out.stop_reason, str):
        f.stop_string = out.stop_reason
    elif isinstance(out.stop_reason, int):
        f.stop_token_id = out.stop_reason
    return pb.GenerateResponse(request_id=out.request_id, final=f)
