"""Serving many LoRA adapters at once (issue 30, item 6): output tok/s, TTFT and adapter loads
of a closed loop through the Python engine, from the base model alone to 2,000 adapters of mixed
ranks and targets with Zipf(1) popularity.

    PYTHONPATH=. python3 bench/rotation.py [--configs base one r8-qv r16-all few zipf]
        [--concurrency 64] [--requests 640 | --duration S] [--max-loras N] [--max-cpu-loras N]
        [--max-lora-rank R] [--adapter-wait-timeout-s S] [--engine-arg KEY=VALUE ...]
        [--device cuda] [--dtype bfloat16] [--model-shape 8b]
    PYTHONPATH=. python3 bench/rotation.py --cpu-small   # tiny model on the CPU, seconds

Configurations, each a closed loop at `--concurrency` over the same seeded workload (prompts of
128-512 random token ids, outputs of 64-256, EOS ignored, as `bench/serving.py` runs it):

- base: the base model alone, in an engine without LoRA;
- one: every request through 1 adapter (rank 8 on q_proj and v_proj, PEFT's default targets);
- r8-qv: 64 adapters of rank 8 on q_proj, v_proj, uniform (request i through adapter i mod 64);
- r16-all: 64 adapters of rank 16 on all seven projections, uniform;
- zipf: 2,000 adapters, ranks drawn from 8/16/32/64 and targets from q,v / q,k,v,o / all seven
  (seeded, per adapter), request j through the adapter at quantile u_j of Zipf(1);
- few: the same requests over 5 adapters (the first 5 of zipf's kinds), Zipf(1) at the same u_j.

`--requests` bounds each run; `--duration S` also stops admitting after S seconds (a guard for
a run that stalls on loads: configurations cut by it ran fewer requests, as their lines say).

On CUDA the adapter arena is 16 GB (`lora_memory_bytes`, as every figure of record ran it; an
`--engine-arg` overrides it: the engine's default held ~20 of r8-qv's 64). Each engine's
`max_lora_rank` is the highest rank of its configuration's adapters (few takes zipf's, so the
two differ in traffic only); configurations with equal settings share an engine
(its graphs captured once). Before each run the adapters go through once, as `bench/serving.py`
primes: all of them for one, r8-qv and r16-all (resident, as the issue states them), for zipf
and few the `--max-loras` most popular and one of each kind, as a pod in steady state holds them.

Adapters: no PEFT files (2,000 of mixed ranks would not fit the device machine's disk). Each
kind (rank, targets) has one random adapter packed once as the pool's host form; every adapter
of that kind is its own `LoraAdapter` (name, adapter_id, sha256 and scaling of its own) over
that shared page-locked buffer, in the pool's host tier. The engine loads and places each one
on the device as its own; only the host copy is shared, so loads run host -> device, never from
disk. Load counts and times: the engine has no counters for them (`EngineStats`,
`model_service/pod/metrics.py`), so the bench times the calls the pool makes to its slot writer
on the engine thread (`TimedWriter`: host time; the copies they queue run asynchronously after
them). EngineStats fields that name adapters or loads, if the engine gains any, are reported too.

One JSON line per engine built (its graph capture), one per configuration (with the ratios to
base, and for zipf to few), and a last line with the issue's targets. Every line states the
setup: device, host CPU, model shape, dtype, the workload and the engine's non-default settings.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import hashlib
import json
import sys
import time
import types
import typing
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from bench.gpu import LLAMA3_8B, SMOLLM2, host_cpu, random_adapter, random_lora_modules, random_model
from bench.serving import capture, prime, spindle_serving, workload
from model_service.engine.config import EngineConfig
from model_service.engine.engine import Engine
from model_service.lora.adapter import LoraAdapter, LoraWeights, content_id
from model_service.lora.pool import LoraPool
from model_service.models.config import ModelConfig
from model_service.models.loader import LoadedModel
from model_service.models.step import StepBatch
from model_service.startup import configure_process

TINY = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 16,
}
SHAPES = {"8b": LLAMA3_8B, "smollm2": SMOLLM2, "tiny": TINY}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
RANKS = (8, 16, 32, 64)
TARGET_SETS = {
    "q,v": ("q_proj", "v_proj"),
    "q,k,v,o": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "all7": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}
LORA_SETTINGS = ("max_loras", "max_cpu_loras", "max_lora_rank", "adapter_wait_timeout_s")
CONFIGS = ("base", "one", "r8-qv", "r16-all", "few", "zipf")  # run order: few before zipf, its reference
# The targets: (what, configuration, its field, bound, at least (True) or at most).
TARGETS = (
    ("r8_qv_over_base", "r8-qv", "over_base", 0.92, True),
    ("r16_all_over_base", "r16-all", "over_base", 0.83, True),
    ("zipf_over_few", "zipf", "over_few", 0.95, True),
    ("zipf_ttft_p99_over_few", "zipf", "ttft_p99_over_few", 1.5, False),
)
CPU_SMALL = {
    "device": "cpu", "model_shape": "tiny", "concurrency": 8, "requests": 32, "prompt_range": [16, 64],
    "output_range": [4, 16], "resident_adapters": 8, "zipf_adapters": 200,
}  # fmt: skip


@dataclass(frozen=True)
class Kind:
    """An adapter's rank and target set (a key of TARGET_SETS)."""

    rank: int
    targets: str


@dataclass
class Config:
    """One configuration: the kind of each adapter (none: the base model), how requests pick
    them, and the engine's `max_lora_rank`."""

    key: str
    kinds: list[Kind]
    traffic: str = "uniform"  # "uniform": request i through adapter i mod n; "zipf": Zipf(1)
    max_rank: int = 0

    def __post_init__(self) -> None:
        self.max_rank = self.max_rank or max((k.rank for k in self.kinds), default=0)


def mixed_kinds(n: int, seed: int) -> list[Kind]:
    """`n` adapters' kinds, rank and target set each drawn uniformly (seeded)."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.randint(0, len(RANKS), (n,), generator=g).tolist()
    targets = torch.randint(0, len(TARGET_SETS), (n,), generator=g).tolist()
    return [Kind(RANKS[r], list(TARGET_SETS)[t]) for r, t in zip(ranks, targets, strict=True)]


def configurations(args: argparse.Namespace) -> list[Config]:
    """The configurations `--configs` picks, in run order."""
    mixed = mixed_kinds(args.zipf_adapters, args.seed)
    every = {
        "base": Config("base", []),
        "one": Config("one", [Kind(8, "q,v")]),
        "r8-qv": Config("r8-qv", [Kind(8, "q,v")] * args.resident_adapters),
        "r16-all": Config("r16-all", [Kind(16, "all7")] * args.resident_adapters),
        "few": Config("few", mixed[: args.few_adapters], "zipf", max(k.rank for k in mixed)),
        "zipf": Config("zipf", mixed, "zipf"),
    }
    return [every[key] for key in CONFIGS if key in args.configs]


def zipf_indices(uniforms: torch.Tensor, n: int) -> list[int]:
    """The adapter at each quantile of Zipf(1) over `n` (adapter k drawn with weight 1 / (k + 1)):
    the same uniforms over 2,000 and over 5 adapters send request j to the same popularity rank
    as far as 5 adapters allow."""
    cdf = torch.cumsum(1.0 / torch.arange(1, n + 1, dtype=torch.float64), 0)
    return torch.searchsorted(cdf / cdf[-1], uniforms.double(), right=True).clamp(max=n - 1).tolist()


def request_adapters(config: Config, names: list[str], uniforms: torch.Tensor) -> list[str]:
    """The adapter of each request (empty for the base model)."""
    if not names:
        return []
    if config.traffic == "zipf":
        return [names[k] for k in zipf_indices(uniforms, len(names))]
    return [names[i % len(names)] for i in range(len(uniforms))]


def primed(names: list[str], kinds: list[Kind], slots: int) -> list[str]:
    """The adapters a run's warm-up sends requests through, in order: the first of each kind
    that the head lacks (its kernels then compile before the run), then the head, the `slots`
    most popular (`names` are in popularity order), last, so that they stay resident."""
    head, firsts = names[:slots], {}
    for name, kind in zip(names, kinds, strict=True):
        if kind not in kinds[:slots]:
            firsts.setdefault(kind, name)
    return [*firsts.values(), *head]


class TimedWriter:
    """Stands in for the pool's slot writer (the executor) and counts and times every call the
    pool makes to it (loads, clears, moves) on the engine thread: the engine has no load
    counters of its own. Host time: device copies that a call queues run after it returns."""

    def __init__(self, writer: object) -> None:
        self.writer = writer
        self.calls: Counter[str] = Counter()
        self.seconds: defaultdict[str, float] = defaultdict(float)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.writer, name)
        if not callable(attr):
            return attr

        @functools.wraps(attr)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                self.calls[name] += 1
                self.seconds[name] += time.perf_counter() - start

        return timed

    def snapshot(self) -> dict[str, tuple[int, float]]:
        return {name: (self.calls[name], self.seconds[name]) for name in self.calls}


class StepAdapters:
    """Wraps an executor's `execute` and records, for each decode step (every row one token),
    how many distinct adapters its rows use: the adapters whose weights the step's LoRA kernels
    must read at least once, so the floor of their time (bytes over the copy bandwidth) scales
    with it. Uniform traffic over 64 adapters at 64 rows leaves ~55 distinct in a full step, not 64."""

    def __init__(self, execute: Callable[..., torch.Tensor]) -> None:
        self.execute, self.counts = execute, []

    def __call__(self, batch: StepBatch, *args: Any, **kwargs: Any) -> torch.Tensor:
        if batch.num_leading_decodes == batch.num_seqs:
            self.counts.append(len(np.unique(batch.host_lora_slots[batch.host_lora_slots >= 0])))
        return self.execute(batch, *args, **kwargs)

    def summary(self, since: int) -> dict[str, float]:
        """Decode steps recorded after the first `since`: the mean and median distinct adapters."""
        counts = self.counts[since:]
        if not counts:
            return {}
        return {
            "decode_steps": len(counts),
            "distinct_adapters_per_decode_step_mean": float(np.mean(counts)),
            "distinct_adapters_per_decode_step_p50": float(np.median(counts)),
        }


class Engines:
    """One engine at a time, built again only when a configuration needs other settings; each
    build is captured as a pod's warm-up is (`bench.serving.capture`) and reported. Also the
    host buffers of the adapters' kinds (`kind_template`), which every engine shares."""

    def __init__(self, loaded: LoadedModel, report: Callable[[dict[str, Any]], None]) -> None:
        self.loaded, self.report = loaded, report
        self.engine: Engine | None = None
        self.templates: dict[Kind, LoraAdapter] = {}

    def get(self, config: EngineConfig) -> Engine:
        if self.engine is not None and self.engine.config == config:
            return self.engine
        self.engine = None  # its device memory goes before the next engine's is taken
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        engine = Engine(config, loaded=self.loaded)
        engine.lora.writer = TimedWriter(engine.lora.writer)
        engine.executor.execute = StepAdapters(engine.executor.execute)
        self.report({"system": "warm-up", **capture(engine), "engine": engine_flags(config)})
        self.engine = engine
        return engine


@dataclass
class Workload:
    """What every configuration runs: the requests (prompt ids, output length), the uniform that
    picks each request's adapter, and the warm-up's prompt lengths."""

    requests: list[tuple[list[int], int]]
    uniforms: torch.Tensor
    warm_prompts: tuple[int, int]


def run(config: Config, engines: Engines, work: Workload, args: argparse.Namespace) -> dict[str, Any]:
    """One configuration: its adapters registered and primed in its engine, the measured run,
    its adapters forgotten. Only this frame holds the engine, so `Engines` can free it for the
    next configuration's before building that one."""
    engine = engines.get(engine_config(args, config))
    names = register(engine, engines.loaded.config, config, engines.templates)
    slots = engine.config.max_loras or args.concurrency
    warm = primed(names, config.kinds, slots)
    prime(engine, engines.loaded.config.vocab_size, warm, work.warm_prompts, min(args.concurrency, slots))
    result = measure(engine, config, names, work.requests, work.uniforms, args)
    forget(engine.lora, names)
    return result | {"engine": engine_flags(engine.config)}


def engine_config(args: argparse.Namespace, config: Config) -> EngineConfig:
    """The configuration's engine: no LoRA for the base model; `--engine-arg`s last, over all."""
    cuda = args.device.startswith("cuda")
    fields: dict[str, Any] = {
        "device": args.device,
        "dtype": args.dtype,
        "max_num_seqs": args.concurrency,
        "kv_cache_memory_bytes": (16 << 30) if cuda else (64 << 20),  # 2.6x what 64 x 768 tokens take
        "max_loras": 0,
    }
    if config.kinds:
        lora = {"max_loras": args.max_loras, "max_cpu_loras": args.max_cpu_loras}
        if cuda:  # the configurations' adapters resident, as the issue states them: the engine's
            # default arena (4 adapters of the top rank on every projection) held ~20 of r8-qv's
            # 64, and every request then loaded its adapter (0.45x the base, 2026-12-02 w)
            lora["lora_memory_bytes"] = 16 * 10**9
        fields |= lora | {"max_lora_rank": args.max_lora_rank or config.max_rank}
        if args.adapter_wait_timeout_s is not None:
            fields["adapter_wait_timeout_s"] = args.adapter_wait_timeout_s
    return EngineConfig(**(fields | args.engine_arg))


def engine_flags(config: EngineConfig) -> dict[str, Any]:
    """The engine's settings as a result states them: its adapter settings, and every other one
    that differs from EngineConfig's default."""
    out = {}
    for f in dataclasses.fields(EngineConfig):
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        if getattr(config, f.name) != default or (f.name in LORA_SETTINGS and config.max_loras):
            out[f.name] = getattr(config, f.name)
    return out


def kind_template(
    pool: LoraPool, cfg: ModelConfig, kind: Kind, cache: dict[Kind, LoraAdapter]
) -> LoraAdapter:
    """One random adapter of `kind` in the pool's host form (packed once, page-locked on a GPU),
    kept in `cache` across engines (same dtype): what every adapter of that kind shares."""
    if kind not in cache:
        seed = RANKS.index(kind.rank) * len(TARGET_SETS) + list(TARGET_SETS).index(kind.targets)
        shared = random_lora_modules(cfg, kind.rank, TARGET_SETS[kind.targets], seed)
        adapter = random_adapter(f"{kind.rank}-{kind.targets}", 1, cfg, shared)
        cache[kind] = pool.host_form(adapter) if pool.host_form is not None else adapter
    return cache[kind]


def register(engine: Engine, cfg: ModelConfig, config: Config, cache: dict[Kind, LoraAdapter]) -> list[str]:
    """The configuration's adapters, `{key}-{k}`, each its own adapter (name, adapter_id, sha256,
    scaling) over its kind's shared host buffer, in the pool's host tier. Returns their names."""
    names = []
    for k, kind in enumerate(config.kinds):
        template, name = kind_template(engine.lora, cfg, kind, cache), f"{config.key}-{k}"
        scaling = 1.0 + k / len(config.kinds)
        modules = {key: LoraWeights(w.a, w.b, scaling) for key, w in template.modules.items()}
        identity = {
            "adapter_id": content_id(name.encode(), b""),
            "sha256": hashlib.sha256(name.encode()).hexdigest(),
        }
        remember_shared(engine.lora, dataclasses.replace(template, name=name, modules=modules, **identity))
        names.append(name)
    return names


def remember_shared(pool: LoraPool, adapter: LoraAdapter) -> None:
    """Put `adapter`, already in host form, into the pool's host tier as it is: the pool would
    pack a copy of its own for every name (2,000 copies of up to 335 MB on the 8B shape, which
    no host holds). Bench only: the pool has no entry point for adapters without a disk copy."""
    form, pool.host_form = pool.host_form, None
    try:
        pool._remember(adapter)
    finally:
        pool.host_form = form


def forget(pool: LoraPool, names: Sequence[str]) -> None:
    """Evict a finished configuration's adapters and drop their host copies, so that the next
    configuration in the same engine starts with its own adapters only."""
    for name in names:
        if pool.slot_of(name) is not None:
            pool.evict(name)
        pool.drop_host_copy(name)


def adapter_counters(engine: Engine) -> dict[str, float]:
    """The engine's own adapter counters, where it has any: EngineStats fields naming adapters or
    loads (none at the time of writing; then the bench's `TimedWriter` figures stand alone)."""
    stats = dataclasses.asdict(engine.stats())
    return {k: v for k, v in stats.items() if any(word in k for word in ("lora", "adapter", "load"))}


def measure(
    engine: Engine,
    config: Config,
    names: list[str],
    requests: list[tuple[list[int], int]],
    uniforms: torch.Tensor,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One configuration's closed loop, with its failures counted (not raised) and the adapter
    loads the pool made during it."""
    writer = engine.lora.writer
    assert isinstance(writer, TimedWriter), "Engines.get wraps every engine's writer"
    calls, counters, preemptions = writer.snapshot(), adapter_counters(engine), engine.stats().num_preemptions
    steps = engine.executor.execute
    assert isinstance(steps, StepAdapters), "Engines.get wraps every engine's execute"
    since = len(steps.counts)
    per_request, failed = request_adapters(config, names, uniforms), []
    result = spindle_serving(
        engine, requests, args.concurrency, per_request, failed=failed, admit_for_s=args.duration or None
    )
    delta = {
        name: (n - calls.get(name, (0, 0.0))[0], s - calls.get(name, (0, 0.0))[1])
        for name, (n, s) in writer.snapshot().items()
    }
    loads = sum(n for name, (n, _) in delta.items() if name.startswith("load"))
    waited = sum(s for _, s in delta.values())
    return result | {
        "failed": len(failed),
        "failures": failed[:3],
        "distinct_adapters": len(set(per_request[: result["requests"]])),
        "adapter_loads": loads,
        "adapter_loads_per_s": loads / result["wall_s"],
        "adapter_load_wait_s": waited,
        "adapter_load_wait_share": waited / result["wall_s"],
        "writer_calls": {name: [n, round(s, 4)] for name, (n, s) in delta.items() if n},
        "engine_adapter_counters": {k: v - counters[k] for k, v in adapter_counters(engine).items()},
        "preemptions": engine.stats().num_preemptions - preemptions,
        **steps.summary(since),
    }


def describe(config: Config, result: dict[str, Any], done: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A configuration's line: what it ran, its figures, and its ratios to base and (zipf) few."""
    line: dict[str, Any] = {
        "config": config.key,
        "adapters": len(config.kinds),
        "traffic": config.traffic if config.kinds else None,
        "ranks": sorted({k.rank for k in config.kinds}),
        "targets": sorted({k.targets for k in config.kinds}),
    }
    line |= {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}
    base = result if config.key == "base" else done.get("base")
    if base is not None:
        line["over_base"] = round(result["output_tokens_per_s"] / base["output_tokens_per_s"], 4)
    if config.key == "zipf" and "few" in done:
        few = done["few"]
        line["over_few"] = round(result["output_tokens_per_s"] / few["output_tokens_per_s"], 4)
        line["ttft_p99_over_few"] = round(result["ttft_p99_ms"] / few["ttft_p99_ms"], 4)
    return line


def summary(lines: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets against this run: each value, its bound, and whether it is met (None
    where its configurations did not run); zero failed requests in every configuration."""
    targets: dict[str, dict[str, Any]] = {}
    for what, key, field, bound, at_least in TARGETS:
        value = lines.get(key, {}).get(field)
        met = None if value is None else (value >= bound if at_least else value <= bound)
        targets[what] = {"value": value, "target": f"{'>=' if at_least else '<='} {bound}", "met": met}
    failed = sum(line["failed"] for line in lines.values())
    targets["failed_requests"] = {"value": failed, "target": "== 0", "met": failed == 0}
    return {"summary": True, "targets": targets, "all_met": all(t["met"] for t in targets.values())}


def engine_arg(pair: str) -> dict[str, Any]:
    """One `--engine-arg KEY=VALUE` as an EngineConfig field, the value read as that field's
    type: options the engine gains (an adapter memory budget, `lora_memory_bytes`) need no flag here."""
    hints = typing.get_type_hints(EngineConfig)
    key, sep, raw = pair.partition("=")
    if not sep or key not in hints:
        raise argparse.ArgumentTypeError(
            f"want KEY=VALUE with KEY one of EngineConfig's fields: {', '.join(hints)}"
        )
    hint = hints[key]
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    kind = next(a for a in typing.get_args(hint) if a is not type(None)) if union else hint
    try:
        return {key: typed(raw, kind, union and type(None) in typing.get_args(hint))}
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{key}: {e}") from e


def typed(raw: str, kind: Any, optional: bool) -> Any:
    """`raw` as a value of `kind` (bool, int, float, str, or a dict as JSON); "none" for None."""
    if optional and raw.lower() == "none":
        return None
    if kind is bool:
        words = {"true": True, "on": True, "1": True, "false": False, "off": False, "0": False}
        if raw.lower() not in words:
            raise ValueError(f"{raw!r} is not one of {', '.join(words)}")
        return words[raw.lower()]
    if kind is int:
        number = float(raw)  # 8e9 reads as well as 8000000000
        if not number.is_integer():
            raise ValueError(f"{raw!r} is not a whole number")
        return int(number)
    if kind is float:
        return float(raw)
    return json.loads(raw) if typing.get_origin(kind) is dict else raw


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=640, help="requests of each configuration's run")
    ap.add_argument("--duration", type=float, default=0, help="stop admitting after S seconds (0: never)")
    ap.add_argument("--prompt-range", type=int, nargs=2, default=[128, 512])
    ap.add_argument("--output-range", type=int, nargs=2, default=[64, 256])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resident-adapters", type=int, default=64, help="adapters of r8-qv and r16-all")
    ap.add_argument("--zipf-adapters", type=int, default=2000)
    ap.add_argument("--few-adapters", type=int, default=5)
    ap.add_argument("--max-loras", type=int, default=None, help="[--concurrency]")
    ap.add_argument("--max-cpu-loras", type=int, default=None, help="[the most adapters of a configuration]")
    ap.add_argument("--max-lora-rank", type=int, default=None, help="[each configuration's highest rank]")
    ap.add_argument("--adapter-wait-timeout-s", type=float, default=None, help="[the engine's default]")
    ap.add_argument("--engine-arg", type=engine_arg, action="append", default=[], metavar="KEY=VALUE",
                    help="any other EngineConfig field (repeatable), e.g. lora_memory_bytes=8e9")  # fmt: skip
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=list(DTYPES), default=None, help="[bfloat16; float32 on the CPU]")
    ap.add_argument("--model-shape", choices=list(SHAPES), default="8b")
    ap.add_argument("--cpu-small", action="store_true", help=f"a few seconds on the CPU: {CPU_SMALL}")
    given = list(argv) if argv is not None else sys.argv[1:]
    if "--cpu-small" in given:
        ap.set_defaults(**CPU_SMALL)  # flags given beside it still win
    args = ap.parse_args(given)
    args.engine_arg = functools.reduce(lambda a, b: a | b, args.engine_arg, {})
    args.ranges = (tuple(args.prompt_range), tuple(args.output_range))
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    args.max_loras = args.max_loras or args.concurrency
    counts = [len(c.kinds) for c in configurations(args)]
    args.max_cpu_loras = args.max_cpu_loras or max(counts, default=1)
    if max(counts, default=0) > args.max_cpu_loras:
        ap.error(f"--max-cpu-loras {args.max_cpu_loras}: the adapters live in the host tier only (no disk "
                 f"copies), so it must hold a configuration's {max(counts)}")  # fmt: skip
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    shape = SHAPES[args.model_shape]
    device = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else args.device
    setup = {
        "device": device,
        "host_cpu": host_cpu(),
        "model": f"llama-{args.model_shape}-shape",
        "dtype": args.dtype,
        "concurrency": args.concurrency,
        "requests_per_config": args.requests,
        "duration_s": args.duration,
        "prompt_range": args.prompt_range,
        "output_range": args.output_range,
        "seed": args.seed,
        "host_copies": "one per (rank, targets), shared; each adapter placed on the device as its own",
        "load_timing": "host time of the pool's slot-writer calls on the engine thread (bench wrapper)",
    }

    def report(line: dict[str, Any]) -> None:
        print(json.dumps({"bench": "rotation", **line, **setup}), flush=True)

    loaded = random_model(shape, args.device, DTYPES[args.dtype])
    engines, done = Engines(loaded, report), {}
    work = Workload(
        workload(args.requests, loaded.config.vocab_size, args.seed, *args.ranges),
        torch.rand(args.requests, generator=torch.Generator().manual_seed(args.seed + 1)),
        # the CPU has no kernels to compile: its warm-up need not cover the GPU's chunk sizes
        args.ranges[0] if args.device == "cpu" else (64, 2048),
    )
    for config in configurations(args):
        done[config.key] = describe(config, run(config, engines, work, args), done)
        report(done[config.key])
    report(summary(done))


if __name__ == "__main__":
    configure_process()
    main()
