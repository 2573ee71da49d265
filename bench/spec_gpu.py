"""What n-gram speculation gains on a GPU for the 8B shape, on a prompt whose continuation repeats it.

Random weights make text meaningless, so this bench builds a model whose greedy continuation is
known: a *successor model* of the Llama-3-8B shape. Its layers run in full (every weight is read,
so a step costs what a real 8B step costs) but their o_proj and down_proj are zero, so the
residual stream stays the embedding of the current token; the LM head maps the embedding of
token `cycle[i]` to `cycle[i + 1]`. Greedy decoding then walks a fixed cycle of `--cycle` token
ids. The prompt is that walk, `--prompt-len` tokens long, so the continuation repeats the
prompt, as code edits and quoting repeat theirs; `--noise` replaces that share of the prompt's
tokens (all but its last 8) with other cycle tokens, so some of prompt lookup's proposals are wrong.

Setup (printed in every line): bf16 on CUDA, CUDA graphs, greedy, EOS ignored; decode tokens/s
excludes prefill (bench/gpu.py's `decode_tok_s`), with and without
`{"method": "ngram", "num_speculative_tokens": k}` in the same process; acceptance rate
= accepted / proposed over the timed runs.

    python bench/spec_gpu.py [--batches 1 64] [--k 4] [--noise 0 0.2] [--small]
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from bench.gpu import LLAMA3_8B, SMOLLM2, random_model, timed_generate
from model_service.engine.config import EngineConfig
from model_service.engine.engine import Engine
from model_service.models.loader import LoadedModel
from model_service.startup import configure_process


def successor_model(shape: dict[str, int], cycle: list[int]) -> LoadedModel:
    """Random weights of `shape`, rewired so that greedy decoding maps cycle[i] to cycle[i + 1]."""
    loaded = random_model(shape)
    module = loaded.module
    with torch.no_grad():
        for layer in module.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = module.model.embed_tokens.weight
        head = module.lm_head.weight
        head.zero_()
        ids = torch.tensor(cycle, device=head.device)
        # Random rows are nearly orthogonal at this width: E[t] . E[t] dwarfs every E[t] . E[u].
        head[ids.roll(-1)] = embed[ids]
    return loaded


def walk(cycle: list[int], length: int, noise: float, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    start = int(torch.randint(len(cycle), (1,), generator=g))
    tokens = [cycle[(start + i) % len(cycle)] for i in range(length)]
    for i in range(length - 8):
        if torch.rand((), generator=g) < noise:
            tokens[i] = cycle[int(torch.randint(len(cycle), (1,), generator=g))]
    return tokens


def walk_from(cycle: list[int], token: int, length: int) -> list[int]:
    """The successor model's greedy continuation of a prompt that ends in `token`."""
    at = cycle.index(token)
    return [cycle[(at + i + 1) % len(cycle)] for i in range(length)]


def decode_run(engine: Engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    """Decode-only seconds (the time of `new_tokens` minus that of one) and the outputs."""
    adapters: list[str | None] = [None] * len(prompts)
    timed_generate(engine, prompts, 8, adapters)  # warm-up: graphs, kernel compiles
    one = min(timed_generate(engine, prompts, 1, adapters) for _ in range(2))
    params = {"max_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    reqs = [{"prompt_token_ids": p, **params} for p in prompts]
    full = min(timed_generate(engine, prompts, new_tokens, adapters) for _ in range(2))
    return full - one, [o.token_ids for o in engine.generate(reqs)]


def successor_parser(description: str, k: int) -> argparse.ArgumentParser:
    """The options both speculation benches on the successor model take."""
    ap = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 64])
    ap.add_argument("--k", type=int, default=k)
    ap.add_argument("--cycle", type=int, default=97)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--small", action="store_true", help="SmolLM2's shape instead of the 8B one")
    return ap


def successor_setup(args: argparse.Namespace) -> tuple[LoadedModel, list[int]]:
    """The successor model of the chosen shape and the cycle its greedy decoding walks."""
    shape = SMOLLM2 if args.small else LLAMA3_8B
    order = torch.randperm(shape["vocab_size"] - 3, generator=torch.Generator().manual_seed(0))
    cycle = (order[: args.cycle] + 3).tolist()
    return successor_model(shape, cycle), cycle


def plain_and_speculative(loaded: LoadedModel, args: argparse.Namespace, spec: str) -> dict[bool, Engine]:
    """Two engines over the same weights, without (False) and with (True) `spec`, with room for
    the largest batch's prompts, outputs and proposals."""
    rows = max(args.batches)
    blocks = rows * math.ceil((args.prompt_len + args.new_tokens + args.k + 16) / 16) + 64
    return {
        on: Engine(
            EngineConfig(model="smollm2", device="cuda", dtype="bfloat16", max_num_seqs=rows, max_loras=0,
                         num_kv_blocks=blocks, speculative_config=spec if on else None),
            loaded=loaded,
        )
        for on in (False, True)
    }  # fmt: skip


def compare(
    engines: dict[bool, Engine], cycle: list[int], prompts: list[list[int]], new_tokens: int
) -> dict[str, object]:
    """Decode both engines over `prompts`: whether the outputs are the walk's and each other's,
    the acceptance rate of the timed runs and the tokens a verify run emits on average (tokens per
    step of a sequence), tokens/s without and with speculation."""
    base_s, base_out = decode_run(engines[False], prompts, new_tokens)
    e = engines[True]
    proposed, accepted, drafts = e.speculation.proposed, e.speculation.accepted, e.speculation.drafts
    spec_s, spec_out = decode_run(e, prompts, new_tokens)
    proposed, accepted = e.speculation.proposed - proposed, e.speculation.accepted - accepted
    drafts = e.speculation.drafts - drafts
    expected = [walk_from(cycle, p[-1], new_tokens) for p in prompts]
    decoded = len(prompts) * (new_tokens - 1)
    return {
        "continuation_repeats_prompt": base_out == expected, "identical": spec_out == base_out,
        "acceptance_rate": round(accepted / max(proposed, 1), 3),
        "tokens_per_step": round(1 + accepted / max(drafts, 1), 2),
        "tok_s_without": round(decoded / base_s, 1), "tok_s_speculative": round(decoded / spec_s, 1),
        "speedup": round(base_s / spec_s, 2),
    }  # fmt: skip


def main() -> None:
    ap = successor_parser(__doc__, k=4)
    ap.add_argument("--noise", type=float, nargs="*", default=[0.0, 0.2])
    args = ap.parse_args()
    loaded, cycle = successor_setup(args)
    engines = plain_and_speculative(
        loaded, args, json.dumps({"method": "ngram", "num_speculative_tokens": args.k})
    )
    setup = {"model": "successor model of the " + ("SmolLM2" if args.small else "Llama-3-8B") + " shape",
             "device": torch.cuda.get_device_name(), "dtype": "bfloat16", "k": args.k, "cycle": args.cycle,
             "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}  # fmt: skip
    for noise in args.noise:
        for batch in args.batches:
            prompts = [walk(cycle, args.prompt_len, noise, seed) for seed in range(batch)]
            result = compare(engines, cycle, prompts, args.new_tokens)
            print(
                json.dumps({"bench": "spec_gpu", "batch": batch, "noise": noise, **result, **setup}),
                flush=True,
            )


if __name__ == "__main__":
    configure_process()
    main()
