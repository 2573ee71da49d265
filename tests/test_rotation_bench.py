"""`bench/rotation.py` on the CPU: its small mode runs every configuration through the engine
with no failed request and reports what the GPU run reports; its adapters share host tensors
yet are resident as adapters of their own; its traffic and flags are what it says."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from bench import rotation
from bench.gpu import random_model
from model_service.engine.config import EngineConfig
from model_service.engine.engine import Engine

FIELDS = {
    "config", "adapters", "traffic", "ranks", "targets", "output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms",
    "failed", "adapter_loads", "adapter_loads_per_s", "adapter_load_wait_s", "engine", "requests",
    "device", "host_cpu", "model", "dtype", "concurrency", "prompt_range", "output_range", "load_timing",
}  # fmt: skip


def test_the_cpu_mode_reports_every_configuration_and_no_request_fails(capsys):
    rotation.main(["--cpu-small"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert all(line["bench"] == "rotation" for line in lines)
    runs = {line["config"]: line for line in lines if "config" in line}
    assert list(runs) == ["base", "one", "r8-qv", "r16-all", "few", "zipf"]
    for key, line in runs.items():
        assert set(line) >= FIELDS, (key, FIELDS - set(line))
        assert line["failed"] == 0 and line["requests"] == 32 and line["output_tokens_per_s"] > 0, line
        assert line["ttft_p99_ms"] >= line["ttft_p50_ms"] > 0
        assert line["over_base"] > 0 and line["device"] == "cpu" and line["model"] == "llama-tiny-shape"
    zipf, few = runs["zipf"], runs["few"]
    assert zipf["adapters"] == 200 and zipf["ranks"] == [8, 16, 32, 64] and len(zipf["targets"]) == 3
    assert zipf["distinct_adapters"] > zipf["engine"]["max_loras"] == 8  # more adapters than slots...
    assert zipf["adapter_loads"] >= zipf["distinct_adapters"] - 8 > 0  # ...so they were loaded in the run
    assert zipf["over_few"] > 0 and zipf["ttft_p99_over_few"] > 0
    assert few["adapters"] == 5 and few["engine"]["max_lora_rank"] == zipf["engine"]["max_lora_rank"] == 64
    assert runs["base"]["engine"]["max_loras"] == 0 and runs["r16-all"]["engine"]["max_lora_rank"] == 16
    # at 8 rows over 8 uniform adapters a decode step holds 1 to 8 of them; the base model none
    r16 = runs["r16-all"]
    assert r16["decode_steps"] > 0 and 1 <= r16["distinct_adapters_per_decode_step_mean"] <= 8
    assert runs["base"]["distinct_adapters_per_decode_step_mean"] == 0
    warm_ups = [line for line in lines if line.get("system") == "warm-up"]
    assert len(warm_ups) == 4  # one and r8-qv share an engine, as do few and zipf
    summary = lines[-1]
    assert summary["summary"] and set(summary["targets"]) == {
        "r8_qv_over_base", "r16_all_over_base", "zipf_over_few", "zipf_ttft_p99_over_few", "failed_requests",
    }  # fmt: skip
    assert summary["targets"]["failed_requests"] == {"value": 0, "target": "== 0", "met": True}
    assert summary["targets"]["zipf_over_few"]["value"] == zipf["over_few"]


def test_adapters_of_one_kind_share_a_host_buffer_yet_each_is_resident_as_its_own():
    loaded = random_model(rotation.TINY, "cpu", torch.float32)
    config = EngineConfig(device="cpu", dtype="float32", max_loras=3, max_cpu_loras=3, max_lora_rank=8,
                          kv_cache_memory_bytes=1 << 20)  # fmt: skip
    engine = Engine(config, loaded=loaded)
    names = rotation.register(engine, loaded.config, rotation.Config("t", [rotation.Kind(8, "q,v")] * 3), {})
    pool = engine.lora
    adapters = [pool.host[name] for name in names]
    assert len({a.packed.data_ptr() for a in adapters}) == 1  # one host copy...
    assert (
        len({a.adapter_id for a in adapters}) == len({a.sha256 for a in adapters}) == 3
    )  # ...three identities
    assert {m for _, m in adapters[0].modules} == {"q_proj", "v_proj"} and adapters[0].max_rank == 8
    for name in names:
        pool.load(name)
    assert sorted(pool.slot_of(name) for name in names) == [0, 1, 2]
    assert len({pool.adapter_id_for(pool.slot_of(name)) for name in names}) == 3
    rotation.forget(pool, names)
    assert not any(pool.known(name) for name in names)


def test_zipf_traffic_sends_the_same_requests_to_the_same_popularity_over_2000_and_over_5():
    uniforms = torch.rand(4000, generator=torch.Generator().manual_seed(1))
    wide, few = rotation.zipf_indices(uniforms, 2000), rotation.zipf_indices(uniforms, 5)
    assert max(wide) < 2000 and set(few) == set(range(5))
    assert few.count(0) / len(few) == pytest.approx(1 / sum(1 / k for k in range(1, 6)), abs=0.03)
    assert wide.count(0) / len(wide) == pytest.approx(1 / sum(1 / k for k in range(1, 2001)), abs=0.02)
    by_quantile = sorted(range(4000), key=lambda j: uniforms[j])
    assert [wide[j] for j in by_quantile] == sorted(wide) and [few[j] for j in by_quantile] == sorted(few)
    config = rotation.Config("r", [rotation.Kind(8, "q,v")] * 3)
    assert rotation.request_adapters(config, ["a", "b", "c"], uniforms[:4]) == ["a", "b", "c", "a"]
    assert rotation.request_adapters(rotation.Config("base", []), [], uniforms) == []


def test_the_warm_up_covers_every_kind_and_leaves_the_most_popular_last():
    kinds = rotation.mixed_kinds(200, 0)
    names = [f"z-{k}" for k in range(200)]
    primed = rotation.primed(names, kinds, 8)
    assert primed[-8:] == names[:8]
    assert {kinds[names.index(n)] for n in primed} == set(kinds)
    assert len(primed) == 8 + len(set(kinds) - set(kinds[:8]))
    args = argparse.Namespace(zipf_adapters=200, few_adapters=5, resident_adapters=8, seed=0, configs=["few"])
    [few] = rotation.configurations(args)
    assert few.kinds == kinds[:5] and few.max_rank == max(k.rank for k in kinds) == 64


def test_engine_args_take_their_fields_types():
    read = rotation.engine_arg
    assert read("max_loras=8") == {"max_loras": 8}
    assert read("kv_cache_memory_bytes=8e9") == {"kv_cache_memory_bytes": 8_000_000_000}
    assert read("num_kv_blocks=none") == {"num_kv_blocks": None}
    assert read("enforce_eager=false") == {"enforce_eager": False}
    assert read("gpu_memory_utilization=0.5") == {"gpu_memory_utilization": 0.5}
    assert read("kv_cache_dtype=fp8") == {"kv_cache_dtype": "fp8"}
    assert read('lora_modules={"x": "/d"}') == {"lora_modules": {"x": "/d"}}
    for bad in ("no_such_field=1", "max_loras", "max_loras=1.5", "enforce_eager=maybe"):
        with pytest.raises(argparse.ArgumentTypeError):
            read(bad)
    flags = ["--engine-arg", "max_loras=2", "--engine-arg", "max_num_seqs=4", "--concurrency", "4"]
    args = rotation.parse_args(["--cpu-small", *flags])
    assert args.engine_arg == {"max_loras": 2, "max_num_seqs": 4} and args.concurrency == 4
    lora = rotation.engine_config(args, rotation.Config("r", [rotation.Kind(16, "all7")]))
    assert (lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras, lora.device) == (2, 16, 200, "cpu")
    with pytest.raises(SystemExit):
        rotation.parse_args(["--cpu-small", "--max-cpu-loras", "16"])  # zipf's 200 live in the host tier only
