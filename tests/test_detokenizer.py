"""Incremental detokenization with the SmolLM2 tokenizer (byte-level BPE: multi-byte
characters are often split across tokens)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from model_service.engine.detokenizer import IncrementalDetokenizer
from model_service.engine.requests import Resume
from model_service.engine.sampling_params import SamplingParams
from tests.conftest import make_engine

TEXTS = {
    "emoji": "Great job 😀👍🏽! Family: 👨‍👩‍👧‍👦, flag 🇫🇷, keycap 1️⃣, 🫠🦀",
    "cjk": "日本語のテキストです。中文字符，还有한국어 텍스트도 있습니다。",
    "accents": "Héllo wörld — naïve café, façade, Ærøskøbing, ñandú; e\u0301 a\u0300 (combining)",
    "code": 'def f(x: int) -> str:\n\tif x > 0:\n\t\treturn f"{x!r}"  # ok\n\treturn "λ"\n',
    "whitespace": "  leading\n\n\ttabs\t\tand   runs   \r\n trailing   \n\n\n",
    "math": "∀x∈ℝ: x² ≥ 0, ∑ᵢ aᵢ ≈ π, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟙𝟚𝟛",
    "mixed": "Tokyo (東京) 🗼 is 9,000 km from Paris — «très loin»! ¿Sí? 😅\n```py\nprint('🐍')\n```",
}
# A long text, so the detokenizer's window slides many times.
TEXTS["long"] = " ".join(TEXTS.values()) * 3


def _stream(tokenizer, ids: list[int], prompt: list[int], windowed: bool = False) -> list[str]:
    """The deltas of pushing `ids`: through tokenizers' streaming decoder (SmolLM2 has a fast
    tokenizer), or through the windowed `decode` path other tokenizers take (`windowed`)."""
    detok = IncrementalDetokenizer(tokenizer, prompt)
    assert detok.stream is not None, "SmolLM2's fast tokenizer should decode as a stream"
    if windowed:
        detok.stream = None
    return [detok.push(t) for t in ids]


@pytest.fixture(scope="module")
def tok(smollm2):
    return smollm2.tokenizer


@pytest.fixture(scope="module")
def prompts(tok):
    return {
        "none": [],
        "text": tok.encode("Say something 😀 with 中文:"),
        "chat": tok.apply_chat_template([{"role": "user", "content": "Écris un poème 🌸"}]),
    }


@pytest.mark.parametrize("windowed", [False, True])
@pytest.mark.parametrize("prompt_kind", ["none", "text", "chat"])
@pytest.mark.parametrize("name", list(TEXTS))
def test_incremental_equals_full_decode(tok, prompts, name, prompt_kind, windowed):
    text = TEXTS[name]
    ids = tok.encode(text)
    deltas = _stream(tok, ids, prompts[prompt_kind], windowed)
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("windowed", [False, True])
def test_split_characters_are_held_back_then_emitted_whole(tok, windowed):
    ids = tok.encode("a😀b")
    # a 4-byte emoji is several byte-level tokens: only the last one of them emits it
    pieces = [tok.decode([t]) for t in ids]
    assert any("\ufffd" in p for p in pieces), "the emoji should be split across tokens"
    deltas = _stream(tok, ids, [], windowed)
    assert "".join(deltas) == "a😀b"
    assert "" in deltas
    assert any("😀" in d for d in deltas)


@pytest.mark.parametrize("windowed", [False, True])
def test_special_tokens_are_skipped(tok, prompts, windowed):
    ids = [*tok.encode("Hi 😀"), 2, 1, *tok.encode(" there 日本")]  # <|im_end|>, <|im_start|>
    deltas = _stream(tok, ids, prompts["chat"], windowed)
    assert "".join(deltas) == tok.decode(ids) == "Hi 😀 there 日本"


# Token-id prompts cut after every token: some end inside a character, which the output completes.
SPLIT_TEXTS = ["a😀b 日本", "é ü 𝔘 👨\u200d👩\u200d👧", "odd \ufffd char, x\ufffd\ufffdy"]


@pytest.mark.parametrize("windowed", [False, True])
@pytest.mark.parametrize("text", SPLIT_TEXTS)
def test_prompt_ending_inside_a_character(tok, text, windowed, monkeypatch):
    """The output tokens that complete the prompt's last character emit it whole: not the prompt's
    text again (the stream did), nor nothing (the window did). A U+FFFD the prompt spells is text."""
    if windowed:
        monkeypatch.setattr(tok, "stream_decoder", lambda *_: None)
    ids = tok.encode(text)
    for cut in range(1, len(ids)):
        prompt, out = ids[:cut], ids[cut:]
        detok = IncrementalDetokenizer(tok, prompt)
        deltas = [detok.push(t) for t in out]
        prompt_text, full = tok.decode(prompt), tok.decode(prompt + out)
        whole = prompt_text if full.startswith(prompt_text) else prompt_text.rstrip("\ufffd")
        assert whole + "".join(deltas) == full == text, (cut, prompt_text, deltas)
        assert (detok.stream is None) == windowed, "streams once the prompt's character is whole"


def test_no_tokenizer_emits_nothing():
    detok = IncrementalDetokenizer(None, [1, 2, 3])
    assert [detok.push(t) for t in (5, 6, 7)] == ["", "", ""]


_ALPHABET = st.one_of(
    st.characters(min_codepoint=0x20, max_codepoint=0x7E),  # ASCII
    st.characters(min_codepoint=0xA0, max_codepoint=0x24F),  # Latin-1 and Latin Extended
    st.characters(min_codepoint=0x300, max_codepoint=0x36F),  # combining marks
    st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF),  # CJK
    st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF),  # emoji
    st.sampled_from(["\n", "\t", " ", "\u200d", "\ufe0f", "\U0001f3fd", "é", "中", "😀"]),
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\ufffd"),  # anything else
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(_ALPHABET, min_size=1, max_size=60), with_prompt=st.booleans(), windowed=st.booleans())
def test_property_incremental_equals_full_decode(tok, prompts, text, with_prompt, windowed):
    ids = tok.encode(text)
    full = tok.decode(ids)
    # The GGUF vocab cannot spell a few lead bytes (e.g. 0xF1, unassigned planes 4-13): such text
    # does not survive encode at all, so there is nothing clean to detokenize.
    assume("\ufffd" not in full)
    deltas = _stream(tok, ids, prompts["chat"] if with_prompt else [], windowed)
    assert "".join(deltas) == full
    assert not any("\ufffd" in d for d in deltas)


@pytest.fixture(scope="module")
def engine(smollm2):
    return make_engine(smollm2, num_kv_blocks=16)


@pytest.mark.parametrize(("stop", "reason"), [(None, "length"), ("eos", "stop"), ("stop string", "stop")])
def test_an_output_ending_inside_a_character_keeps_its_text(engine, tok, stop, reason):
    """SmolLM2's " 😀" is [" \\xf0\\x9f\\x98", "\\x80"]: an output cut after the first (max_tokens,
    or a stop token next) ends inside the emoji. Its held text was dropped, the space with it ("Hi"
    where `decode` reads "Hi \\ufffd"); now the output ends as `decode` spells it, and a stop
    string in that text still stops it."""
    ids = tok.encode("Hi 😀")[:-1]
    assert tok.decode(ids) == "Hi \ufffd"
    resumed = [*ids, tok.eos_token_id] if stop == "eos" else ids
    max_tokens = 16 if stop == "eos" else len(ids)
    params = SamplingParams(max_tokens=max_tokens, stop=["i "] if stop == "stop string" else [])
    rid = engine.add_request("Say hi:", params=params, resume=Resume(resumed, 0))
    out = engine.run_to_completion()[rid]
    assert out.finish_reason == reason
    assert out.text == ("H" if stop == "stop string" else "Hi \ufffd")
    assert out.new_text == out.text  # the final output carries it
