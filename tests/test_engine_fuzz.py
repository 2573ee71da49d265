"""A seeded stateful fuzz of one engine: random interleavings of adds, aborts and steps over a
tiny random Llama with a small paged KV cache (preemption by recompute or swap), the prefix
cache, chunked prefill under a small token budget, more LoRA adapters than fit (evictions, and
drains when more adapters wait than `max_loras`), n-gram speculation, async scheduling, beam
search, structured output and seeded sampling. The cancel storms (tests/test_faults.py) check
leaks at the end through the services; this checks the engine's own bookkeeping after every
step, where a transient double count or a sequence in two queues shows before it is masked:

- every KV block's refcount is the number of running sequences' block tables holding it, a
  block is free exactly when that is zero, and each prefix-cache entry names its block;
- no sequence is in two queues or twice in one, running ones hold state, waiting ones none,
  nothing finished is queued, a swapped copy belongs to a waiting sequence and the swap bytes
  add up;
- each LoRA slot's refcount is the running sequences on it plus the preempted ones that kept
  it, on the adapter they asked for; at most `max_loras` distinct adapters run;
- every live request is queued (a beam search: its live beams), every queued one is live.

At the end nothing is held, and every request that finished (and the streamed part of every
aborted one) equals the same request run alone on a fresh engine: preemption, adapter rotation,
speculation and batching must not change float32 greedy, beam or seeded output. One more
request then runs on the fuzzed engine and must match a fresh one: nothing leaked into results.

SPINDLE_FUZZ_STEPS (steps per seed) and SPINDLE_FUZZ_SEEDS scale it; the default runs in the
normal suite. Run with -s for the counters.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from model_service.engine.engine import Engine
from model_service.engine.sequence import Sequence, Status
from model_service.models.loader import LoadedModel
from model_service.models.tokenizer import Tokenizer
from tests.conftest import make_engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STEPS = int(os.environ.get("SPINDLE_FUZZ_STEPS", "120"))
SEEDS = int(os.environ.get("SPINDLE_FUZZ_SEEDS", "4"))
TICK_S = 0.02  # simulated seconds per step: adapter starvation and drains run on this clock

# Small enough to preempt and rotate often, large enough for every request alone.
BASE = {
    "block_size": 4,
    "num_kv_blocks": 14,
    "max_num_batched_tokens": 8,
    "max_num_seqs": 8,
    "max_loras": 2,
    "lora_memory_bytes": 40960,  # two or three of the adapters below at once, never all
    "adapter_starvation_s": 0.1,
    "adapter_drain_s": 0.2,
}
# What each seed adds to BASE, in turn.
VARIANTS = [
    {"preemption_mode": "recompute"},
    {"preemption_mode": "swap", "swap_space_bytes": 16384},  # some swaps, then recompute when full
    {
        "speculative_config": json.dumps({"method": "ngram", "num_speculative_tokens": 3}),
        "preemption_mode": "swap",
    },
    {"async_scheduling": "on", "preemption_mode": "swap", "swap_space_bytes": 16384},
]
STRUCTURED = [
    {"regex": "[a-e ]{1,12}"},
    {
        "json_schema": {
            "type": "object",
            "properties": {"k": {"type": "integer"}},
            "required": ["k"],
            "additionalProperties": False,
        }
    },
]
FINAL_REASONS = {"length", "stop", "abort", "capacity"}  # "capacity": a beam search that cannot fit


def byte_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-fallback BPE tokenizer of exactly `vocab_size` ids (specials, the 256 bytes, then
    filler pieces): structured output needs a tokenizer, and the tiny Llama has none."""
    from tokenizers import AddedToken, decoders, models
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    pieces = [f"▁w{i}" for i in range(vocab_size - len(specials) - 256)]
    vocab = {t: i for i, t in enumerate([*specials, *(f"<0x{b:02X}>" for b in range(256)), *pieces])}
    raw = RawTokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    raw.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    return Tokenizer(hf)


@pytest.fixture(scope="module")
def model(tiny_llama) -> LoadedModel:
    """The tiny Llama with a tokenizer (its EOS, id 2, is the model's)."""
    return dataclasses.replace(tiny_llama, tokenizer=byte_tokenizer(tiny_llama.config.vocab_size))


@pytest.fixture(scope="module")
def adapters(lora_dirs) -> dict[str, str]:
    """Five names over the four test adapters; `a_twin` is `a`'s files (same weights, so the same
    prefix-cache identity, under another name and slot)."""
    return {**{n: str(p) for n, p in lora_dirs.items()}, "a_twin": str(lora_dirs["a"])}


class Clock:
    """The scheduler's and adapter control's time, moved on by the test: runs do not depend on
    the machine's speed."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Tally:
    """What a run exercised (printed with -s), summed over seeds."""

    counts: collections.Counter[str] = field(default_factory=collections.Counter)

    def add(self, **kw: int) -> None:
        self.counts.update(kw)


def fuzzed_engine(model: LoadedModel, adapters: dict[str, str], variant: dict[str, Any]) -> Engine:
    engine = make_engine(model, **BASE, **variant, lora_modules=adapters)
    engine.scheduler.clock = engine.adapters.clock = Clock()
    return engine


# --- invariants ---------------------------------------------------------------------------


def check_invariants(engine: Engine) -> None:
    """The engine's bookkeeping between steps (the module docstring lists it)."""
    s, blocks, pool = engine.scheduler, engine.cache.blocks, engine.lora
    running, waiting = s.running, s.waiting
    queued = [id(q) for q in running + waiting]
    assert len(set(queued)) == len(queued), "a sequence is queued twice"
    for seq in running:
        assert seq.status is Status.RUNNING and seq.state is not None and not seq.state.freed, seq.request_id
        assert seq.admission.held_slot == -1, seq.request_id
    for seq in waiting:
        assert seq.status is Status.WAITING and seq.state is None, seq.request_id
    assert set(map(id, s._swapped)) <= set(map(id, waiting)), "a swapped copy of no waiting sequence"
    assert s.swap_used == sum(saved.nbytes for saved in s._swapped.values()) <= s.swap_budget

    holders: collections.Counter[int] = collections.Counter()
    for seq in running:
        table = seq.state.block_table
        assert len(set(table)) == len(table), f"{seq.request_id} holds a block twice: {table}"
        assert len(table) * blocks.block_size >= seq.state.num_computed, seq.request_id
        assert len(seq.state.block_keys) <= seq.state.num_computed // blocks.block_size, seq.request_id
        holders.update(table)
    for b in range(blocks.num_blocks):
        assert blocks.ref_count(b) == holders[b], (
            f"block {b}: refcount {blocks.ref_count(b)}, held {holders[b]}"
        )
        assert (b in blocks._free) == (holders[b] == 0), (
            f"block {b} free={b in blocks._free}, held {holders[b]}"
        )
    assert blocks.num_free + len(holders) == blocks.num_blocks
    for key, b in blocks._cached.items():
        assert blocks._blocks[b].key == key, f"prefix-cache entry of block {b} names another key"

    refs = collections.Counter(q.state.lora_slot for q in running if q.state.lora_slot >= 0)
    refs.update(q.admission.held_slot for q in waiting if q.admission.held_slot >= 0)
    for i, slot in enumerate(pool.slots):
        assert slot.refcount == refs[i], f"LoRA slot {i}: refcount {slot.refcount}, held by {refs[i]}"
    for seq in running:
        if seq.admission.adapter is None:
            assert seq.state.lora_slot == -1, seq.request_id
        else:
            adapter = pool.slots[seq.state.lora_slot].adapter
            assert adapter is not None and adapter.adapter_id == seq.admission.adapter_id, seq.request_id
            assert engine.lora.identity[seq.admission.adapter].adapter_id == adapter.adapter_id
    assert len(s.adapters_in_step()) <= s.max_loras

    live = engine.requests
    for seq in running + waiting:
        assert live.get(seq.request_id) is not None, f"{seq.request_id} is queued but not live"
    for rid, seq in live.items():
        if seq.group is not None:
            beams = engine.beams.live[rid]
            assert beams and all(not b.finished and b.group is seq.group for b in beams), rid
            assert all(b in running or b in waiting for b in beams), f"{rid}: a live beam is not queued"
        else:
            assert not seq.finished and (seq in running or seq in waiting), f"{rid} is live but not queued"
    if engine.speculation is not None:
        assert all(q in running for q in engine.speculation.proposals), "a proposal of no running sequence"


def check_nothing_held(engine: Engine) -> None:
    s, blocks = engine.scheduler, engine.cache.blocks
    assert not engine.has_unfinished() and not engine.requests
    assert not s.running and not s.waiting and not s._swapped and s.swap_used == 0
    assert blocks.num_free == blocks.num_blocks  # the rest of the blocks only in the prefix cache
    assert all(blocks.ref_count(b) == 0 for b in range(blocks.num_blocks))
    assert all(slot.refcount == 0 for slot in engine.lora.slots)
    assert not engine.beams.live and not engine.beams.logits
    if engine.speculation is not None:
        assert not engine.speculation.proposals


# --- requests -----------------------------------------------------------------------------


@dataclass
class Request:
    body: dict[str, Any]
    tokens: list[int] = field(default_factory=list)
    reason: str | None = None

    @property
    def checked(self) -> bool:
        """Whether its output is a function of the request alone (not an unseeded draw)."""
        return self.body.get("temperature", 1.0) == 0 or "seed" in self.body or "num_beams" in self.body


def random_request(rng: random.Random, prefixes: list[list[int]], seen: list[list[int]]) -> dict[str, Any]:
    """Prompts share prefixes (prefix cache) or repeat earlier ones whole; each kind of request
    in proportion."""
    roll = rng.random()
    if seen and roll < 0.15:
        prompt = list(rng.choice(seen))
    elif roll < 0.3:  # a repeated pattern: n-gram speculation finds proposals in it
        pattern = [rng.randrange(3, 320) for _ in range(rng.randrange(1, 4))]
        prompt = pattern * rng.randrange(2, 6)
    elif roll < 0.65:
        prompt = rng.choice(prefixes) + [rng.randrange(3, 320) for _ in range(rng.randrange(0, 10))]
    else:
        prompt = [rng.randrange(3, 320) for _ in range(rng.randrange(1, 24))]
    body: dict[str, Any] = {
        "prompt_token_ids": prompt,
        "max_tokens": rng.randrange(1, 16),
        "ignore_eos": rng.random() < 0.7,
        "priority": rng.choice([0, 0, 0, 1, -1]),
    }
    if rng.random() < 0.6:
        body["adapter"] = rng.choice(["a", "a2", "b", "c", "a_twin"])
    kind = rng.random()
    if kind < 0.5:
        body["temperature"] = 0
    elif kind < 0.65:
        body |= {"temperature": 0.8, "top_k": 20, "seed": rng.randrange(1000)}
    elif kind < 0.75:
        body |= {"num_beams": rng.choice([2, 3]), "max_tokens": rng.randrange(1, 8)}
    elif kind < 0.85:
        body |= {"temperature": 0, "structured_output": rng.choice(STRUCTURED)}
    elif kind < 0.92:
        body |= {"temperature": 0, "logprobs": 2, "repetition_penalty": 1.2}  # rows that do not speculate
    else:
        body["temperature"] = 1.0  # unseeded: only the bookkeeping is checked
    return body


def add(engine: Engine, body: dict[str, Any]) -> str:
    """Queue `body`; a grammar is waited for here, so that a run does not depend on its compile
    thread's timing."""
    rid = engine.add_request_dict(body)
    seq: Sequence | None = engine.requests.get(rid)
    if seq is not None and seq.sampling.constraint is not None:
        seq.sampling.constraint.compiled.result(timeout=60)
    return rid


def step(engine: Engine, requests: dict[str, Request]) -> None:
    engine.scheduler.clock.now += TICK_S
    for out in engine.step():
        req = requests[out.request_id]
        assert req.reason is None, f"{out.request_id} has output after it finished"
        req.tokens = list(out.token_ids)
        if out.finished:
            assert out.finish_reason in FINAL_REASONS, (out.request_id, out.finish_reason, out.error)
            req.reason = out.finish_reason
    check_invariants(engine)


def reference_engine(model: LoadedModel, adapters: dict[str, str]) -> Engine:
    """An engine with room for one request alone (no preemption, no rotation) and no prefix cache,
    so each request it runs is computed whole, as on a fresh engine: one serves a seed's
    references (a fresh engine a request was over a third of the fuzz's time)."""
    room = {"block_size": 4, "num_kv_blocks": 256, "max_loras": 2}
    return make_engine(model, **room, lora_modules=adapters, enable_prefix_caching=False)


def solo(engine: Engine, body: dict[str, Any]) -> list[int]:
    """`body`'s tokens run alone on `engine` (`reference_engine`), which it leaves idle."""
    out = engine.generate([body])[0]
    assert out.finish_reason in ("length", "stop"), out
    assert engine.cache.num_free_blocks == engine.cache.num_total_blocks
    return out.token_ids


# --- the run ------------------------------------------------------------------------------


def fuzz_one(
    model: LoadedModel, adapters: dict[str, str], seed: int, tally: Tally, limit: int = STEPS
) -> None:
    """`limit` steps of random operations with seed `seed`, then steps until nothing is left."""
    rng = random.Random(seed)
    engine = fuzzed_engine(model, adapters, VARIANTS[seed % len(VARIANTS)])
    swaps = collections.Counter[str]()
    swap_out = engine.cache.swap_out
    engine.cache.swap_out = lambda state: swaps.update(["swap"]) or swap_out(state)  # count, then swap
    prefixes = [[rng.randrange(3, 320) for _ in range(rng.randrange(4, 14))] for _ in range(3)]
    requests: dict[str, Request] = {}
    seen: list[list[int]] = []
    steps = 0
    while steps < limit:
        op = rng.random()
        live = [rid for rid, r in requests.items() if r.reason is None]
        if op < 0.3 and len(live) < 16:
            body = random_request(rng, prefixes, seen)
            seen.append(body["prompt_token_ids"])
            requests[add(engine, body)] = Request(body)
        elif op < 0.36 and live:
            engine.abort(rng.choice(live))
        else:
            step(engine, requests)
            steps += 1
    while engine.has_unfinished():
        step(engine, requests)
        steps += 1
        assert steps < limit + 2000, "the engine did not drain"
    check_nothing_held(engine)

    refs: dict[str, list[int]] = {}
    reference = reference_engine(model, adapters)
    for rid, req in requests.items():
        assert req.reason is not None, f"{rid} never finished"
        if not req.checked or req.reason == "capacity" or (req.reason == "abort" and "num_beams" in req.body):
            continue  # an aborted beam search streamed nothing
        key = json.dumps(req.body, sort_keys=True)
        if key not in refs:
            refs[key] = solo(reference, req.body)
        want = refs[key] if req.reason != "abort" else refs[key][: len(req.tokens)]
        assert req.tokens == want, f"seed {seed} {rid} {req.body} ({req.reason}): {req.tokens} != {want}"

    after = {"prompt_token_ids": prefixes[0] + [7, 8, 9], "max_tokens": 8, "temperature": 0, "adapter": "a"}
    assert engine.generate([after])[0].token_ids == solo(reference_engine(model, adapters), after)  # fresh
    check_nothing_held(engine)

    stats = engine.stats()
    reasons = collections.Counter(r.reason for r in requests.values())
    tally.add(
        seeds=1, steps=steps, requests=len(requests), compared=len(refs),
        preemptions=stats.num_preemptions, swaps=swaps["swap"], adapter_loads=stats.adapter_loads,
        adapter_evictions=stats.adapter_evictions, adapter_drains=stats.adapter_drains,
        prefix_hit_tokens=stats.prefix_cache_hit_tokens, spec_accepted=stats.spec_accepted_tokens,
        **{f"finished_{k}": v for k, v in reasons.items()},
    )  # fmt: skip


def test_random_interleavings_keep_the_engine_consistent_and_outputs_exact(model, adapters):
    tally = Tally()
    started = time.monotonic()
    for seed in range(SEEDS):
        fuzz_one(model, adapters, seed, tally)
    print(f"ENGINE FUZZ {time.monotonic() - started:.1f} s: {dict(tally.counts)}")
    c = tally.counts
    assert c["preemptions"] and c["adapter_evictions"] and c["prefix_hit_tokens"], c  # the fuzz reached them


# --- what the fuzz found ------------------------------------------------------------------


def test_async_step_whose_constrained_rows_all_finish_in_the_drain_samples_the_rest(model):
    """Found by the fuzz (async scheduling, seed 3): a step with a structured-output row does not
    launch before the step before's tokens are read; if that read finishes every constrained row
    (here the grammar `a` is complete after one token), the rows left have no mask at all, and
    `launch_masked` asserted one, so the forward pass "failed" and took the whole batch with it
    (finish "error", "engine error: ")."""
    engine = make_engine(model, async_scheduling="on", max_loras=0)
    plain = {"prompt_token_ids": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    constrained = {**plain, "structured_output": {"regex": "a"}}
    outs = engine.generate([constrained, plain])
    assert [o.finish_reason for o in outs] == ["stop", "length"], [o.error for o in outs]
    assert outs[0].text == "a"
    alone = make_engine(model, async_scheduling="off", max_loras=0).generate([plain])[0]
    assert outs[1].token_ids == alone.token_ids
    assert engine.cache.num_free_blocks == engine.cache.num_total_blocks


def test_idle_adapters_waited_for_do_not_keep_the_memory_starving_ones_need(model, adapters):
    """Found by the fuzz (seed 0 at 500 steps): adapters `a` and `c` resident and idle, their
    requests waiting since before `a2`, `b` and `a_twin` starved; the starving line kept both
    `max_loras` places of the step, so `a` and `c` were never admitted, and never starved
    themselves (resident, with places free). Each quiescent point loaded the waited-for adapters
    longest wait first, so it took references on `a` and `c` before trying `a2`: the pool could
    not evict them, `a2` never fit, nothing ran that a drain could free, and the engine stepped
    forever with 15 requests waiting. Starving adapters now load first."""
    fuzz_one(model, adapters, 0, Tally(), limit=500)
