"""Engine settings: one definition for the dataclass, its command-line flags and their help.

Each field's flag is its name with dashes (`max_num_seqs` -> `--max-num-seqs`, as vLLM spells
them), typed by its annotation; booleans get `--x/--no-x`. A field's metadata holds its help and,
where the flag differs from the field, how: `swap_space_bytes` is `--swap-space` in GiB and
`lora_modules` is the repeatable `--lora NAME=DIR`. `spindle.envflags` then reads every flag from
`SPINDLE_<FLAG>` as well.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from model_service.errors import ConfigError
from model_service.models.quantization import ONLINE_SCHEMES
from spindle import flagtypes
from spindle.peft import lora_specs

# The default adapter memory holds this many adapters of --max-lora-rank on every projection
# (the memory the 4 padded slots of the old default took); smaller adapters fit many more.
DEFAULT_LORA_ROOM = 4
_GIB = 1 << 30


def _opt(default: Any, help: str, **meta: Any) -> Any:
    """A field with its flag's help; `meta` may hold group, choices, flag, type, metavar, action,
    to_field (flag value -> field value) and shown (the default as the help shows it)."""
    return field(default=default, metadata={"help": help, **meta})


@dataclass
class EngineConfig:
    model: str = _opt("smollm2-135m-instruct", "alias ({aliases}), an HF checkpoint dir, or a .gguf file")
    device: str = _opt("auto", "cpu, cuda, cuda:N or auto (= cuda when available)")
    dtype: str = _opt(
        "auto",
        "compute dtype; auto = float32 on CPU, bfloat16 on CUDA",
        choices=["auto", "float32", "bfloat16", "float16"],
    )
    block_size: int = _opt(16, "tokens per KV cache block")
    num_kv_blocks: int | None = _opt(None, "KV cache size in blocks (overrides the memory budget)")
    kv_cache_memory_bytes: int | None = _opt(
        None, "KV cache memory budget [CPU: 1 GiB; CUDA: --gpu-memory-utilization of free memory]"
    )
    gpu_memory_utilization: float = _opt(0.9, "fraction of free device memory the KV cache may take")
    kv_cache_dtype: str = _opt(
        "auto",
        "KV cache storage: auto = the compute dtype; fp8 = float8 e4m3, half of bfloat16's bytes (twice "
        "the tokens, half the decode attention's reads) for K/V rounded to 3 mantissa bits (sm89+ on CUDA)",
        choices=["auto", "fp8"],
    )
    quantization: str = _opt(
        "none",
        "weights: none = as the checkpoint stores them (an FP8 checkpoint runs in FP8); fp8 = quantize an "
        "unquantized checkpoint's projections at load: float8 e4m3 weights scaled per channel, inputs "
        "quantized per token (half of bfloat16's weight bytes; W8A8 GEMMs on sm89+); fp8-g128 = the same "
        "with a scale per row and 128 input columns, inputs per token and 128 columns (closer to the "
        "original model; sm90 GEMMs)",
        choices=["none", *ONLINE_SCHEMES],
    )
    max_num_batched_tokens: int = _opt(
        2048, "token budget of one engine step; longer prompts are prefilled in chunks"
    )
    max_num_seqs: int = _opt(256, "most sequences running at once")
    max_model_len: int | None = _opt(None, "context length [the model's maximum]")
    max_waiting_requests: int = _opt(
        1024, "queue bound; beyond it new requests are refused as RESOURCE_EXHAUSTED"
    )
    enable_prefix_caching: bool = _opt(True, "reuse KV blocks of identical prompt prefixes across requests")
    preemption_mode: str = _opt(
        "recompute",
        "when KV blocks run out: free and recompute, or swap KV to host memory",
        choices=["recompute", "swap"],
    )
    swap_space_bytes: int = _opt(
        4 * _GIB,
        "GiB of host memory for swapped-out KV; past it, preemption recomputes",
        flag="swap-space",
        metavar="GIB",
        type=flagtypes.gib,
        to_field=lambda gib: int(gib * _GIB),
        shown=4,
    )
    max_loras: int = _opt(
        32,
        "most distinct adapters in one step (vLLM's meaning; 0 = no adapters); how many stay "
        "resident is set by --lora-memory-bytes",
        group="lora",
    )
    lora_memory_bytes: int | None = _opt(
        None,
        "device memory for resident adapters, each stored at its own rank and targets "
        f"[room for {DEFAULT_LORA_ROOM} adapters of --max-lora-rank on every projection]",
        group="lora",
    )
    max_cpu_loras: int = _opt(
        16, "parsed adapters kept in host memory (in the model's dtype; page-locked on a GPU)", group="lora"
    )
    max_lora_rank: int = _opt(64, "refuse adapters of a higher rank", group="lora")
    max_adapter_bytes: int = _opt(
        _GIB,
        "refuse adapter weight files larger than this (as the adapter service's --max-adapter-bytes)",
        group="lora",
    )
    lora_modules: dict[str, str] = field(  # name -> PEFT adapter dir, registered at start
        default_factory=dict,
        metadata={
            "help": "register a PEFT adapter directory under NAME (repeatable)",
            "group": "lora",
            "flag": "lora",
            "action": "append",
            "metavar": "NAME=DIR",
            "to_field": lora_specs,
        },
    )
    speculative_config: str | None = _opt(
        None,
        'speculative decoding, as vLLM\'s JSON: \'{{"method": "ngram", "num_speculative_tokens": 4}}\' '
        "(prompt lookup; prompt_lookup_max / prompt_lookup_min set the n-gram lengths) or "
        '\'{{"method": "draft", "model": "DRAFT", "num_speculative_tokens": 4}}\' (a smaller model '
        "with the same tokenizer: an alias, checkpoint dir or .gguf file) or "
        '\'{{"method": "mtp", "num_speculative_tokens": 1}}\' (the checkpoint\'s own '
        "multi-token-prediction layer: DeepSeek-V3's num_nextn_predict_layers) or "
        '\'{{"method": "eagle3", "model": "HEAD_DIR", "num_speculative_tokens": 3}}\' (an EAGLE-3 '
        "draft head trained on this model, reading three of its layers' states)",
    )
    tensor_parallel_size: int = _opt(
        1,
        "split the model over this many devices of the host, one process each (rank 0 runs the "
        "scheduler; NCCL on GPUs, gloo on the CPU)",
    )
    enable_expert_parallel: bool = _opt(
        False,
        "with --tensor-parallel-size N on a mixture-of-experts model: each rank holds whole experts "
        "(a contiguous run of them) instead of a slice of every expert; no effect otherwise",
    )
    enforce_eager: bool = _opt(False, "CUDA: run decode steps eagerly, without CUDA graphs (debugging)")
    piecewise_graphs: bool = _opt(
        True,
        "CUDA, dense and MoE models: at start-up, capture prefill and mixed steps of up to 4,096 tokens "
        "as CUDA graphs split at attention, while they fit in memory (~6 GB with the decode graphs "
        "on an 8B model, ~11 GB with LoRA on; short prompts serve about a third faster); "
        "--no-piecewise-graphs runs them eagerly",
    )
    async_scheduling: str = _opt(
        "auto",
        "run each step's host work (scheduling, batch building, detokenizing, stop checks) while "
        "the device runs the step before: on, off, or auto (= on for CUDA, one GPU or tensor-parallel)",
        choices=["auto", "on", "off"],
    )
    adapter_starvation_s: float = _opt(
        1.0,
        "seconds a request may wait for device memory for its adapter before the adapter takes "
        "precedence: a resident adapter (the one with the least work left) stops admitting requests "
        "until its running ones are done, and the waiting adapter takes its place",
        group="lora",
    )
    adapter_drain_s: float = _opt(
        1.0,
        "seconds such a displaced adapter's running requests may take to finish before they are "
        "preempted (they queue again; their K/V mostly comes back from the prefix cache)",
        group="lora",
    )
    adapter_wait_timeout_s: float = _opt(
        30.0,
        "seconds a request waits while its adapter cannot be loaded at all (a bad file, unreachable "
        "storage; retried after 1, 2, 4... s) before it fails; busy device memory never fails a request",
        group="lora",
    )

    def __post_init__(self) -> None:
        check_ranges(self)

    def torch_device(self) -> torch.device:
        """The device `--device` names, refused (ConfigError) when it is not a device torch knows
        or not one this host has: torch's own errors were tracebacks (an AssertionError "Torch
        not compiled with CUDA enabled", a RuntimeError listing 20 device types)."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            device = torch.device(self.device)
        except RuntimeError:
            raise ConfigError(f"--device must be cpu, cuda, cuda:N or auto, got {self.device!r}") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"--device {self.device}: this host has no CUDA device torch can use")
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            raise ConfigError(
                f"--device {self.device}: this host has {torch.cuda.device_count()} CUDA devices"
            )
        return device

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        try:
            return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
                self.dtype
            ]
        except KeyError:
            raise ValueError(
                f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            ) from None


_GROUPS = {"engine": "engine", "lora": "LoRA adapters"}
# Each numeric setting's least value (a None optional one means "derive it": not checked). Zero
# sizes and negative counts were taken as given and failed later as tracebacks (a negative
# --num-kv-blocks), or silently meant "unset" (--num-kv-blocks 0 and --max-model-len 0).
_LEAST = {
    1: ("block_size", "max_num_batched_tokens", "max_num_seqs", "tensor_parallel_size", "num_kv_blocks",
        "kv_cache_memory_bytes", "max_model_len", "max_lora_rank", "max_adapter_bytes"),
    0: ("max_waiting_requests", "swap_space_bytes", "max_loras", "lora_memory_bytes", "max_cpu_loras",
        "adapter_starvation_s", "adapter_drain_s", "adapter_wait_timeout_s"),
}  # fmt: skip


def flag_name(name: str) -> str:
    """The command-line flag of EngineConfig field `name` (`swap_space_bytes` -> `--swap-space`)."""
    meta = EngineConfig.__dataclass_fields__[name].metadata
    return "--" + meta.get("flag", name.replace("_", "-"))


def check_ranges(config: EngineConfig) -> None:
    """Refuse a setting out of its range or choices, naming its flag (ConfigError): at start-up,
    before a model loads, rather than as a traceback or a silently different setting later."""
    for least, names in _LEAST.items():
        for name in names:
            value = getattr(config, name)
            if value is not None and value < least:
                unit = f" ({name})" if flag_name(name) != "--" + name.replace("_", "-") else ""
                raise ConfigError(f"{flag_name(name)}{unit} must be at least {least}, got {value}")
    if not 0 < config.gpu_memory_utilization <= 1:
        raise ConfigError(
            f"--gpu-memory-utilization is a fraction of the device's memory, in (0, 1]; got "
            f"{config.gpu_memory_utilization}"
        )
    for f in dataclasses.fields(EngineConfig):
        choices, value = f.metadata.get("choices"), getattr(config, f.name)
        if choices is not None and value not in choices:
            raise ConfigError(f"{flag_name(f.name)} must be one of {choices}, got {value!r}")


def _flag_type(f: dataclasses.Field[Any], hints: dict[str, Any]) -> Callable[[str], Any]:
    if "type" in f.metadata:
        return f.metadata["type"]
    hint = hints[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint  # `int | None` -> int


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add one flag per EngineConfig field (see the module docstring)."""
    from model_service.models.loader import ALIASES

    hints = typing.get_type_hints(EngineConfig)
    groups = {key: parser.add_argument_group(title) for key, title in _GROUPS.items()}
    for f in dataclasses.fields(EngineConfig):
        meta = f.metadata
        default = meta.get("shown", [] if meta.get("action") == "append" else f.default)
        help_ = meta["help"].format(aliases=", ".join(sorted(ALIASES)))
        if default is not None and default != []:
            help_ += f" [{'on' if default is True else default}]"
        kwargs: dict[str, Any] = {"default": default, "help": help_, "dest": f.name}
        if hints[f.name] is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif meta.get("action"):
            kwargs.update(action=meta["action"], metavar=meta.get("metavar"))
        else:
            kwargs.update(type=_flag_type(f, hints), choices=meta.get("choices"), metavar=meta.get("metavar"))
        flag = "--" + meta.get("flag", f.name.replace("_", "-"))
        groups[meta.get("group", "engine")].add_argument(flag, **kwargs)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the flags of `add_engine_args` describe (raises SpindleError on a bad value)."""
    values = {}
    for f in dataclasses.fields(EngineConfig):
        value = getattr(args, f.name)
        convert = f.metadata.get("to_field")
        values[f.name] = convert(value) if convert is not None else value
    return EngineConfig(**values)
