"""`chat_template_kwargs` (vLLM's field: more variables for the chat template, e.g. Qwen3's
`enable_thinking`): from the HTTP body through the gRPC request to the pod's template call, with
transformers' own `apply_chat_template(..., **kwargs)` as the oracle, and the names a request may
not set refused by name."""

from __future__ import annotations

import pytest

from model_service.engine.engine import _request_arguments
from model_service.engine.requests import PromptReader
from model_service.errors import InvalidRequestError
from model_service.models.tokenizer import Tokenizer
from model_service.pod import wire
from spindle.openai_api.errors import ApiError
from spindle.openai_api.requests import chat_request, completion_request
from spindle.v1 import generation_pb2 as pb
from tests.test_tool_calling import _byte_tokenizer

ASK = [{"role": "user", "content": "Why is the sky blue?"}]
ADA = {"name": "Ada"}
# Qwen3's switch, as its template spells it: an empty thought when thinking is off.
THINKING = """{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{%- if enable_thinking is defined and enable_thinking is false %}
<think>

</think>
{% endif %}{% endif %}
{%- if persona is defined %}[{{ persona.name }}]{% endif %}
{%- if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}{% endif %}"""


def _reader() -> tuple[PromptReader, object]:
    hf = _byte_tokenizer()
    hf.chat_template = THINKING
    return PromptReader(
        Tokenizer(hf), vocab_size=len(hf), max_model_len=4096, num_blocks=4096, block_size=1
    ), hf


def _pod_ids(body: dict) -> list[int]:
    """What the pod tokenizes for an HTTP chat body, through the bytes of the gRPC request."""
    req, _ = chat_request(body, {"m"})
    kwargs = wire.engine_request(pb.GenerateRequest.FromString(req.SerializeToString()))
    reader, _ = _reader()
    return reader.token_ids(
        None, kwargs["messages"], None, kwargs.get("tools"), kwargs.get("chat_template_kwargs")
    )


def _hf_ids(hf, **kwargs) -> list[int]:
    out = hf.apply_chat_template(ASK, add_generation_prompt=True, tokenize=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize(
    "template_kwargs", [{"enable_thinking": False}, {"enable_thinking": True}, {"persona": {"name": "Ada"}}]
)
def test_template_variables_reach_the_template_as_transformers_passes_them(template_kwargs):
    _, hf = _reader()
    ids = _pod_ids({"messages": ASK, "chat_template_kwargs": template_kwargs})
    assert ids == _hf_ids(hf, **template_kwargs)
    text = hf.decode(ids)
    assert ("<think>" in text) == (template_kwargs.get("enable_thinking") is False)
    assert ("[Ada]" in text) == ("persona" in template_kwargs)


@pytest.mark.parametrize(
    ("body", "rendered"),
    [
        ({"reasoning_effort": "high"}, {"reasoning_effort": "high"}),
        ({"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high", "persona": ADA}},
         {"reasoning_effort": "high", "persona": ADA}),
    ],
)  # fmt: skip
def test_reasoning_effort_is_the_template_variable_gpt_oss_reads(body, rendered):
    """OpenAI's `reasoning_effort` reaches the template as `reasoning_effort` (gpt-oss's template
    writes "Reasoning: high" from it); it was dropped, so every effort was served as the default."""
    _, hf = _reader()
    assert _pod_ids({"messages": ASK, **body}) == _hf_ids(hf, **rendered)
    with pytest.raises(ApiError, match="reasoning_effort"):
        chat_request({"messages": ASK, "reasoning_effort": 3}, {"m"})


def test_no_variables_and_an_empty_object_render_the_default():
    _, hf = _reader()
    assert (
        _pod_ids({"messages": ASK}) == _pod_ids({"messages": ASK, "chat_template_kwargs": {}}) == _hf_ids(hf)
    )


@pytest.mark.parametrize(
    ("template_kwargs", "problem"),
    [
        ({"tokenize": False}, "may not set 'tokenize'"),  # would hand the engine text, not ids
        ({"add_generation_prompt": False}, "may not set 'add_generation_prompt'"),
        ({"messages": []}, "may not set 'messages'"),
        ({"not a name": 1}, "no template variable's name"),
    ],
)
def test_names_the_server_sets_are_refused_by_name(template_kwargs, problem):
    with pytest.raises(InvalidRequestError, match=problem):
        _pod_ids({"messages": ASK, "chat_template_kwargs": template_kwargs})


def test_the_http_front_refuses_what_is_no_object_and_a_prompt_without_a_template():
    with pytest.raises(ApiError, match="chat_template_kwargs"):
        chat_request({"messages": ASK, "chat_template_kwargs": ["enable_thinking"]}, {"m"})
    with pytest.raises(ApiError, match="chat_template_kwargs"):
        completion_request({"prompt": "a", "chat_template_kwargs": {"enable_thinking": False}}, {"m"})


def test_grpc_and_request_files_take_them_only_with_messages():
    """A malformed JSON text from a gRPC client, and variables beside a plain prompt (a gRPC
    request or a `spindle generate --requests` line), are the request's errors."""
    bad = pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="x")]))
    bad.chat.template_kwargs = "{enable_thinking: false}"
    with pytest.raises(InvalidRequestError, match=r"chat\.template_kwargs is not JSON"):
        wire.engine_request(bad)
    reader, _ = _reader()
    args = _request_arguments({"prompt": "x", "chat_template_kwargs": {"enable_thinking": False}})
    with pytest.raises(InvalidRequestError, match="send them with `messages`"):
        reader.token_ids(args["prompt"], None, None, None, args["chat_template_kwargs"])
