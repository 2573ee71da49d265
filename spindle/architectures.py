"""Which model families the engine serves and which of their layers are mixture-of-experts, read
from an HF `config.json` dict without torch.

The pods (model_service/models/config.py) and the adapter service (adapter_service/base_model.py)
both need this: a LoRA on gate/up/down of an MoE layer is refused by the pod, so the adapter
service must refuse it at upload by the same rule, and one function keeps the two from drifting.
"""

from __future__ import annotations

from typing import Any

# Architectures whose forward pass is the Llama decoder with small switches (or MLA, for DeepSeek).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen3NextForCausalLM": "qwen3_next",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "GraniteForCausalLM": "granite",  # Llama with embedding / residual / attention / logits multipliers
    "Olmo2ForCausalLM": "olmo2",  # post-norm residual blocks, q/k RMSNorm over the whole projection
    "Phi3ForCausalLM": "phi3",  # fused qkv_proj / gate_up_proj in the checkpoint, partial rotary, LongRoPE
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "GptOssForCausalLM": "gpt_oss",  # attention sinks, biased MoE with a clamped SwiGLU (models/gpt_oss.py)
}
MODEL_TYPES = {family: family for family in SUPPORTED_ARCHITECTURES.values()}  # config.json model_type
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "qwen3_next", "deepseek_v2", "deepseek_v3", "gpt_oss")
DEEPSEEK_FAMILIES = ("deepseek_v2", "deepseek_v3")
# Gated attention (Qwen3-Next): q_proj writes each head's query and its output gate, 2 x head_dim.
GATED_ATTENTION_FAMILIES = ("qwen3_next",)
HYBRID_FAMILIES = ("qwen3_next",)  # layers of Gated DeltaNet (linear attention) between attention layers
# Phi-3: one qkv_proj and one gate_up_proj in the checkpoint, and so in PEFT adapters' targets.
FUSED_PROJECTION_FAMILIES = ("phi3",)
# Gemma 2 / Gemma 3 text: the Llama decoder with (1 + weight) norms around both blocks, scaled
# embeddings, a GELU MLP, and their own attention scale and soft-capping (models/gemma.py).
GEMMA_FAMILIES = ("gemma2", "gemma3_text")


_GEMMA = {
    "num_key_value_heads": 4,
    "head_dim": 256,
    "sliding_window": 4096,
    "query_pre_attn_scalar": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True,
    "eos_token_id": 1,
    "bos_token_id": 2,
}
_QWEN_SLIDING = {"max_position_embeddings": 32768, "sliding_window": 4096, "max_window_layers": 28}
# What transformers assumes for a field config.json leaves out, where it differs from the generic
# fallback the readers use (hidden_size // heads for head_dim, all heads for K/V, eps 1e-6, theta
# 1e4, 2,048 positions, no sliding window, no renormalized top-k, no q LoRA, no shared experts,
# plain routing). Hand-written and older configs leave fields out, and their weights were trained
# and saved by HF's meaning of the omission. tests/test_hf_config.py checks each against the
# installed transformers' config classes.
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "mistral": {"max_position_embeddings": 131072, "sliding_window": 4096, "num_key_value_heads": 8},
    "qwen2": {**_QWEN_SLIDING, "num_key_value_heads": 32},
    "qwen3": {**_QWEN_SLIDING, "num_key_value_heads": 32, "head_dim": 128},
    "mixtral": {
        "max_position_embeddings": 131072,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1e6,
    },
    "qwen2_moe": {**_QWEN_SLIDING, "num_key_value_heads": 16, "shared_expert_intermediate_size": 5632},
    "qwen3_moe": {"max_position_embeddings": 32768, "sliding_window": 4096, "num_key_value_heads": 4},
    "qwen3_next": {
        "max_position_embeddings": 32768,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "partial_rotary_factor": 0.25,
        "norm_topk_prob": True,
        "shared_expert_intermediate_size": 512,
    },
    "deepseek_v2": {"q_lora_rank": 1536, "n_shared_experts": 2},
    "olmo2": {"rms_norm_eps": 1e-5},
    "phi3": {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "original_max_position_embeddings": 4096},
    "gemma2": {
        **_GEMMA,
        "max_position_embeddings": 8192,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
    },
    "gemma3_text": {**_GEMMA, "max_position_embeddings": 131072, "rope_theta": 1e6},
    "gpt_oss": {
        "num_key_value_heads": 8,
        "head_dim": 64,
        "sliding_window": 128,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "num_local_experts": 128,
        "num_experts_per_tok": 4,
        "attention_bias": True,
        "rope_theta": 150000.0,
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
    },
    "deepseek_v3": {
        "max_position_embeddings": 4096,
        "q_lora_rank": 1536,
        "n_shared_experts": 1,
        "first_k_dense_replace": 3,
        "n_group": 8,
        "topk_group": 4,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
    },
}


def family(raw: dict[str, Any]) -> str | None:
    """The family of a `config.json`: its first supported `architectures` entry, else its
    `model_type` unless `architectures` names models of another kind; None when the engine does
    not serve it."""
    archs = raw.get("architectures") or []
    found = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if found is not None or not _may_generate(archs):
        return found
    return MODEL_TYPES.get(raw.get("model_type", ""))


def _may_generate(archs: list[str]) -> bool:
    """Whether `architectures` leaves room for a causal LM under an unlisted name (none given, or
    a fork's *ForCausalLM class). A reward model (`Gemma2ForSequenceClassification`) or an
    embedding backbone (`Gemma2Model`) shares its family's `model_type` but has no LM head: read
    by `model_type`, it was loaded as a generator and refused on a tensor it has or lacks."""
    return not archs or any("ForCausalLM" in a or a.endswith("LMHeadModel") for a in archs)


def with_hf_defaults(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` with transformers' default for each family field it leaves out (`HF_DEFAULTS`); a field
    present, even as null, is kept: HF keeps an explicit null too."""
    return {**HF_DEFAULTS.get(family(raw) or "", {}), **raw}


def moe_layers(family: str | None, raw: dict[str, Any], count: int) -> list[bool]:
    """Whether each of the first `count` layers has a mixture-of-experts MLP (DeepSeek counts its
    MTP layers after the decoder's). DeepSeek: from `first_k_dense_replace` on, every
    `moe_layer_freq`-th, when it has `n_routed_experts`. Mixtral: every layer. Qwen MoE: layer i
    unless listed in `mlp_only_layers` or off the `decoder_sparse_step` stride. Raises KeyError
    for a Qwen MoE config without `num_experts` / `num_local_experts` (the caller names it)."""
    if family in DEEPSEEK_FAMILIES:
        experts = int(raw.get("n_routed_experts") or 0)
        first_dense, freq = int(raw.get("first_k_dense_replace") or 0), int(raw.get("moe_layer_freq") or 1)
        return [experts > 0 and i >= first_dense and i % freq == 0 for i in range(count)]
    if family in ("mixtral", "gpt_oss"):
        return [True] * count
    if family in MOE_FAMILIES:
        experts = int(raw["num_experts"] if "num_experts" in raw else raw["num_local_experts"])
        dense, step = set(raw.get("mlp_only_layers") or []), int(raw.get("decoder_sparse_step") or 1)
        return [experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(count)]
    return [False] * count


def layer_types(family: str | None, raw: dict[str, Any], count: int) -> list[str]:
    """Each layer's mixer as `config.json` names it: "linear_attention" or "full_attention" for a
    hybrid (its `layer_types`, else every `full_attention_interval`-th layer full), otherwise
    "full_attention" (sliding windows aside). The pod validates the names; the adapter service
    needs them because a linear-attention layer has no q/k/v/o projection to adapt."""
    if family not in HYBRID_FAMILIES:
        return ["full_attention"] * count
    interval = int(raw.get("full_attention_interval", 4))
    return raw.get("layer_types") or [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(count)
    ]
