"""PEFT LoRA rules shared by the engine, which loads adapters, and the adapter service, which
validates uploads without torch: the projections a LoRA may target, their shapes on a base
model, and the `adapter_config.json` features Spindle does not run."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Protocol

from spindle.errors import SpindleError

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
LORA_MODULES = ATTENTION_MODULES + MLP_MODULES  # a Llama-shaped base's; projection_shapes has any base's
# Multi-head latent attention (DeepSeek-V2/V3): q_proj without a q_lora_rank, else q_a_proj and q_b_proj.
MLA_ATTENTION_MODULES = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")
# What PEFT writes for gate/up/down targets on an MoE model: LoRA on the routed experts (one
# module per expert, or the stacked experts of transformers 5: `mlp.experts.base_layer`) and on the
# shared experts (Qwen's `shared_expert`, DeepSeek's `shared_experts`), which no pod adapts.
EXPERTS_KEY = re.compile(r"\.mlp\.(?:experts|shared_experts?)\.")
# LoRA on a hybrid's Gated DeltaNet projections (`layers.N.linear_attn.*`), which no pod adapts.
LINEAR_ATTENTION_KEY = re.compile(r"\blayers\.(\d+)\.linear_attn\.")
# Projections PEFT can target that no pod adapts, and why (the refusal's words, on pod and service).
NOT_TARGETABLE = {
    "kv_b_proj": (
        "kv_b_proj decompresses the cached latents, which earlier steps wrote without any adapter, "
        "and is absorbed into the decode queries, so no step's adapter covers its rows"
    ),
    "embed_tokens": "the token embeddings (embed_tokens) carry no LoRA here",
    "lm_head": "the LM head carries no LoRA here",
}


class LatentSizes(Protocol):
    """MLA's sizes as both the pod's `LatentAttentionShape` and `LatentShape` carry them."""

    @property
    def q_lora_rank(self) -> int | None: ...
    @property
    def kv_lora_rank(self) -> int: ...
    @property
    def qk_nope_head_dim(self) -> int: ...
    @property
    def qk_rope_head_dim(self) -> int: ...
    @property
    def v_head_dim(self) -> int: ...


@dataclass(frozen=True)
class LatentShape:
    """MLA's sizes from a DeepSeek `config.json`, for the adapter service (which has no torch)."""

    q_lora_rank: int | None  # None: one q_proj (V2-Lite); else q_a_proj -> norm -> q_b_proj (V3)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


def projection_shapes(
    hidden: int,
    intermediate: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    latent: LatentSizes | None = None,
    gated_query: bool = False,
    fused: bool = False,
) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection a LoRA may target: the pods' `module_shapes`
    and the adapter service's `BaseModel.projection_shapes` both come from here, so an upload is
    accepted exactly when a pod would load it. `intermediate` is the dense MLP's width (MoE layers'
    gate/up/down are not targetable: see `spindle.architectures.moe_layers`).

    With `latent` (MLA; `kv_heads` and `head_dim` unused): each head's query is qk_nope + qk_rope
    dims wide, `kv_a_proj_with_mqa` writes the latent and the rotary key, o_proj reads v_head_dim
    per head; not `kv_b_proj` (NOT_TARGETABLE says why). `gated_query` (Qwen3-Next's gated
    attention): q_proj writes each head's output gate after its query, twice as wide. `fused`
    (Phi-3): q/k/v are one `qkv_proj` and gate/up one `gate_up_proj`, as PEFT targets them."""
    mlp = {
        "gate_proj": (hidden, intermediate),
        "up_proj": (hidden, intermediate),
        "down_proj": (intermediate, hidden),
    }
    if latent is None and fused:
        q, kv = heads * head_dim, kv_heads * head_dim
        return {
            "qkv_proj": (hidden, q + 2 * kv),
            "o_proj": (q, hidden),
            "gate_up_proj": (hidden, 2 * intermediate),
            "down_proj": (intermediate, hidden),
        }
    if latent is None:
        q, kv = heads * head_dim, kv_heads * head_dim
        attention = {
            "q_proj": (hidden, 2 * q if gated_query else q),
            "k_proj": (hidden, kv),
            "v_proj": (hidden, kv),
            "o_proj": (q, hidden),
        }
        return attention | mlp
    q = heads * (latent.qk_nope_head_dim + latent.qk_rope_head_dim)
    attention = {"kv_a_proj_with_mqa": (hidden, latent.kv_lora_rank + latent.qk_rope_head_dim)}
    if latent.q_lora_rank is None:
        attention["q_proj"] = (hidden, q)
    else:
        attention |= {"q_a_proj": (hidden, latent.q_lora_rank), "q_b_proj": (latent.q_lora_rank, q)}
    attention["o_proj"] = (heads * latent.v_head_dim, hidden)
    return attention | mlp


def linear_attention_refusal(layer: int, shapes: dict[str, tuple[int, int]]) -> str:
    """Why a hybrid's linear-attention (Gated DeltaNet) layer carries no LoRA but on its MLP, and
    where attention LoRA may go: the reader trained the adapter, perhaps for another layout."""
    attention = ", ".join(m for m in shapes if m not in MLP_MODULES)
    return (
        f"layer {layer} is a linear-attention (Gated DeltaNet) layer: it has no {attention}, and LoRA on "
        "its own projections is not supported; target those on the full-attention layers"
    )


def untargetable(module: str, shapes: dict[str, tuple[int, int]]) -> str:
    """Why `module` cannot carry a LoRA on a base of these `shapes`, and the names that can: the
    reader is an adapter's author choosing `target_modules`."""
    why = NOT_TARGETABLE.get(module)
    valid = f"LoRA targets on this base model: {', '.join(shapes)}"
    return f"{why}; {valid}" if why else valid


# PEFT config fields that, when set, make the adapter compute something other than plain LoRA's
# `x @ A.T @ B.T * scaling` on the base model's own weights: PEFT serves them its own way, so served
# as plain LoRA their answers would be silently wrong (aLoRA was: its delta applied to the whole
# prompt). Only what a field's presence changes; fields that only shape training (`eva_config`,
# `lora_ga_config`, `velora_config`, `loftq_config` without LoftQ's init) are served.
VARIANT_FIELDS = {
    "alora_invocation_tokens": "Activated LoRA (alora_invocation_tokens: the delta applies only from its "
    "invocation tokens on)",
    "use_bdlora": "BD-LoRA (use_bdlora: block-diagonal A or B factors)",
    "kasa_config": "KaSA (kasa_config: a trained singular-value diagonal on a truncated base weight)",
    "arrow_config": "Arrow routing (arrow_config: several LoRAs mixed per token)",
    "use_qalora": "QALoRA (use_qalora=true: A reads group-pooled inputs)",
}
# `init_lora_weights` values whose init rewrites the base weights it trains against: PEFT loading
# such an adapter redoes that init on the base (PiSSA, OLoRA, CorDA subtract their initial
# B0 @ A0; LoftQ quantizes), so on the unchanged base its deltas are not the trained model's.
BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq")


def base_rewriting_init(config: dict[str, Any]) -> str | None:
    """Why an adapter whose `init_lora_weights` rewrote its base cannot be served, or None. PiSSA,
    OLoRA and CorDA adapters convert to plain LoRA (PEFT's `save_pretrained(...,
    path_initial_model_for_weight_conversion=...)`, rank doubled), which is served."""
    init = config.get("init_lora_weights")
    if not isinstance(init, str) or not init.lower().startswith(BASE_REWRITING_INITS):
        return None
    fix = (
        "LoftQ's quantized base is not this one"
        if init.lower().startswith("loftq")
        else "save it as plain LoRA with save_pretrained's path_initial_model_for_weight_conversion"
    )
    return f"init_lora_weights={init!r} (trained on a base its init rewrote: {fix})"


def target_refusal(config: dict[str, Any], shapes: dict[str, tuple[int, int]]) -> str | None:
    """Why `target_modules` names a module no pod adapts, or None; pods and the adapter service
    both refuse by this, so they accept the same adapters. A list entry is a module's name or a
    dotted path ending in it (PEFT's suffix rule). A string is PEFT's regular expression over
    module paths, which can name a module only to exclude it (`^(?!.*embed_tokens).*q_proj$`), so
    the saved tensors decide (a pod refused any pattern that mentioned embed or lm_head)."""
    targets = config.get("target_modules")
    for t in targets if isinstance(targets, list) else []:
        module = str(t).rpartition(".")[2]
        if module not in shapes:
            return f"target module {t!r} ({untargetable(module, shapes)})"
    return None


def unsupported_feature(config: dict[str, Any]) -> str | None:
    """The first feature of a PEFT config that Spindle cannot serve, named for the adapter's
    author ("DoRA (use_dora=true)"), or None."""
    # set is not truthy: PEFT enables KaSA for `kasa_config: {}` (its defaults), off only for null
    variant = next((w for key, w in VARIANT_FIELDS.items() if config.get(key) not in (None, False)), None)
    if variant is not None:
        return variant
    if config.get("peft_type", "LORA") != "LORA":
        return f"peft_type {config.get('peft_type')!r} (only LORA)"
    if config.get("use_dora"):
        return "DoRA (use_dora=true)"
    if config.get("modules_to_save"):
        return f"modules_to_save {config['modules_to_save']} (full-weight modules)"
    if config.get("lora_bias"):
        return "lora_bias=true (bias terms on lora_B)"
    if config.get("trainable_token_indices"):
        return "trainable_token_indices (trained embedding rows)"
    if config.get("layer_replication"):
        return "layer_replication (decoder layers stacked from copies of the base model's)"
    if config.get("fan_in_fan_out"):
        return "fan_in_fan_out=true (Conv1D-style weights)"
    return base_rewriting_init(config)


def bias_refusal(key: str, config: dict[str, Any]) -> str | None:
    """Why tensor `key` cannot be served if it is a bias, else None. PEFT's `bias="all"` or
    `"lora_only"` saves the base model's biases it trained, which Spindle does not swap per
    request; on a base without biases (Llama) nothing is saved and the adapter is plain LoRA, so
    the tensors decide, not the config."""
    if not key.endswith(".bias"):
        return None
    return f"tensor {key!r} is a trained bias (bias={config.get('bias')!r}): bias terms are not supported"


def declared_base(config: dict[str, Any]) -> str:
    """The base model an adapter's config says it was trained on, for a refusal of shapes that do
    not fit this one: the author sees which model they trained against (PEFT saves it)."""
    name = config.get("base_model_name_or_path")
    return f" (adapter_config.json names base model {str(name)[:200]!r})" if name else ""


def module_path(layer: int, module: str) -> str:
    """The HF module path PEFT's rank_pattern / alpha_pattern keys are matched against."""
    return f"model.layers.{layer}.{'self_attn' if module[0] in 'qkvo' else 'mlp'}.{module}"


def names_module(targets: list[str], path: str) -> bool:
    """Whether a `target_modules` list names the module at `path`, by PEFT's rule: an entry is
    the module's path or a dotted suffix of it. Entries are not only bare names ("q_proj"):
    PEFT saves `target_modules="all-linear"` as every module's full path
    ("model.layers.0.self_attn.q_proj"), and authors write "self_attn.q_proj"."""
    return any(path == t or path.endswith(f".{t}") for t in targets)


def pattern_value(patterns: dict[str, Any], key: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup: a pattern matches the end of the module path.
    Raises ValueError for a pattern that is not a regular expression."""
    for pattern, value in patterns.items():
        try:
            if re.match(rf"(.*\.)?({pattern})$", key):
                return value
        except re.error as e:
            raise ValueError(f"pattern {pattern!r} is not a regular expression: {e}") from e
    return default


def declared_mismatch(config: dict[str, Any], layer: int, module: str, rank: int) -> str | None:
    """How `adapter_config.json` misdescribes one module's tensors of rank `rank` (PEFT scales by the
    config's r and lora_alpha, so a config that lies changes the adapter's output), or None."""
    path = module_path(layer, module)
    try:
        r = pattern_value(config.get("rank_pattern") or {}, path, config.get("r", rank))
        alpha = pattern_value(config.get("alpha_pattern") or {}, path, config.get("lora_alpha", 8))
    except (ValueError, AttributeError) as e:
        return f"rank_pattern / alpha_pattern: {e}"
    if rank < 1:
        return f"{path} has rank {rank}; a LoRA needs rank >= 1"
    if r != rank or isinstance(r, bool):
        return f"{path} has rank {rank} but the config says r={r!r}: the config lies about the weights"
    if (
        isinstance(alpha, bool)
        or not isinstance(alpha, (int, float))
        or not math.isfinite(alpha)
        or alpha <= 0
    ):
        return f"lora_alpha {alpha!r} for {path} must be a finite number > 0"
    targets, params = config.get("target_modules"), config.get("target_parameters")
    # PEFT's `target_parameters` LoRA on a projection's weight ("self_attn.q_proj.weight", matched
    # as target_modules are) is the same delta as a LoRA on the projection
    by_param = isinstance(params, list) and names_module(params, f"{path}.weight")
    if isinstance(targets, list) and not names_module(targets, path) and not by_param:
        return f"{path} has weights but target_modules {targets} does not name {module!r}"
    return None


def pod_adapter_name_problem(name: str) -> str | None:
    """Why a pod may not hold an adapter under `name`, or None. A comma or a control character is
    refused: the pod's `vllm:lora_requests_info` lists adapters comma-joined (vLLM's format, which
    the Gateway API Inference Extension splits on commas), so `x,y` would read as two adapters;
    `@` begins the pod's own names (`@active`); `/` and `\\` would leave its cache directory."""
    bad = any(c in name for c in "/\\\0,") or not name.isprintable() or name.startswith("@")
    if not name or len(name) > 256 or bad:
        return f"adapter name {name!r} is empty, too long, or has / \\ , @ or a control character"
    return None


def lora_specs(specs: list[str]) -> dict[str, str]:
    """`--lora NAME=DIR` flags as {name: dir} (`spindle generate`, `serve` and `up` alike). A name
    given twice is refused: the last one silently won, serving other weights than the first named.
    A name the pod's control API refuses is refused here too (it was taken: `x,y` was listed
    as two adapters in `vllm:lora_requests_info`)."""
    modules: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SpindleError(f"--lora takes NAME=DIR, got {spec!r}")
        problem = pod_adapter_name_problem(name)
        if problem is not None:
            raise SpindleError(f"--lora {spec!r}: {problem}")
        if name in modules:
            raise SpindleError(f"--lora {name} is given twice ({modules[name]} and {path})")
        modules[name] = path
    return modules
