"""Tensor parallelism on one host: a Llama-3-8B-shaped model (random bf16 weights of the real
shapes, no download) at TP=1 and TP=N. Do the outputs agree, and what does decode gain?

Setup (printed in every line): bf16 on CUDA, greedy, EOS ignored, prompts of `--prompt-len`
random token ids, NCCL between the GPUs of one host, CUDA graphs on every rank.
- parity: the last-token logits of `--parity-prompts` prompts at TP=1 and at TP=N, and a float32
  TP=1 run over the same (bf16-rounded) weights. TP=N is within bf16 tolerance when its distance
  to TP=1 is of the order of bf16's own distance to float32 (a different summation order in the
  all-reduce is all that differs). Also: greedy continuations of `--parity-tokens` tokens.
- decode tokens/s as bench/gpu.py measures it (prefill excluded) at each `--batches` size, and
  the scaling efficiency tok/s(TP=N) / (N x tok/s(TP=1)).
Prints one JSON line per result.

    python bench/tp.py [--tp 2] [--batches 1 64] [--new-tokens 64] [--small] [--async-scheduling off]
    python bench/tp.py --cpu      # the same code over gloo: SmolLM2 itself in float32, parity only
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import gc
import json
import math

import torch

from bench.gpu import LLAMA3_8B, SMOLLM2, decode_tok_s, random_model
from model_service.engine.batch_builder import StepItem
from model_service.engine.config import EngineConfig
from model_service.engine.engine import Engine
from model_service.models.loader import LoadedModel, load_model
from model_service.startup import configure_process


def make_engine(loaded: LoadedModel, args: argparse.Namespace, tp: int, dtype: str) -> Engine:
    rows = max([*args.batches, args.parity_prompts])
    blocks = rows * math.ceil((args.prompt_len + max(args.new_tokens, args.parity_tokens) + 8) / 16) + 64
    config = EngineConfig(
        model="smollm2",  # the CPU run's model; on CUDA the engine gets its weights from `loaded`
        device=args.device,
        dtype=dtype,
        max_num_seqs=rows,
        max_loras=0,
        num_kv_blocks=blocks,
        tensor_parallel_size=tp,
        async_scheduling=args.async_scheduling,  # both sizes alike: auto is on on CUDA
    )
    return Engine(config, loaded=loaded)


def prompts(args: argparse.Namespace, vocab: int, n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(n)]


def last_token_logits(engine: Engine, batch: list[list[int]]) -> torch.Tensor:
    """One prefill step over `batch`; float32 logits of each prompt's last token, on the host."""
    states = [engine.cache.allocate() for _ in batch]
    for s, ids in zip(states, batch, strict=True):
        assert engine.cache.reserve(s, len(ids))
    items = [StepItem(s, ids, 1) for s, ids in zip(states, batch, strict=True)]
    logits = engine.executor.execute(engine.builder.build(items))
    for s in states:
        engine.cache.free(s)
    return logits.float().cpu()


def greedy(engine: Engine, batch: list[list[int]], n: int) -> list[list[int]]:
    reqs = [{"prompt_token_ids": p, "max_tokens": n, "temperature": 0, "ignore_eos": True} for p in batch]
    return [o.token_ids for o in engine.generate(reqs)]


def run(engine: Engine, loaded: LoadedModel, args: argparse.Namespace) -> dict[str, object]:
    """Parity outputs and decode tokens/s of one engine."""
    vocab = loaded.config.vocab_size
    batch = prompts(args, vocab, args.parity_prompts)
    tok_s = {}
    if args.device == "cuda":
        tok_s = {b: decode_tok_s(engine, b, args.prompt_len, args.new_tokens, vocab) for b in args.batches}
    return {
        "logits": last_token_logits(engine, batch),
        "tokens": greedy(engine, batch, args.parity_tokens),
        "tok_s": tok_s,
    }


def float32_logits(loaded: LoadedModel, args: argparse.Namespace) -> torch.Tensor:
    """The TP=1 logits over the same weights in float32: bf16's own error, to judge TP=N's by."""
    full = dataclasses.replace(loaded, module=copy.deepcopy(loaded.module).float())
    engine = make_engine(full, args, 1, "float32")
    logits = last_token_logits(engine, prompts(args, loaded.config.vocab_size, args.parity_prompts))
    engine.executor.teardown()
    return logits


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def report(setup: dict[str, object], one: dict, many: dict, fp32: torch.Tensor | None, tp: int) -> None:
    a, b = one["logits"], many["logits"]
    parity = {
        "metric": "parity",
        "max_abs_diff_tp1_vs_tpn": (b - a).abs().max().item(),
        "mean_abs_diff_tp1_vs_tpn": (b - a).abs().mean().item(),
        "logits_std": a.std().item(),
        "top1_agree": (a.argmax(-1) == b.argmax(-1)).float().mean().item(),
        "greedy_sequences_equal": sum(x == y for x, y in zip(one["tokens"], many["tokens"], strict=True)),
        "greedy_sequences": len(one["tokens"]),
    }
    if fp32 is not None:
        parity["max_abs_diff_bf16_vs_fp32"] = (a - fp32).abs().max().item()
        parity["mean_abs_diff_bf16_vs_fp32"] = (a - fp32).abs().mean().item()
    print(json.dumps({"bench": "tp", **parity, **setup}))
    for batch, tps1 in one["tok_s"].items():
        tpsn = many["tok_s"][batch]
        for size, tps in ((1, tps1), (tp, tpsn)):
            print(json.dumps({"bench": "tp", "metric": "decode_tok_s", "tp_size": size, "batch": batch,
                              "value": round(tps, 1), **setup}))  # fmt: skip
        efficiency, speedup = round(tpsn / (tp * tps1), 3), round(tpsn / tps1, 3)
        print(json.dumps({"bench": "tp", "metric": "scaling_efficiency", "batch": batch,
                          "value": efficiency, "speedup": speedup, **setup}))  # fmt: skip


def model(args: argparse.Namespace, shape: dict[str, int]) -> LoadedModel:
    """On CUDA random weights of `shape`, seeded: every rank builds the same ones on its own GPU
    (rank 0 keeps this copy). On the CPU the real SmolLM2, which the workers load by name."""
    if args.cpu:
        return load_model("smollm2", torch.float32, torch.device("cpu"))
    loaded = random_model(shape)
    loaded.source = functools.partial(random_model, shape)
    return loaded


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 64])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--parity-prompts", type=int, default=8)
    ap.add_argument("--parity-tokens", type=int, default=32)
    ap.add_argument("--small", action="store_true", help="SmolLM2's shape instead of the 8B one")
    ap.add_argument("--cpu", action="store_true", help="gloo, SmolLM2, float32, parity only")
    ap.add_argument("--async-scheduling", default="auto", choices=["auto", "on", "off"])
    args = ap.parse_args()
    args.device, args.dtype = ("cpu", "float32") if args.cpu else ("cuda", "bfloat16")
    shape = SMOLLM2 if args.small else LLAMA3_8B
    one_rank = model(args, shape)
    setup = {
        "model": one_rank.name,
        "dtype": args.dtype,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "tp": args.tp,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "async_scheduling": args.async_scheduling,
    }
    engine = make_engine(one_rank, args, 1, args.dtype)
    one = run(engine, one_rank, args)
    fp32 = float32_logits(one_rank, args) if args.device == "cuda" else None
    engine.executor.teardown()  # after the float32 copy: teardown moves the weights to "meta"
    del one_rank, engine
    free_memory()
    loaded = model(args, shape)
    engine = make_engine(loaded, args, args.tp, args.dtype)
    report(setup, one, run(engine, loaded, args), fp32, args.tp)
    engine.executor.teardown()  # after the report: stopping the workers is not what is measured


if __name__ == "__main__":
    configure_process()
    main()
