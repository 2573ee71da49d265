"""Prefill and decode speed of the hybrid Qwen3-Next decoder (random weights, no download).

Setup (printed in every line): a Qwen3-Next-shaped model with dense MLPs (the default: 3 Gated
DeltaNet layers per gated-attention layer, Qwen3-Next-80B's mixer sizes, `--layers` layers;
`--small` for a tiny one that runs on CPU), one device, greedy, random prompt ids, EOS ignored.
- prefill: one request of `--prompt-len` tokens, one step, timed with the chunked scan and with
  the token-by-token recurrence (the two forms of `models/gated_delta.py`).
- decode: `--batches` requests decoding together; tokens/s = batch x steps / time, after prefill.
  On CUDA decode steps replay CUDA graphs (the Gated DeltaNet step kernels inside them);
  `--eager` runs them without graphs, as before those kernels. `step_mb` is what a decode step
  must move at least (`decode_step_bytes`), and on CUDA `fraction_of_copy_bandwidth` = step_mb x
  steps/s over the card's measured copy bandwidth: 1 / fraction is how far a step is above its
  bandwidth floor; `host_share` / `host_exposed` (`bench/gpu.py`'s `host_share`): the host's
  share of a waited step, and of the wall the device waits for it. `--profile B` prints, after
  the JSON lines, the device time per kernel of 8 decode steps at batch B (`bench/gpu.py`'s
  `kernel_profile`): where a step above its floor goes.
`--moe`: Qwen3-Next-80B-A3B's sparse MLPs in every layer instead (512 experts, 10 routed and a
shared one of width 512; the floor counts the experts a batch is expected to hit), ~3.2 GB a
layer in bf16: up to ~40 layers fit an H200. `--quantization fp8`: the model quantized as the
engine's `--quantization fp8` does it, a layer at a time as it is built, so the real model's 48
layers fit (~80 GB in FP8).
Prints one JSON line per result.

    python bench/hybrid.py [--layers 8] [--prompt-len 2048] [--batches 1 16 64] [--small] [--eager]
                           [--profile 1] [--moe] [--quantization fp8]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time

import torch

from bench.gpu import copy_bandwidth, generate_or_raise, host_share, kernel_profile, weight_bytes
from bench.moe import hit_fraction
from model_service.engine.config import EngineConfig
from model_service.engine.engine import Engine
from model_service.models import gated_delta
from model_service.models.config import LayerKind, LinearAttentionShape, Mixer, ModelConfig
from model_service.models.fp8_linear import quantize_online
from model_service.models.loader import LoadedModel
from model_service.models.moe import SparseMoeBlock
from model_service.models.quantization import ONLINE
from model_service.models.qwen3_next import HybridDecoderLayer, Qwen3NextModel
from model_service.startup import configure_process


def _config(layers: int, small: bool, moe: bool = False) -> ModelConfig:
    mixers = [Mixer.FULL_ATTENTION if i % 4 == 3 else Mixer.LINEAR_ATTENTION for i in range(layers)]
    hidden, inter, heads, head_dim = (128, 256, 4, 32) if small else (2048, 5120, 16, 256)
    sizes = {"hidden_size": hidden, "intermediate_size": inter, "num_heads": heads, "head_dim": head_dim}
    linear = LinearAttentionShape(2, 4, 32, 32, 4) if small else LinearAttentionShape(16, 32, 128, 128, 4)
    if moe:  # Qwen3-Next-80B-A3B's sparse MLPs in every layer: 512 experts, 10 routed and a shared one
        experts, top_k, width = (8, 2, 64) if small else (512, 10, 512)
        sizes |= {"num_experts": experts, "num_experts_per_tok": top_k, "moe_intermediate_size": width,
                  "shared_expert_intermediate_size": width, "norm_topk_prob": True}  # fmt: skip
    return ModelConfig(
        family="qwen3_next",
        vocab_size=32000,
        num_layers=layers,
        rms_norm_eps=1e-6,
        max_position_embeddings=65536,
        qk_norm=True,
        rotary_dim=sizes["head_dim"] // 4,
        linear_attention=linear,
        num_kv_heads=2,
        layer_kinds=[LayerKind(m, moe=moe) for m in mixers],
        **sizes,
    )


def _initialized(module: torch.nn.Module) -> torch.nn.Module:
    """`module`'s matrices drawn at the scale of a trained model's, its decay rates in their range."""
    for name, p in module.named_parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, 0, 0.02)
        elif name.endswith("A_log"):
            p.data.uniform_(1, 16).log_()
    return module


def _module(cfg: ModelConfig, device: str, fp8: bool) -> Qwen3NextModel:
    """The random model, built in the default dtype. With `fp8` each layer is quantized as soon as
    it is built (what `--quantization fp8` does to a loaded one), so the 16-bit copy of only one
    layer ever exists: 48 layers of Qwen3-Next-80B's experts are ~155 GB in bf16, ~80 in FP8."""
    if not fp8:
        with torch.device(device):
            return _initialized(Qwen3NextModel(cfg).eval())
    one = dataclasses.replace(cfg, num_layers=1, layer_kinds=cfg.layer_kinds[:1])
    with torch.device(device):
        module = _initialized(Qwen3NextModel(one).eval())  # embeddings, final norm, head, RoPE
    layers = []
    for i in range(cfg.num_layers):
        with torch.device(device):
            layer = _initialized(HybridDecoderLayer(cfg, i).eval())
        quantize_online(layer)
        layers.append(layer)
    module.model.layers, module.config = torch.nn.ModuleList(layers), cfg
    return module


def _engine(cfg: ModelConfig, device: str, dtype: torch.dtype, fp8: bool = False, **config: object) -> Engine:
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype: a float32 copy of the MoE shapes would not fit
    try:
        module = _module(cfg, device, fp8)
    finally:
        torch.set_default_dtype(previous)
    cfg = dataclasses.replace(cfg, quantization=ONLINE) if fp8 else cfg
    loaded = LoadedModel("hybrid-random" + "-fp8" * fp8, cfg, module, None)
    dtype_name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    return Engine(EngineConfig(device=device, dtype=dtype_name, max_loras=0, **config), loaded=loaded)


def decode_step_bytes(engine: Engine, batch: int, context: int) -> int:
    """Bytes one decode step moves at the least: every weight once (the embedding table only for
    the batch's rows; of a sparse MLP's experts those the batch is expected to hit under uniform
    routing, `bench/moe.py`'s `hit_fraction`, as its floor counts them), FP8 scales, each
    sequence's recurrent states (float32) read and written, and its K/V read at `context` tokens
    in the full-attention layers."""
    module, cfg = engine.executor.module, engine.loaded.config
    embed = module.model.embed_tokens.weight
    size = embed.element_size()
    weights = weight_bytes(module) - embed.shape[1] * size  # the row it keeps: `rows` counts the batch's
    experts_hit = hit_fraction(cfg, batch) if cfg.num_experts else 0.0
    for block in (m for m in module.modules() if isinstance(m, SparseMoeBlock)):
        experts = block.experts
        stacked = [experts.gate_up_proj, experts.down_proj]
        every = sum(t.numel() * t.element_size() for t in [*stacked, *experts.buffers()])  # + e4m3 scales
        # The shared expert's slots at the stack's end (`moe.shared_expert_slots`): read every step.
        read = (len(block.expert_range) * experts_hit + block.shared_slots) / experts.gate_up_proj.shape[0]
        weights += round(every * read) - sum(t.numel() * t.element_size() for t in stacked)
    rows = batch * embed.shape[1] * size
    states = 2 * 4 * batch * sum(math.prod(shape) for shape in module.recurrent_state_shapes())
    full = sum(kind.mixer == Mixer.FULL_ATTENTION for kind in cfg.layer_kinds)
    kv = full * batch * context * 2 * cfg.num_kv_heads * cfg.head_dim * size
    return weights + rows + states + kv


def _timed(engine: Engine, requests: list[dict], device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    generate_or_raise(engine, requests)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 32000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--eager", action="store_true", help="decode steps without CUDA graphs")
    parser.add_argument("--profile", type=int, default=0, metavar="B", help="kernel times at batch B (CUDA)")
    parser.add_argument("--moe", action="store_true", help="Qwen3-Next-80B-A3B's sparse MLPs, not dense ones")
    parser.add_argument("--quantization", default="none", choices=["none", "fp8"], help="the engine's flag")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cfg = _config(args.layers, args.small, args.moe)
    bandwidth = copy_bandwidth() if device == "cuda" else None  # before the engine takes the free memory
    engine = _engine(  # no prefix cache: every timed run computes its prompts
        cfg, device, dtype, args.quantization == "fp8", max_num_batched_tokens=max(args.prompt_len, 2048),
        block_size=16, enable_prefix_caching=False, enforce_eager=args.eager,
    )  # fmt: skip
    graphs = engine.executor.graphs is not None
    setup = {
        "device": device,
        "dtype": str(dtype),
        "layers": args.layers,
        "small": args.small,
        "graphs": graphs,
        "moe": args.moe,
        "quantization": args.quantization,
    }
    prefill = [{"prompt_token_ids": _prompt(64, 1), "max_tokens": 1, "temperature": 0}]
    _timed(engine, prefill, device)  # warm-up
    default_run = gated_delta.MIN_CHUNKED_RUN
    for form, min_run in (("chunked", default_run), ("recurrent", 1 << 30)):
        gated_delta.MIN_CHUNKED_RUN = min_run
        ids = _prompt(args.prompt_len, seed=2 if form == "chunked" else 3)  # no prefix-cache reuse
        seconds = _timed(engine, [{**prefill[0], "prompt_token_ids": ids}], device)
        rate = round(args.prompt_len / seconds, 1)
        result = {"bench": "prefill", "form": form, "prompt_len": args.prompt_len, "tokens_per_s": rate}
        print(json.dumps({**setup, **result, "seconds": round(seconds, 4)}))
    gated_delta.MIN_CHUNKED_RUN = default_run
    for batch in args.batches:

        def run(n: int, batch: int = batch) -> float:
            prompts = [_prompt(16, 100 + i) for i in range(batch)]
            greedy = {"max_tokens": n, "temperature": 0, "ignore_eos": True}
            reqs = [{"prompt_token_ids": p, **greedy} for p in prompts]
            return min(_timed(engine, reqs, device) for _ in range(2))

        run(2)  # warm-up at this batch size
        first, full = run(1), run(args.new_tokens)  # decode rate excludes the prefill: time(n) - time(1)
        rate = batch * (args.new_tokens - 1) / (full - first)
        step_bytes = decode_step_bytes(engine, batch, context=16 + args.new_tokens // 2)
        result = {"bench": "decode", "batch": batch, "new_tokens": args.new_tokens}
        result |= {"tokens_per_s": round(rate, 1), "step_mb": round(step_bytes / 1e6, 1)}
        if bandwidth is not None:
            result["fraction_of_copy_bandwidth"] = round(step_bytes * rate / batch / 1e9 / bandwidth, 3)
            share, exposed = host_share(engine, batch, 16, cfg.vocab_size)
            result |= {"host_share": round(share, 3), "host_exposed": round(exposed, 3)}
        print(json.dumps({**setup, **result}))
    if args.profile and device == "cuda":
        print(kernel_profile(engine, args.profile, 16, cfg.vocab_size))


if __name__ == "__main__":
    configure_process()
    main()
