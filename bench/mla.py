"""MLA decode on a DeepSeek-V2-Lite-shaped model (random bf16 weights): tokens/s at each batch,
and how close a step comes to its bandwidth floor.

Setup (printed in every line): 27 layers (`--layers`), hidden 2048, 16 heads, latent 512 + rope
64, q_proj without a q LoRA, 64 routed experts (top 6, width 1408) and 2 shared, the first layer
dense; one CUDA device, bf16, greedy, prompts of `--prompt-len` random tokens, `--new-tokens`
generated; decode tokens/s measured as bench/gpu.py measures it (prefill excluded), with decode
graphs and eagerly (`--eager` lines): decode rows through the Triton latent kernel
(kernels/mla_decode.py), prefill in torch.

The floor of one decode step is the bytes it must read: every weight a token touches (attention,
the dense layer, each MoE layer's router, shared experts and the routed experts the batch hits,
expected E * (1 - (1 - k/E)^batch) of them; embedding rows, LM head) plus the latent cache of
every sequence (context x layers x 576 x 2 bytes). `floor_fraction` = those bytes per second over
the card's copy bandwidth (bench/gpu.py's `copy_bandwidth`, read + write).

    python bench/mla.py [--batches 1 64] [--layers 27] [--prompt-len 512] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.gpu import copy_bandwidth, decode_tok_s, random_module
from model_service.engine.config import EngineConfig
from model_service.engine.engine import Engine
from model_service.models.config import ModelConfig
from model_service.models.loader import LoadedModel
from model_service.startup import configure_process

V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 102400, "hidden_size": 2048,
    "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_attention_heads": 16,
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
    "first_k_dense_replace": 1, "topk_method": "greedy", "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1},
}  # fmt: skip


def v2_lite_shape(layers: int) -> LoadedModel:
    cfg = ModelConfig.from_hf({**V2_LITE, "num_hidden_layers": layers})
    return LoadedModel("random-deepseek-v2-lite", cfg, random_module(cfg), None)


def step_bytes(cfg: ModelConfig, batch: int, context: int) -> float:
    """bf16 bytes one decode step of `batch` sequences of `context` tokens must read."""
    mla = cfg.latent_attention
    assert mla is not None
    h, heads = cfg.hidden_size, cfg.num_heads
    attention = (
        h * heads * mla.qk_head_dim
        + h * mla.cache_dim
        + mla.kv_lora_rank * heads * (mla.qk_nope_head_dim + mla.v_head_dim)
        + heads * mla.v_head_dim * h
    )
    expert = 3 * h * cfg.moe_intermediate_size
    hit = cfg.num_experts * (1 - (1 - cfg.num_experts_per_tok / cfg.num_experts) ** batch)
    sparse = sum(k.moe for k in cfg.layer_kinds)
    moe = sparse * (cfg.num_experts * h + 3 * h * cfg.shared_expert_intermediate_size + hit * expert)
    dense = (cfg.num_layers - sparse) * 3 * h * cfg.intermediate_size
    weights = cfg.num_layers * attention + moe + dense + (batch + cfg.vocab_size) * h
    cache = batch * context * cfg.num_layers * mla.cache_dim
    return 2.0 * (weights + cache)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 64])
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    loaded = v2_lite_shape(args.layers)
    cfg = loaded.config
    bandwidth = copy_bandwidth()
    setup = {"model": "deepseek-v2-lite-shape", "layers": args.layers, "dtype": "bfloat16",
             "device": torch.cuda.get_device_name(), "prompt_len": args.prompt_len,
             "new_tokens": args.new_tokens, "copy_gb_s": round(bandwidth)}  # fmt: skip
    for eager in (False, True):
        config = EngineConfig(
            device="cuda", dtype="bfloat16", max_num_seqs=max(args.batches), max_loras=0, enforce_eager=eager,
            kv_cache_memory_bytes=8 << 30, max_model_len=4096, max_num_batched_tokens=8192,
        )  # fmt: skip
        engine = Engine(config, loaded=loaded)
        for batch in args.batches:
            rate = decode_tok_s(engine, batch, args.prompt_len, args.new_tokens, cfg.vocab_size)
            context = args.prompt_len + args.new_tokens // 2  # the average step's context
            gb_s = step_bytes(cfg, batch, context) * rate / batch / 1e9
            line = {"bench": "mla_decode", "system": "spindle-eager" if eager else "spindle", "batch": batch,
                    "decode_tokens_per_s": round(rate, 1), "step_gb_s": round(gb_s),
                    "floor_fraction": round(gb_s / bandwidth, 3)}  # fmt: skip
            print(json.dumps({**line, **setup}), flush=True)
        del engine


if __name__ == "__main__":
    configure_process()
    main()
