"""Load and validate a PEFT LoRA adapter (`adapter_config.json` + `adapter_model.safetensors`).

Everything is checked against the base model before a byte reaches a GPU slot: module names,
layer indices and shapes, rank against `max_lora_rank`, and features this engine does not
run (DoRA, embedding LoRA, `modules_to_save`, bias). Each refusal names the file, tensor or
field, because the reader is the person who trained the adapter.

`adapter_id` is derived from the adapter's bytes (config + weights), not its name: the prefix
cache keys KV by it, so re-uploading different weights under the same name never reuses KV
computed with the old ones.

From disk, an adapter goes straight into its host form (`HostForm`: the slots' dtype, laid out
as the arena is, in a buffer reused from earlier adapters): the checks need only the safetensors
header, so each tensor is then converted once, from the file's bytes to its place in the packed
buffer, with no float32 copy of the whole adapter in between (lora/reading.py has why the file is
read and hashed as it is).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from model_service.errors import SpindleError
from model_service.kernels.lora import aligned_up, arena_views
from model_service.lora.buffers import HostBuffers
from model_service.lora.files import MAX_ADAPTER_BYTES, MAX_CONFIG_BYTES, read_regular
from model_service.lora.reading import WeightsFile, read_weights, sha256_of
from model_service.models.config import Mixer, ModelConfig
from spindle.architectures import FUSED_PROJECTION_FAMILIES, GATED_ATTENTION_FAMILIES
from spindle.peft import (
    EXPERTS_KEY,
    LINEAR_ATTENTION_KEY,
    MLP_MODULES,
    bias_refusal,
    declared_base,
    declared_mismatch,
    linear_attention_refusal,
    module_path,
    pattern_value,
    projection_shapes,
    target_refusal,
    unsupported_feature,
    untargetable,
)
from spindle.safetensors_header import HeaderError, TensorEntry, header_length, parse_header

_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$"
)

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
Key = tuple[int, str]  # (layer, PEFT module name)


class AdapterError(SpindleError, ValueError):
    """An adapter that cannot be served on this base model (INVALID_ARGUMENT / FAILED_PRECONDITION)."""


@dataclass
class LoraWeights:
    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out_features, rank]
    scaling: float


@dataclass
class LoraAdapter:
    name: str
    adapter_id: int
    path: Path | None
    modules: dict[Key, LoraWeights] = field(default_factory=dict)
    sha256: str = ""  # of adapter_model.safetensors: the identity peers and the adapter service check
    chunked: bytes = b""  # adapter_model.safetensors' chunked digest (lora/reading.py): adapter_id's input
    packed: torch.Tensor | None = None  # the host form's one buffer, of which the modules' A and B are views
    # `arena_layout` of the modules, set by `HostForm` while the modules are views of `packed` at
    # exactly those places (a load then copies `packed` whole, unchecked); None otherwise.
    packed_layout: tuple[list[tuple[int, int]], int] | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (to tensor-parallel ranks) as the packed buffer once and each view's place in
        it: pickle would write the whole buffer again for every view of it."""
        state = dict(self.__dict__)
        if self.packed is not None:
            place = functools.partial(_place, self.packed)
            state["modules"] = {k: (place(w.a), place(w.b), w.scaling) for k, w in self.modules.items()}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        packed = state.get("packed")
        if packed is not None:
            view = functools.partial(_view, packed)
            modules = state["modules"].items()
            state["modules"] = {k: LoraWeights(view(a), view(b), s) for k, (a, b, s) in modules}
        self.__dict__.update(state)

    @property
    def max_rank(self) -> int:
        return max((w.a.shape[0] for w in self.modules.values()), default=0)

    @property
    def numel(self) -> int:
        """Elements of its extent in the adapter arena (lora/arena.py): `arena_layout`'s."""
        return self.layout[1]

    @property
    def layout(self) -> tuple[list[tuple[int, int]], int]:
        """`arena_layout` of its modules (computed once by `HostForm`: 224 modules on the 8B shape)."""
        return self.packed_layout or arena_layout(self.modules)

    @property
    def nbytes(self) -> int:
        return sum(
            w.a.numel() * w.a.element_size() + w.b.numel() * w.b.element_size() for w in self.modules.values()
        )


def in_buffer(t: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether `t` is a view of `packed` (a sharded copy of a module is not)."""
    return t.untyped_storage().data_ptr() == packed.untyped_storage().data_ptr()


# Where a view lies in its packed buffer (offset, shape, stride), or a tensor outside it.
Place = tuple[int, tuple[int, ...], tuple[int, ...]] | torch.Tensor


def _place(packed: torch.Tensor, t: torch.Tensor) -> Place:
    if not in_buffer(t, packed):
        return t
    return t.storage_offset() - packed.storage_offset(), tuple(t.shape), tuple(t.stride())


def _view(packed: torch.Tensor, place: Place) -> torch.Tensor:
    if isinstance(place, torch.Tensor):
        return place
    offset, shape, stride = place
    return packed.as_strided(shape, stride, packed.storage_offset() + offset)


def arena_layout(modules: dict[Key, LoraWeights]) -> tuple[list[tuple[int, int]], int]:
    """Where each module's A and B start, relative to the adapter's start, and the elements it
    takes, as the adapter arena holds it (kernels/lora.py's `AdapterTable`): modules in order,
    A [rank, in] then B [out, rank] with rows `aligned_up(rank)` apart (zeros between), each
    start aligned. The host copy (`HostForm`) is laid out the same, so a load is one transfer."""
    places, cursor = [], 0
    for w in modules.values():
        a = cursor
        b = aligned_up(a + w.a.numel())
        places.append((a, b))
        cursor = aligned_up(b + w.b.shape[0] * aligned_up(w.b.shape[1]))
    return places, cursor


def laid_out(packed: torch.Tensor, w: LoraWeights, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of `w`'s A and B at their places (`arena_layout`) in the 1-D buffer `packed`."""
    (rank, in_features), out = w.a.shape, w.b.shape[0]
    views = arena_views(packed, (a, b, rank), in_features, out)
    assert views is not None, "an adapter module has rank >= 1"
    return views


@dataclass(frozen=True)
class HostForm:
    """The copy a pool keeps in host memory: every module's A and B, in the slots' dtype, packed
    into one buffer (`packed`; the modules are views of it) laid out as the arena is, from
    `buffers` (page-locked for slots on a GPU). A slot load is then one asynchronous transfer of
    the whole adapter and a few batched device copies, with nothing cast on the engine thread,
    which every step waits for: float32 pageable copies, tensor by tensor, held it 38.9 ms a
    load on the 8B shape (rank 16, all seven projections), page-locked ones 17.9
    (docs/performance-notes.md, session k). Adapters read from disk are converted into this
    form directly (`load_peft_adapter`); calling it packs an adapter made in memory."""

    dtype: torch.dtype
    buffers: HostBuffers

    def __call__(self, adapter: LoraAdapter) -> LoraAdapter:
        return dataclasses.replace(adapter, **self.pack(adapter.modules))

    def pack(self, modules: dict[Key, LoraWeights]) -> dict[str, Any]:
        """The `packed`, `packed_layout` and `modules` of an adapter of these modules (their A
        and B of any dtype: each converted by its one copy into place)."""
        places, size = arena_layout(modules)
        packed = self.buffers.take(size, self.dtype)
        held = {}
        for (key, w), (a, b) in zip(modules.items(), places, strict=True):
            a_view, b_view = laid_out(packed, w, a, b)
            a_view.copy_(w.a)
            b_view.copy_(w.b)
            rank, stride = w.b.shape[1], aligned_up(w.b.shape[1])
            if stride > rank:  # the kernels read B's padding columns: zeros (the buffer is reused)
                packed[b : b + w.b.shape[0] * stride].view(-1, stride)[:, rank:].zero_()
            held[key] = LoraWeights(a_view, b_view, w.scaling)
        return {"packed": packed, "packed_layout": (places, size), "modules": held}


# What `load_peft_adapter` makes without a host form: float32, pageable, nothing kept for reuse.
_PARSED = HostForm(torch.float32, HostBuffers(torch.device("cpu"), spare=0))


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each LoRA-targetable projection of the base model, from
    spindle/peft.py, which the adapter service validates uploads with too.

    MLA (DeepSeek): the query and latent projections and o_proj, not `kv_b_proj`, which
    decompresses cached latents written by earlier steps (and is absorbed into decode queries):
    no step's adapter plan covers those rows. Gated attention (Qwen3-Next): q_proj as the
    checkpoint has it, each head's query then its output gate."""
    return projection_shapes(
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.latent_attention,
        gated_query=cfg.family in GATED_ATTENTION_FAMILIES,
        fused=cfg.family in FUSED_PROJECTION_FAMILIES,
    )


def content_id(config_bytes: bytes, weights_digest: bytes) -> int:
    """The adapter's identity in prefix-cache keys: its config and its weights file's chunked
    digest (lora/reading.py: the same bytes give the same id in every process)."""
    digest = hashlib.sha256(config_bytes + b"\0" + weights_digest).digest()
    return int.from_bytes(digest[:8], "big") >> 1 or 1  # positive, never the base model's 0


def load_peft_adapter(
    name: str,
    path: Path,
    base: ModelConfig,
    max_lora_rank: int,
    max_bytes: int = MAX_ADAPTER_BYTES,
    form: HostForm | None = None,
    known: tuple[bytes, str] | None = None,
) -> LoraAdapter:
    """The adapter in the PEFT directory `path`, validated against `base` and in `form` (float32
    and pageable without one). `known`: (chunked digest, sha256) of a version read before (at
    registration): when the file's chunked digest is that, its sha256 is that one, not hashed
    again (the plain hash would take most of the load)."""
    path = Path(path)
    try:  # a path is user input: too long, a NUL byte, unreadable, a FIFO are the caller's to fix
        config_bytes, weights = _read_files(name, path, max_bytes)
    except (OSError, ValueError) as e:
        raise AdapterError(f"adapter {name!r}: cannot read {str(path)[:200]!r}: {e}") from e
    sha256 = known[1] if known is not None and known[0] == weights.chunked else None
    return parse_peft_adapter(name, config_bytes, weights, base, max_lora_rank, path, form or _PARSED, sha256)


def _read_files(name: str, path: Path, max_bytes: int) -> tuple[bytes, WeightsFile]:
    config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not path.is_dir():
        raise AdapterError(f"adapter {name!r}: {path} is not a directory")
    if not config_file.exists():
        raise AdapterError(f"adapter {name!r}: {path} has no adapter_config.json")
    if not weights_file.exists():
        pickles = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
        hint = f" (found pickle weights {pickles}; convert them to safetensors)" if pickles else ""
        raise AdapterError(f"adapter {name!r}: {path} has no adapter_model.safetensors{hint}")
    config = read_regular(config_file, MAX_CONFIG_BYTES, "adapter_config.json's limit")
    return config, read_weights(weights_file, max_bytes)


def parse_peft_adapter(
    name: str,
    config_bytes: bytes,
    weights: WeightsFile,
    base: ModelConfig,
    max_lora_rank: int,
    path: Path,
    form: HostForm,
    sha256: str | None,
) -> LoraAdapter:
    """Validate an adapter from its files' contents (`weights`: as `reading.read_weights` left
    them) and convert it into `form`; `sha256` of the weights when known, else hashed beside the
    conversion."""
    try:
        config = json.loads(config_bytes)
    except ValueError as e:  # JSONDecodeError, or UnicodeDecodeError for bytes that are not text
        raise AdapterError(f"adapter {name!r}: adapter_config.json is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise AdapterError(f"adapter {name!r}: adapter_config.json is not a JSON object")
    _check_config(name, config, module_shapes(base))
    data, raw = weights.data, weights.data.numpy()
    try:
        n = header_length(raw[:8].tobytes(), len(raw))
        tensors = parse_header(raw[8 : 8 + n].tobytes(), len(raw))
    except HeaderError as e:
        raise AdapterError(f"adapter {name!r}: cannot read adapter_model.safetensors: {e}") from e
    modules = _modules(name, config, tensors, base, max_lora_rank)
    if not modules:
        raise AdapterError(f"adapter {name!r}: no LoRA weights found in adapter_model.safetensors")
    digest = sha256_of(data) if sha256 is None else None  # beside the conversion
    body = data[8 + n :]
    packed = form.pack(
        {k: LoraWeights(_tensor(body, a), _tensor(body, b), s) for k, (a, b, s) in modules.items()}
    )
    sha256 = sha256 if digest is None else digest.result()
    adapter_id = content_id(config_bytes, weights.chunked)
    return LoraAdapter(name, adapter_id, path, sha256=sha256, chunked=weights.chunked, **packed)


def _tensor(body: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    """The tensor `entry` describes, as a view of the file's data `body` (uint8) where it lies
    aligned for its dtype, else a copy (safetensors writers align the data; others may not)."""
    raw = body[entry.begin : entry.end]
    dtype = _DTYPES[entry.dtype]
    if raw.data_ptr() % dtype.itemsize:
        raw = raw.clone()
    return raw.view(dtype).view(entry.shape)


def _check_config(name: str, config: dict[str, Any], shapes: dict[str, tuple[int, int]]) -> None:
    """The adapter service's config checks (spindle/peft.py), so both accept the same configs."""
    feature = unsupported_feature(config) or target_refusal(config, shapes)
    if feature is not None:
        raise AdapterError(f"adapter {name!r}: adapter_config.json: {feature} is not supported")


def _modules(
    name: str, config: dict[str, Any], tensors: dict[str, TensorEntry], base: ModelConfig, max_rank: int
) -> dict[Key, tuple[TensorEntry, TensorEntry, float]]:
    """Each module's A, B and scaling, in (layer, module) order, once every tensor's name and
    shape and every module's rank have been checked against the base model and the config."""
    shapes = module_shapes(base)
    pairs: dict[Key, dict[str, TensorEntry]] = {}
    for key, tensor in tensors.items():
        layer, module, ab = _target(name, key, config, shapes, base)
        pairs.setdefault((layer, module), {})[ab] = tensor

    alpha, use_rslora = float(config.get("lora_alpha", 8)), bool(config.get("use_rslora", False))
    out: dict[Key, tuple[TensorEntry, TensorEntry, float]] = {}
    for (layer, module), ab in sorted(pairs.items()):
        path = module_path(layer, module)
        if set(ab) != {"A", "B"}:
            raise AdapterError(
                f"adapter {name!r}: {path} has lora_{''.join(ab)} but not both lora_A and lora_B"
            )
        a, b = ab["A"], ab["B"]
        in_f, out_f = shapes[module]
        rank = a.shape[0] if a.shape else 0
        if a.shape != (rank, in_f) or b.shape != (out_f, rank):
            raise AdapterError(
                f"adapter {name!r}: {path} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
                f"the base model needs ({rank}, {in_f}) and ({out_f}, {rank}): made for another base "
                f"model?{declared_base(config)}"
            )
        if rank > max_rank:
            raise AdapterError(
                f"adapter {name!r}: {path} has rank {rank}, above max_lora_rank {max_rank} (--max-lora-rank)"
            )
        wrong = declared_mismatch(config, layer, module, rank)
        if wrong is not None:
            raise AdapterError(f"adapter {name!r}: adapter_config.json: {wrong}")
        module_alpha = float(pattern_value(config.get("alpha_pattern") or {}, path, alpha))
        scaling = module_alpha / (math.sqrt(rank) if use_rslora else rank)
        out[(layer, module)] = (a, b, scaling)
    return out


def _target(
    name: str, key: str, config: dict[str, Any], shapes: dict[str, tuple[int, int]], base: ModelConfig
) -> tuple[int, str, str]:
    """(layer, module, "A" or "B") of one tensor of the adapter, once its name is known to name a
    module this engine adapts on that layer of the base model."""
    attention = tuple(m for m in shapes if m not in MLP_MODULES)  # what an MoE layer can carry
    if "lora_embedding" in key or "lora_magnitude_vector" in key:
        what = "DoRA magnitude vectors" if "magnitude" in key else "LoRA on embeddings"
        raise AdapterError(f"adapter {name!r}: {what} ({key}) is not supported")
    if EXPERTS_KEY.search(key):  # PEFT turns gate/up/down targets on an MoE model into expert LoRA
        raise AdapterError(
            f"adapter {name!r}: tensor {key!r} adapts mixture-of-experts experts, which is not "
            f"supported; target {attention} (and gate/up/down of dense layers only)"
        )
    bias = bias_refusal(key, config)
    if bias is not None:
        raise AdapterError(f"adapter {name!r}: {bias}")
    linear = LINEAR_ATTENTION_KEY.search(key)
    if linear is not None:
        refusal = linear_attention_refusal(int(linear.group(1)), shapes)
        raise AdapterError(f"adapter {name!r}: tensor {key!r}: {refusal}")
    m = _KEY.match(key)
    if m is None:
        raise AdapterError(f"adapter {name!r}: tensor {key!r} does not match any module of the base model")
    layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
    if module not in shapes:
        raise AdapterError(
            f"adapter {name!r}: tensor {key!r} targets {module!r}: {untargetable(module, shapes)}"
        )
    if layer >= base.num_layers:
        raise AdapterError(
            f"adapter {name!r}: tensor {key!r} names layer {layer}; the base model has {base.num_layers}"
        )
    if base.layer_kinds[layer].mixer is Mixer.LINEAR_ATTENTION and module not in MLP_MODULES:
        raise AdapterError(f"adapter {name!r}: tensor {key!r}: {linear_attention_refusal(layer, shapes)}")
    if base.layer_kinds[layer].moe and module in MLP_MODULES:
        raise AdapterError(
            f"adapter {name!r}: tensor {key!r} targets {module!r} of layer {layer}, a mixture-of-experts "
            f"layer; LoRA on experts is not supported (target {attention} there)"
        )
    return layer, module, ab
