"""One normalized description of a decoder-only model, whatever file it came from.

HF `config.json` files spell the same thing several ways across transformers versions
(`rope_theta` + `rope_scaling` vs `rope_parameters`, `head_dim` present or not, per-layer
`layer_types`); GGUF files spell it a third way. Everything downstream reads only `ModelConfig`.
"""

from __future__ import annotations

import enum
import logging
import math
from dataclasses import dataclass, field, replace
from typing import Any

from model_service.errors import ModelLoadError
from model_service.models.quantization import Fp8Scheme, quantization_scheme
from spindle.architectures import (
    DEEPSEEK_FAMILIES,
    GEMMA_FAMILIES,
    MOE_FAMILIES,
    SUPPORTED_ARCHITECTURES,
    layer_types,
    moe_layers,
    with_hf_defaults,
)
from spindle.architectures import family as hf_family

log = logging.getLogger(__name__)

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
# Every MLP (and Qwen3-Next's conv) computes SiLU; HF's ACT2FN also spells it "swish".
SUPPORTED_ACTIVATIONS = ("silu", "swish")
# A dense MLP also computes HF's exact and tanh GELUs (Gemma's); the fused MoE experts only SiLU.
GELU_ACTIVATIONS = ("gelu", "gelu_pytorch_tanh")


class Mixer(str, enum.Enum):
    """What mixes tokens in a layer; it decides what per-sequence memory the layer needs."""

    FULL_ATTENTION = "full_attention"  # K/V of every token, in the paged block pool
    SLIDING_ATTENTION = "sliding_attention"  # K/V in the pool too; attention sees only the last `window`
    LINEAR_ATTENTION = "linear_attention"  # a fixed-size recurrent state per sequence (state slots)


@dataclass(frozen=True)
class LayerKind:
    """One layer's shape as the cache manager and the attention backends need to know it."""

    mixer: Mixer = Mixer.FULL_ATTENTION
    window: int | None = None  # tokens a sliding-attention layer sees
    moe: bool = False  # a mixture-of-experts MLP instead of a dense one

    @property
    def holds_kv(self) -> bool:
        return self.mixer is not Mixer.LINEAR_ATTENTION


def attention_layers(windows: list[int | None]) -> list[LayerKind]:
    """Layer kinds of a pure-attention decoder from its per-layer sliding windows (None = full)."""
    return [LayerKind(Mixer.SLIDING_ATTENTION, w) if w else LayerKind(Mixer.FULL_ATTENTION) for w in windows]


@dataclass(frozen=True)
class LinearAttentionShape:
    """Sizes of a Gated DeltaNet mixer (Qwen3-Next's `linear_*` fields)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int  # causal depthwise conv width; the conv state keeps conv_kernel - 1 inputs


@dataclass(frozen=True)
class LatentAttentionShape:
    """Sizes of multi-head latent attention (DeepSeek-V2/V3's MLA). A token's keys and values are
    made from one `kv_lora_rank`-wide latent (shared by all heads) and one `qk_rope_head_dim`-wide
    rotary key (shared too); each head's query is `qk_nope_head_dim` dims that meet the latent's
    keys and `qk_rope_head_dim` that meet the rotary key."""

    q_lora_rank: int | None  # None: one q_proj (V2-Lite); else q_a_proj -> norm -> q_b_proj (V3)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # rotary pairs are adjacent dims (x0, x1), (x2, x3): DeepSeek's layout

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """Width of one token's cache row: its latent, then its rotated rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class Routing:
    """How an MoE router turns logits into (weights, experts), beyond top-k.

    Qwen and Mixtral: softmax over all experts. DeepSeek-V2: softmax, optionally only within the
    `topk_groups` groups with the best single expert (`group_limited_greedy`). DeepSeek-V3
    (`noaux_tc`): sigmoid scores; experts are *chosen* by score plus a learned per-expert bias
    (`e_score_correction_bias`, the auxiliary-loss-free balancing term) within the `topk_groups`
    groups whose two best biased scores sum highest, but *weighted* by the unbiased score."""

    scoring: str = "softmax"  # or "sigmoid"
    group_score: str | None = None  # None (no groups), "max" (V2), "top2_sum" (V3)
    num_groups: int = 1
    topk_groups: int = 1
    correction_bias: bool = False  # V3: the router holds e_score_correction_bias
    scaling_factor: float = 1.0  # routed_scaling_factor, applied after any renormalization
    float32_logits: bool = False  # DeepSeek: router logits from float32 weights (HF keeps them so)


PLAIN_TOP_K = Routing()  # softmax over all experts, no groups, no scaling: Qwen's and Mixtral's


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation, as HF's `GptOssExperts._apply_gate`: gate clamped above at
    `limit`, up clamped to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""

    alpha: float = 1.702
    limit: float = 7.0


@dataclass
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default"})
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_proj_bias: bool = False  # Llama/Qwen3 `attention_bias` covers o_proj too; Qwen2's q/k/v bias does not
    mlp_bias: bool = False  # Llama `mlp_bias`
    qk_norm: bool = False
    hidden_act: str = "silu"  # the MLP's activation, by its name in HF's ACT2FN
    # Gemma 2: cap * tanh(x / cap) on the attention logits; Gemma: the same on the LM head's logits.
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # Gemma 3: the (theta, scaling) of sliding layers' RoPE, where it differs from the full layers'.
    sliding_rope: tuple[float, dict[str, Any]] | None = None
    rotary_dim: int | None = None  # partial rotary: RoPE on the first rotary_dim dims only (None: all)
    linear_attention: LinearAttentionShape | None = None  # set when some layer is LINEAR_ATTENTION
    layer_kinds: list[LayerKind] = field(default_factory=list)  # one per layer
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    # Mixture of experts (layers whose kind says `moe`); zero for dense models.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's width
    norm_topk_prob: bool = False  # renormalize the top-k routing weights to sum to one
    shared_expert_intermediate_size: int = 0  # an always-on expert (Qwen: behind a sigmoid gate)
    shared_expert_gated: bool = True  # False: DeepSeek's `shared_experts`, added ungated
    routing: Routing = field(default_factory=Routing)
    latent_attention: LatentAttentionShape | None = None  # MLA (DeepSeek): set for every layer
    # DeepSeek-V3's multi-token-prediction layers, numbered after the decoder's (their kinds: MoE
    # or dense by the decoder's own rule). The target's load leaves them out; MTP speculation
    # loads the first (models/mtp.py).
    mtp_layer_kinds: list[LayerKind] = field(default_factory=list)
    # Qwen3-Next's MTP layers (`mtp_num_hidden_layers`), shipped as `mtp.*` tensors in every hub
    # checkpoint: a part of the checkpoint the target's load leaves on disk, which MTP speculation
    # does not run (another layer than DeepSeek's).
    qwen3_next_mtp_layers: int = 0
    # FP8 weights: the checkpoint's scheme (config.json's quantization_config, which also says which
    # projections stay in high precision) or --quantization fp8's; None: the compute dtype throughout.
    quantization: Fp8Scheme | None = None
    # Granite's multipliers (neutral elsewhere): the embeddings are scaled by embedding_multiplier,
    # each attention and MLP output by residual_multiplier before the residual add, the logits
    # divided by logits_scaling, and attention_multiplier is the softmax scale (not 1/sqrt(head_dim);
    # Gemma's too: 1/sqrt(query_pre_attn_scalar)).
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    attention_multiplier: float | None = None
    # gpt-oss (models/gpt_oss.py): a learned logit per head in each attention softmax's denominator
    # (the torch attention backend only, see executor.py), biased router and experts whose
    # activation is `expert_swiglu`, and experts stored in MXFP4 (dequantized at load).
    attention_sinks: bool = False
    expert_swiglu: ClampedSwiGLU | None = None
    mxfp4_experts: bool = False

    def __post_init__(self) -> None:
        if not self.layer_kinds:
            self.layer_kinds = attention_layers([None] * self.num_layers)

    @property
    def sliding_windows(self) -> list[int | None]:
        return [k.window for k in self.layer_kinds]

    @property
    def softmax_scale(self) -> float:
        """The attention logits' scale: 1/sqrt(query width), times DeepSeek's YaRN `mscale_all_dim`
        correction squared where the config asks for it (the rotary tables' own attention factor
        covers only `mscale`, and only the rotary dims; HF's `yarn_apply_mscale`)."""
        mla = self.latent_attention
        if mla is None:
            return self.head_dim**-0.5 if self.attention_multiplier is None else self.attention_multiplier
        scale = mla.qk_head_dim**-0.5
        all_dim = self.rope_scaling.get("mscale_all_dim")
        if self.rope_scaling.get("rope_type", "default") != "default" and all_dim:
            factor = float(self.rope_scaling["factor"])
            m = 0.1 * float(all_dim) * math.log(factor) + 1.0 if factor > 1 else 1.0
            scale *= m * m
        return scale

    def context_length(self, asked: int | None) -> int:
        """The context the engine runs: `asked` (--max-model-len) or the positions the RoPE reaches
        (`scaled_positions`). Past max_position_embeddings, HF's dynamic NTK rescales every
        frequency by the sequence's current length, which keys already rotated into a paged cache
        cannot follow: refused, not served with other numbers than HF's. Static scalings run past
        the RoPE's reach as HF runs them, with a warning (vLLM refuses it without an opt-in):
        positions the checkpoint never saw, unless it was trained on them."""
        limit = self.scaled_positions
        self._check_longrope_context(asked)
        if asked and asked > limit and self.rope_scaling.get("rope_type") == "dynamic":
            raise ModelLoadError(
                f"--max-model-len {asked} is past max_position_embeddings {limit}, where dynamic NTK "
                "RoPE rescales its frequencies by each sequence's length; a paged K/V cache cannot "
                f"reproduce that, so this checkpoint's context is at most {limit} tokens"
            )
        if asked and asked > limit:
            log.warning(
                "--max-model-len %d is past the checkpoint's %d positions (max_position_embeddings %d, "
                "RoPE %s): outputs past %d tokens may degrade unless the model was trained for them",
                asked, limit, self.max_position_embeddings, self.rope_scaling.get("rope_type"), limit,
            )  # fmt: skip
        return asked or limit

    def _check_longrope_context(self, asked: int | None) -> None:
        """LongRoPE (Phi-3) as HF runs it rotates every position of a forward pass with the long
        factors once the sequence passes original_max_position_embeddings, and with the short ones
        before: the keys a paged K/V cache (and its shared prefixes) already holds were rotated with
        the short factors, so past that length no engine step is HF's. Served up to it, exactly."""
        rope = self.rope_scaling
        if rope.get("rope_type") != "longrope" or not asked or asked <= self.scaled_positions:
            return
        raise ModelLoadError(
            f"--max-model-len {asked} is past original_max_position_embeddings {self.scaled_positions}, "
            "where LongRoPE switches a sequence's rotary frequencies to its long factors for every "
            "position, keys already cached included; a paged K/V cache cannot reproduce that, so this "
            f"checkpoint's context is at most {self.scaled_positions} tokens"
        )

    @property
    def scaled_positions(self) -> int:
        """The positions the checkpoint's RoPE reaches: max_position_embeddings, or for YaRN its
        pretraining length times `factor` where that is more. Qwen2.5's and Qwen3's model cards
        extend the context by adding YaRN to a config.json whose max_position_embeddings stays the
        pretraining 32,768 (40,960); vLLM serves such a checkpoint 131,072 tokens, and so does this
        engine, instead of refusing every prompt past the length the scaling was added to pass."""
        rope = self.rope_scaling
        if rope.get("rope_type") == "longrope":  # the short factors' reach (_check_longrope_context)
            return min(self.max_position_embeddings, int(rope["original_max_position_embeddings"]))
        if rope.get("rope_type") != "yarn":
            return self.max_position_embeddings
        scaled = float(rope.get("original_max_position_embeddings") or 0) * float(rope.get("factor") or 1)
        return max(self.max_position_embeddings, int(scaled))

    @property
    def mtp_layers(self) -> int:
        return len(self.mtp_layer_kinds)

    @property
    def mtp_prefixes(self) -> tuple[str, ...]:
        """The checkpoint name prefix of each MTP layer's tensors."""
        return tuple(f"model.layers.{self.num_layers + i}." for i in range(self.mtp_layers))

    @property
    def left_on_disk(self) -> tuple[str, ...]:
        """The name prefixes of the checkpoint's tensors the target does not load: its MTP layers."""
        return self.mtp_prefixes + (("mtp.",) if self.qwen3_next_mtp_layers else ())

    def mtp_layer_config(self) -> ModelConfig:
        """The config of the first MTP layer as a one-layer model: its layer kind, and a K/V cache
        of its own (`KVCache.for_model`) whose layer 0 it is."""
        return replace(self, num_layers=1, layer_kinds=self.mtp_layer_kinds[:1], mtp_layer_kinds=[])

    @property
    def num_state_layers(self) -> int:
        """Layers that keep a recurrent state per sequence instead of K/V blocks."""
        return sum(not k.holds_kv for k in self.layer_kinds)

    @classmethod
    def from_hf(cls, raw: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelConfig:
        """Build from a `config.json` dict; refuse what the engine cannot run, naming the field. A
        field the dict leaves out means what transformers' config class defaults it to. A value
        of a shape no reader expects (a string for `rope_scaling`, a number for `layer_types`, zero
        heads) is a ModelLoadError too, never a traceback ending the pod's start."""
        try:
            return cls._from_hf(raw, generation_config)
        except ModelLoadError:
            raise
        except (TypeError, ValueError, ArithmeticError, AttributeError, IndexError) as e:
            raise ModelLoadError(f"config.json cannot be read: {type(e).__name__}: {e}") from e

    @classmethod
    def _from_hf(cls, raw: dict[str, Any], generation_config: dict[str, Any] | None) -> ModelConfig:
        raw = with_hf_defaults(raw)
        _check_numbers(raw)
        archs = raw.get("architectures") or []
        family = hf_family(raw)
        if family is None:
            raise ModelLoadError(
                f"unsupported architecture {archs or raw.get('model_type')!r}; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        # HF: Llama/Qwen3 put `attention_bias` on q/k/v/o; Qwen2 always has q/k/v bias and no o bias;
        # Mistral has no bias at all whatever the config says.
        attention_bias = family in (
            "llama", "qwen3", "qwen3_moe", "qwen3_next", "granite", "olmo2", *DEEPSEEK_FAMILIES,
            *GEMMA_FAMILIES, "gpt_oss",
        ) and bool(raw.get("attention_bias", False))  # fmt: skip
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            layers = int(raw["num_hidden_layers"])
            cfg = cls(
                family=family,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=layers,
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                qkv_bias=family == "qwen2" or attention_bias or _qwen2_moe_qkv_bias(raw, family),
                o_proj_bias=attention_bias,
                mlp_bias=family in ("llama", "deepseek_v2", "granite") and bool(raw.get("mlp_bias", False)),
                qk_norm=family in ("qwen3", "qwen3_moe", "qwen3_next", "gemma3_text"),
                hidden_act=_activation(raw, family),
            )
        except KeyError as e:
            raise ModelLoadError(f"config.json is missing required field {e.args[0]!r}") from e
        cfg.rope_theta, cfg.rope_scaling = _rope_from_hf(raw)
        # compressed-tensors' older checkpoints say `compression_config`
        quantization = raw.get("quantization_config") or raw.get("compression_config")
        if family == "gpt_oss":
            quantization = _gpt_oss_from_hf(raw, cfg, quantization)
        cfg.quantization = quantization_scheme(quantization)
        cfg.layer_kinds = attention_layers(_sliding_windows_from_hf(raw, family, layers))
        if family in GEMMA_FAMILIES:
            _gemma_from_hf(raw, cfg)
        if family == "qwen3_next":
            _hybrid_from_hf(raw, cfg)
        if family == "granite":
            _granite_from_hf(raw, cfg)
        if family == "phi3":
            cfg.rotary_dim = _partial_rotary_dim(raw, cfg.head_dim)
            _check_longrope_factors(cfg)
        if family in DEEPSEEK_FAMILIES:
            _deepseek_from_hf(raw, cfg)
        elif family in MOE_FAMILIES:
            _moe_from_hf(cfg, raw)
        cfg.eos_token_ids = _token_ids(raw.get("eos_token_id"))
        if generation_config:
            for t in _token_ids(generation_config.get("eos_token_id")):
                if t not in cfg.eos_token_ids:
                    cfg.eos_token_ids.append(t)
        bos = raw.get("bos_token_id")
        cfg.bos_token_id = bos if isinstance(bos, int) else None
        return cfg


# config.json's numeric fields, as transformers' config classes type them: an int field takes an
# integer, a float field any number; a required one (left out: a missing-field error) may not be null.
_INT_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "original_max_position_embeddings",
    "sliding_window", "sliding_window_pattern", "num_local_experts", "num_experts_per_tok",
    "query_pre_attn_scalar", "moe_intermediate_size",
)  # fmt: skip
_FLOAT_FIELDS = (
    "rms_norm_eps", "rope_theta", "rope_local_base_freq", "partial_rotary_factor", "final_logit_softcapping",
    "attn_logit_softcapping", "swiglu_alpha", "swiglu_limit",
)  # fmt: skip
_NOT_NULL = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "rms_norm_eps", "max_position_embeddings", "query_pre_attn_scalar")  # fmt: skip


def _check_numbers(raw: dict[str, Any]) -> None:
    """Refuse a numeric field of another type, naming it: a null, a string or a list read by
    `int()` / `float()` ended the load in a TypeError traceback naming no field, and a string such
    as "12" (which transformers' strict config classes refuse) was read as the number."""
    for name in (*_INT_FIELDS, *_FLOAT_FIELDS):
        value = raw.get(name)
        if value is None:
            if name in raw and name in _NOT_NULL:
                raise ModelLoadError(f"config.json's {name} must be a number, got null")
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not number or (name in _INT_FIELDS and value != int(value)):
            kind = "an integer" if name in _INT_FIELDS else "a number"
            raise ModelLoadError(f"config.json's {name} must be {kind}, got {value!r:.100}")


def _activation(raw: dict[str, Any], family: str) -> str:
    """The MLP's activation as HF reads it: Gemma's `hidden_activation` (HF ignores the `hidden_act`
    its configs also carry), else `hidden_act`. One the MLP cannot compute is refused:
    Llama-architecture checkpoints with ReLU MLPs exist on the hub, and running them with SiLU
    would give fluent-looking wrong tokens."""
    field_name = "hidden_activation" if family in GEMMA_FAMILIES else "hidden_act"
    act = raw.get(field_name, "silu")
    supported = SUPPORTED_ACTIVATIONS + (() if family in MOE_FAMILIES else GELU_ACTIVATIONS)
    if act not in supported:
        raise ModelLoadError(f"unsupported {field_name} {act!r} for {family}; supported: {supported}")
    return act


def _gemma_from_hf(raw: dict[str, Any], cfg: ModelConfig) -> None:
    """Gemma 2 / 3 text: the attention scale (1/sqrt(query_pre_attn_scalar), in Granite's field),
    the soft-caps and Gemma 3's two RoPEs. HF's Gemma 3 attention never hands
    `attn_logit_softcapping` to its attention function, so that field is read for Gemma 2 only.
    EmbeddingGemma's bidirectional attention is no causal decoder."""
    if raw.get("use_bidirectional_attention"):
        raise ModelLoadError(
            "use_bidirectional_attention is set: an encoder (EmbeddingGemma), not a causal decoder"
        )
    cfg.attention_multiplier = float(raw["query_pre_attn_scalar"]) ** -0.5  # the softmax scale
    cfg.final_logit_softcapping = _softcap(raw, "final_logit_softcapping")
    if cfg.family == "gemma2":
        cfg.attn_logit_softcapping = _softcap(raw, "attn_logit_softcapping")
    if cfg.family == "gemma3_text":
        full, sliding = (
            _rope_from_hf({**raw, "rope_scaling": None, "rope_parameters": params})
            for params in _gemma3_rope_dicts(raw)
        )
        cfg.rope_theta, cfg.rope_scaling = full
        cfg.sliding_rope = sliding


def _gpt_oss_from_hf(raw: dict[str, Any], cfg: ModelConfig, quantization: Any) -> Any:
    """gpt-oss's sinks and clamped SwiGLU (transformers' defaults for what config.json leaves
    out); an `mxfp4` quantization_config, the hub checkpoints', marks the experts as MXFP4 blocks
    to dequantize at load (`mxfp4.dequantize_experts`) and is no FP8 scheme: returned as None.
    HF's mxfp4 quantizes the experts only, whatever `modules_to_not_convert` lists."""
    cfg.attention_sinks = True
    try:
        cfg.expert_swiglu = ClampedSwiGLU(float(raw["swiglu_alpha"]), float(raw["swiglu_limit"]))
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"gpt-oss's swiglu_alpha and swiglu_limit must be numbers: {e}") from e
    if isinstance(quantization, dict) and quantization.get("quant_method") == "mxfp4":
        cfg.mxfp4_experts = True
        return None
    return quantization


def _softcap(raw: dict[str, Any], name: str) -> float | None:
    cap = raw.get(name)
    if cap is not None and float(cap) <= 0:
        raise ModelLoadError(f"{name} must be positive or null, got {cap!r}")
    return float(cap) if cap is not None else None


def _gemma3_rope_dicts(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The RoPE dicts of Gemma 3's full and sliding layers as transformers builds them: a
    transformers 5 config keys them by layer type in `rope_parameters`; a hub config says
    `rope_theta` (1e6) and `rope_scaling` for the full layers and `rope_local_base_freq` (1e4)
    for the sliding ones, which are never scaled."""
    per_type = raw.get("rope_parameters") or {}
    full = dict(per_type.get("full_attention") or {"rope_type": "default"})
    full.update(raw.get("rope_scaling") or {})
    full.setdefault("rope_theta", raw.get("rope_theta", 1e6))
    sliding = dict(per_type.get("sliding_attention") or {"rope_type": "default"})
    sliding.setdefault("rope_theta", raw.get("rope_local_base_freq", 1e4))
    return full, sliding


def _token_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _hf_rope_dict(raw: dict[str, Any]) -> dict[str, Any]:
    """A copy of the RoPE dict transformers reads: the legacy `rope_scaling` when set, even beside
    `rope_parameters` (a model card's "add rope_scaling to config.json" on a config transformers 5
    saved must take effect, as it does in HF), else `rope_parameters`."""
    return dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})


def _rope_from_hf(raw: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    params = _hf_rope_dict(raw)
    theta = float(params.pop("rope_theta", None) or raw.get("rope_theta") or 10000.0)
    params.pop("partial_rotary_factor", None)  # a head-dim split, not a frequency scaling: see rotary_dim
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type in ("su", "yarn") and hf_family(raw) == "phi3":
        rope_type = "longrope"  # Phi3Config reads its legacy spellings so
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"unsupported RoPE scaling type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}"
        )
    params["rope_type"] = rope_type
    # As HF: a top-level `original_max_position_embeddings` (Phi-3's spelling) overrides the dict's;
    # the pretraining length defaults to max_position_embeddings, and a YaRN config without
    # `factor` means the ratio of the two.
    if rope_type in ("llama3", "yarn", "longrope") and raw.get("original_max_position_embeddings"):
        params["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
    if rope_type in ("llama3", "yarn", "longrope") and not params.get("original_max_position_embeddings"):
        params["original_max_position_embeddings"] = raw.get("max_position_embeddings", 2048)
    if (
        rope_type in ("yarn", "longrope")
        and params.get("factor") is None
        and raw.get("max_position_embeddings")
    ):
        params["factor"] = raw["max_position_embeddings"] / params["original_max_position_embeddings"]
    missing = [k for k in _ROPE_REQUIRED_KEYS.get(rope_type, ()) if params.get(k) is None]
    if missing:
        raise ModelLoadError(
            f"RoPE scaling type {rope_type!r} needs {missing} in config.json's rope_parameters"
        )
    return theta, params


_ROPE_REQUIRED_KEYS = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "yarn": ("factor",),
    "longrope": ("short_factor", "long_factor"),
}


def _partial_rotary_dim(raw: dict[str, Any], head_dim: int) -> int:
    """The head dims RoPE rotates: `partial_rotary_factor` of head_dim, read where HF reads it
    (the RoPE dict's over the top level's; 1.0 where neither says)."""
    factor = _hf_rope_dict(raw).get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    return int(head_dim * float(factor))


def _check_longrope_factors(cfg: ModelConfig) -> None:
    """LongRoPE scales each rotary frequency by its own factor: lists of another length than the
    rotated dims' half (HF only warns) would fail mid-forward or rotate by the wrong frequencies."""
    rope, half = cfg.rope_scaling, (cfg.rotary_dim or cfg.head_dim) // 2
    if rope["rope_type"] != "longrope":
        return
    for key in ("short_factor", "long_factor"):
        if not isinstance(rope[key], list) or len(rope[key]) != half:
            raise ModelLoadError(f"LongRoPE {key} must list {half} numbers (half the rotated head dims)")


def _granite_from_hf(raw: dict[str, Any], cfg: ModelConfig) -> None:
    """Granite's multipliers; transformers' 1.0 for one config.json leaves out (attention_multiplier
    too: then the softmax scale is 1, not 1/sqrt(head_dim)). A null or a string is refused: HF's
    strict config refuses it, and serving 1.0 instead would change every token."""
    values = {}
    for key in ("embedding_multiplier", "residual_multiplier", "logits_scaling", "attention_multiplier"):
        value = raw.get(key, 1.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ModelLoadError(f"Granite's {key} must be a number, got {value!r}")
        values[key] = float(value)
    if values["logits_scaling"] == 0:
        raise ModelLoadError("Granite's logits_scaling divides the logits: it cannot be 0")
    for key, value in values.items():
        setattr(cfg, key, value)


def _sliding_windows_from_hf(raw: dict[str, Any], family: str, layers: int) -> list[int | None]:
    """Mistral, Mixtral and Phi-3 slide in every layer when `sliding_window` is set; the Qwen families
    only when `use_sliding_window` also says so, Qwen3-MoE in every layer, the others per layer;
    Gemma and gpt-oss by `layer_types`. Llama, Qwen3-Next and DeepSeek never slide (HF ignores
    the field for them)."""
    if family in (*GEMMA_FAMILIES, "gpt_oss"):
        return _layer_type_windows(raw, family, layers)
    window = raw.get("sliding_window")
    if not window:
        return [None] * layers
    if family in ("mistral", "mixtral", "phi3"):
        return [int(window)] * layers
    if family not in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") or not raw.get("use_sliding_window"):
        return [None] * layers
    if family == "qwen3_moe":
        return [int(window)] * layers
    types = raw.get("layer_types") or _qwen_layer_types(raw, family, layers)
    _check_attention_layer_types(types, layers)
    return [int(window) if t == "sliding_attention" else None for t in types]


def _layer_type_windows(raw: dict[str, Any], family: str, layers: int) -> list[int | None]:
    """Gemma and gpt-oss slide the layers `layer_types` names; a config without it (written before
    the field) all but every `sliding_window_pattern`-th layer (Gemma 3, 6 by default) or every
    other one (Gemma 2, gpt-oss), as transformers derives them. Gemma 3 picks each layer's RoPE
    by its type, so a sliding layer without a window is refused rather than run with the other
    RoPE."""
    pattern = int(raw.get("sliding_window_pattern") or 6) if family == "gemma3_text" else 2
    types = raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
    ]
    _check_attention_layer_types(types, layers)
    window = raw.get("sliding_window")
    if not window and "sliding_attention" in types:
        raise ModelLoadError("layer_types names sliding_attention layers but sliding_window is not set")
    return [int(window) if t == "sliding_attention" else None for t in types]


def _check_attention_layer_types(types: list[str], layers: int) -> None:
    """A `layer_types` must name each layer's attention, as HF's config validation demands: a list
    one layer short failed on an index later, and an entry other than the two (a typo such as
    "sliding", or another family's "chunked_attention") ran as full attention without a word."""
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown or len(types) != layers:
        raise ModelLoadError(
            f"layer_types must list {layers} of ['full_attention', 'sliding_attention'], got {types}"
        )


def _qwen_layer_types(raw: dict[str, Any], family: str, layers: int) -> list[str]:
    """HF's layer types for a sliding Qwen config.json that does not list them (those written
    before transformers had `layer_types`): Qwen2/Qwen3 slide from layer `max_window_layers` on;
    Qwen2-MoE slides the even layers *below* it (transformers' own rule for that family)."""
    max_window_layers = int(raw["max_window_layers"])  # HF_DEFAULTS has each Qwen family's
    if family == "qwen2_moe":
        sliding = [i % 2 == 0 and i < max_window_layers for i in range(layers)]
    else:
        sliding = [i >= max_window_layers for i in range(layers)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def _qwen2_moe_qkv_bias(raw: dict[str, Any], family: str) -> bool:
    """Qwen2-MoE's q/k/v carry a bias unless a transformers 5.x config says `qkv_bias: false`."""
    return family == "qwen2_moe" and bool(raw.get("qkv_bias", True))


def _moe_from_hf(cfg: ModelConfig, raw: dict[str, Any]) -> None:
    """The MoE sizes and which layers are sparse. Mixtral: every layer, experts as wide as
    `intermediate_size`, top-k always renormalized. Qwen: layer i is sparse unless listed in
    `mlp_only_layers` or off the `decoder_sparse_step` stride; dense layers keep `intermediate_size`.
    Qwen3-MoE hub configs say `num_experts`, transformers 5.x writes `num_local_experts`."""
    try:
        cfg.num_experts = int(raw["num_experts"] if "num_experts" in raw else raw["num_local_experts"])
        cfg.num_experts_per_tok = int(raw["num_experts_per_tok"])
        if cfg.family in ("mixtral", "gpt_oss"):  # gpt-oss: softmax over the top-k logits, the same
            cfg.moe_intermediate_size, cfg.norm_topk_prob = cfg.intermediate_size, True
        else:
            cfg.moe_intermediate_size = int(raw["moe_intermediate_size"])
            cfg.norm_topk_prob = bool(raw.get("norm_topk_prob", False))
            cfg.shared_expert_intermediate_size = int(raw.get("shared_expert_intermediate_size") or 0)
        sparse = moe_layers(
            cfg.family, raw, cfg.num_layers
        )  # spindle/architectures.py: the service's rule too
    except KeyError as e:
        raise ModelLoadError(f"config.json is missing required MoE field {e.args[0]!r}") from e
    if any(sparse) and not 0 < cfg.num_experts_per_tok <= cfg.num_experts:
        raise ModelLoadError(
            f"num_experts_per_tok {cfg.num_experts_per_tok} must be between 1 and "
            f"num_experts {cfg.num_experts}"
        )
    cfg.layer_kinds = [replace(k, moe=s) for k, s in zip(cfg.layer_kinds, sparse, strict=True)]


def _hybrid_from_hf(raw: dict[str, Any], cfg: ModelConfig) -> None:
    """Qwen3-Next: per-layer linear / full attention, Gated DeltaNet sizes, partial rotary."""
    try:
        cfg.linear_attention = LinearAttentionShape(
            num_key_heads=int(raw["linear_num_key_heads"]),
            num_value_heads=int(raw["linear_num_value_heads"]),
            key_head_dim=int(raw["linear_key_head_dim"]),
            value_head_dim=int(raw["linear_value_head_dim"]),
            conv_kernel=int(raw["linear_conv_kernel_dim"]),
        )
    except KeyError as e:
        raise ModelLoadError(f"config.json is missing required field {e.args[0]!r}") from e
    shape = cfg.linear_attention
    if shape.num_value_heads % shape.num_key_heads:
        raise ModelLoadError("linear_num_value_heads must be a multiple of linear_num_key_heads")
    cfg.rotary_dim = _partial_rotary_dim(raw, cfg.head_dim)
    types = layer_types(cfg.family, raw, cfg.num_layers)
    mixers = {"linear_attention": Mixer.LINEAR_ATTENTION, "full_attention": Mixer.FULL_ATTENTION}
    unknown = sorted(set(types) - set(mixers))
    if unknown or len(types) != cfg.num_layers:
        raise ModelLoadError(f"layer_types must list {cfg.num_layers} of {sorted(mixers)}, got {types}")
    cfg.layer_kinds = [LayerKind(mixers[t]) for t in types]  # which are sparse: _moe_from_hf
    cfg.qwen3_next_mtp_layers = int(raw.get("mtp_num_hidden_layers") or 0)


def _deepseek_from_hf(raw: dict[str, Any], cfg: ModelConfig) -> None:
    """DeepSeek-V2/V3: MLA in every layer; MoE from layer `first_k_dense_replace` on, every
    `moe_layer_freq`-th, with `n_shared_experts` ungated shared experts of the experts' width.

    Routing: V2 renormalizes the top-k only if `norm_topk_prob` and then scales by
    `routed_scaling_factor` (vLLM's and HF's order; every V2 checkpoint has norm_topk_prob false,
    where DeepSeek's own code agrees); V3 as HF and DeepSeek's code."""
    try:
        cfg.latent_attention = LatentAttentionShape(
            q_lora_rank=int(raw["q_lora_rank"]) if raw.get("q_lora_rank") else None,
            kv_lora_rank=int(raw["kv_lora_rank"]),
            qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
            qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
            v_head_dim=int(raw["v_head_dim"]),
            # V2's rotary is always interleaved (complex multiplication); V3 says so, default true
            rope_interleave=cfg.family == "deepseek_v2" or bool(raw.get("rope_interleave", True)),
        )
        experts = int(raw.get("n_routed_experts") or 0)
        cfg.num_experts = experts
        cfg.num_experts_per_tok = int(raw.get("num_experts_per_tok") or 0)
        cfg.moe_intermediate_size = int(raw["moe_intermediate_size"]) if experts else 0
    except KeyError as e:
        raise ModelLoadError(f"config.json is missing required DeepSeek field {e.args[0]!r}") from e
    mla = cfg.latent_attention
    cfg.num_kv_heads, cfg.head_dim, cfg.rotary_dim = cfg.num_heads, mla.qk_head_dim, mla.qk_rope_head_dim
    cfg.norm_topk_prob = bool(raw.get("norm_topk_prob", False))
    cfg.shared_expert_intermediate_size = cfg.moe_intermediate_size * int(raw.get("n_shared_experts") or 0)
    cfg.shared_expert_gated = False
    cfg.routing = _deepseek_routing(raw, cfg.family, experts)
    mtp = int(raw.get("num_nextn_predict_layers") or 0)
    sparse = moe_layers(cfg.family, raw, cfg.num_layers + mtp)
    if any(sparse) and not 0 < cfg.num_experts_per_tok <= experts:
        raise ModelLoadError(
            f"num_experts_per_tok {cfg.num_experts_per_tok} must be between 1 and n_routed_experts {experts}"
        )
    decoder = sparse[: cfg.num_layers]
    cfg.layer_kinds = [replace(k, moe=s) for k, s in zip(cfg.layer_kinds, decoder, strict=True)]
    cfg.mtp_layer_kinds = [LayerKind(Mixer.FULL_ATTENTION, moe=s) for s in sparse[cfg.num_layers :]]


def _deepseek_routing(raw: dict[str, Any], family: str, experts: int) -> Routing:
    scaling = float(raw.get("routed_scaling_factor") or 1.0)
    groups, topk_groups = int(raw.get("n_group") or 1), int(raw.get("topk_group") or 1)
    if family == "deepseek_v3":  # HF's V3 always routes noaux_tc, whatever `topk_method` says
        routing = Routing("sigmoid", "top2_sum", groups, topk_groups, True, scaling, True)
    else:
        method = raw.get("topk_method") or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise ModelLoadError(
                f"DeepSeek-V2 topk_method {method!r} is not supported; "
                "supported: greedy, group_limited_greedy"
            )
        if method == "greedy":
            groups = topk_groups = 1
        group_score = "max" if method == "group_limited_greedy" else None
        routing = Routing("softmax", group_score, groups, topk_groups, False, scaling, True)
    if routing.group_score and (experts % groups or not 0 < topk_groups <= groups):
        raise ModelLoadError(
            f"n_group {routing.num_groups} must divide n_routed_experts {experts} and "
            f"topk_group {routing.topk_groups} must be between 1 and n_group"
        )
    return routing
