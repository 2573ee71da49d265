"""Time to the first token of a pod's first requests, after its warm-up, against later ones.

Setup: one CUDA GPU, random bf16 weights of a model shape with `--layers` layers (dense: Llama-3-8B;
moe: Qwen3-30B-A3B; hybrid: Qwen3-Next-80B-A3B's mixers and sparse MLPs), the engine's defaults
(2,048-token steps, CUDA graphs). `Engine.warm_up` runs as a pod runs it (`--graphs-only`: only
its captures, as before 2026-12-03), then one greedy request a prompt length, one output token,
in three rounds of new prompts: "first" pays whatever the warm-up left to compile. One JSON line
a model: ms to the first token by round and length, the warm-up's seconds, and the Triton kernels
compiled during the first round (none, when the warm-up covered them).

    PYTHONPATH=. python bench/first_requests.py --models dense moe hybrid
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Iterator

import torch

from bench.gpu import LLAMA3_8B, random_model, timed_generate
from bench.hybrid import _config, _engine
from bench.moe import qwen3_30b_shape
from model_service.engine.config import EngineConfig
from model_service.engine.engine import Engine

LENGTHS = [100, 777, 2048, 3000]
MODELS = ["dense", "moe", "hybrid"]
KV_BYTES = 8 << 30


def build(model: str, layers: int) -> Engine:
    if model == "hybrid":
        cfg = _config(layers, small=False, moe=True)
        return _engine(cfg, "cuda", torch.bfloat16, kv_cache_memory_bytes=KV_BYTES, max_model_len=8192)
    loaded = (
        random_model({**LLAMA3_8B, "num_layers": layers}) if model == "dense" else qwen3_30b_shape(layers)
    )
    config = EngineConfig(
        device="cuda", dtype="bfloat16", max_loras=0, kv_cache_memory_bytes=KV_BYTES, max_model_len=8192
    )
    return Engine(config, loaded=loaded)


@contextlib.contextmanager
def recorded_compiles() -> Iterator[list[str]]:
    """The Triton kernels compiled inside the block (Triton's post-compile hook), each as Triton
    prints its specialization: `name[options](arguments)`."""
    import triton

    compiled: list[str] = []
    triton.knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(kw["repr"])
    try:
        yield compiled
    finally:
        triton.knobs.runtime.jit_post_compile_hook = None


def first_requests(engine: Engine, lengths: list[int]) -> dict[str, object]:
    g = torch.Generator().manual_seed(11)
    result: dict[str, object] = {}
    for rnd in ("first", "second", "third"):
        with recorded_compiles() as compiled:
            for n in lengths:
                prompt = torch.randint(3, 32000, (n,), generator=g).tolist()
                result[f"{rnd}_{n}_ms"] = round(timed_generate(engine, [prompt], 1, [None]) * 1e3, 1)
        if rnd == "first":
            result["compiled_in_first_round"] = sorted({c.partition("[")[0] for c in compiled})
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--lengths", type=int, nargs="+", default=LENGTHS)
    parser.add_argument("--graphs-only", action="store_true", help="warm up by capturing graphs alone")
    args = parser.parse_args()
    for model in args.models:
        engine = build(model, args.layers)
        start = time.perf_counter()
        if args.graphs_only:
            engine.executor.capture_graphs()  # the warm-up before 2026-12-03
        else:
            engine.warm_up()
        setup = {"model": model, "layers": args.layers, "warm_up_prefills": not args.graphs_only}
        setup["warm_up_s"] = round(time.perf_counter() - start, 1)
        print(json.dumps({**setup, **first_requests(engine, args.lengths)}), flush=True)
        del engine
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
