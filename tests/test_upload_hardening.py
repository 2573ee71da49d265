"""Adapter uploads that lie, refused by the service's validator before a byte is stored and by the
engine's loader before a slot is written (the end-to-end refusals, with the store and registry
checked unchanged, are in tests/test_fuzz_rpcs.py and tests/test_adapter_service.py)."""

from __future__ import annotations

import json
import shutil
import struct

import pytest

from adapter_service import base_model, validate
from model_service.lora.adapter import AdapterError, load_peft_adapter
from tests.test_adapter_service_units import CONFIG, _check, _lora


@pytest.fixture(scope="module")
def smol() -> base_model.BaseModel:
    return base_model.load("smollm2-135m-instruct")


def _config(**fields) -> bytes:
    return json.dumps(
        {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], **fields}
    ).encode()


def _with_header(data: bytes, edit) -> bytes:
    """The same file with its safetensors header rewritten by `edit(header)`."""
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    edit(header)
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data[8 + n :]


def _first(header: dict) -> dict:
    return next(v for k, v in header.items() if k != "__metadata__")


@pytest.mark.parametrize(
    ("config", "words"),
    [
        (_config(r=4), "config says r=4"),  # the tensors are rank 8: PEFT would scale by alpha / 4
        (_config(rank_pattern={"q_proj": 16}), "config says r=16"),
        (_config(rank_pattern={"(": 8}), "not a regular expression"),
        (_config(lora_alpha=float("nan")), "lora_alpha"),
        (_config(lora_alpha="16"), "lora_alpha"),
        (_config(lora_alpha=-1), "lora_alpha"),
        (_config(target_modules=["v_proj"]), "does not name 'q_proj'"),
        (_config(r=True), "r=True"),
    ],
)
def test_a_config_that_lies_about_the_weights_is_refused(tmp_path, smol, config, words):
    with pytest.raises(validate.ValidationError) as e:
        _check(tmp_path, _lora(8), smol, config)
    assert words in str(e.value)
    assert _check(tmp_path, _lora(8), smol, _config()).rank == 8  # the honest config passes


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda h: _first(h).update(data_offsets=["0", "4"]), "malformed"),  # was a TypeError (UNKNOWN)
        (lambda h: _first(h).update(data_offsets=[0.0, 18432.0]), "malformed"),
        (lambda h: _first(h).update(shape=[8.5, 576]), "malformed"),
        (lambda h: _first(h).update(shape=[-8, -576]), "negative"),
        (lambda h: _first(h).update(data_offsets=[4, 4 + 8 * 576 * 4]), "overlap"),  # into the next tensor
        (lambda h: h.update(extra={"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}), "not a LoRA"),
        (lambda h: _first(h).update(dtype="I64"), "dtype"),
    ],
)
def test_a_header_that_lies_about_offsets_or_shapes_is_refused(tmp_path, smol, edit, words):
    with pytest.raises(validate.ValidationError) as e:
        _check(tmp_path, _with_header(_lora(8), edit), smol, CONFIG)
    assert words in str(e.value)


def test_rank_zero_is_refused(tmp_path, smol):
    """Rank 0 passed every shape check and then divided by zero on the pod (alpha / r)."""
    with pytest.raises(validate.ValidationError, match="rank >= 1"):
        _check(tmp_path, _lora(0), smol, _config(r=0))


def test_the_engine_loader_refuses_what_the_service_refuses(tiny_llama, lora_dirs, tmp_path):
    """A pod loading from disk (--lora, PromoteFromDisk) applies the same rules: a named error."""
    d = tmp_path / "lying"
    shutil.copytree(lora_dirs["a"], d)
    config = json.loads((d / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps({**config, "r": config["r"] * 2}))
    with pytest.raises(AdapterError, match="config says r="):
        load_peft_adapter("lying", d, tiny_llama.config, 64)
    (d / "adapter_config.json").write_text("[]")
    with pytest.raises(AdapterError, match="not a JSON object"):
        load_peft_adapter("lying", d, tiny_llama.config, 64)
    for bad in (tmp_path / ("x" * 300), tmp_path / "nul\0byte"):  # ENAMETOOLONG / ValueError: not INTERNAL
        with pytest.raises(AdapterError, match=r"cannot read|not a directory"):
            load_peft_adapter("x", bad, tiny_llama.config, 64)


def _special_dirs(src, tmp_path) -> dict[str, tuple[object, str]]:
    """Adapter directories whose file is not a regular file, and the words each refusal names."""
    import os

    out = {}
    for what, make, words in (
        ("fifo-weights", lambda p: os.mkfifo(p), "FIFO"),
        ("zero-weights", lambda p: p.symlink_to("/dev/zero"), "character device"),
        ("dir-weights", lambda p: p.mkdir(), "a directory"),
    ):
        d = tmp_path / what
        shutil.copytree(src, d)
        (d / "adapter_model.safetensors").unlink()
        make(d / "adapter_model.safetensors")
        out[what] = (d, words)
    d = tmp_path / "fifo-config"
    shutil.copytree(src, d)
    (d / "adapter_config.json").unlink()
    os.mkfifo(d / "adapter_config.json")
    out["fifo-config"] = (d, "FIFO")
    return out


def test_the_loader_refuses_fifos_devices_directories_and_oversized_files(tiny_llama, lora_dirs, tmp_path):
    """Refused before a byte is read: a FIFO would block the engine thread, /dev/zero exhaust memory
    (the test would hang or run out of memory if either were opened and read)."""
    for d, words in _special_dirs(lora_dirs["a"], tmp_path).values():
        with pytest.raises(AdapterError, match=words):
            load_peft_adapter("x", d, tiny_llama.config, 64)
    size = (lora_dirs["a"] / "adapter_model.safetensors").stat().st_size
    with pytest.raises(AdapterError, match=r"above the limit of .* \(--max-adapter-bytes\)"):
        load_peft_adapter("x", lora_dirs["a"], tiny_llama.config, 64, max_bytes=size - 1)
    assert load_peft_adapter("x", lora_dirs["a"], tiny_llama.config, 64, max_bytes=size).modules


_PATHS = [f"model.layers.{i}.self_attn.{m}" for i in (0, 1) for m in ("q_proj", "v_proj")]  # "all-linear"'s


def _service_and_pod(d, fields: dict, base, cfg) -> tuple[list[str], dict]:
    """The service's targets and the pod's scaling of each module of the adapter in `d`, its
    config updated by `fields` (written back to `d`)."""
    config = json.loads((d / "adapter_config.json").read_text())
    text = json.dumps({**config, **fields})
    (d / "adapter_config.json").write_text(text)
    summary = validate.validate(text.encode(), d / "adapter_model.safetensors", base, 64)
    return summary.target_modules, {
        k: w.scaling for k, w in load_peft_adapter("a", d, cfg, 64).modules.items()
    }


@pytest.mark.parametrize(
    "fields",
    [
        {"target_modules": _PATHS},
        {"target_modules": ["self_attn.q_proj", "v_proj"]},
        {"bias": "all"},  # on a base without biases PEFT saves none
        {"bias": "lora_only"},
    ],
)
def test_configs_peft_writes_for_plain_lora_are_served_as_plain_lora(tiny_llama, lora_dirs, tmp_path, fields):
    """A target_modules entry names a module by its path or a dotted suffix of it (PEFT saves
    "all-linear" as full paths), and a bias setting that saved no bias is plain LoRA: the service
    and the pods refused both."""
    d = shutil.copytree(lora_dirs["a"], tmp_path / "a")
    base = base_model.load(tiny_llama.name)
    plain = _service_and_pod(d, {}, base, tiny_llama.config)
    assert _service_and_pod(d, fields, base, tiny_llama.config) == plain
    assert plain[0] == ["q_proj", "v_proj"]


@pytest.mark.parametrize("targets", [_PATHS, ["self_attn.q_proj", "v_proj"]])
def test_target_modules_that_leave_out_a_module_with_weights_are_refused(
    tiny_llama, lora_dirs, tmp_path, targets
):
    d = shutil.copytree(lora_dirs["a"], tmp_path / "a")
    without_v = {"target_modules": [t for t in targets if "v_proj" not in t]}
    with pytest.raises(validate.ValidationError, match="does not name 'v_proj'"):
        _service_and_pod(d, without_v, base_model.load(tiny_llama.name), tiny_llama.config)
    with pytest.raises(AdapterError, match="does not name 'v_proj'"):  # the config written above
        load_peft_adapter("a", d, tiny_llama.config, 64)
