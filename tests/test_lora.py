"""Many LoRA adapters: PEFT parity, mixed batches, slots and refcounts, control ops, refusals."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from model_service.engine.sampling_params import SamplingParams
from model_service.errors import NotFoundError, PreconditionError
from model_service.lora import pool as pool_module
from model_service.lora.adapter import AdapterError, load_peft_adapter
from model_service.lora.control import (
    EvictAdapter,
    LoadAdapter,
    PinAdapter,
    RegisterAdapter,
    SetActiveAdapter,
)
from model_service.lora.pool import ACTIVE
from tests.conftest import assert_all_blocks_free, make_engine
from tests.overlap_helpers import mixed_requests, run_steps

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SMOL_ADAPTERS = {
    "attn_r8": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
    "all_r4_rslora": {"r": 4, "lora_alpha": 8, "target_modules": ALL, "use_rslora": True},
    "mlp_r16": {"r": 16, "lora_alpha": 8, "target_modules": ["gate_proj", "up_proj", "down_proj"]},
    "mixed_ranks": {
        "r": 6,
        "lora_alpha": 12,
        "target_modules": ["k_proj", "o_proj", "down_proj"],
        "rank_pattern": {"down_proj": 2},
        "alpha_pattern": {"o_proj": 3},
    },
}


def _greedy(max_tokens: int) -> SamplingParams:
    """Greedy decoding of exactly `max_tokens` tokens (EOS ignored)."""
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def arena_bytes(loaded, *paths: Path) -> int:
    """Device bytes the adapters at `paths` take in `loaded`'s float32 adapter arena: a test
    sizes `lora_memory_bytes` with it to make residency tight."""
    return 4 * sum(load_peft_adapter("x", p, loaded.config, 64).numel for p in paths)


def make_adapter(hf_model, path: Path, seed: int, scale: float = 0.05, **lora_kwargs) -> Path:
    """Save a random PEFT adapter for `hf_model` (left unmodified) and return its directory."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(hf_model, LoraConfig(init_lora_weights=False, **lora_kwargs))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0, scale)
    peft_model.save_pretrained(path)
    peft_model.unload()
    return path


def peft_greedy(
    hf_model, adapter_dir: Path, prompts: list[list[int]], n: int, eos: int | None
) -> list[list[int]]:
    """PEFT's greedy tokens for each prompt, one at a time (no padding), under one load of the
    adapter."""
    from peft import PeftModel

    peft_model = PeftModel.from_pretrained(hf_model, str(adapter_dir))
    try:
        outs = [
            peft_model.generate(
                input_ids=torch.tensor([ids]),
                max_new_tokens=n,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos or 0,
            )[0, len(ids) :].tolist()
            for ids in prompts
        ]
    finally:
        peft_model.unload()
    return [gen[: gen.index(eos) + 1] if eos is not None and eos in gen else gen for gen in outs]


@pytest.fixture(scope="module")
def smol_adapters(hf_smollm2, tmp_path_factory):
    root = tmp_path_factory.mktemp("smol_adapters")
    return {
        name: make_adapter(hf_smollm2, root / name, seed=i, **kw)
        for i, (name, kw) in enumerate(SMOL_ADAPTERS.items())
    }


def test_smollm2_adapters_match_peft(smollm2, hf_smollm2, smol_adapters):
    """Every adapter's rows and the base model's in one batch (the engine's steps are the cost,
    whatever the rows): each adapter's tokens are PEFT's, and differ from the base model's."""
    engine = make_engine(smollm2, max_loras=4, lora_modules={k: str(v) for k, v in smol_adapters.items()})
    prompts = [
        smollm2.tokenizer.apply_chat_template([{"role": "user", "content": q}])
        for q in ("What is the capital of France?", "Write one word about rain.")
    ]
    adapters = [None, *smol_adapters]
    outputs = engine.generate(
        [
            {"prompt_token_ids": ids, "max_tokens": 10, "temperature": 0, "adapter": name}
            for name in adapters
            for ids in prompts
        ]
    )
    got = {name: [o.token_ids for o in outputs[i * 2 : i * 2 + 2]] for i, name in enumerate(adapters)}
    for name, path in smol_adapters.items():
        expected = peft_greedy(hf_smollm2, path, prompts, 10, eos=2)
        assert got[name] == expected, name
        # Otherwise the test could not tell a missing delta from a correct one.
        assert expected != got[None], f"adapter {name} does not change the output"
    assert_all_blocks_free(engine)


@pytest.fixture(scope="module")
def hf_tiny(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tiny_adapters(hf_tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_adapters")
    specs = [
        {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        {"r": 8, "lora_alpha": 8, "target_modules": ALL},
        {"r": 2, "lora_alpha": 4, "target_modules": ["down_proj", "o_proj"], "use_rslora": True},
        {"r": 16, "lora_alpha": 16, "target_modules": ["gate_proj", "k_proj"]},
        {"r": 4, "lora_alpha": 2, "target_modules": ["up_proj"]},
    ]
    return {
        f"t{i}": make_adapter(hf_tiny, root / f"t{i}", seed=100 + i, scale=0.3, **s)
        for i, s in enumerate(specs)
    }


PROMPTS = [
    [5, 17, 33, 101, 250, 7],
    [9, 64, 12, 8, 19, 200, 3, 44],
    [77, 78, 79],
    [300, 1, 150, 151, 152, 153],
]


def _run(engine, reqs):
    return [o.token_ids for o in engine.generate(reqs)]


def _req(prompt, adapter, n=8):
    return {
        "prompt_token_ids": prompt,
        "max_tokens": n,
        "temperature": 0,
        "ignore_eos": True,
        "adapter": adapter,
    }


@pytest.fixture(scope="module")
def tiny_reference(tiny_llama, tiny_adapters):
    """Every (prompt, adapter) run alone: the answer any batch or schedule must reproduce."""
    engine = make_engine(tiny_llama, max_loras=1, lora_modules={k: str(v) for k, v in tiny_adapters.items()})
    return {
        (i, a): _run(engine, [_req(p, a)])[0] for i, p in enumerate(PROMPTS) for a in [None, *tiny_adapters]
    }


def test_tiny_adapters_match_peft(hf_tiny, tiny_adapters, tiny_reference):
    for name, path in tiny_adapters.items():
        expected = peft_greedy(hf_tiny, path, PROMPTS[:2], 8, eos=None)
        assert [tiny_reference[(i, name)] for i in range(2)] == expected, name


def test_a_disk_only_adapter_is_read_in_a_worker_while_other_requests_run(
    tiny_llama, tiny_adapters, tiny_reference, monkeypatch
):
    """The host tier holds one adapter, so t0 is on disk only when its request comes. Its read
    (slowed to 0.5 s here) runs in a worker thread: the base request beside it finishes before
    t0's is admitted, and t0's answer is exact."""
    modules = {k: str(tiny_adapters[k]) for k in ("t0", "t1")}
    engine = make_engine(tiny_llama, max_cpu_loras=1, lora_modules=modules)
    assert "t0" not in engine.lora.host and engine.lora.slot_of("t0") is None
    readers = []

    def slow_read(*args, **kwargs):
        readers.append(threading.current_thread().name)
        time.sleep(0.5)
        return load_peft_adapter(*args, **kwargs)

    monkeypatch.setattr(pool_module, "load_peft_adapter", slow_read)
    engine.add_request_dict({**_req(PROMPTS[0], "t0"), "request_id": "lora"})
    engine.add_request_dict({**_req(PROMPTS[1], None), "request_id": "base"})
    finished = []
    while engine.has_unfinished():
        finished += [(o.request_id, o.token_ids) for o in engine.step() if o.finished]
    assert [rid for rid, _ in finished] == ["base", "lora"]
    assert dict(finished) == {"base": tiny_reference[(1, None)], "lora": tiny_reference[(0, "t0")]}
    assert len(readers) == 1 and readers[0].startswith("lora-read")
    assert engine.stats().adapter_loads == 1


def test_mixed_batch_of_base_and_five_adapters_equals_each_alone(tiny_llama, tiny_adapters, tiny_reference):
    engine = make_engine(tiny_llama, max_loras=5, lora_modules={k: str(v) for k, v in tiny_adapters.items()})
    combos = [(i, a) for i in range(len(PROMPTS)) for a in [None, *tiny_adapters]]
    random.Random(0).shuffle(combos)
    assert _run(engine, [_req(PROMPTS[i], a) for i, a in combos]) == [tiny_reference[c] for c in combos]
    assert all(s.refcount == 0 for s in engine.lora.slots)
    assert_all_blocks_free(engine)


def test_waiting_adapter_does_not_block_base_or_resident(tiny_llama, tiny_adapters, tiny_reference):
    """One slot, held by a long request: a request for another adapter waits (not fails), and
    base requests queued behind it still run."""
    engine = make_engine(tiny_llama, max_loras=1, lora_modules={k: str(v) for k, v in tiny_adapters.items()})
    engine.add_request(prompt_token_ids=PROMPTS[0], adapter="t0", request_id="long", params=_greedy(30))
    engine.step()
    engine.add_request(prompt_token_ids=PROMPTS[1], adapter="t1", request_id="needs_t1", params=_greedy(8))
    engine.add_request(
        prompt_token_ids=PROMPTS[2],
        request_id="base",
        params=_greedy(8),
    )
    order, final = [], {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                order.append(o.request_id)
                final[o.request_id] = o
    assert order.index("base") < order.index("long") < order.index("needs_t1")
    assert final["needs_t1"].token_ids == tiny_reference[(1, "t1")]
    assert final["base"].token_ids == tiny_reference[(2, None)]
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_a_starving_adapter_drains_a_busy_one_and_both_answers_stay_exact(
    tiny_llama, tiny_adapters, tiny_reference, overlap
):
    """One slot, held by a long t0 request; a t1 request starves at once (0 s) and its drain
    preempts at once (0 s), so the two adapters take turns, every turn a preemption recomputed
    from the prefix cache. Both answers stay exact (each request sees its own adapter's weights
    only), with async scheduling too (the step in flight is read before a preemption)."""
    modules = {k: str(v) for k, v in tiny_adapters.items()}
    long = _req(PROMPTS[0], "t0", n=30)
    expected = _run(make_engine(tiny_llama, max_loras=1, lora_modules=modules), [long])[0]
    engine = make_engine(
        tiny_llama, max_loras=1, lora_modules=modules, block_size=4, async_scheduling=overlap,
        adapter_starvation_s=0.0, adapter_drain_s=0.0,
    )  # fmt: skip
    engine.add_request_dict({**long, "request_id": "long"})
    engine.step()
    engine.add_request_dict({**_req(PROMPTS[1], "t1"), "request_id": "cold"})
    final = engine.run_to_completion()
    assert final["long"].token_ids == expected and final["cold"].token_ids == tiny_reference[(1, "t1")]
    stats = engine.stats()
    assert stats.adapter_drains > 0 and stats.num_preemptions > 0
    assert all(s.refcount == 0 for s in engine.lora.slots) and not engine.scheduler.draining
    assert_all_blocks_free(engine)


def run_control(engine, op):
    future = engine.submit_control(op)
    engine.step()
    return future.result(timeout=0)


def test_control_operations_report_slots_and_respect_refcounts_and_pins(tiny_llama, tiny_adapters):
    room = arena_bytes(tiny_llama, tiny_adapters["t0"], tiny_adapters["t1"])  # t2 fits t1's room
    engine = make_engine(tiny_llama, max_loras=2, lora_memory_bytes=room)
    for name, path in tiny_adapters.items():
        run_control(engine, RegisterAdapter(name, str(path)))
    r0 = run_control(engine, LoadAdapter("t0"))
    r1 = run_control(engine, LoadAdapter("t1"))
    assert (r0.slot, r0.evicted, r1.slot, r1.evicted) == (0, None, 1, None) and r0.adapter_id != r1.adapter_id
    run_control(engine, PinAdapter("t0"))
    r2 = run_control(engine, LoadAdapter("t2"))  # memory: LRU victim among unpinned idle adapters, t1
    assert (r2.slot, r2.evicted) == (2, "t1")
    with pytest.raises(AdapterError, match="'t0' is pinned"):
        run_control(engine, EvictAdapter("t0"))
    run_control(engine, PinAdapter("t0", pinned=False))
    engine.add_request(prompt_token_ids=PROMPTS[0], adapter="t0", request_id="r", params=_greedy(20))
    engine.step()
    with pytest.raises(AdapterError, match="in use by 1 running"):
        run_control(engine, EvictAdapter("t0"))
    with pytest.raises(AdapterError, match="slot 0 holds adapter 't0', which is in use"):
        run_control(engine, LoadAdapter("t3", slot=0))
    assert engine.abort("r")
    assert run_control(engine, EvictAdapter("t0")).slot == 0
    assert {a.name: a.tier for a in engine.list_adapters()} == {
        "t2": "gpu",
        "t0": "cpu",
        "t1": "cpu",
        "t3": "cpu",
        "t4": "cpu",
    }
    assert_all_blocks_free(engine)


def test_rotation_releases_the_resolved_slot(tiny_llama, tiny_adapters, tiny_reference):
    """`@active` resolves at admission; rotating while it runs changes nothing for it, and its
    release goes to the slot it actually took."""
    engine = make_engine(tiny_llama, max_loras=2, lora_modules={k: str(v) for k, v in tiny_adapters.items()})
    run_control(engine, LoadAdapter("t0"))
    run_control(engine, LoadAdapter("t1"))
    run_control(engine, SetActiveAdapter("t0"))
    engine.add_request(
        prompt_token_ids=PROMPTS[1],
        adapter=ACTIVE,
        request_id="a",
        params=_greedy(8),
    )
    engine.step()
    assert [s.refcount for s in engine.lora.slots[:2]] == [1, 0]
    run_control(engine, SetActiveAdapter("t1"))  # rotate mid-request
    final = {}
    while engine.has_unfinished():
        final.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert final["a"] == tiny_reference[(1, "t0")]
    assert [s.refcount for s in engine.lora.slots[:2]] == [0, 0]
    # The raw contract: acquire(-1) returns the resolved index; release by it.
    resolved = engine.lora.acquire(-1)
    assert resolved == 1
    engine.lora.set_active("t0")
    engine.lora.release(resolved)
    assert [s.refcount for s in engine.lora.slots[:2]] == [0, 0]


def test_same_name_new_content_never_reuses_stale_kv(tiny_llama, tiny_adapters, tiny_reference, tmp_path):
    engine = make_engine(tiny_llama, block_size=2, max_loras=2)
    shutil.copytree(tiny_adapters["t1"], tmp_path / "x")
    run_control(engine, RegisterAdapter("x", str(tmp_path / "x")))
    assert _run(engine, [_req(PROMPTS[1], "x")]) == [tiny_reference[(1, "t1")]]
    # Re-upload different weights under the same name.
    shutil.rmtree(tmp_path / "x")
    shutil.copytree(tiny_adapters["t3"], tmp_path / "x")
    run_control(engine, RegisterAdapter("x", str(tmp_path / "x")))
    hits_before = engine.stats().prefix_cache_hit_tokens
    assert _run(engine, [_req(PROMPTS[1], "x")]) == [tiny_reference[(1, "t3")]]
    assert engine.stats().prefix_cache_hit_tokens == hits_before  # nothing reused across contents
    assert _run(engine, [_req(PROMPTS[1], "x")]) == [tiny_reference[(1, "t3")]]
    assert engine.stats().prefix_cache_hit_tokens > hits_before  # same content: reused
    assert_all_blocks_free(engine)


def _start(engine, adapter: str, n: int = 8) -> str:
    """A greedy request on PROMPTS[1] for `adapter`, admitted and holding its slot."""
    engine.add_request(
        prompt_token_ids=PROMPTS[1],
        adapter=adapter,
        request_id=f"held-{adapter}",
        params=_greedy(n),
    )
    engine.step()
    return f"held-{adapter}"


def _finish(engine) -> dict[str, list[int]]:
    final = {}
    while engine.has_unfinished():
        final.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return final


@pytest.mark.parametrize("in_use", [False, True], ids=["idle", "in-use"])
def test_a_pinned_adapters_new_version_frees_the_old_slot_and_is_reported(
    tiny_llama, tiny_adapters, tiny_reference, in_use
):
    """Re-registering a pinned adapter (a new version from the adapter service) left the old
    version's slot pinned and stale for good: its memory never came back, and the pod reported
    the old sha256 under the name, hiding the new version from the service and the gateway."""
    engine = make_engine(tiny_llama, max_loras=2)
    run_control(engine, RegisterAdapter("x", str(tiny_adapters["t1"])))
    run_control(engine, LoadAdapter("x"))
    run_control(engine, PinAdapter("x", True))
    held = _start(engine, "x") if in_use else None
    run_control(engine, RegisterAdapter("x", str(tiny_adapters["t3"])))
    new = hashlib.sha256((tiny_adapters["t3"] / "adapter_model.safetensors").read_bytes()).hexdigest()
    assert [(a.name, a.sha256) for a in engine.list_adapters()] == [("x", new)]
    final = _finish(engine)
    if held:
        assert final[held] == tiny_reference[(1, "t1")]  # it finished on the version it began with
    assert engine.lora.memory_used_bytes == 0  # the old version's slot is gone with its last request
    assert _run(engine, [_req(PROMPTS[1], "x")]) == [tiny_reference[(1, "t3")]]
    assert_all_blocks_free(engine)


def test_forgetting_an_adapter_in_use_lets_its_requests_finish_and_refuses_new_ones(
    tiny_llama, tiny_adapters, tiny_reference
):
    """Evict(from_disk) is how a Delete reaches a pod. It was refused while a request ran, so the
    pod kept serving the deleted adapter (and its files) to every later request for it."""
    engine = make_engine(tiny_llama, max_loras=2)
    run_control(engine, LoadAdapter("x", str(tiny_adapters["t1"])))
    held = _start(engine, "x")
    run_control(engine, EvictAdapter("x", from_disk=True))
    assert engine.list_adapters() == []
    with pytest.raises(NotFoundError, match="unknown adapter 'x'"):
        engine.add_request(prompt_token_ids=PROMPTS[0], adapter="x", request_id="new")
    assert _finish(engine)[held] == tiny_reference[(1, "t1")]
    assert engine.lora.memory_used_bytes == 0
    run_control(engine, RegisterAdapter("x", str(tiny_adapters["t3"])))  # registered again, new weights
    run_control(engine, LoadAdapter("x"))
    run_control(engine, PinAdapter("x", True))
    with pytest.raises(AdapterError, match="'x' is pinned"):
        run_control(engine, EvictAdapter("x", from_disk=True))
    assert _run(engine, [_req(PROMPTS[1], "x")]) == [tiny_reference[(1, "t3")]]
    assert_all_blocks_free(engine)


# A control operation that changes what a running request's adapter name means, each under one
# preemption mode: (operation, the name the request asks for, preemption mode).
RENAMINGS = [
    ("forget", "x", "recompute"),
    ("new-version", "x", "swap"),
    ("rotate", ACTIVE, "recompute"),
]


@pytest.mark.parametrize(("change", "adapter", "mode"), RENAMINGS, ids=[r[0] for r in RENAMINGS])
def test_a_preempted_request_keeps_the_adapter_it_began_with(
    tiny_llama, tiny_adapters, tiny_reference, change, adapter, mode
):
    """A running request keeps its adapter through a Delete, a new version or a rotation, until
    it ends. Preempted after such a change (a tiny K/V pool), it was admitted again by name: a
    Delete failed it ("could not be loaded"), a new version or the next `@active` adapter wrote
    the rest of its tokens (HF's answer up to the preemption, then another model's)."""
    engine = make_engine(tiny_llama, max_loras=2, num_kv_blocks=7, block_size=4, preemption_mode=mode)
    run_control(engine, LoadAdapter("x", str(tiny_adapters["t1"])))
    run_control(engine, SetActiveAdapter("x"))
    engine.add_request(prompt_token_ids=PROMPTS[0], request_id="base", params=_greedy(12))
    engine.add_request(prompt_token_ids=PROMPTS[1], adapter=adapter, request_id="lora", params=_greedy(8))
    engine.step()
    op = {
        "forget": EvictAdapter("x", from_disk=True),
        "new-version": RegisterAdapter("x", str(tiny_adapters["t3"])),
        "rotate": LoadAdapter("y", str(tiny_adapters["t3"])),
    }[change]
    run_control(engine, op)
    if change == "rotate":
        run_control(engine, SetActiveAdapter("y"))
    final = _finish(engine)
    assert engine.scheduler.num_preemptions > 0  # the request that holds the adapter was preempted
    assert final["lora"] == tiny_reference[(1, "t1")]
    assert all(s.refcount == 0 for s in engine.lora.slots)
    assert_all_blocks_free(engine)


def test_a_request_for_an_adapter_larger_than_the_adapter_memory_ends_at_once(tiny_llama, tiny_adapters):
    """t1 needs more than the whole arena: no eviction can place it. Its request was retried for
    `adapter_wait_timeout_s` (30 s) before it failed with the same reason; the base request
    beside it is served either way."""
    room = arena_bytes(tiny_llama, tiny_adapters["t0"])
    engine = make_engine(tiny_llama, lora_memory_bytes=room, lora_modules={"big": str(tiny_adapters["t1"])})
    engine.add_request(prompt_token_ids=PROMPTS[0], adapter="big", request_id="big", params=_greedy(4))
    engine.add_request(prompt_token_ids=PROMPTS[1], request_id="base", params=_greedy(4))
    final = {}
    for _ in range(8):
        final.update({o.request_id: o for o in engine.step() if o.finished})
    assert final["big"].finish_reason == "error" and "--lora-memory-bytes" in final["big"].error
    assert final["base"].finish_reason == "length"
    assert_all_blocks_free(engine)


def test_a_request_waiting_for_an_adapter_that_is_forgotten_ends_at_once(tiny_llama, tiny_adapters):
    """A request queued for an adapter deleted before it was loaded waited the whole
    `adapter_wait_timeout_s` (30 s) for a load that could never succeed."""
    engine = make_engine(tiny_llama, max_loras=2)
    run_control(engine, RegisterAdapter("x", str(tiny_adapters["t1"])))  # on disk: read before a load
    engine.add_request(prompt_token_ids=PROMPTS[0], adapter="x", request_id="waits", params=_greedy(8))
    engine.step()
    assert engine.lora.slot_of("x") is None  # still waiting for its adapter
    engine.submit_control(EvictAdapter("x", from_disk=True))
    start, ended = time.monotonic(), []
    while engine.has_unfinished() and time.monotonic() - start < 5:
        ended += [o for o in engine.step() if o.finished]
    assert [(o.finish_reason, "'x'" in o.error) for o in ended] == [("error", True)]
    assert_all_blocks_free(engine)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    events=st.lists(
        st.tuples(
            st.sampled_from(["add", "add", "add", "abort", "step", "step", "rotate", "promote", "evict"]),
            st.integers(0, 99),
        ),
        min_size=5,
        max_size=40,
    ),
)
def test_random_interleavings_keep_slots_and_requests_straight(
    tiny_llama, tiny_adapters, tiny_reference, events
):
    engine = make_engine(
        tiny_llama,
        max_loras=2,
        num_kv_blocks=24,
        block_size=4,
        lora_modules={k: str(v) for k, v in tiny_adapters.items()},
    )
    names = [None, *tiny_adapters]
    which, aborted, finals = {}, set(), {}
    for n, (kind, k) in enumerate(events):
        if kind == "add":
            adapter = names[k % len(names)]
            engine.add_request(
                prompt_token_ids=PROMPTS[k % len(PROMPTS)],
                adapter=adapter,
                request_id=f"r{n}",
                params=_greedy(8),
            )
            which[f"r{n}"] = (k % len(PROMPTS), adapter)
        elif kind == "abort":
            rid = sorted(which)[k % len(which)] if which else "none"
            if engine.abort(rid):
                aborted.add(rid)
        else:
            op = {
                "rotate": SetActiveAdapter(names[1 + k % 5]),
                "promote": LoadAdapter(names[1 + k % 5]),
                "evict": EvictAdapter(names[1 + k % 5]),
                "step": None,
            }[kind]
            held = [s.adapter.name for s in engine.lora.slots if s.adapter and s.refcount]
            future = engine.submit_control(op) if op else None
            finals.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
            if (
                future is not None
                and isinstance(op, (EvictAdapter, LoadAdapter))
                and future.exception() is None
            ):
                evicted = op.name if isinstance(op, EvictAdapter) else future.result().evicted
                assert evicted not in held  # an adapter in use is never evicted
    while engine.has_unfinished():
        finals.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    for rid, key in which.items():
        if rid in aborted:
            assert tiny_reference[key][: len(finals[rid])] == finals[rid]
        else:
            assert finals[rid] == tiny_reference[key]  # never another adapter's weights
    assert all(s.refcount == 0 for s in engine.lora.slots)
    assert_all_blocks_free(engine)


def test_unknown_adapter_is_not_found(tiny_llama):
    engine = make_engine(tiny_llama)
    with pytest.raises(NotFoundError, match="unknown adapter 'nope'"):
        engine.add_request(prompt_token_ids=[1, 2], adapter="nope")


def test_an_adapter_request_without_slots_is_refused_not_left_waiting(tiny_llama, tiny_adapters):
    engine = make_engine(tiny_llama, max_loras=0, lora_modules={"t0": str(tiny_adapters["t0"])})
    with pytest.raises(PreconditionError, match="no LoRA slots"):
        engine.add_request(prompt_token_ids=[1, 2], adapter="t0")
    assert not engine.has_unfinished()


@pytest.mark.parametrize(
    "lora_kwargs",
    [  # a pattern naming embed_tokens only to exclude it: a pod refused it, the service took it
        {"target_modules": r"^(?!.*embed_tokens).*\.(q_proj|v_proj)$"},
        # LoRA on a projection's weight parameter: refused as a config naming no such module
        {
            "target_modules": ["v_proj"],
            "target_parameters": ["self_attn.q_proj.weight", "mlp.down_proj.weight"],
        },
    ],
    ids=["excluding-pattern", "target-parameters"],
)
def test_targets_peft_adapts_are_served_as_peft_serves_them(
    hf_tiny, tiny_llama, tiny_reference, tmp_path, lora_kwargs
):
    path = make_adapter(hf_tiny, tmp_path / "a", seed=7, scale=0.3, r=4, lora_alpha=8, **lora_kwargs)
    engine = make_engine(tiny_llama, lora_modules={"a": str(path)})
    got = [_run(engine, [_req(p, "a")])[0] for p in PROMPTS[:2]]
    assert got == peft_greedy(hf_tiny, path, PROMPTS[:2], 8, eos=None)
    assert got != [tiny_reference[(i, None)] for i in range(2)]


# --- refusals --------------------------------------------------------------------------------


def _broken(src: Path, dst: Path, config: dict | None = None, tensors=None) -> Path:
    shutil.copytree(src, dst)
    if config is not None:
        cfg = json.loads((dst / "adapter_config.json").read_text())
        cfg.update(config)
        (dst / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        from safetensors.torch import load_file, save_file

        weights = dst / "adapter_model.safetensors"
        save_file({k: v.contiguous() for k, v in tensors(load_file(str(weights))).items()}, str(weights))
    return dst


@pytest.mark.parametrize(
    ("config", "tensors", "message"),
    [
        ({"use_dora": True}, None, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
        (  # bias="all" on a base without biases saves none: refused only when one is saved
            {"bias": "lora_only"},
            lambda t: {**t, "base_model.model.model.layers.0.self_attn.q_proj.bias": torch.zeros(64)},
            "trained bias",
        ),
        ({"lora_bias": True}, None, "lora_bias"),
        ({"trainable_token_indices": [3, 5]}, None, "trainable_token_indices"),
        ({"layer_replication": [[0, 2], [1, 2]]}, None, "layer_replication"),
        # PEFT applies aLoRA only from the invocation tokens on (served as plain LoRA: other tokens)
        ({"alora_invocation_tokens": [9, 64], "task_type": "CAUSAL_LM"}, None, "Activated LoRA"),
        # PEFT redoes these inits on the base as it loads them (served on the plain base: other tokens)
        ({"init_lora_weights": "pissa_niter_4"}, None, "path_initial_model_for_weight_conversion"),
        ({"init_lora_weights": "olora"}, None, "init_lora_weights='olora'"),
        ({"init_lora_weights": "loftq"}, None, "LoftQ"),
        ({"use_bdlora": {"nblocks": 2}}, None, "BD-LoRA"),
        ({"kasa_config": {}}, None, "KaSA"),
        (  # Qwen-MoE's shared expert (DeepSeek's `shared_experts`): experts, not the dense MLP
            None,
            lambda t: {k.replace("self_attn.q_proj", "mlp.shared_expert.gate_proj"): v for k, v in t.items()},
            "mixture-of-experts experts",
        ),
        ({"target_modules": ["embed_tokens"]}, None, "embeddings"),
        (
            None,
            lambda t: {k.replace("q_proj", "qkv_proj"): v for k, v in t.items()},
            "does not match|qkv_proj",
        ),
        (None, lambda t: {k: v[:, :-1] if "lora_A" in k else v for k, v in t.items()}, "another base model"),
        (None, lambda t: {k.replace("layers.1.", "layers.9."): v for k, v in t.items()}, "layer 9"),
        (None, lambda t: {k: v for k, v in t.items() if "lora_B" not in k}, "both lora_A and lora_B"),
    ],
)
def test_bad_adapters_are_refused_with_a_named_reason(
    tiny_llama, tiny_adapters, tmp_path, config, tensors, message
):
    bad = _broken(tiny_adapters["t0"], tmp_path / "bad", config, tensors)
    with pytest.raises(AdapterError, match=message):
        load_peft_adapter("bad", bad, tiny_llama.config, max_lora_rank=64)


def test_rank_above_limit_and_pickle_weights_are_refused(tiny_llama, tiny_adapters, tmp_path):
    with pytest.raises(AdapterError, match=r"rank 16, above max_lora_rank 8 \(--max-lora-rank\)"):
        load_peft_adapter("big", tiny_adapters["t3"], tiny_llama.config, max_lora_rank=8)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(tiny_adapters["t0"] / "adapter_config.json", pickled)
    (pickled / "adapter_model.bin").write_bytes(b"not really")
    with pytest.raises(AdapterError, match="pickle"):
        load_peft_adapter("pickled", pickled, tiny_llama.config, max_lora_rank=64)


def test_cli_generate_with_adapters(tiny_llama, tiny_adapters, tiny_reference, tmp_path, capsys):
    from spindle.cli import main

    reqs = tmp_path / "reqs.jsonl"
    reqs.write_text("\n".join(json.dumps(_req(PROMPTS[i], a)) for i, a in [(0, "t0"), (1, None), (2, "t1")]))
    argv = [
        "generate",
        "--model",
        tiny_llama.name,
        "--requests",
        str(reqs),
        "--json",
        "--device",
        "cpu",
        "--lora",
        f"t0={tiny_adapters['t0']}",
        "--lora",
        f"t1={tiny_adapters['t1']}",
        "--max-loras",
        "1",
    ]
    assert main(argv) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [o["token_ids"] for o in out] == [
        tiny_reference[(0, "t0")],
        tiny_reference[(1, None)],
        tiny_reference[(2, "t1")],
    ]


def test_shipped_demo_adapter_matches_peft_and_changes_the_answer(smollm2, hf_smollm2):
    from tests.service_helpers import ROOT

    pirate = ROOT / "adapters" / "smollm2-pirate"
    engine = make_engine(smollm2, lora_modules={"pirate": str(pirate)})
    ids = smollm2.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of Japan?"}]
    )
    out = engine.generate(
        [{"prompt_token_ids": ids, "max_tokens": 16, "temperature": 0, "adapter": "pirate"}]
    )[0]
    assert [out.token_ids] == peft_greedy(hf_smollm2, pirate, [ids], 16, eos=2)
    assert out.text.startswith("Arr") and "Tokyo" in out.text


def test_host_tier_holds_adapters_in_the_slots_dtype(tiny_llama, tiny_adapters):
    """The pool's host copy is the adapter in the pool's host form (here bf16 and, on a CPU,
    pageable), converted from the file once, and a slot load writes exactly those weights."""
    from model_service.lora.adapter import HostForm
    from model_service.lora.buffers import HostBuffers
    from model_service.lora.pool import LoraPool

    written: dict[int, object] = {}

    class Writer:
        def load_slot(self, slot: int, adapter: object, offset: int) -> None:
            written[slot] = adapter

        def clear_slot(self, slot: int) -> None:
            written.pop(slot, None)

        def move_slot(self, slot: int, offset: int) -> None:
            pass

    bf16 = HostForm(torch.bfloat16, HostBuffers(torch.device("cpu")))
    name, path = next(iter(tiny_adapters.items()))
    pool = LoraPool(tiny_llama.config, 1, 2, 64, Writer(), (1 << 20, 2), host_form=bf16)
    parsed = pool.register(name, path)
    held = pool.host[name]
    fresh = load_peft_adapter(name, path, tiny_llama.config, 64)
    assert parsed is held and held.adapter_id == fresh.adapter_id
    assert held.modules.keys() == fresh.modules.keys()
    for key, w in held.modules.items():
        want = fresh.modules[key]
        assert w.a.dtype == w.b.dtype == torch.bfloat16 and w.scaling == want.scaling
        assert torch.equal(w.a, want.a.to(torch.bfloat16)) and torch.equal(w.b, want.b.to(torch.bfloat16))
    slot, _ = pool.load(name)
    assert written[slot] is held


def test_host_form_keeps_an_adapter_pageable_when_page_locked_memory_fails(
    tiny_llama, tiny_adapters, monkeypatch, caplog
):
    from model_service.lora.adapter import HostForm
    from model_service.lora.buffers import HostBuffers

    empty = torch.empty

    def exhausted(*args, pin_memory: bool = False, **kwargs) -> torch.Tensor:
        if pin_memory:
            raise RuntimeError("CUDA error: out of memory")
        return empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", exhausted)
    name, path = next(iter(tiny_adapters.items()))
    held = load_peft_adapter(
        name, path, tiny_llama.config, 64, form=HostForm(torch.float16, HostBuffers(torch.device("cuda")))
    )
    assert held.packed is not None and held.packed.dtype == torch.float16 and not held.packed.is_pinned()
    assert "pageable host memory" in caplog.text


def test_a_packed_adapter_pickles_its_buffer_once_and_keeps_its_views(tiny_llama, tiny_adapters):
    """Tensor-parallel ranks receive adapters pickled: the packed buffer goes once (not once a
    view), and the copy's modules are views of its own buffer with the same values."""
    import pickle

    from model_service.lora.adapter import in_buffer

    name, path = next(iter(tiny_adapters.items()))
    held = load_peft_adapter(name, path, tiny_llama.config, 64)
    data = pickle.dumps(held)
    assert len(data) < 1.5 * held.packed.numel() * 4
    copy = pickle.loads(data)
    assert copy.adapter_id == held.adapter_id and copy.modules.keys() == held.modules.keys()
    for key, w in copy.modules.items():
        assert in_buffer(w.a, copy.packed) and in_buffer(w.b, copy.packed)
        assert torch.equal(w.a, held.modules[key].a) and torch.equal(w.b, held.modules[key].b)


def test_adapter_loads_go_on_while_a_step_is_in_flight(tiny_llama, tiny_adapters, monkeypatch):
    """Requests on three adapters with two slots: adapters are loaded (idle ones evicted) while
    a step is in flight, without draining the pipeline, and every request's tokens are the
    synchronous engine's."""
    config = {"max_loras": 2, "lora_modules": {k: str(v) for k, v in tiny_adapters.items()}}
    reqs = mixed_requests(tiny_llama.config.vocab_size, [*list(tiny_adapters)[:3], None])
    expected = run_steps(make_engine(tiny_llama, async_scheduling="off", **config), reqs)
    engine = make_engine(tiny_llama, async_scheduling="on", **config)
    load, in_flight = engine.lora.load, []

    def counted(*args, **kwargs):
        in_flight.append(engine.overlap.busy)
        return load(*args, **kwargs)

    monkeypatch.setattr(engine.lora, "load", counted)
    assert run_steps(engine, reqs) == expected
    assert any(in_flight), "no adapter was loaded while a step was in flight"


def test_registered_adapters_name_the_kinds_of_projection_whose_graphs_a_warm_up_captures(tmp_path):
    """What `Engine.warm_up` hands the executor: the registered adapters' PEFT modules, one set a
    recipe, the most common first; the executor maps a set to its kinds of projection (q_proj
    alone is the q/k/v kind, the MLP's names its two kinds, all seven every kind)."""
    from bench.lora import write_adapter
    from model_service.engine.cuda_graphs import captured_kinds
    from model_service.models.loader import LoadedModel
    from tests.random_models import random_llama

    cfg, model = random_llama()
    qv, mlp = ("q_proj", "v_proj"), ("gate_proj", "up_proj", "down_proj")
    targets = {"qv": qv, "qv2": qv, "mlp": mlp, "q": ("q_proj",), "all": None}
    paths = {
        name: str(write_adapter(tmp_path / name, cfg, rank=4, seed=i, targets=t))
        for i, (name, t) in enumerate(targets.items())
    }
    loaded = LoadedModel("random", cfg, model, None)
    engine = make_engine(loaded, max_loras=2, max_lora_rank=8, lora_modules=paths)
    seven = frozenset({*qv, "k_proj", "o_proj", *mlp})
    sets = engine.lora.target_sets()
    assert sets[0] == set(qv) and set(sets[1:]) == {seven, frozenset(mlp), frozenset({"q_proj"})}
    layers = engine.executor.lora
    attention = layers.kinds_of_targets({"q_proj"})
    assert layers.kinds_of_targets(qv) == attention == layers.kinds_of_targets({"k_proj"})
    assert (
        layers.kinds_of_targets(seven) == layers.plan.all_kinds and bin(layers.plan.all_kinds).count("1") == 4
    )
    both = layers.kinds_of_targets(mlp)
    assert both == layers.kinds_of_targets({"up_proj"}) | layers.kinds_of_targets({"down_proj"})
    assert bin(both).count("1") == 2 and both & attention == 0 and layers.kinds_of_targets(()) == 0

    class Graphs:  # what the decode graphs are asked to capture (there are none on the CPU)
        def capture_all(self, kinds: list[int]) -> None:
            self.kinds = kinds

    engine.executor.graphs = graphs = Graphs()
    engine.executor.capture_graphs(sets)
    assert graphs.kinds == [layers.kinds_of_targets(t) for t in sets]
    # none, q/k/v and all are always captured: the registered sets add one more
    assert captured_kinds(layers.plan.all_kinds, graphs.kinds) == [0, attention, layers.plan.all_kinds, both]
    assert captured_kinds(15, [3, 5, 6, 7, 9, 10]) == [0, 1, 15, 3, 5, 6, 7]  # at most four more
