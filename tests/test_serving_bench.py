"""`bench/serving.py`'s closed loop, on the CPU with a tiny random model: every request of the
workload runs to its length, and never more than `concurrency` are in flight at once."""

from __future__ import annotations

import torch

from bench.serving import spindle_serving, workload
from model_service.engine.config import EngineConfig
from model_service.engine.engine import Engine
from model_service.models.config import ModelConfig
from model_service.models.llama import DecoderModel
from model_service.models.loader import LoadedModel


def _tiny_engine(**config: object) -> Engine:
    """A tiny random Llama (vocab 256) on the CPU, with a K/V cache sized for these workloads (the
    CPU default, 1 GiB, is 131,072 of its blocks: ~0.5 s to zero and list for each engine)."""
    cfg = ModelConfig(family="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
                      max_position_embeddings=512)  # fmt: skip
    torch.manual_seed(0)
    loaded = LoadedModel("random", cfg, DecoderModel(cfg).eval(), None)
    return Engine(EngineConfig(device="cpu", dtype="float32", num_kv_blocks=512, **config), loaded=loaded)


def test_closed_loop_keeps_concurrency_and_runs_every_request():
    engine = _tiny_engine(max_num_seqs=8, max_num_batched_tokens=64)
    requests = workload(11, 256, 3, (5, 90), (2, 9))
    assert all(5 <= len(p) <= 90 and 2 <= n <= 9 for p, n in requests)
    assert workload(11, 256, 3, (5, 90), (2, 9)) == requests  # seeded
    most = 0
    step = engine.step

    def counting_step() -> list:
        nonlocal most
        most = max(most, len(engine.scheduler.running) + len(engine.scheduler.waiting))
        return step()

    engine.step = counting_step
    result = spindle_serving(engine, requests, concurrency=3)
    assert most == 3
    assert result["output_tokens"] == sum(n for _, n in requests)
    assert result["output_tokens_per_s"] > 0 and result["ttft_p50_ms"] > 0 and result["tpot_p50_ms"] >= 0


def test_the_lora_run_sends_requests_through_every_adapter_in_turn():
    from bench.gpu import register_random_adapters

    engine = _tiny_engine(max_num_seqs=4, max_loras=3, max_cpu_loras=3, max_lora_rank=8)
    names = register_random_adapters(engine, engine.executor.config, 3, 8)
    seen = []
    add = engine.add_request_dict
    engine.add_request_dict = lambda r: seen.append(r["adapter"]) or add(r)
    requests = workload(7, 256, 1, (5, 40), (2, 5))
    result = spindle_serving(engine, requests, concurrency=2, adapters=names)
    assert seen == ["a0", "a1", "a2", "a0", "a1", "a2", "a0"]
    assert result["output_tokens"] == sum(n for _, n in requests)
    assert sorted(s.adapter.name for s in engine.lora.slots if s.adapter is not None) == names


def test_results_name_the_host_cpu_even_without_proc_cpuinfo(monkeypatch):
    """Host-bound figures move between the device tool's hosts, so every result says which."""
    from pathlib import Path

    from bench.gpu import host_cpu

    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    names = [line for line in lines if line.startswith("model name")]
    assert host_cpu() == (names[0].split(":", 1)[1].strip() if names else host_cpu())
    monkeypatch.setattr(Path, "read_text", lambda self: (_ for _ in ()).throw(OSError("none")))
    assert isinstance(host_cpu(), str) and host_cpu()


def test_rounds_alternate_base_and_adapters_on_fresh_prompts_and_sum_their_times():
    """`--rounds 2`: base then adapters on the same requests each round, other prompts in the
    second round (no prefix-cache hits left by the first), and the overall ratio from the
    summed times of all rounds."""
    import argparse

    from bench.gpu import register_random_adapters
    from bench.serving import measure_rounds, requests_at

    engine = _tiny_engine(max_num_seqs=4, max_loras=2, max_cpu_loras=2, max_lora_rank=8)
    names = register_random_adapters(engine, engine.executor.config, 2, 8)
    args = argparse.Namespace(
        rounds=2, requests_per_slot=2, ranges=((5, 40), (2, 5)), step_times=False, lora_rank=8, host_profile=0
    )
    assert requests_at(args, 256, 2, 0) != requests_at(args, 256, 2, 1)
    assert requests_at(args, 256, 2, 1) == requests_at(args, 256, 2, 1)
    lines = []
    measure_rounds(engine, args, 256, 2, names, lambda *line: lines.append(line))
    systems = [(system, r.get("round")) for system, _, _, r in lines]
    assert systems == [("spindle", 0), ("spindle-2-loras", 0), ("spindle", 1), ("spindle-2-loras", 1),
                       ("spindle-2-loras-all-rounds", None)]  # fmt: skip
    seconds = [r["output_tokens"] / r["output_tokens_per_s"] for _, _, _, r in lines[:4]]
    assert lines[-1][3]["lora_over_base"] == (seconds[0] + seconds[2]) / (seconds[1] + seconds[3])


def test_a_host_profile_names_the_functions_that_held_the_host(capsys):
    """`--host-profile N`: after the run, cProfile's N functions by their own time."""
    import argparse

    from bench.serving import measured

    engine = _tiny_engine(max_num_seqs=4)
    args = argparse.Namespace(step_times=False, host_profile=5)
    result = measured(engine, workload(4, 256, 2, (5, 20), (2, 4)), 2, (), args)
    assert result["output_tokens"] > 0
    out = capsys.readouterr().out
    assert "host profile, concurrency 2, 0 adapters:" in out and "tottime" in out
    assert "List reduced from" in out and "to 5 due to restriction" in out
