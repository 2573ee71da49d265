"""The gateway and the client install without the `model` extra (torch & co.), and run without it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
PROJECT = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in requirements}


def test_the_core_install_has_none_of_the_model_extra():
    model = _names(PROJECT["optional-dependencies"]["model"])
    assert "torch" in model
    assert not model & _names(PROJECT["dependencies"])
    bundled = {
        extra
        for item in PROJECT["optional-dependencies"]["all"]
        if item.startswith("spindle[")
        for extra in item.removeprefix("spindle[").removesuffix("]").split(",")
    }
    assert {"model", "adapter"} <= bundled


def test_gateway_client_and_command_line_import_no_model_package():
    entry_module = PROJECT["scripts"]["spindle"].split(":")[0]
    heavy = sorted(_names(PROJECT["optional-dependencies"]["model"]))
    code = (
        f"import sys, json, gateway, gateway.server, spindle.client, {entry_module}\n"
        f"print(json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == []


def test_a_checkpoint_with_only_tokenizer_model_loads_with_the_model_extra(tmp_path):
    """Llama-2 / Mistral checkpoints may ship only SentencePiece's tokenizer.model, which
    transformers reads with `sentencepiece`. The model extra lacked it (only the tests had it): the
    model image's pod loaded no tokenizer and served token ids only, telling text and chat
    requests the model had none."""
    spm = pytest.importorskip("sentencepiece")
    from model_service.models.tokenizer import Tokenizer

    text = "Hello world! Héllo wörld, naïve café. 日本語 😀"
    with (tmp_path / "tokenizer.model").open("wb") as f:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter([text] * 20), model_writer=f, vocab_size=300, model_type="bpe",
            byte_fallback=True, character_coverage=1.0, minloglevel=2,
        )  # fmt: skip
    config = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok is not None and tok.decode(tok.encode(text + " 𝔘")) == text + " 𝔘"  # 𝔘: byte fallback
    assert "sentencepiece" in _names(PROJECT["optional-dependencies"]["model"])
