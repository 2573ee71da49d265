"""The adapter service's parts without a cluster: validation, the placement policy, and both
stores and both registries against the same contract (S3 on moto's server, a real Redis)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from adapter_service import base_model, validate
from adapter_service.controller import Controller
from adapter_service.placement import (
    Knobs,
    PodView,
    choose_target,
    match_hints,
    replicas_for,
    to_cool,
    to_spread,
)
from adapter_service.popularity import Popularity
from adapter_service.registry import MemoryRegistry, RedisRegistry
from adapter_service.store import PROBE_SECONDS, LocalStore, S3Store, Version
from spindle.safetensors_header import header_length
from spindle.v1 import adapters_pb2 as apb
from spindle.v1 import model_control_pb2 as mc
from spindle.v1 import model_control_pb2_grpc
from tests.adapter_helpers import aws_env
from tests.service_helpers import free_port

ROOT = Path(__file__).resolve().parents[1]
PIRATE = ROOT / "adapters" / "smollm2-pirate"


@pytest.fixture(scope="module")
def smol() -> base_model.BaseModel:
    return base_model.load("smollm2-135m-instruct")


def _safetensors(tensors: dict[str, tuple[list[int], int]]) -> bytes:
    """A float32 safetensors file of zeros: {name: (shape, n_elements)}."""
    header, offset = {}, 0
    for name, (shape, n) in tensors.items():
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + 4 * n]}
        offset += 4 * n
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + b"\0" * offset


def _lora(rank: int, module: str = "q_proj", fan_in: int = 576, fan_out: int = 576, layer: int = 0) -> bytes:
    prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
    return _safetensors(
        {
            f"{prefix}.lora_A.weight": ([rank, fan_in], rank * fan_in),
            f"{prefix}.lora_B.weight": ([fan_out, rank], fan_out * rank),
        }
    )


CONFIG = json.dumps({"peft_type": "LORA", "r": 8, "target_modules": ["q_proj"]}).encode()


def _check(
    tmp_path: Path, data: bytes, base: base_model.BaseModel, config: bytes = CONFIG, max_rank: int = 64
):
    f = tmp_path / "w.safetensors"
    f.write_bytes(data)
    return validate.validate(config, f, base, max_rank)


def test_an_alias_has_the_shapes_of_its_gguf_file(smol):
    from model_service.models.loader import resolve_model_path

    from_file = base_model.load(str(resolve_model_path("smollm2-135m-instruct")))
    assert dataclasses.replace(from_file, name=smol.name) == smol


def test_the_shipped_adapter_fits_smollm2_without_torch(smol):
    summary = validate.validate(
        (PIRATE / "adapter_config.json").read_bytes(), PIRATE / "adapter_model.safetensors", smol, 64
    )
    assert (summary.rank, summary.target_modules) == (8, ["q_proj", "v_proj"])


@pytest.mark.parametrize(
    ("data", "config", "words"),
    [
        (b"\x80\x04\x95" + b"\0" * 64, CONFIG, "pickle"),
        (b"PK\x03\x04" + b"\0" * 64, CONFIG, "pickle"),
        (struct.pack("<Q", 1 << 40) + b"{}", CONFIG, "header"),
        (_lora(8, fan_in=1024), CONFIG, "another base model"),
        (_lora(8, module="v_proj", fan_out=576), CONFIG, "another base model"),  # v_proj is 576 -> 192
        (_lora(8, layer=30), CONFIG, "layer 30"),
        (_lora(128), CONFIG, "above the limit 64 (--max-lora-rank)"),
        (  # the refusal names the base the author trained on
            _lora(8, fan_in=960),
            json.dumps({"r": 8, "base_model_name_or_path": "HuggingFaceTB/SmolLM2-360M-Instruct"}).encode(),
            "names base model 'HuggingFaceTB/SmolLM2-360M-Instruct'",
        ),
        (_lora(8), b"not json", "not valid JSON"),
        (_lora(8), json.dumps({"target_modules": ["embed_tokens"]}).encode(), "embed_tokens"),
        (_lora(8), json.dumps({"use_dora": True}).encode(), "DoRA"),
        (_lora(8), json.dumps({"alora_invocation_tokens": [9, 64]}).encode(), "Activated LoRA"),
        (_lora(8), json.dumps({"init_lora_weights": "pissa"}).encode(), "path_initial_model"),
        (_safetensors({"model.layers.0.mlp.up_proj.weight": ([4], 4)}), CONFIG, "not a LoRA"),
        (_safetensors({}), CONFIG, "no LoRA weights"),
    ],
)
def test_bad_adapters_are_refused_with_the_reason(tmp_path, smol, data, config, words):
    with pytest.raises(validate.ValidationError) as e:
        _check(tmp_path, data, smol, config)
    assert words in str(e.value)


@pytest.mark.parametrize("init", [True, False, "gaussian", "mica", "eva", "lora_ga", "orthogonal"])
def test_an_init_that_leaves_the_base_alone_is_served(tmp_path, smol, init):
    """`init_lora_weights` only shapes training unless the init rewrote the base (PiSSA, OLoRA,
    CorDA, LoftQ: refused above): PEFT loads these on the unchanged base as plain LoRA."""
    config = json.dumps({"r": 8, "target_modules": ["q_proj"], "init_lora_weights": init}).encode()
    assert _check(tmp_path, _lora(8), smol, config).rank == 8


def test_a_header_of_640_bytes_is_not_taken_for_a_pickle(tmp_path, smol):
    """Its length's low byte is 0x80, as a pickle's first byte is (seen: a tiny random adapter
    refused as a pickle by every pod: `header_length` is the service's and the engine's reader)."""
    good = _lora(8)
    n = struct.unpack("<Q", good[:8])[0]
    text = good[8 : 8 + n].ljust(0x280)  # JSON may end in spaces, as safetensors pads it
    padded = struct.pack("<Q", len(text)) + text + good[8 + n :]
    assert padded[:1] == b"\x80" and header_length(padded[:8], len(padded)) == 0x280
    assert _check(tmp_path, padded, smol).rank == 8


def test_a_header_that_lies_about_offsets_is_refused(tmp_path, smol):
    good = _lora(8)
    n = struct.unpack("<Q", good[:8])[0]
    header = json.loads(good[8 : 8 + n])
    next(iter(header.values()))["data_offsets"] = [0, 10 << 20]
    text = json.dumps(header).encode()
    with pytest.raises(validate.ValidationError, match="lies"):
        _check(tmp_path, struct.pack("<Q", len(text)) + text + good[8 + n :], smol)
    assert _check(tmp_path, good, smol).rank == 8


@pytest.mark.parametrize(
    "name", ["", "../x", "a/b", "a\\b", ".hidden", "a" * 129, "x\0y", "a..b", "@active", "a\n"]
)
def test_unsafe_names_are_refused(name):
    with pytest.raises(validate.ValidationError):
        validate.check_name(name)


def test_hf_config_dirs_give_the_projection_shapes(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            }
        )
    )  # fmt: skip
    shapes = base_model.load(str(tmp_path)).projection_shapes()
    assert shapes["q_proj"] == (64, 64) and shapes["k_proj"] == (64, 32) and shapes["down_proj"] == (128, 64)


def _gguf(path: Path, arch: str, meta: dict, tensors: tuple[str, ...] = ()) -> str:
    """A GGUF file of a 2-layer base (64 wide, 4 heads of 16, FFN 128) plus `meta` (a list: a
    per-layer array, as llama.cpp's converter writes for a model whose layers differ), and a zero
    token embedding plus `tensors` (4 x 64 zeros each)."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch=arch)
    fields = {"embedding_length": 64, "block_count": 2, "feed_forward_length": 128, "attention.head_count": 4}
    for key, value in {**fields, **meta}.items():
        add = {list: writer.add_array, str: writer.add_string}.get(type(value), writer.add_uint32)
        add(f"{arch}.{key}", value)
    for name in ("token_embd.weight", *tensors):
        writer.add_tensor(name, np.zeros((32, 64) if name == "token_embd.weight" else (4, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_a_gguf_base_with_per_layer_arrays_gives_its_shapes(tmp_path):
    """llama.cpp writes head counts and FFN widths as per-layer arrays; whose layers agree, the
    pods load (was a raw TypeError here: `--base-model` ended the service in a traceback)."""
    meta = {
        "attention.head_count": [4, 4],
        "attention.head_count_kv": [2, 2],
        "feed_forward_length": [128, 128],
    }
    base = base_model.load(_gguf(tmp_path / "m.gguf", "llama", meta))
    assert (base.num_heads, base.num_kv_heads, base.intermediate_size) == (4, 2, 128)
    shapes = base.projection_shapes()
    assert shapes["q_proj"] == (64, 64) and shapes["k_proj"] == (64, 32) and shapes["down_proj"] == (128, 64)


def test_a_gguf_base_is_read_without_torch(tmp_path):
    """The service's image has no torch: the GGUF rules it shares with the pods must not need it."""
    path = _gguf(tmp_path / "m.gguf", "llama", {"attention.head_count": [4, 4]})
    code = (
        f"import sys; from adapter_service import base_model; base_model.load({path!r}); "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    ("arch", "meta", "tensors", "named"),
    [
        ("gpt2", {}, (), "GGUF architecture 'gpt2' is not supported"),
        ("gemma3", {}, (), "GGUF architecture 'gemma3' is not supported"),
        ("llama", {"attention.head_count_kv": [2, 4]}, (), "'llama.attention.head_count_kv' differs"),
        ("llama", {"rope.scaling.type": "yarn"}, (), "RoPE scaling (yarn)"),
        ("llama", {}, ("blk.0.ffn_gate_exps.weight",), "['blk.0.ffn_gate_exps.weight']"),
    ],
    ids=["architecture", "gemma", "layers-differ", "rope-scaling", "mixtral-experts"],
)
def test_a_gguf_base_the_pods_refuse_is_refused_naming_why(tmp_path, arch, meta, tensors, named):
    """The service read any architecture's shapes, and no RoPE or tensor rule, so adapters were
    accepted for a base no pod can serve; it now refuses by the pods' own rules, with their words."""
    from model_service.errors import ModelLoadError
    from model_service.models.gguf_weights import read_gguf

    path = _gguf(tmp_path / "m.gguf", arch, meta, tensors)
    with pytest.raises(ValueError) as service:
        base_model.load(path)
    with pytest.raises(ModelLoadError) as pod:
        read_gguf(Path(path))
    assert named in str(service.value) and str(service.value) == str(pod.value)


# --- DeepSeek (MLA) bases: what the pods accept, refused where they refuse ----------------------

# Small DeepSeek-V2-Lite- and V3-shaped config.json files: MLA (no q_lora_rank / a q_lora_rank),
# one dense layer then MoE layers, as tests/test_deepseek.py's tiny checkpoints.
_DEEPSEEK = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8, "v_head_dim": 12, "first_k_dense_replace": 1, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "moe_intermediate_size": 24, "n_shared_experts": 1,
}  # fmt: skip
V2_LITE = {**_DEEPSEEK, "architectures": ["DeepseekV2ForCausalLM"], "q_lora_rank": None}
V3 = {
    **_DEEPSEEK,
    "architectures": ["DeepseekV3ForCausalLM"],
    "q_lora_rank": 24,
    "n_group": 4,
    "topk_group": 2,
}
_MLP = {"gate_proj", "up_proj", "down_proj"}


def _config_dir(path: Path, raw: dict) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw))
    return str(path)


def _pairs(modules: list[tuple[int, str, int, int]], rank: int = 4) -> bytes:
    """A PEFT safetensors file of zeros with A and B for each (layer, module, in, out)."""
    tensors = {}
    for layer, module, fan_in, fan_out in modules:
        prefix = f"base_model.model.model.layers.{layer}.{'mlp' if module in _MLP else 'self_attn'}.{module}"
        tensors[f"{prefix}.lora_A.weight"] = ([rank, fan_in], rank * fan_in)
        tensors[f"{prefix}.lora_B.weight"] = ([fan_out, rank], fan_out * rank)
    return _safetensors(tensors)


def _peft_config(targets: list[str], rank: int = 4) -> bytes:
    return json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 8, "target_modules": targets}).encode()


@pytest.mark.parametrize(
    ("raw", "attention"),
    [
        (V2_LITE, {"kv_a_proj_with_mqa": (64, 40), "q_proj": (64, 96), "o_proj": (48, 64)}),
        (
            V3,
            {"kv_a_proj_with_mqa": (64, 40), "q_a_proj": (64, 24), "q_b_proj": (24, 96), "o_proj": (48, 64)},
        ),
    ],
    ids=["v2-lite", "v3"],
)
def test_deepseek_config_dirs_give_the_mla_shapes(tmp_path, raw, attention):
    """Each head's query is qk_nope + qk_rope = 24 wide (4 heads: 96); kv_a_proj_with_mqa writes the
    32-wide latent and the 8-wide rotary key; o_proj reads v_head_dim 12 per head; the dense MLP is
    intermediate_size wide; no kv_b_proj; layer 0 dense (first_k_dense_replace), 1 and 2 MoE."""
    base = base_model.load(_config_dir(tmp_path, raw))
    mlp = {"gate_proj": (64, 96), "up_proj": (64, 96), "down_proj": (96, 64)}
    assert base.projection_shapes() == attention | mlp
    assert base.moe_layers == (1, 2)


@pytest.mark.parametrize("raw", [V2_LITE, V3], ids=["v2-lite", "v3"])
def test_an_mla_adapter_is_accepted_and_kv_b_proj_and_moe_mlp_refused(tmp_path, raw):
    base = base_model.load(_config_dir(tmp_path / "base", raw))
    shapes = base.projection_shapes()
    attention = [m for m in shapes if m not in _MLP]
    good = [(layer, m, *shapes[m]) for layer in (0, 2) for m in attention] + [
        (0, "gate_proj", *shapes["gate_proj"])
    ]
    summary = _check(tmp_path, _pairs(good), base, _peft_config([*attention, "gate_proj"]))
    assert (summary.rank, summary.target_modules) == (4, sorted([*attention, "gate_proj"]))

    kv_b = _pairs([(0, "kv_b_proj", 32, 4 * (16 + 12))])
    with pytest.raises(validate.ValidationError, match=r"kv_b_proj.*decompresses the cached latents"):
        _check(tmp_path, kv_b, base, _peft_config(["o_proj", "kv_b_proj"]))  # refused by its config...
    with pytest.raises(validate.ValidationError, match="decompresses the cached latents") as e:
        _check(tmp_path, kv_b, base, _peft_config(["kv_a_proj_with_mqa"]))  # ...and by its tensor
    assert "kv_a_proj_with_mqa" in str(e.value)  # the valid names, for the author
    with pytest.raises(
        validate.ValidationError, match=r"'k_proj'.*LoRA targets on this base model: kv_a_proj"
    ):
        _check(tmp_path, _pairs(good), base, _peft_config(["k_proj"]))  # Llama names on an MLA base

    moe_mlp = _pairs([(1, "up_proj", *shapes["up_proj"])])
    with pytest.raises(
        validate.ValidationError, match=r"layer 1, a mixture-of-experts layer.*dense layers: 0\)$"
    ):
        _check(tmp_path, moe_mlp, base, _peft_config(["up_proj"]))
    # One expert's, the stacked experts' (transformers 5), DeepSeek's and Qwen's shared experts'
    for part in (
        "experts.3.gate_proj",
        "experts.base_layer",
        "shared_experts.gate_proj",
        "shared_expert.gate_proj",
    ):
        experts = _safetensors(
            {f"base_model.model.model.layers.1.mlp.{part}.lora_{ab}.weight": ([4], 4) for ab in "AB"}
        )
        with pytest.raises(validate.ValidationError, match="mixture-of-experts experts"):
            _check(tmp_path, experts, base, _peft_config(["gate_proj"]))


def _pod_config(raw: dict):
    from model_service.models.config import ModelConfig

    return ModelConfig.from_hf(raw)


_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
}  # fmt: skip
_BASES = {
    "v2-lite": V2_LITE,
    "v3": V3,
    "v3-moe-layer-freq": {**V3, "num_hidden_layers": 6, "moe_layer_freq": 2, "first_k_dense_replace": 2},
    "llama": _LLAMA,
    "mixtral": {**_LLAMA, "architectures": ["MixtralForCausalLM"], "num_local_experts": 4,
                "num_experts_per_tok": 2},
    "qwen3-moe": {**_LLAMA, "architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 4,
                  "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "decoder_sparse_step": 2, "mlp_only_layers": [3]},
}  # fmt: skip


@pytest.mark.parametrize("raw", list(_BASES.values()), ids=list(_BASES))
def test_the_service_and_the_pod_agree_on_a_base(tmp_path, raw):
    """The same config.json gives the pod's `module_shapes` and MoE layers and the service's, and an
    adapter on every projection of every layer is refused by both or accepted by both (the pod
    loads it from disk as a registration would)."""
    from model_service.lora.adapter import AdapterError, load_peft_adapter, module_shapes

    cfg, base = _pod_config(raw), base_model.load(_config_dir(tmp_path / "base", raw))
    shapes = base.projection_shapes()
    assert module_shapes(cfg) == shapes
    assert tuple(i for i, k in enumerate(cfg.layer_kinds) if k.moe) == base.moe_layers
    for layer in range(base.num_layers):
        for module in [*shapes, "kv_b_proj"]:
            fan_in, fan_out = shapes.get(module, (32, 112))
            adapter = tmp_path / f"{layer}-{module}"
            adapter.mkdir()
            (adapter / "adapter_config.json").write_bytes(_peft_config([module]))
            (adapter / "adapter_model.safetensors").write_bytes(_pairs([(layer, module, fan_in, fan_out)]))
            try:
                validate.validate(
                    _peft_config([module]),
                    adapter / "adapter_model.safetensors",
                    dataclasses.replace(base),
                    8,
                )
                service = None
            except validate.ValidationError as e:
                service = str(e)
            try:
                load_peft_adapter("a", adapter, cfg, max_lora_rank=8)
                pod = None
            except AdapterError as e:
                pod = str(e)
            assert (service is None) == (pod is None), (layer, module, service, pod)
            assert (pod is None) == (module in shapes and not (module in _MLP and layer in base.moe_layers))


# --- the placement policy -------------------------------------------------------------------------


def _view(address: str, slots: list[tuple[str, int, bool]], adapters: dict[str, tuple[int, int]]) -> PodView:
    """slots: (adapter, refcount, pinned); adapters: name -> (tier, refcount)."""
    return PodView(
        address,
        ok=True,
        slots=[mc.Slot(index=i, adapter=a, refcount=r, pinned=p) for i, (a, r, p) in enumerate(slots)],
        adapters={
            n: mc.AdapterState(name=n, tier=t, refcount=r, sha256="s") for n, (t, r) in adapters.items()
        },
    )


def test_target_prefers_room_then_the_shorter_queue():
    free = _view("p1:1", [("", 0, False)], {})
    idle = _view("p2:1", [("x", 0, False)], {"x": (mc.TIER_DEVICE, 0)})
    busy = _view("p3:1", [("y", 2, False)], {"y": (mc.TIER_DEVICE, 2)})
    for hot in (False, True):
        assert choose_target([busy, idle, free], "a", "s", None, hot).address == "p1:1"
    hints = match_hints(
        [busy, idle, free],
        [
            apb.PodHint(address="p1:1", num_waiting=9),
            apb.PodHint(address="p2:1"),
            apb.PodHint(address="p3:1"),
        ],
    )
    assert choose_target([busy, idle, free], "a", "s", hints, hot=True).address == "p2:1"
    holder = _view("p4:1", [("a", 0, False)], {"a": (mc.TIER_DEVICE, 0)})
    assert choose_target([holder], "a", "s", None) is None  # already there


def test_tail_adapters_go_to_the_pod_with_the_fewest_adapters():
    """AIBrix's least-adapters: a tail adapter goes where the fewest adapters are (any tier),
    whatever the room and queue; ties by room + queue + KV. A hot one goes by load first."""
    crowded = _view(
        "p1:1", [("", 0, False)], {"x": (mc.TIER_HOST, 0), "y": (mc.TIER_DISK, 0), "z": (mc.TIER_DISK, 0)}
    )
    sparse = _view("p2:1", [("w", 0, False)], {"w": (mc.TIER_DEVICE, 0)})
    tie = _view("p3:1", [("v", 0, False)], {"v": (mc.TIER_DEVICE, 0)})
    hints = match_hints(
        [crowded, sparse, tie],
        [
            apb.PodHint(address="p1:1"),
            apb.PodHint(address="p2:1", num_waiting=4),
            apb.PodHint(address="p3:1"),
        ],
    )
    assert (
        choose_target([crowded, sparse, tie], "a", "s", hints).address == "p3:1"
    )  # 1 adapter, shorter queue
    assert choose_target([crowded, sparse, tie], "a", "s", hints, hot=True).address == "p1:1"  # a free slot


def test_popularity_is_each_adapters_share_of_recent_requests():
    pop = Popularity(half_life=10.0)
    pop.observe("p", {"a": 30, "b": 10})
    pop.observe("q", {"a": 0, "b": 10})
    pop.decay(0.0)
    assert pop.shares() == {"a": 0.6, "b": 0.4}
    pop.observe("p", {"a": 30, "b": 10})  # nothing new
    assert pop.shares() == {"a": 0.6, "b": 0.4}
    pop.decay(10.0)  # one half-life: the old counts weigh half
    pop.observe("p", {"a": 30, "b": 25})  # 15 new for b
    assert pop.shares() == {"a": 15 / 40, "b": 25 / 40}
    pop.observe("p", {"a": 2, "b": 25})  # p restarted: its 2 requests for a are new
    assert pop.weight["a"] == 17
    pop.forget_pod("p")  # gone: its next appearance counts from zero
    pop.observe("p", {"a": 1})
    assert pop.weight["a"] == 18 and pop.share("c") == 0.0
    pop.decay(1000.0)  # everything forgotten
    assert pop.shares() == {}


def test_hot_adapters_get_replicas_in_proportion_to_their_share():
    knobs = Knobs(hot_share=0.02, max_replicas=4)
    assert [replicas_for(s, knobs) for s in (0.0, 0.01, 0.02, 0.021, 0.05, 0.5)] == [1, 1, 1, 2, 3, 4]
    views = [_view(f"p{i}:1", [("", 0, False)], {}) for i in range(6)]
    for name, holders in (("head", 1), ("second", 2), ("tail", 1)):
        for v in views[:holders]:
            v.adapters[name] = mc.AdapterState(name=name, tier=mc.TIER_DEVICE, sha256="s")
    latest = {"head": "s", "second": "s", "tail": "s", "unplaced": "s"}
    shares = {"head": 0.1, "second": 0.05, "tail": 0.001, "unplaced": 0.2}
    # head belongs on 4 pods, second on 3; the tail stays on one; one nobody holds is placed on demand
    assert to_spread(views, latest, shares, knobs) == ["head", "second"]
    for v in views[:3]:
        v.adapters["second"] = mc.AdapterState(name="second", tier=mc.TIER_DEVICE, sha256="s")
    assert to_spread(views, latest, shares, knobs) == ["head"]


class _FakePod(model_control_pb2_grpc.ModelControlServicer):
    """A pod's control API with one device slot: what placement asks of a pod, and no engine."""

    def __init__(self) -> None:
        self.adapters: dict[str, mc.AdapterState] = {}

    async def GetSlots(self, request, context):
        names = [n for n, a in self.adapters.items() if a.tier == mc.TIER_DEVICE]
        return mc.SlotReport(slots=[mc.Slot(index=0, adapter=names[0] if names else "")],
                             adapters=list(self.adapters.values()))  # fmt: skip

    async def PromoteFromPeer(self, request, context):
        self.adapters[request.name] = mc.AdapterState(
            name=request.name, tier=mc.TIER_HOST, sha256=request.sha256
        )
        return self.adapters[request.name]

    async def LoadAdapter(self, request, context):
        self.adapters[request.name].tier = mc.TIER_DEVICE
        return mc.SlotChange(slot=0, adapter=self.adapters[request.name])


def test_a_pod_that_comes_up_between_polls_can_take_an_adapter(tmp_path):
    """The quickstart's failure: the service's first poll came before the pod served, and a
    placement right after start-up was refused as '0 of 1 reachable' until the next poll."""
    address = f"127.0.0.1:{free_port()}"

    async def go() -> None:
        registry = MemoryRegistry()
        controller = Controller(
            registry, LocalStore(tmp_path), discover=lambda: asyncio.sleep(0, [address]),
            advertise="127.0.0.1:1", poll_interval=60.0,
        )  # fmt: skip
        await controller.start()  # nothing listens yet: the pod is down in its view
        assert [w.ok for w in controller.views()] == [False]
        await registry.put(Version("a", 1, "sha-a", 10, 8, ["q_proj"], "m", time.time()))
        server = grpc.aio.server()
        model_control_pb2_grpc.add_ModelControlServicer_to_server(_FakePod(), server)
        server.add_insecure_port(address)
        await server.start()
        try:
            placed = await controller.place("a", [])
            assert list(placed.pods) == [address] and placed.source == "storage"
            assert controller.views()[0].adapters["a"].tier == mc.TIER_DEVICE
        finally:
            await controller.close()
            await server.stop(None)

    asyncio.run(go())


def test_gateway_addresses_map_to_control_addresses_by_pod_ip():
    views = [_view("10.0.0.1:50053", [], {}), _view("10.0.0.2:50053", [], {})]
    hints = match_hints(views, [apb.PodHint(address="10.0.0.2:50052", num_waiting=3)])
    assert list(hints) == ["10.0.0.2:50053"] and hints["10.0.0.2:50053"].num_waiting == 3
    assert match_hints(views, []) is None


def test_cooling_never_touches_what_is_in_use_or_pinned():
    knobs = Knobs(slot_idle_seconds=10, host_idle_seconds=20, disk_idle_seconds=30)
    views = [
        _view(
            "p:1",
            [("busy", 1, False), ("idle", 0, False), ("pinned", 0, True)],
            {
                "busy": (mc.TIER_DEVICE, 1), "idle": (mc.TIER_DEVICE, 0), "pinned": (mc.TIER_DEVICE, 0),
                "cold": (mc.TIER_HOST, 0), "kept": (mc.TIER_HOST, 0),
            },
        )
    ]  # fmt: skip
    views[0].adapters["pinned"].pinned = True
    idle: dict = {}
    assert to_cool(views, idle, {"kept"}, 0.0, knobs) == []  # clocks start
    out = to_cool(views, idle, {"kept"}, 10.0, knobs)
    assert [(e.name, e.leaves) for e in out] == [("idle", "device")]
    views[0].adapters["idle"].tier = mc.TIER_HOST  # as the next poll reports it
    out = to_cool(views, idle, {"kept"}, 20.0, knobs)
    assert [(e.name, e.leaves) for e in out] == [("cold", "host")]
    views[0].adapters["cold"].tier = mc.TIER_DISK
    out = to_cool(views, idle, {"kept"}, 50.0, knobs)  # "cold" forgotten: only storage keeps it
    assert [(e.name, e.leaves) for e in out] == [("idle", "host"), ("cold", "disk")]
    request = out[1].request()
    assert request.from_disk and request.from_host


def test_busy_adapters_spread_up_to_the_replica_limit():
    hot = [_view("p:1", [("a", 9, False)], {"a": (mc.TIER_DEVICE, 9)}), _view("q:1", [("", 0, False)], {})]
    assert to_spread(hot, {"a": "s"}, {}, Knobs(spread_threshold=8)) == ["a"]
    assert to_spread(hot, {"a": "s"}, {}, Knobs(spread_threshold=10)) == []
    assert to_spread(hot, {"a": "s"}, {}, Knobs(spread_threshold=8, max_replicas=1)) == []


# --- stores and registries: one contract, both implementations -----------------------------------


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path, monkeypatch):
    if request.param == "local":
        return LocalStore(tmp_path / "store")
    s3 = request.getfixturevalue("s3")
    for k, v in aws_env().items():
        monkeypatch.setenv(k, v)
    return S3Store(s3.bucket, f"unit-{time.monotonic_ns()}/", s3.endpoint, "us-east-1")


def test_an_s3_health_check_into_a_silent_endpoint_ends_within_its_own_bounds(monkeypatch):
    """An endpoint that accepts connections and never answers (a frozen S3): the check fails in
    about PROBE_SECONDS, one attempt, not the data path's ~40 s of retried reads, so the worker
    threads that the service's 2 s health wait leaves behind end soon and cannot pile up."""
    for k, v in aws_env().items():
        monkeypatch.setenv(k, v)
    silent = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    accepting = threading.Thread(target=lambda: held.append(silent.accept()[0]), daemon=True)
    accepting.start()
    store = S3Store("b", "p/", f"http://127.0.0.1:{silent.getsockname()[1]}", "us-east-1")
    start = time.monotonic()
    with pytest.raises(Exception, match=r"(?i)timeout|timed out"):
        asyncio.run(store.check())
    assert time.monotonic() - start < 2 * PROBE_SECONDS + 1.0
    accepting.join(5)
    for conn in [*held, silent]:
        conn.close()


def _version(name: str, n: int) -> Version:
    return Version(name, n, f"sha{n}", 4, 8, ["q_proj"], "base", 0.0)


def test_store_versions_multipart_pins_removal_and_no_half_writes(store, tmp_path):
    weights = tmp_path / "w"
    weights.write_bytes(b"abcd")

    async def go() -> None:
        await store.check()
        await store.put(_version("a", 1), b"{}", weights)
        await store.put(_version("a", 2), b'{"r": 8}', weights)
        big = tmp_path / "big"  # above the 8 MiB multipart threshold of the S3 store
        big.write_bytes(bytes(range(256)) * (36 << 10))
        await store.put(_version("b", 1), b"{}", big)
        assert (await store.read("b", 1))[1] == big.read_bytes()
        assert [(v.name, v.version) for v in await store.versions()] == [("a", 1), ("a", 2), ("b", 1)]
        assert await store.read("a", 2) == (b'{"r": 8}', b"abcd")
        await store.set_pinned("a", True)
        assert [v.pinned for v in await store.versions("a")] == [True, True]
        await store.put(_version("a", 10), b"{}", weights)  # v000010 sorts above v000002
        latest = [(v.name, v.version, v.pinned) for v in await store.versions(latest=True)]
        assert latest == [("a", 10, True), ("b", 1, False)]
        assert [v.version for v in await store.versions("a", latest=True)] == [10]
        assert await store.versions("c", latest=True) == []
        assert await store.remove("a") == 3
        assert [v.name for v in await store.versions()] == ["b"]
        original = store._write

        def failing(key: str, data):  # storage fails at the commit mark: nothing may remain
            if key.endswith("meta.json"):
                raise OSError("disk full")
            original(key, data)

        store._write = failing
        with pytest.raises(OSError):
            await store.put(_version("c", 1), b"{}", weights)
        assert store._keys("c/") == []

    asyncio.run(go())


@pytest.fixture(params=["memory", "redis"])
def registry_factory(request):
    if request.param == "memory":
        return MemoryRegistry
    url = request.getfixturevalue("redis_url")

    def make():
        return RedisRegistry(url)

    import redis

    redis.Redis.from_url(url).flushall()
    return make


def test_registry_index_leases_and_bounded_staging(registry_factory):
    async def go() -> None:
        reg = registry_factory()
        await reg.check()
        assert not await reg.is_built()
        await reg.rebuild([_version("a", 1), _version("a", 2), _version("b", 1)])
        assert await reg.is_built() and (await reg.get("a")).version == 2
        built = await reg.generation()
        await reg.put(_version("c", 1))
        assert built is not None and await reg.generation() not in (None, built)  # the index changed
        assert set(await reg.get_many(["a", "c", "x"])) == {"a", "c"}
        assert [v.name for v in await reg.page("", 2)] == ["a", "b"]
        assert [v.name for v in await reg.page("b", 2)] == ["c"]
        await reg.lease("a", "pod1", {"tier": 3}, ttl=0.3)
        await reg.lease("a", "pod2", {"tier": 2}, ttl=30)
        assert set(await reg.leases("a")) == {"pod1", "pod2"}
        await reg.lease_many("pod3", {"a": {"tier": 1}, "b": {"tier": 3}}, ttl=30)  # one poll's
        await asyncio.sleep(0.4)
        assert await reg.leases("a") == {"pod2": {"tier": 2}, "pod3": {"tier": 1}}  # pod1 stopped
        assert await reg.leases("b") == {"pod3": {"tier": 3}} and await reg.leases("c") == {}
        await reg.stage("x", b"1" * 60, max_total=100)
        await reg.stage("y", b"2" * 60, max_total=100)  # over the bound: the oldest goes
        await reg.stage("z", b"3" * 200, max_total=100)  # too big to stage at all
        assert (await reg.staged("x"), await reg.staged("y"), await reg.staged("z")) == (
            None,
            b"2" * 60,
            None,
        )
        before = await reg.generation()
        await reg.remove("a")
        assert await reg.get("a") is None and await reg.leases("a") == {}
        assert await reg.generation() != before

    asyncio.run(go())


@pytest.mark.parametrize("corrupted", ["staging", "storage"])
def test_a_corrupted_copy_of_the_weights_is_never_sent_to_a_pod(registry_factory, tmp_path, corrupted):
    """A staged copy that does not hash to the registered sha256 went to every pod that asked
    (each refused it, so the adapter could not be placed anywhere); it is now replaced from
    storage. A corrupted stored copy is refused, naming the adapter, its version and the fix."""
    from adapter_service.controller import PlacementError

    data = _lora(4)
    v = dataclasses.replace(_version("a", 1), sha256=hashlib.sha256(data).hexdigest())
    weights = tmp_path / "w"
    weights.write_bytes(data)
    store = LocalStore(tmp_path / "store")
    bad = data[:-1] + b"\1"

    async def go() -> None:
        c = Controller(registry_factory(), store, discover=lambda: asyncio.sleep(0, []), advertise="x:1")
        await c.registry.rebuild([v])
        await store.put(v, CONFIG, weights)
        await c.stage(v.sha256, CONFIG, bad)
        if corrupted == "storage":
            (tmp_path / "store" / "a" / "v000001" / "adapter_model.safetensors").write_bytes(bad)
            with pytest.raises(PlacementError, match=r"'a' version 1 .* register the adapter again") as e:
                await c.weights("a")
            assert e.value.code == grpc.StatusCode.DATA_LOSS
        else:
            assert (await c.weights("a"))[1:] == (data, v, "storage")
            assert (await c.weights("a"))[1:] == (data, v, "staging")  # staged again, intact
        await c.close()

    asyncio.run(go())


def _ipv6_only_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process as a pod of an IPv6 single-stack cluster sees itself: its name (in
    /etc/hosts) has an IPv6 address and no IPv4 one, so an IPv4 lookup of it fails."""
    def getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):
        if host != "pod-0" or family == socket.AF_INET:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("fd00:10:244::7", 0, 0, 0))]

    def gethostbyname(host):  # glibc's IPv4-only lookup of a name with an IPv6 address alone
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "gethostname", lambda: "pod-0")
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(socket, "gethostbyname", gethostbyname)


def test_the_advertised_address_on_an_ipv6_only_pod_is_its_bracketed_ipv6_address(monkeypatch):
    """The chart runs the service on the default --host 0.0.0.0 with no --advertise-address, so it
    advertised its host name's address as gethostbyname (IPv4 alone) found it: on an IPv6
    single-stack cluster that raised gaierror and the service exited at start, a traceback."""
    import argparse

    from adapter_service import server

    _ipv6_only_host(monkeypatch)
    for host in ("0.0.0.0", "::", ""):
        args = argparse.Namespace(advertise_address="", host=host)
        assert server._advertise(args, 50060) == "[fd00:10:244::7]:50060"
    args = argparse.Namespace(advertise_address="", host="fd00::9")
    assert server._advertise(args, 50060) == "[fd00::9]:50060"


def test_a_host_name_that_resolves_to_nothing_is_a_config_error_naming_advertise_address(monkeypatch):
    """Where the host's own name resolves to no address the service can say so, and which flag to
    give, in one line (it was a gaierror traceback)."""
    import argparse

    from adapter_service import server
    from spindle.errors import ConfigError

    _ipv6_only_host(monkeypatch)
    monkeypatch.setattr(socket, "gethostname", lambda: "nowhere")
    with pytest.raises(ConfigError, match="--advertise-address"):
        server._advertise(argparse.Namespace(advertise_address="", host="0.0.0.0"), 50060)
