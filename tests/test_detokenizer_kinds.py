"""Incremental detokenization and chat templates with tokenizer kinds other than SmolLM2's,
built here by hand (a fixed vocabulary, so each case is the same on every run):
SentencePiece-style BPE with byte fallback (Llama-2 / Mistral: "▁" for spaces, <0x..> byte
tokens, a decoder that strips the first space), with special and added tokens; and chat
templates that refuse what they are given."""

from __future__ import annotations

import itertools

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from model_service.engine.detokenizer import IncrementalDetokenizer
from model_service.engine.requests import PromptReader
from model_service.errors import InvalidRequestError
from model_service.models.tokenizer import Tokenizer
from model_service.pod.status import status_for

SPECIAL = ["<unk>", "<s>", "</s>"]
PIECES = ["▁", "H", "i", "j", "o", "k", ",", "é", "日", "本", "▁H", "▁Hi", "▁o", "▁ok", "日本", "▁日本"]
MERGES = [("▁", "H"), ("▁H", "i"), ("▁", "o"), ("▁o", "k"), ("日", "本"), ("▁", "日本")]
ADDED_SPECIAL, ADDED = ["<|im_start|>", "<|im_end|>"], ["<tool>"]


def byte_fallback_tokenizer() -> Tokenizer:
    """Llama-2's layout: <unk> <s> </s>, the 256 byte tokens, then pieces and merges."""
    from tokenizers import AddedToken, decoders, models, normalizers
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate([*SPECIAL, *(f"<0x{b:02X}>" for b in range(256)), *PIECES])}
    raw = RawTokenizer(models.BPE(vocab, MERGES, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    raw.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    raw.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL + ADDED_SPECIAL])
    raw.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    return Tokenizer(hf)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return byte_fallback_tokenizer()


def _id(tok: Tokenizer, piece: str) -> int:
    return tok.hf.convert_tokens_to_ids(piece)


def _deltas(tok: Tokenizer, prompt: list[int], out: list[int], skip: bool, windowed: bool) -> list[str]:
    """The deltas of pushing `out`, then what the end of the output flushes."""
    detok = IncrementalDetokenizer(tok, prompt, skip)
    if windowed:
        detok.stream = None
    return [*(detok.push(t) for t in out), detok.flush()]


@pytest.mark.parametrize("windowed", [False, True])
def test_a_byte_run_that_is_not_utf8_does_not_break_the_stream(tok, windowed):
    """<0x6A> alone is "j", but <0x6A><0xFD> decodes to two U+FFFD: the decode of the tokens so
    far changed, and tokenizers' stream raised ("Invalid prefix") inside the engine's step,
    failing every request in the batch. The text goes on as the window decodes it."""
    prompt = tok.encode("Hi")
    out = [_id(tok, "<0x6A>"), _id(tok, "<0xFD>"), _id(tok, "▁ok"), _id(tok, "<0x6A>"), _id(tok, "▁Hi")]
    deltas = _deltas(tok, prompt, out, True, windowed)
    assert deltas[0] == "j"  # whole when it came: emitted
    assert "".join(deltas[1:]).endswith(" okj Hi")
    assert tok.decode(prompt + out).endswith(" okj Hi")


def _monotonic(tok: Tokenizer, ids: list[int], start: int, skip: bool) -> bool:
    """Whether each decode of ids[:n] (n >= start), less a trailing partial character, extends
    the one before: where it does not, no stream can equal the decode of the whole."""
    texts = [tok.decode(ids[:n], skip).rstrip("\ufffd") for n in range(start, len(ids) + 1)]
    return all(b.startswith(a) for a, b in itertools.pairwise(texts))


@settings(max_examples=150, deadline=None)
@given(data=st.data(), skip=st.booleans(), windowed=st.booleans())
def test_property_any_ids_stream_their_decode(tok, data, skip, windowed):
    """Random ids of every kind (bytes of broken characters, specials and added tokens mid-stream,
    a leading "▁" piece first): the deltas are the decode of prompt and output past the prompt's
    text; what waited for a character to complete comes out at the end, as `decode` spells it."""
    ids = st.lists(st.integers(0, len(tok.hf) - 1), max_size=12)
    prompt, out = data.draw(ids, "prompt"), data.draw(ids.filter(bool), "output")
    *deltas, flushed = _deltas(tok, prompt, out, skip, windowed)  # never raises
    prompt_text, full = tok.decode(prompt, skip), tok.decode(prompt + out, skip)
    if not full.startswith(prompt_text) or not _monotonic(tok, prompt + out, len(prompt), skip):
        return
    assert "".join(deltas) + flushed == full[len(prompt_text) :]
    assert "\ufffd" not in "".join(deltas)[-1:], "a delta never ends inside a character"
    assert not flushed or flushed.endswith("\ufffd"), "only text ending inside a character waits"


# Llama-2's chat template, in short: user and assistant must alternate.
ALTERNATING = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ ' ' + message['content'] + eos_token }}{% endif %}{% endfor %}"
)


@pytest.mark.parametrize(
    ("template", "why"),
    [(ALTERNATING, "roles must alternate"), ("{{ messages[0].content | no_such_filter }}", "no_such_filter")],
)
def test_a_chat_template_refusing_the_messages_is_an_invalid_request(template, why):
    """Was a jinja2 TemplateError: INTERNAL at the pod, a 500 over HTTP (which the SDKs retry)."""
    tok = byte_fallback_tokenizer()
    tok.hf.chat_template = template
    user = {"role": "user", "content": "Hi"}
    with pytest.raises(InvalidRequestError, match=why) as refused:
        tok.apply_chat_template([user, user])
    assert status_for(refused.value)[0] == grpc.StatusCode.INVALID_ARGUMENT
    if template is ALTERNATING:  # the same template renders what it accepts, as HF does
        messages = [user, {"role": "assistant", "content": "ok"}, user]
        expected = tok.hf.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        assert tok.apply_chat_template(messages) == expected


def test_a_chat_template_rendering_no_tokens_is_an_invalid_request():
    """A template that renders only user turns, given a system message alone, renders nothing:
    the empty prompt was queued, and its step failed with every request batched with it
    ("engine error: index 0 is out of bounds")."""
    tok = byte_fallback_tokenizer()
    tok.hf.chat_template = "{% for m in messages if m.role == 'user' %}{{ m.content }}{% endfor %}"
    reader = PromptReader(tok, len(tok.hf), max_model_len=64, num_blocks=1024, block_size=1)
    assert reader.token_ids(None, [{"role": "user", "content": "Hi"}], None) == tok.encode("Hi")
    with pytest.raises(InvalidRequestError, match="no tokens"):
        reader.token_ids(None, [{"role": "system", "content": "Be brief."}], None)


@pytest.mark.parametrize("form", ["prompt", "messages"])
def test_a_prompt_spelling_a_token_the_model_has_no_embedding_for_is_refused(form):
    """A tokenizer with tokens added past the model's embedding rows (no resize): a text prompt
    spelling one (here "<tool>") failed the step of every request batched with it (IndexError)."""
    tok = byte_fallback_tokenizer()
    tok.hf.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    tool = _id(tok, "<tool>")
    reader = PromptReader(
        tok, tool, max_model_len=64, num_blocks=1024, block_size=1
    )  # embeddings up to <tool>
    ask = {"prompt": ("Hi <tool>", None), "messages": (None, [{"role": "user", "content": "Hi <tool>"}])}
    with pytest.raises(InvalidRequestError, match=r"no embedding for \(ids \[\d+\]: \['<tool>'\]\)"):
        reader.token_ids(*ask[form], None)
    assert reader.token_ids("Hi ok", None, None) == tok.encode("Hi ok")
