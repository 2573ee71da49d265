"""The synchronous engine: add requests, step, abort. One thread drives it (see AsyncEngine).

A step is a loop of stages, each with one owner:

    quiescent point   AdapterControl (control ops, loads, drains); GrammarWait (matchers)
    schedule          Scheduler: the rows and their token counts; it plans their cache too
    build the batch   Scheduler.item: each row's tokens (Overlap.item: a placeholder for a
                      token still on the device); BatchBuilder packs them
    launch            the executor's forward pass; Scheduler.commit counts the tokens cached
    sample            Overlap.launch on the device, else SampleStage on the host: the sampler,
                      BeamSearch, Speculation.verify (Scheduler.rollback of rejected tokens);
                      `logits_rows` gives each its rows
    process outputs   RequestTable + OutputProcessor (append, detokenize, stop), then free what
                      finished; Speculation.propose for the rows that go on

A fault confined to one request finishes that request with `finish_reason="error"`; a fault in
the forward pass fails the requests of that batch, never the engine.

Who owns what: the scheduler owns the queues and, through the cache manager, every block table,
state slot and `num_computed` (the engine asks it, never the cache); the executor owns the module
and the device tensors; the LoRA pool owns adapter names, tiers and slot refcounts; the request
table owns the live requests and their outputs. A sequence's own state is split the same way,
each record written by its owner (docs/architecture.md, "A sequence's state"). This class wires
them and runs the loop.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from model_service.attention.kv_cache import cache_bytes_per_block
from model_service.engine.adapters import AdapterControl
from model_service.engine.batch_builder import BatchBuilder
from model_service.engine.beams import BeamSearch
from model_service.engine.block_manager import BlockManager
from model_service.engine.cache_manager import CacheManager
from model_service.engine.config import EngineConfig
from model_service.engine.detokenizer import IncrementalDetokenizer
from model_service.engine.executor import recurrent_state_bytes
from model_service.engine.executors import Executor, build_executor
from model_service.engine.grammar import GrammarCompiler
from model_service.engine.logits_processors import resolve as resolve_processors
from model_service.engine.output_processor import OutputProcessor
from model_service.engine.overlap import InFlight, Overlap
from model_service.engine.prompt_logprobs import score as score_prompts
from model_service.engine.proposers import build_speculation, load_proposer_models
from model_service.engine.request_table import RequestTable
from model_service.engine.requests import GrammarWait, PromptReader, Resume
from model_service.engine.sample_stage import SampleStage, logits_rows
from model_service.engine.sampling_params import SamplingParams
from model_service.engine.scheduler import Scheduler
from model_service.engine.sequence import RequestOutput, Sequence
from model_service.engine.speculation import Speculation, SpeculativeConfig
from model_service.engine.warm_up import run_requests
from model_service.errors import InvalidRequestError
from model_service.lora.adapter import HostForm
from model_service.lora.buffers import HostBuffers
from model_service.lora.control import ControlOp, ControlResult
from model_service.lora.pool import AdapterInfo, LoraPool
from model_service.models.config import ModelConfig
from model_service.models.loader import LoadedModel, load_model

log = logging.getLogger(__name__)
# The fields a request object may have (`Engine.add_request_dict`): its SamplingParams' and these.
_REQUEST_FIELDS = {
    "prompt", "messages", "tools", "chat_template_kwargs", "prompt_token_ids", "request_id", "priority",
    "adapter",
} | {f.name for f in dataclasses.fields(SamplingParams)}  # fmt: skip
# An engine with nothing to run but a request whose adapter a worker is reading, or whose grammar
# is compiling, waits this long for it rather than spinning through empty steps.
IDLE_WAIT_S = 0.005


@dataclass
class EngineStats:
    """Counters and gauges the model pod exports (as Prometheus metrics: model_service/pod/metrics.py)."""

    num_waiting: int
    num_swapped: int
    num_running: int
    kv_blocks_total: int
    kv_blocks_free: int  # includes cached blocks no request holds (reclaimable)
    kv_blocks_cached: int
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int
    num_preemptions: int
    num_computed_tokens: int
    num_steps: int
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_drafts: int = 0  # verify runs: 1 + accepted / drafts is the mean tokens a run emits
    spec_accepted_per_position: tuple[int, ...] = ()  # accepted proposals by position in the run
    adapter_drains: int = 0  # resident adapters drained so that a starving one could load
    adapter_loads: int = 0  # adapters copied to the device
    adapter_load_seconds: float = 0.0  # the engine thread's time in those loads
    adapter_evictions: int = 0  # idle adapters evicted from the device to make room
    # Recurrent-state slots (hybrid models; 0 without recurrent layers). Free includes the slots
    # holding prefix-cache snapshots, which are given back when a sequence needs one; so once
    # nothing runs, free == total, or a slot leaked.
    state_slots_total: int = 0
    state_slots_free: int = 0
    state_slots_cached: int = 0

    @classmethod
    def collect(
        cls,
        scheduler: Scheduler,
        lora: LoraPool,
        adapters: AdapterControl,
        speculation: Speculation | None,
        num_steps: int,
    ) -> EngineStats:
        """The counters, read from their owners (the engine counts only its steps)."""
        s, cache, spec = scheduler, scheduler.cache, speculation
        return cls(
            num_waiting=len(s.waiting) - s.num_swapped,
            num_swapped=s.num_swapped,
            num_running=len(s.running),
            kv_blocks_total=cache.blocks.num_blocks,
            kv_blocks_free=cache.blocks.num_free,
            kv_blocks_cached=cache.blocks.num_cached,
            prefix_cache_query_tokens=s.prefix_query_tokens,
            prefix_cache_hit_tokens=s.prefix_hit_tokens,
            num_preemptions=s.num_preemptions,
            num_computed_tokens=s.num_computed_tokens,
            num_steps=num_steps,
            spec_proposed_tokens=spec.proposed if spec is not None else 0,
            spec_accepted_tokens=spec.accepted if spec is not None else 0,
            spec_drafts=spec.drafts if spec is not None else 0,
            spec_accepted_per_position=tuple(spec.accepted_at) if spec is not None else (),
            adapter_drains=adapters.num_drains,
            adapter_loads=lora.num_loads,
            adapter_load_seconds=lora.load_seconds,
            adapter_evictions=lora.num_evictions,
            state_slots_total=cache.num_state_slots,
            state_slots_free=cache.num_free_state_slots + cache.num_cached_states,
            state_slots_cached=cache.num_cached_states,
        )

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.kv_blocks_free / self.kv_blocks_total

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hit_tokens / max(self.prefix_cache_query_tokens, 1)


class AdapterMemory(Protocol):
    """Device memory for adapter weights, as the LoRA pool counts it: what the pod reports so the
    gateway can prefer a pod with room, and an operator can see memory pressure."""

    @property
    def memory_used_bytes(self) -> int: ...

    @property
    def memory_capacity_bytes(self) -> int:
        """All the device memory adapters may take; 0 = not counted in bytes (slots only)."""
        ...


@dataclass(frozen=True)
class MemoryCount:
    """An `AdapterMemory` of fixed values: what an engine that keeps no adapters on a device
    (the benchmarks' fake engine) reports; capacity 0 = not counted."""

    memory_used_bytes: int = 0
    memory_capacity_bytes: int = 0


NOT_COUNTED = MemoryCount()


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.loaded = loaded or _load(config)
        self.tokenizer, mc = self.loaded.tokenizer, self.loaded.config
        speculative = SpeculativeConfig.from_json(config.speculative_config)
        models = load_proposer_models(speculative, config, self.loaded)  # a draft model, MTP, EAGLE-3
        state_slots = _num_state_slots(config, mc.num_state_layers, speculative)
        self.executor = build_executor(self.loaded, config, models.kv_config, state_slots, models.aux_layers)
        num_blocks, self.max_model_len = self.executor.kv_cache.num_blocks, self.executor.max_model_len
        self.cache = _cache_manager(self.executor, config, self.loaded, state_slots)
        self.lora = _lora_pool(self.executor, config, mc)
        self.speculation = build_speculation(
            speculative, models, self.loaded, config, num_blocks, self.max_model_len
        )
        proposals = self.speculation.proposals if self.speculation is not None else None
        self.scheduler = Scheduler(config, self.cache, self.lora, proposals=proposals)
        self.builder = BatchBuilder(config.block_size, self.executor.device)
        self.eos_token_ids = set(mc.eos_token_ids)
        self.prompts = PromptReader(
            self.tokenizer, mc.vocab_size, self.max_model_len, num_blocks, config.block_size, state_slots
        )
        self.outputs = OutputProcessor(self.eos_token_ids, self.max_model_len)
        self.beams = BeamSearch(self.scheduler, self.tokenizer)
        # Structured output (engine/grammar.py); none without a tokenizer (token-id serving).
        self.grammars = (
            GrammarCompiler(self.tokenizer, mc.vocab_size, self.eos_token_ids)
            if self.tokenizer is not None
            else None
        )
        self.grammar_wait = GrammarWait(self.grammars)
        self.adapters = AdapterControl(self.lora, self.scheduler, config)
        self.overlap = Overlap(Overlap.wanted(config, self.executor.device, self.speculation is not None))
        self.table = RequestTable(self.scheduler, self.beams, self.outputs, self.speculation)
        self.sample = SampleStage(self.scheduler, self.table, self.beams, self.grammars, self.speculation)
        self._arrivals = itertools.count()
        self.num_steps = 0

    @property
    def vocab_size(self) -> int:
        return self.loaded.config.vocab_size

    @property
    def requests(self) -> dict[str, Sequence]:
        """The live requests, by id."""
        return self.table.by_id

    def warm_up(self) -> None:
        """Before a pod reports SERVING: every graph captured and, on CUDA, `warm_up.run_requests` run."""
        self.executor.capture_graphs(self.lora.target_sets())
        if self.executor.device.type == "cuda":
            run_requests(self)

    # --- requests -------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        prompt_token_ids: list[int] | None = None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        adapter: str | None = None,
        resume: Resume | None = None,
    ) -> str:
        """Validate and queue a request; raises InvalidRequestError / CapacityError, changing nothing.

        `resume`: output a previous engine produced for it; generation continues after it.
        `request_id` must not be one this engine still runs: a process's entry keeps ids unique
        (the pod's Generate handler, `spindle generate`'s request reader), in one place."""
        params = params or SamplingParams()
        params.validate(self.vocab_size)
        request_id = request_id or uuid.uuid4().hex
        self.adapters.check_request(adapter)
        self.grammar_wait.check(params)
        ids = self.prompts.token_ids(prompt, messages, prompt_token_ids, tools, chat_template_kwargs)
        self.prompts.check_room(resume, params, len(ids))
        detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        arrival, device = next(self._arrivals), self.executor.device
        seq = Sequence(request_id, ids, params, detokenizer, arrival, priority, device, adapter)
        seq.sampling.processors = resolve_processors(params, self.tokenizer, self.eos_token_ids)  # may refuse
        if resume is not None and self.outputs.replay(seq, resume):
            self.table.finish(seq, seq.output.finish_reason or "stop")  # its resumed output ended it
            return request_id
        self.scheduler.add(seq)
        self.grammar_wait.add(seq)
        if params.num_beams > 1:
            self.beams.start(seq, self.eos_token_ids, self.max_model_len)
        self.table.add(seq)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Stop a request and free everything it holds; its stream ends with finish_reason "abort"."""
        seq = self.requests.get(request_id)
        if seq is None or seq.finished:
            return False
        self.table.finish(seq, "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self.table.has_pending or self.overlap.busy

    # --- the loop -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One turn of the loop (the module docstring draws its stages)."""
        self._quiescent_point()
        outputs = self.table.take()
        work = self.scheduler.schedule().work
        if work:
            outputs += self._step(work)
        else:
            self._idle()
            outputs += self.table.outputs_of(self._drain())
        return outputs + self.table.take()

    def _quiescent_point(self) -> None:
        """Before scheduling: adapter control and admission (the step in flight read first where
        they, or a scheduling that may preempt, change what runs), stalled beam searches started
        over, then the grammars that have compiled."""
        if self.overlap.busy and (self.adapters.needs_quiescence() or self.scheduler.needs_quiescence()):
            self.table.report(self._drain())
        self.table.unstall(self.scheduler.take_stalled())
        for seq, error in self.adapters.at_quiescent_point():
            self.table.finish(seq, "error", error)
        for seq, reason, why in self.grammar_wait.start_compiled():
            self.table.finish(seq, reason, why)

    def _step(self, work: list[tuple[Sequence, int]]) -> list[RequestOutput]:
        """Run the scheduled `work`; a bad batch fails its requests, not the engine."""
        self.num_steps += 1
        try:
            return self.table.outputs_of(self._run(work))
        except Exception as e:
            log.exception("forward pass failed; failing %d requests", len(work))
            self._fail(work, e)
            return []

    def _run(self, work: list[tuple[Sequence, int]]) -> list[Sequence]:
        """Build the batch -> launch -> sample; returns the sequences it produced tokens for
        (with async scheduling: those the step before produced, whose tokens have just arrived)."""
        items = [self.overlap.item(s) if s.in_flight else self.scheduler.item(s, n) for s, n in work]
        logits = self.executor.execute(self.builder.build(items), self.overlap.tokens)
        if self.speculation is not None:
            self.speculation.on_forward(
                [(s, it) for (s, _), it in zip(work, items, strict=True)], self.executor.hidden
            )
        self.scheduler.commit(work)
        rows, verify, prompt = logits_rows(work, items)
        score_prompts(prompt, logits)
        rows = self.table.finish_scored_only(rows)
        produced = self._drain(self.overlap.launch(work, rows, logits))  # the step before's tokens
        for (seq, _), item in zip(work, items, strict=True):
            if item.num_logits <= 1:  # its tokens are known now; a verify row's once verified
                self.scheduler.register_prefix(seq)
        if self.overlap.busy:  # this step's tokens stay on the device, to be read next step
            return produced
        live = [(s, r) for s, r in rows if not s.finished]
        if live and self.overlap.overlaps(work):  # structured output: masks from the tokens just read
            self.overlap.launch_masked(live, logits, self.grammars)
            return produced
        return produced + self.sample.run(live, verify, logits)

    def _drain(self, then: InFlight | None = None) -> list[Sequence]:
        """Read the in-flight step's tokens and append them; `then`, a step just launched, is
        in flight after. Returns the sequences that got one."""
        return self.table.arrived(self.overlap.drain(then))

    def _fail(self, work: list[tuple[Sequence, int]], error: Exception) -> None:
        """A forward pass failed: its requests fail. The step before's tokens are appended if they
        can still be read (else the device is gone, and the requests waiting for them fail)."""
        self.table.fail([seq for seq, _ in work], f"engine error: {error}")
        try:
            self.table.report(self._drain())
        except Exception:
            log.exception("the tokens of the step before the failed one are lost")
        self.table.fail_in_flight(f"engine error: {error}")

    def _idle(self) -> None:
        """Nothing was scheduled. Beams that wait for each other with nothing in flight are a
        stalled search (`BeamSearch.unstall`); else wait, `IDLE_WAIT_S` at most, for a worker's
        adapter read or grammar compile that a waiting request needs, rather than spin."""
        if not self.overlap.busy and self.scheduler.running and not self.scheduler.adapter_demand:
            self.table.unstall(self.scheduler.running)
        pending: list[concurrent.futures.Future[Any]] = []
        if not self.overlap.busy and self.scheduler.adapter_demand:
            pending += self.lora.pending_reads()
        if not self.scheduler.running:
            pending += self.grammar_wait.compiles()
        if pending:
            concurrent.futures.wait(pending, IDLE_WAIT_S, concurrent.futures.FIRST_COMPLETED)

    # --- adapters -------------------------------------------------------------------------

    def submit_control(self, op: ControlOp) -> Future[ControlResult]:
        """Queue an adapter operation (thread-safe); it runs at the start of the next step."""
        return self.adapters.submit(op)

    def on_lost(self, callback: Callable[[str], None]) -> None:
        """Call `callback(why)`, from any thread, if this engine loses a device it cannot serve
        without (a tensor-parallel rank); the engine thread may then be stuck in a collective."""
        self.executor.on_lost(callback)

    def list_adapters(self) -> list[AdapterInfo]:
        return self.lora.report()

    @property
    def adapter_memory(self) -> AdapterMemory:
        """The LoRA pool, whose `memory_used_bytes` / `memory_capacity_bytes` (its adapter
        arena, lora/arena.py) the pod reports."""
        return self.lora

    def stats(self) -> EngineStats:
        return EngineStats.collect(self.scheduler, self.lora, self.adapters, self.speculation, self.num_steps)

    # --- conveniences ---------------------------------------------------------------------

    def add_request_dict(self, r: dict[str, Any]) -> str:
        """`add_request` from one request object, as `--requests` files and `generate` spell them."""
        return self.add_request(**_request_arguments(r))

    def run_to_completion(self) -> dict[str, RequestOutput]:
        """Step until nothing is left; the final output of every request that finished, by id."""
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return final

    def generate(self, requests: list[dict[str, Any]]) -> list[RequestOutput]:
        """Run request dicts to completion, as one batch; returns the final output of each, in
        input order. All or nothing: if one request is refused, the ones already queued are
        withdrawn before the error is raised."""
        ids: list[str] = []
        try:
            for r in requests:
                ids.append(self.add_request_dict(r))
        except Exception:
            for rid in ids:
                self.abort(rid)
            self.table.withdraw(ids)
            raise
        final = self.run_to_completion()
        return [final[i] for i in ids]


def _num_state_slots(
    config: EngineConfig, num_state_layers: int, speculative: SpeculativeConfig | None
) -> int:
    """Recurrent-state slots (hybrid models): per running sequence its own, one per speculative
    token (verify checkpoints), and one for prefix-cache snapshots; none without recurrent layers."""
    if not num_state_layers:
        return 0
    spec = speculative.num_speculative_tokens if speculative is not None else 0
    return config.max_num_seqs * (2 + spec)


def _load(config: EngineConfig) -> LoadedModel:
    """The configured model. Tensor-parallel ranks slice the weights from a host copy; one device
    loads onto itself."""
    device = torch.device("cpu") if config.tensor_parallel_size > 1 else config.torch_device()
    return load_model(config.model, config.torch_dtype(), device, quantization=config.quantization)


def _cache_manager(
    executor: Executor, config: EngineConfig, loaded: LoadedModel, state_slots: int
) -> CacheManager:
    """The cache manager over the executor's K/V cache (and its recurrent-state slots)."""
    blocks = BlockManager(executor.kv_cache.num_blocks, config.block_size, config.enable_prefix_caching)
    per_token = cache_bytes_per_block(loaded.config, 1, executor.dtype)
    state_bytes = recurrent_state_bytes(loaded.module, 1)
    return CacheManager(blocks, executor, per_token, state_slots, state_bytes)


def _lora_pool(executor: Executor, config: EngineConfig, mc: ModelConfig) -> LoraPool:
    """The adapter pool over the executor's LoRA slots and arena, with the configured adapters
    registered; host copies pinned on CUDA."""
    held = HostForm(executor.dtype, HostBuffers(executor.device))
    pool = LoraPool(
        mc, executor.lora_slots, config.max_cpu_loras, config.max_lora_rank, executor,
        executor.lora_arena, config.max_adapter_bytes, held,
    )  # fmt: skip
    for name, path in config.lora_modules.items():
        pool.register(name, Path(path))
    return pool


def _request_arguments(r: dict[str, Any]) -> dict[str, Any]:
    """`Engine.add_request`'s arguments from one request object (prompt/messages (and tools,
    chat_template_kwargs)/prompt_token_ids,
    sampling fields, request_id, priority, adapter). A field it does not know is refused: dropped,
    a misspelt max_tokens or vLLM's min_tokens would silently change the answer."""
    unknown = sorted(set(r) - _REQUEST_FIELDS)
    if unknown:
        raise InvalidRequestError(f"unknown request fields: {', '.join(unknown)}")
    return {
        "prompt": r.get("prompt"),
        "messages": r.get("messages"),
        "tools": r.get("tools"),
        "chat_template_kwargs": r.get("chat_template_kwargs"),
        "prompt_token_ids": r.get("prompt_token_ids"),
        "params": SamplingParams.from_dict(r),
        "request_id": r.get("request_id"),
        "priority": int(r.get("priority", 0)),
        "adapter": r.get("adapter"),
    }
