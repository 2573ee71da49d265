"""GPU decode throughput of the engine on an 8B Llama-shaped model (random bf16 weights of the real
shapes, no download), against the card's copy bandwidth and HF `transformers.generate`.

Setup (printed in every line): one CUDA device, bf16, greedy, prompts of `--prompt-len` random
token ids, EOS ignored. Decode tokens/s = batch x (new_tokens - 1) / (time(new_tokens) -
time(1 token)), so prefill is excluded the same way for every system. Batch-1 achieved GB/s =
the bytes a step reads (`weight_bytes`) x tokens/s. With `--lora-adapters N`, the same decode
at `--lora-batch` rows with N distinct rank-`--lora-rank` adapters on all seven projections,
against the base model in the same engine. With `--quantization fp8`, the same model's
projections quantized online (per-channel e4m3 weights, per-token activations,
`torch._scaled_mm`: `--quantization fp8` of the engine; `fp8-g128`: per row and 128 columns,
per token and 128 columns) run instead, and with `--compare` as
well as the bf16 model, each figure beside the other (and their ratio) in one run. Several
schemes (`--quantization fp8 fp8-g128`) run one after the other over the same random weights,
each quantized copy built when its turn comes: one process, one machine, comparable figures.
`--kv-cache-dtype fp8`: every engine of the run stores K/V in e4m3 (the engine's flag). Prints
one JSON line per result, then a short table.

    python bench/gpu.py [--batches 1 16 64 256] [--new-tokens 64] [--hf-batches] [--small]
                        [--lora-adapters 64 --lora-batch 64 --lora-rank 16]
                        [--quantization fp8 [fp8-g128] [--compare]] [--kv-cache-dtype fp8]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch

from model_service.engine.batch_builder import StepItem
from model_service.engine.config import EngineConfig
from model_service.engine.engine import Engine
from model_service.engine.executor import own_module_tree
from model_service.lora.adapter import LoraAdapter, LoraWeights, module_shapes
from model_service.lora.layers import full_adapter_elements
from model_service.models.config import ModelConfig
from model_service.models.fp8_linear import Fp8Linear, quantize_online
from model_service.models.llama import DecoderModel
from model_service.models.loader import LoadedModel
from model_service.models.quantization import ONLINE_SCHEMES
from model_service.models.registry import model_class
from model_service.models.rope import RotaryEmbedding
from model_service.models.step import StepBatch
from model_service.startup import configure_process

LLAMA3_8B = {
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_layers": 32,
    "num_heads": 32,
    "num_kv_heads": 8,
    "head_dim": 128,
}
SMOLLM2 = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_layers": 30,
    "num_heads": 9,
    "num_kv_heads": 3,
    "head_dim": 64,
}


def copy_bandwidth() -> float:
    """GB/s of a large device-to-device copy, counting bytes read plus bytes written."""
    src = torch.randn(1 << 30, device="cuda", dtype=torch.float32)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    rate = 2 * src.numel() * 4 * 10 / (time.perf_counter() - start) / 1e9
    del src, dst
    torch.cuda.empty_cache()  # its 8 GB back: an engine built next sizes its cache by what is free
    return rate


def random_model(
    shape: dict[str, int], device: str = "cuda", dtype: torch.dtype = torch.bfloat16
) -> LoadedModel:
    cfg = ModelConfig(
        family="llama", rms_norm_eps=1e-5, max_position_embeddings=8192, rope_theta=500000.0, **shape
    )
    name = "random-8b" if shape is LLAMA3_8B else "random-smollm2" if shape is SMOLLM2 else "random"
    return LoadedModel(name, cfg, random_module(cfg, device, dtype), None)


def random_module(
    cfg: ModelConfig, device: str = "cuda", dtype: torch.dtype = torch.bfloat16
) -> DecoderModel:
    """The registered module of `cfg`'s family, weights N(0, 0.02), norms 1; RoPE's table
    computed (a meta init leaves it empty). bf16 on CUDA unless told: the CPU modes of the
    benchmarks build the same model small."""
    with torch.device("meta"):
        module = model_class(cfg)(cfg)
    module = module.to(dtype).to_empty(device=device)  # never the float32 copy: MoE shapes are large
    torch.manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.02)
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
    module.rotary = RotaryEmbedding(cfg.rotary_dim or cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(
        device
    )
    return module.eval()


def quantized(loaded: LoadedModel, flag: str = "fp8") -> LoadedModel:
    """`loaded` with its projections quantized online to FP8 (what `--quantization flag` does at
    load), on a copy of its module tree: the embeddings, norms and LM head stay shared."""
    module = own_module_tree(loaded.module)
    quantize_online(module, ONLINE_SCHEMES[flag])
    config = dataclasses.replace(loaded.config, quantization=ONLINE_SCHEMES[flag])
    return LoadedModel(f"{loaded.name}-{flag}", config, module, None)


def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes a batch-1 decode step streams: every parameter and the FP8 projections' scales, but
    of an untied input embedding only the one row it looks up (a tied table is the LM head's,
    read whole). Until 2026-12-02 y the whole untied table was counted: 1.05 GB of the 8B shape's
    16.06 (bf16) and 9.09 (FP8), so earlier fractions of copy read 7% (bf16) to 13% (FP8) high."""
    scales = [m.weight_scale for m in module.modules() if isinstance(m, Fp8Linear)]
    total = sum(t.numel() * t.element_size() for t in [*module.parameters(), *scales])
    embed = module.model.embed_tokens.weight
    if module.lm_head.weight is not embed:
        total -= (embed.shape[0] - 1) * embed.shape[1] * embed.element_size()
    return total


GREEDY = {"temperature": 0}


def generate_or_raise(engine: Engine, requests: list[dict[str, Any]]) -> None:
    """`engine.generate`, raising if a request failed: a failed request ends at once, and a
    benchmark that timed it would print a rate it never ran at (a kernel that did not compile once
    read as a negative tok/s)."""
    failed = [o for o in engine.generate(requests) if o.error or o.finish_reason not in ("length", "stop")]
    if failed:
        why = failed[0].error or failed[0].finish_reason
        raise RuntimeError(f"{len(failed)} of {len(requests)} requests failed: {why}")


def timed_generate(
    engine: Engine,
    prompts: list[list[int]],
    new_tokens: int,
    adapters: list[str | None],
    sampling: dict[str, Any] = GREEDY,
) -> float:
    reqs = [
        {"prompt_token_ids": p, "max_tokens": new_tokens, "ignore_eos": True, "adapter": a, **sampling}
        for p, a in zip(prompts, adapters, strict=True)
    ]
    torch.cuda.synchronize()
    start = time.perf_counter()
    generate_or_raise(engine, reqs)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def decode_tok_s(
    engine: Engine,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    vocab: int,
    adapters: list[str | None] | None = None,
    sampling: dict[str, Any] = GREEDY,
) -> float:
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(3, vocab, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    adapters = adapters or [None] * batch
    timed_generate(engine, prompts, 4, adapters, sampling)  # warm-up: graphs, kernel compiles, adapter slots
    one = min(timed_generate(engine, prompts, 1, adapters, sampling) for _ in range(2))
    full = min(timed_generate(engine, prompts, new_tokens, adapters, sampling) for _ in range(2))
    return batch * (new_tokens - 1) / (full - one)


def start_decode(
    engine: Engine,
    batch: int,
    prompt_len: int,
    vocab: int,
    max_tokens: int,
    adapters: list[str | None] | None = None,
) -> None:
    """Admit `batch` random prompts and step until every one is past its prefill (chunked
    prefill spreads a large batch's prompts over several steps): what follows is decode only."""
    g = torch.Generator().manual_seed(1)
    for adapter in adapters or [None] * batch:
        prompt = torch.randint(3, vocab, (prompt_len,), generator=g).tolist()
        request = {"prompt_token_ids": prompt, "max_tokens": max_tokens, "ignore_eos": True}
        engine.add_request_dict({**request, "adapter": adapter})
    engine.step()
    while engine.scheduler.waiting or any(s.num_pending > 1 for s in engine.scheduler.running):
        engine.step()
    engine.step()
    torch.cuda.synchronize()


def host_share(engine: Engine, batch: int, prompt_len: int, vocab: int) -> tuple[float, float]:
    """(host share, exposed host share) of a decode step at `batch`. The first: the share of a
    step's wall time outside the forward pass (scheduling, batch building, sampling's host side,
    outputs) when each forward is waited for. The second, with the engine running as configured
    (nothing waited for): the share of wall time the device spends idle, waiting for the host
    (1 - the device's busy time / wall time; a step's busy time runs from the start of its forward
    to the end of its sampling and token copy, CUDA events): what async scheduling leaves exposed."""
    execute, run = engine.executor.execute, engine._run
    waited, events = 0.0, []

    def waited_execute(step_batch: StepBatch, fed: torch.Tensor | None = None) -> torch.Tensor:
        nonlocal waited
        start = time.perf_counter()
        out = execute(step_batch, fed)
        torch.cuda.synchronize()
        waited += time.perf_counter() - start
        return out

    def event_execute(step_batch: StepBatch, fed: torch.Tensor | None = None) -> torch.Tensor:
        events.append([torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)])
        events[-1][0].record()
        return execute(step_batch, fed)

    def event_run(work: list) -> list:
        out = run(work)
        events[-1][1].record()  # every device op of the step is queued by now
        return out

    def decode_steps(timed: Callable[..., torch.Tensor], with_events: bool) -> float:
        start_decode(engine, batch, prompt_len, vocab, max_tokens=96)
        events.clear()
        engine.executor.execute = timed
        if with_events:
            engine._run = event_run
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        torch.cuda.synchronize()
        engine.executor.execute, engine._run = execute, run
        return time.perf_counter() - start

    total = decode_steps(waited_execute, False)
    wall = decode_steps(event_execute, True)
    busy = sum(a.elapsed_time(b) for a, b in events) / 1e3
    return (total - waited) / total, max(0.0, 1 - busy / wall)


def kernel_profile(
    engine: Engine,
    batch: int,
    prompt_len: int,
    vocab: int,
    adapters: list[str | None] | None = None,
    steps: int = 8,
) -> str:
    """Device time per kernel over `steps` decode steps at `batch` (torch.profiler, CUPTI: the
    kernels inside replayed graphs too): where a step's device time goes."""
    from torch.profiler import ProfilerActivity, profile

    start_decode(engine, batch, prompt_len, vocab, steps + 64, adapters)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished():
        engine.step()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=60)


def ttft_ms(
    engine: Engine, vocab: int, prompt_len: int, cached: int, adapter: str | None = None
) -> tuple[float, float]:
    """Time to the first token in ms, the median of three: a prompt never seen (cold), then one
    that shares its first `cached` tokens with it (a prefix-cache hit); with `adapter`, through
    that LoRA adapter. A first round warms both shapes' kernels up."""
    g = torch.Generator().manual_seed(7)

    def cold_then_hit() -> tuple[float, float]:
        shared = torch.randint(3, vocab, (cached,), generator=g).tolist()
        tails = [torch.randint(3, vocab, (prompt_len - cached,), generator=g).tolist() for _ in "ab"]
        cold, hit = (timed_generate(engine, [shared + tail], 1, [adapter]) * 1e3 for tail in tails)
        return cold, hit

    cold_then_hit()
    cold, hit = zip(*(cold_then_hit() for _ in range(3)), strict=True)
    return statistics.median(cold), statistics.median(hit)


def verify_costs(loaded: LoadedModel, k: int, setup: dict[str, object]) -> None:
    """One JSON line per batch: a plain decode step against a verify step of k proposals a row,
    in an engine configured for n-gram speculation (so its graphs cover k + 1 rows a sequence)."""
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": k})
    engine = Engine(
        EngineConfig(
            device="cuda",
            dtype="bfloat16",
            max_num_seqs=64,
            max_loras=0,
            kv_cache_memory_bytes=20 << 30,
            max_model_len=8192,
            speculative_config=spec,
        ),
        loaded=loaded,
    )
    for batch in (1, 16, 64):
        plain, verify = verify_cost_ms(engine, batch, k, 512)
        line = {"bench": "gpu", "metric": "verify_step_ms", "batch": batch, "k": k, "context": 512}
        times = {"decode_ms": round(plain, 2), "verify_ms": round(verify, 2)}
        print(json.dumps({**line, **times, "verify_over_decode": round(verify / plain, 2), **setup}))


def verify_cost_ms(engine: Engine, batch: int, k: int, context: int) -> tuple[float, float]:
    """(plain decode step, verify step of k proposals per row) forward time in ms at `batch` rows
    with `context` tokens cached each: what speculation pays per step before any acceptance."""
    states = [engine.cache.allocate() for _ in range(batch)]
    for s in states:
        assert engine.cache.reserve(s, context + k + 1)
        s.num_computed = context  # timing only: the cached K/V's values do not matter

    def timed(items: list[StepItem]) -> float:
        for _ in range(3):
            engine.executor.execute(engine.builder.build(items))
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            engine.executor.execute(engine.builder.build(items))
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / 20 * 1e3

    plain = timed([StepItem(s, [7], 1) for s in states])
    verify = timed([StepItem(s, [7] * (k + 1), k + 1) for s in states])
    for s in states:
        engine.cache.free(s)
    return plain, verify


def random_lora_modules(
    cfg: ModelConfig, rank: int, modules: Collection[str] | None = None, seed: int = 0
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Random (A, B) of rank `rank` for each of `modules` (PEFT names; all seven by default),
    N(0, 0.01), float32 on the host: one pair a module, which `random_adapter` repeats in every layer."""
    g = torch.Generator().manual_seed(seed)
    return {
        m: (torch.randn(rank, i, generator=g) * 0.01, torch.randn(o, rank, generator=g) * 0.01)
        for m, (i, o) in module_shapes(cfg).items()
        if modules is None or m in modules
    }


def random_adapter(
    name: str,
    adapter_id: int,
    cfg: ModelConfig,
    shared: dict[str, tuple[torch.Tensor, torch.Tensor]],
    scaling: float = 1.0,
) -> LoraAdapter:
    """An adapter with `shared`'s (A, B) in every layer, without a disk copy: the benchmarks skip
    writing and parsing PEFT files (the host tier's copy is the pool's own, `adapter.HostForm`)."""
    weights = {
        (layer, m): LoraWeights(a, b, scaling)
        for layer in range(cfg.num_layers)
        for m, (a, b) in shared.items()
    }
    return LoraAdapter(name, adapter_id, None, weights)


def adapter_room(loaded: LoadedModel, n: int, rank: int, element_size: int = 2) -> int:
    """`lora_memory_bytes` that keeps `n` adapters of `rank` on every projection resident (5% for
    the arena's alignment of each tensor)."""
    return int(1.05 * n * full_adapter_elements(loaded.module, rank) * element_size)


def register_random_adapters(
    engine: Engine, cfg: ModelConfig, n: int, rank: int, modules: Collection[str] | None = None
) -> list[str]:
    """Adapters a0 .. a{n-1} of rank `rank` on `modules` (all seven projections by default),
    sharing random host tensors (each fills its own device slot, so the kernels read n
    different slots); they go into the pool's host tier directly, skipping disk. Returns their
    names."""
    shared = random_lora_modules(cfg, rank, modules)
    for k in range(n):
        adapter = random_adapter(f"a{k}", k + 1, cfg, shared, 1.0 + k / n)
        engine.lora._remember(adapter)  # bench only: no disk tier
    return [f"a{k}" for k in range(n)]


def lora_vs_base(loaded: LoadedModel, args: argparse.Namespace) -> tuple[float, float]:
    """(base, LoRA) decode tokens/s, `--lora-adapters` distinct adapters over `--lora-batch` rows
    (`register_random_adapters`)."""
    n, rank, cfg = args.lora_adapters, args.lora_rank, loaded.config
    engine = Engine(
        EngineConfig(
            device="cuda",
            dtype="bfloat16",
            max_num_seqs=args.lora_batch,
            max_loras=n,
            lora_memory_bytes=adapter_room(loaded, n, rank),
            max_cpu_loras=n,
            max_lora_rank=rank,
            kv_cache_memory_bytes=20 << 30,
            max_model_len=8192,
        ),
        loaded=loaded,
    )
    register_random_adapters(engine, cfg, n, rank)
    batch, vocab = args.lora_batch, cfg.vocab_size
    base = decode_tok_s(engine, batch, args.prompt_len, args.new_tokens, vocab)
    names: list[str | None] = [f"a{i % n}" for i in range(batch)]
    lora = decode_tok_s(engine, batch, args.prompt_len, args.new_tokens, vocab, names)
    for adapter in (None, "a0") if args.ttft else ():  # prefill with one adapter against none
        cold, hit = ttft_ms(engine, vocab, 4096, 3584, adapter)
        line = {"bench": "gpu", "metric": "ttft_ms_4096", "adapter": adapter, "lora_rank": rank}
        print(json.dumps({**line, "cold": round(cold, 1), "hit_3584": round(hit, 1)}), flush=True)
    if args.profile_lora:
        print(f"device time per kernel, batch {batch}, {n} adapters:")
        print(kernel_profile(engine, batch, args.prompt_len, vocab, names))
    return base, lora


def hf_llama(loaded: LoadedModel) -> torch.nn.Module:
    """HF's Llama on CUDA in bf16 with `loaded`'s shapes and its own random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = loaded.config
    hf_cfg = LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        max_position_embeddings=c.max_position_embeddings,
    )
    with torch.device("meta"):
        hf = LlamaForCausalLM(hf_cfg)
    hf = hf.to_empty(device="cuda").to(torch.bfloat16).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.02)
    return hf


def hf_decode_tok_s(loaded: LoadedModel, batch: int, prompt_len: int, new_tokens: int) -> float:
    hf = hf_llama(loaded)
    ids = torch.randint(3, loaded.config.vocab_size, (batch, prompt_len), device="cuda")

    def run(n: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    run(2)
    return batch * (new_tokens - 1) / (run(new_tokens) - run(1))


def host_cpu() -> str:
    """The host's CPU model, in every result's setup: the device tool lends hosts that differ
    between calls, and host-bound figures (eager steps' launches) move with them (0.839x and
    0.816x for the LoRA ratio on two hosts, same code: docs/performance-notes.md, session l)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor() or "unknown"


def engine_runs(
    loaded: LoadedModel, args: argparse.Namespace, setup: dict[str, Any], bandwidth: float
) -> list[dict[str, Any]]:
    """Every figure of our engine over `loaded` (graphs, eager, TTFT, host share, profiles,
    verify cost, LoRA); returns the table's rows. The system names end in -fp8 for FP8 weights."""
    scheme = loaded.config.quantization
    online = (f for f, s in ONLINE_SCHEMES.items() if s == scheme)
    flag = "none" if scheme is None else next(online, scheme.method)  # a checkpoint's: its method
    setup = {**setup, "quantization": flag}
    suffix = "" if scheme is None else f"-{flag}"
    vocab = loaded.config.vocab_size
    sampling = {k: setup[k] for k in ("temperature", "top_p", "top_k", "min_p")}
    weights = weight_bytes(loaded.module)
    rows = []
    for eager, batches in ((False, args.batches), (True, args.eager_batches)):
        if not batches:
            continue
        engine = Engine(
            EngineConfig(
                device="cuda",
                dtype="bfloat16",
                max_num_seqs=max(*batches, args.host_share_batch),
                max_loras=0,
                enforce_eager=eager,
                kv_cache_memory_bytes=40 << 30,
                max_model_len=8192,
                async_scheduling=args.async_scheduling,
                kv_cache_dtype=args.kv_cache_dtype,
            ),
            loaded=loaded,
        )
        for batch in batches:
            rate = decode_tok_s(engine, batch, args.prompt_len, args.new_tokens, vocab, None, sampling)
            system = f"spindle{suffix}-eager" if eager else f"spindle{suffix}"
            line = {"bench": "gpu", "system": system, "batch": batch, "decode_tokens_per_s": round(rate, 1)}
            if batch == 1:
                line["achieved_gb_s"] = round(weights * rate / 1e9)
                line["fraction_of_copy_bandwidth"] = round(weights * rate / 1e9 / bandwidth, 3)
            print(json.dumps({**line, **setup}), flush=True)
            rows.append(line)
        if not eager and args.ttft:
            cold, hit = ttft_ms(engine, vocab, 4096, 3584)
            line = {
                "bench": "gpu",
                "metric": "ttft_ms_4096",
                "cold": round(cold, 1),
                "hit_3584": round(hit, 1),
            }
            print(json.dumps({**line, **setup}))
        if not eager and args.host_share_batch:
            share, exposed = host_share(engine, args.host_share_batch, args.prompt_len, vocab)
            line = {"bench": "gpu", "metric": "host_share_of_decode_step", "batch": args.host_share_batch,
                    "value": round(share, 3), "exposed": round(exposed, 3)}  # fmt: skip
            print(json.dumps({**line, **setup}))
        for batch in [] if eager else args.profile_batches:
            print(f"device time per kernel, batch {batch}{suffix}:")
            print(kernel_profile(engine, batch, args.prompt_len, vocab))
        del engine
        torch.cuda.empty_cache()
    if args.verify_k:
        verify_costs(loaded, args.verify_k, setup)
        torch.cuda.empty_cache()
    if args.lora_adapters:
        base, lora = lora_vs_base(loaded, args)
        for system, rate in (
            (f"spindle{suffix}-base", base),
            (f"spindle{suffix}-{args.lora_adapters}-loras", lora),
        ):
            line = {
                "bench": "gpu",
                "system": system,
                "batch": args.lora_batch,
                "decode_tokens_per_s": round(rate, 1),
            }
            ratio = {"lora_rank": args.lora_rank, "lora_over_base": round(lora / base, 3)}
            print(json.dumps({**line, **ratio, **setup}))
            rows.append(line)
        torch.cuda.empty_cache()
    return rows


def print_fp8_over_bf16(rows: list[dict[str, Any]], setup: dict[str, Any], flag: str) -> None:
    """One line per system and batch that ran both ways: FP8 (`--quantization flag`) tokens/s
    over bf16 tokens/s."""
    rates = {(r["system"], r["batch"]): r["decode_tokens_per_s"] for r in rows}
    for (system, batch), rate in rates.items():
        fp8 = rates.get((system.replace("spindle", f"spindle-{flag}", 1), batch))
        if "-fp8" not in system and fp8 is not None:
            line = {"bench": "gpu", "metric": "fp8_over_bf16", "system": system, "batch": batch}
            print(json.dumps({**line, "bf16": rate, "fp8": fp8, "value": round(fp8 / rate, 3), **setup}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 16, 64, 256])
    ap.add_argument("--eager-batches", type=int, nargs="*", default=[1, 64])
    ap.add_argument("--hf-batches", type=int, nargs="*", default=[1, 64])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--small", action="store_true", help="SmolLM2's shape instead of the 8B one")
    ap.add_argument("--lora-adapters", type=int, default=0, help="distinct adapters (0 = no LoRA run)")
    ap.add_argument("--lora-batch", type=int, default=64)
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--host-share-batch", type=int, default=0, help="measure host time at this batch")
    ttft_help = "4,096-token prompt: cold and 3,584 cached (also with and without an adapter in the LoRA run)"
    ap.add_argument("--ttft", action="store_true", help=ttft_help)
    ap.add_argument("--verify-k", type=int, default=0, help="time a K-proposal verify step")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--async-scheduling", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--profile-batches", type=int, nargs="*", default=[], help="device time per kernel")
    ap.add_argument("--profile-lora", action="store_true", help="device time per kernel of the LoRA run")
    ap.add_argument(
        "--quantization", nargs="+", default=["none"], choices=["none", *ONLINE_SCHEMES],
        help="the engine's flag; several: each in turn",
    )  # fmt: skip
    ap.add_argument("--compare", action="store_true", help="with --quantization fp8: the bf16 model too")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"], help="the engine's flag")
    args = ap.parse_args()
    schemes = [q for q in dict.fromkeys(args.quantization) if q != "none"]
    if args.compare and not schemes:
        ap.error("--compare compares --quantization fp8 with bf16: give --quantization fp8")
    shape = SMOLLM2 if args.small else LLAMA3_8B
    setup = {
        "model": "llama3-8b-shape" if shape is LLAMA3_8B else "smollm2-135m-shape",
        "dtype": "bfloat16",
        "device": torch.cuda.get_device_name(),
        "host_cpu": host_cpu(),
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "async_scheduling": args.async_scheduling,
        "kv_cache_dtype": args.kv_cache_dtype,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
    }
    bandwidth = copy_bandwidth()
    print(json.dumps({"bench": "gpu", "metric": "copy_bandwidth_gb_s", "value": round(bandwidth), **setup}))
    loaded = random_model(shape)
    bf16 = "none" in args.quantization or args.compare
    rows = engine_runs(loaded, args, setup, bandwidth) if bf16 else []
    for flag in schemes:  # one quantized copy at a time: each is 8 GB on the 8B shape
        rows += engine_runs(quantized(loaded, flag), args, setup, bandwidth)
        torch.cuda.empty_cache()
        if args.compare:
            print_fp8_over_bf16(rows, setup, flag)
    for batch in args.hf_batches:
        torch.cuda.empty_cache()
        rate = hf_decode_tok_s(loaded, batch, args.prompt_len, args.new_tokens)
        line = {
            "bench": "gpu",
            "system": "hf-generate",
            "batch": batch,
            "decode_tokens_per_s": round(rate, 1),
        }
        print(json.dumps({**line, **setup}), flush=True)
        rows.append(line)
    print(f"\n{'system':<20} {'batch':>5} {'tok/s':>10} {'GB/s':>6}  (copy {bandwidth:.0f} GB/s)")
    for r in rows:
        gb_s = r.get("achieved_gb_s", "")
        print(f"{r['system']:<20} {r['batch']:>5} {r['decode_tokens_per_s']:>10} {gb_s:>6}")


if __name__ == "__main__":
    configure_process()
    main()
