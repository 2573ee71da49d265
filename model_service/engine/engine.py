"""The synchronous engine: add requests, step, abort. One thread drives it (see AsyncEngine).

A step = run adapter control at the quiescent point -> schedule -> build the step batch -> one
forward pass on the executor -> sample the rows that completed their pending tokens -> append,
detokenize, check stop conditions -> free what finished. A fault confined to one request
finishes that request with `finish_reason="error"`; a fault in the forward pass fails the
requests of that batch, never the engine.

Who owns what: the scheduler owns the queues and, through the cache manager, every block table
and state slot; the executor owns the module and the device tensors; the LoRA pool owns adapter
names, tiers and slot refcounts; this class only wires them and keeps the request table.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import logging
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from model_service.engine.adapters import AdapterControl
from model_service.engine.batch_builder import BatchBuilder, StepItem
from model_service.engine.beam_search import BeamGroup
from model_service.engine.beams import BeamSearch
from model_service.engine.block_manager import BlockManager
from model_service.engine.cache_manager import CacheManager
from model_service.engine.config import EngineConfig
from model_service.engine.detokenizer import IncrementalDetokenizer
from model_service.engine.draft import DraftProposer, load_draft
from model_service.engine.executors import build_executor
from model_service.engine.grammar import GrammarCompiler, GrammarError
from model_service.engine.output_processor import OutputProcessor
from model_service.engine.overlap import PLACEHOLDER, InFlight, can_overlap, launch
from model_service.engine.requests import PromptReader, Resume
from model_service.engine.sampler import (
    AllowedTokens,
    SampleRow,
    TokenLogprobs,
    filtered_probs,
    sample,
    to_device,
)
from model_service.engine.sampling_params import SamplingParams
from model_service.engine.scheduler import Scheduler
from model_service.engine.sequence import RequestOutput, Sequence, Status
from model_service.engine.speculation import (
    NgramProposer,
    Proposer,
    SpeculativeConfig,
    accept_greedy,
    accept_sampled,
    can_speculate,
)
from model_service.errors import InvalidRequestError, NotFoundError, PreconditionError
from model_service.lora.adapter import host_form
from model_service.lora.control import ControlOp, ControlResult
from model_service.lora.pool import ACTIVE, AdapterInfo, LoraPool
from model_service.models.loader import LoadedModel, load_model

log = logging.getLogger(__name__)
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
        # Tensor-parallel ranks slice the weights from a host copy; one device loads onto itself.
        load_device = torch.device("cpu") if config.tensor_parallel_size > 1 else config.torch_device()
        self.loaded = loaded or load_model(config.model, config.torch_dtype(), load_device)
        self.tokenizer = self.loaded.tokenizer
        mc = self.loaded.config
        self.speculative = SpeculativeConfig.from_json(config.speculative_config)
        draft = load_draft(self.speculative, config, self.loaded)  # None unless method "draft"
        state_slots = self._num_state_slots()
        draft_config = draft.config if draft is not None else None
        self.executor = build_executor(self.loaded, config, draft_config, state_slots)
        device, dtype = self.executor.device, self.executor.dtype
        num_blocks, self.max_model_len = self.executor.kv_cache.num_blocks, self.executor.max_model_len
        blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        per_token = self.executor.kv_cache.bytes_per_block(
            mc.layer_kinds, 1, mc.num_kv_heads, mc.head_dim, dtype
        )
        self.cache = CacheManager(blocks, self.executor, per_token, state_slots)
        held = functools.partial(host_form, dtype=dtype, pin=device.type == "cuda")
        self.lora = LoraPool(
            mc, self.executor.lora_slots, config.max_cpu_loras, config.max_lora_rank, self.executor,
            self.executor.lora_arena, config.max_adapter_bytes, held,
        )  # fmt: skip
        self.scheduler = Scheduler(config, self.cache, self.lora)
        self.builder = BatchBuilder(config.block_size, device)
        self.eos_token_ids = set(mc.eos_token_ids)
        self.prompts = PromptReader(
            self.tokenizer, mc.vocab_size, self.max_model_len, num_blocks * config.block_size
        )
        self.outputs = OutputProcessor(self.eos_token_ids, self.max_model_len)
        self.beams = BeamSearch(self.scheduler, self.tokenizer)
        # Structured output (engine/grammar.py); none without a tokenizer (token-id serving).
        self.grammars = GrammarCompiler(self.tokenizer, mc.vocab_size) if self.tokenizer is not None else None
        self._compiling: list[Sequence] = []  # waiting for their grammar's matcher
        self.adapters = AdapterControl(self.lora, self.scheduler, config)
        self.proposer: Proposer | None = None
        if draft is not None:  # its cache has as many blocks as the target's (budgeted above)
            self.proposer = DraftProposer(draft, config, num_blocks, self.max_model_len, mc.vocab_size)
        elif self.speculative is not None:
            self.proposer = NgramProposer(self.speculative)
        self.spec_proposed = self.spec_accepted = 0  # proposed and accepted speculative tokens
        self.requests: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        self._pending: list[RequestOutput] = []
        self._inflight: InFlight | None = None  # the last step's tokens, still on the device
        self.overlap = _async_scheduling(config, self.executor.device, self.proposer is None)
        for name, path in config.lora_modules.items():
            self.lora.register(name, Path(path))
        self.num_computed_tokens = 0  # tokens run through the model (prefix-cache hits excluded)
        self.num_steps = 0

    @property
    def vocab_size(self) -> int:
        return self.loaded.config.vocab_size

    def warm_up(self) -> None:
        """Capture every decode graph (and piecewise bucket, when on), compiling the kernels
        they run, before serving: a pod calls this before it reports SERVING, so its first
        requests do not wait on captures. The draft model's graphs are still captured lazily."""
        self.executor.capture_graphs()

    def _num_state_slots(self) -> int:
        """Recurrent-state slots (hybrid models): per running sequence its own, one per speculative
        token (verify checkpoints), and one for prefix-cache snapshots; none without recurrent layers."""
        if not self.loaded.config.num_state_layers:
            return 0
        spec = self.speculative.num_speculative_tokens if self.speculative is not None else 0
        return self.config.max_num_seqs * (2 + spec)

    # --- requests -------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
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
        if adapter == ACTIVE and self.lora.slot_of(ACTIVE) is None:
            raise PreconditionError(
                f"no adapter is active, so {ACTIVE!r} names none: ModelControl.SetActive sets one "
                "(or name the adapter itself)"
            )
        if adapter is not None and self.config.max_loras == 0:  # it would wait forever for a slot
            raise PreconditionError(
                f"adapter {adapter!r} asked for, but this server has no LoRA slots (--max-loras 0)"
            )
        if adapter is not None and not self.lora.known(adapter):
            names = sorted(a.name for a in self.lora.report())
            raise NotFoundError(f"unknown adapter {adapter!r}; this server has {names or 'no adapters'}")
        if params.structured_output is not None and self.grammars is None:
            raise InvalidRequestError(
                "structured_output needs the model's tokenizer, and this model has none"
            )
        ids = self.prompts.token_ids(prompt, messages, prompt_token_ids)
        if resume is not None:
            self.prompts.check_resume(resume, params, len(ids))
        seq = Sequence(
            request_id,
            ids,
            params,
            IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens),
            arrival=next(self._arrivals),
            priority=priority,
            device=self.executor.device,
        )
        seq.adapter_name = adapter
        if resume is not None and self._replay(seq, resume):
            return request_id  # its resumed output already ended it: only its final output is left
        self.scheduler.add(seq)
        if params.structured_output is not None:
            assert self.grammars is not None
            seq.constraint = self.grammars.constraint(params.structured_output)
            self._compiling.append(seq)
        if params.num_beams > 1:
            group = BeamGroup(
                request_id,
                params.num_beams,
                params.length_penalty,
                params.early_stopping,
                min(params.max_tokens, self.max_model_len - len(ids)),
                set() if params.ignore_eos else self.eos_token_ids,
            )
            self.beams.start(seq, group)
        self.requests[request_id] = seq
        return request_id

    def _replay(self, seq: Sequence, resume: Resume) -> bool:
        """Append resumed output as if sampled here (stop strings, penalties and seeded noise see the
        same history) and mark what the caller has as sent; True when that output finished the
        request, whose final output is then queued."""
        ids = resume.output_token_ids
        for i, token in enumerate(ids):
            if self.outputs.append(seq, token, None) and i + 1 < len(ids):
                raise InvalidRequestError(
                    f"resume.output_token_ids goes on after output token {i}, where this request stops"
                )
        if resume.text_chars > len(seq.text):
            raise InvalidRequestError(
                f"resume.text_chars is {resume.text_chars} but its output tokens make {len(seq.text)} "
                "characters of text"
            )
        seq.emitted_tokens, seq.emitted_chars = seq.num_output_tokens, resume.text_chars
        if seq.finish_reason is None:
            return False
        seq.status = Status.FINISHED
        self._pending.append(seq.take_output())
        return True

    def abort(self, request_id: str) -> bool:
        """Stop a request and free everything it holds; its stream ends with finish_reason "abort"."""
        seq = self.requests.get(request_id)
        if seq is None or seq.finished:
            return False
        self._finish(seq, "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending) or self._inflight is not None

    # --- stepping -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self._inflight is not None and self.adapters.needs_quiescence():
            self._emit_outputs(self._drain())  # control operations and adapter drains need one
        for seq in self.adapters.at_quiescent_point():
            self._finish(seq, "error")
        if self._inflight is not None and self.scheduler.may_preempt():
            self._emit_outputs(self._drain())  # a preempted sequence must have all its tokens
        self._start_grammars()
        outputs, self._pending = self._pending, []
        work = self.scheduler.schedule().work
        if not work:
            if self._inflight is None and self.scheduler.running and not self.scheduler.adapter_demand:
                self._end_stalled_beam_search()
            self._wait_for_background()
            return outputs + self._outputs(self._drain()) + self._take_pending()
        self.num_steps += 1
        try:
            sampled = self._run(work)
        except Exception as e:  # a bad batch fails its requests, not the engine
            log.exception("forward pass failed; failing %d requests", len(work))
            for seq, _ in work:
                if not seq.finished:
                    seq.error = f"engine error: {e}"
                    self._finish(seq, "error")
            self._settle_in_flight(e)
            return outputs + self._take_pending()
        return outputs + self._outputs(sampled) + self._take_pending()

    def _wait_for_background(self) -> None:
        """Nothing was scheduled: wait, `IDLE_WAIT_S` at most, for a worker's adapter read or
        grammar compile that a waiting request needs, rather than spin through empty steps."""
        pending: list[concurrent.futures.Future[Any]] = []
        if self._inflight is None and self.scheduler.adapter_demand:
            pending += self.lora.pending_reads()
        if self._compiling and not self.scheduler.running:
            pending += [s.constraint.compiled for s in self._compiling if s.constraint is not None]
        if pending:
            concurrent.futures.wait(pending, IDLE_WAIT_S, concurrent.futures.FIRST_COMPLETED)

    def _start_grammars(self) -> None:
        """Start the matchers whose grammars have compiled, so their requests can be admitted; a
        grammar that does not compile for this vocabulary (or a resumed output it refuses) fails
        its request."""
        if not self._compiling:
            return
        assert self.grammars is not None  # add_request queues none without it
        waiting = []
        for seq in self._compiling:
            if seq.finished or seq.constraint is None:
                continue
            try:
                if not self.grammars.poll(seq.constraint, seq.output_ids):
                    waiting.append(seq)
                elif seq.constraint.done:  # a resumed output that was already complete
                    self._finish(seq, "stop")
            except (InvalidRequestError, GrammarError) as e:
                seq.error = str(e)
                self._finish(seq, "error")
        self._compiling = waiting

    def _end_stalled_beam_search(self) -> None:
        """Nothing was scheduled, nothing is in flight, yet sequences run: they are beams waiting
        for siblings that cannot be admitted, because the K/V blocks they need are held by
        running beams, which wait too. Nothing would free them, and the pod would hang (holding
        those blocks from every other request). So the youngest stalled search starts over from
        its prompt, whole (`BeamSearch.restart`: beams preempted one by one may be what stalls
        it); if it stalls again, it ends with a capacity error, since it cannot run as it is. On
        28 blocks of 4, two searches of 8 beams of 40 tokens now both finish, where the younger
        used to end; on 24 the older, which cannot run even alone, ends and the younger finishes
        (it used to end too)."""
        stalled = [s for s in self.scheduler.running if s.group is not None]
        if not stalled:
            return
        beam = max(stalled, key=Sequence.sort_key)
        group = beam.group
        assert group is not None
        if not group.restarted:
            log.info("request %s: beam search starts over, for lack of K/V blocks", group.request_id)
            self.requests[group.request_id] = self.beams.restart(group)
            return
        beam.error = (
            f"beam search of {group.num_beams} beams needs more K/V cache at once than is free for "
            f"it (this engine has {self.cache.num_total_blocks} blocks of {self.cache.block_size} tokens): "
            "ask for fewer beams or fewer max_tokens, or retry"
        )
        log.warning("request %s: %s", group.request_id, beam.error)
        self._finish(beam, "capacity")

    def _settle_in_flight(self, error: Exception) -> None:
        """After a failed step: the step before's tokens are appended if they can still be read
        (else the device is gone); a sequence whose token is lost fails rather than run on."""
        try:
            self._emit_outputs(self._drain())
        except Exception:
            log.exception("the tokens of the step before the failed one are lost")
        for seq in list(self.requests.values()):
            if seq.in_flight and not seq.finished:
                seq.in_flight = 0
                seq.error = f"engine error: {error}"
                self._finish(seq, "error")

    def _outputs(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """The new output of each sequence that produced tokens and goes on (once each)."""
        return [seq.take_output() for seq in dict.fromkeys(seqs) if not seq.finished]

    def _emit_outputs(self, seqs: list[Sequence]) -> None:
        self._pending += self._outputs(seqs)

    def _run(self, work: list[tuple[Sequence, int]]) -> list[Sequence]:
        """One forward pass over the scheduled work; returns the sequences it produced tokens for
        (with async scheduling: those the step before produced, whose tokens have just arrived)."""
        items = [self._item(seq, n) for seq, n in work]
        batch = self.builder.build(items)
        logits = self.executor.execute(batch, self._inflight.tokens if self._inflight is not None else None)
        self.scheduler.commit(work)
        self.num_computed_tokens += sum(len(item.tokens) for item in items)
        rows, verify, first = [], [], 0  # one logits row per plain row; k + 1 per verify row
        for (seq, _), item in zip(work, items, strict=True):
            if item.num_logits > 1:
                verify.append((seq, logits[first : first + item.num_logits]))
            elif item.num_logits:
                rows.append((seq, first))
            first += item.num_logits
        launched = None
        if self.overlap and not verify and all(can_overlap(seq) for seq, _ in work):
            launched = launch([s for s, _ in rows], self._rows(logits, rows))
        produced = self._drain()  # the step before: its tokens are needed from here on
        for (seq, _), item in zip(work, items, strict=True):
            if item.num_logits <= 1:
                self.scheduler.register_prefix(seq)
        if launched is not None:
            self._inflight = launched
            return produced
        return produced + self._sample_now([(s, r) for s, r in rows if not s.finished], verify, logits)

    @staticmethod
    def _rows(logits: torch.Tensor, rows: list[tuple[Sequence, int]]) -> torch.Tensor:
        if len(rows) == len(logits):
            return logits
        return logits[to_device([r for _, r in rows], logits.device)]

    def _sample_now(
        self,
        rows: list[tuple[Sequence, int]],
        verify: list[tuple[Sequence, torch.Tensor]],
        logits: torch.Tensor,
    ) -> list[Sequence]:
        """Sample, verify and propose on the host's schedule: the step's tokens are read at once."""
        beams = [(s, logits[r]) for s, r in rows if s.group is not None]
        for out in self.beams.report(beams):  # searches that ended: their ids are free again
            self.requests.pop(out.request_id, None)
            self._pending.append(out)
        plain = [(s, r) for s, r in rows if s.group is None]
        if plain:
            self._sample([s for s, _ in plain], self._rows(logits, plain))
        for seq, seq_logits in verify:
            self._verify(seq, seq_logits)
        produced = [s for s, _ in plain] + [s for s, _ in verify]
        if self.proposer is not None:
            self._propose([s for s in produced if not s.finished])
        return produced

    def _drain(self) -> list[Sequence]:
        """Read the in-flight step's tokens and append them: the sequences that got one."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return []
        got = []
        for seq, token in zip(inflight.seqs, inflight.wait(), strict=True):
            seq.in_flight -= 1
            if not seq.finished:  # else it finished (a stop, an abort) while this token was in flight
                self._emit(seq, [token], None)
                got.append(seq)
        return got

    def _item(self, seq: Sequence, n: int) -> StepItem:
        """`n` of the sequence's pending tokens, or its last token and its proposals to verify."""
        assert seq.state is not None
        if seq.in_flight:  # its last token is still on the device: `feed` writes it in
            assert self._inflight is not None
            return StepItem(seq.state, [PLACEHOLDER], 1, self._inflight.row_of[id(seq)])
        if n > seq.num_pending:  # the scheduler took its proposals
            return StepItem(seq.state, [seq.token_ids[-1], *seq.spec_tokens], n)
        start = seq.num_computed
        ends_prompt = start + n == len(seq.token_ids)
        return StepItem(seq.state, seq.token_ids[start : start + n], int(ends_prompt))

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        allowed = None
        if self.grammars is not None and any(s.constraint is not None for s in seqs):
            allowed = self.grammars.allowed_tokens([s.constraint for s in seqs])
        tokens, logprobs = sample(
            logits,
            [SampleRow(s.params, s.generator, s.token_ids, s.num_prompt_tokens) for s in seqs],
            allowed,
        )
        for seq, token, lp in zip(seqs, tokens, logprobs, strict=True):
            self._emit(seq, [token], lp)

    def _verify(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Keep the accepted proposals and the target's next token; cut the rest's K/V off (and
        restore a hybrid model's recurrent state from the checkpoint after the last kept input)."""
        assert seq.state is not None
        proposals, seq.spec_tokens = seq.spec_tokens, []
        draft_probs, seq.spec_probs = seq.spec_probs, None
        if seq.constraint is not None:  # the target's distribution under the grammar, at each row
            bits = seq.constraint.verify_bitmask(proposals, self.vocab_size)
            logits = AllowedTokens(list(range(len(logits))), bits).apply(logits)
        if seq.params.greedy:
            emitted = accept_greedy(proposals, logits)
        else:
            probs = filtered_probs(logits, [seq.params] * len(logits))
            emitted = accept_sampled(proposals, probs, seq.generator, draft_probs)
        self.spec_proposed += len(proposals)
        self.spec_accepted += len(emitted) - 1
        self.scheduler.rollback(seq, len(proposals) - len(emitted) + 1)
        self._emit(seq, emitted, None)
        if not seq.finished:
            self.scheduler.register_prefix(seq)
            assert self.proposer is not None
            self.proposer.on_verified(seq, len(emitted) - 1)

    def _emit(self, seq: Sequence, tokens: list[int], logprobs: TokenLogprobs | None) -> None:
        """Append tokens until one finishes the request."""
        try:
            for token in tokens:
                if self.outputs.append(seq, token, logprobs):
                    self._finish(seq, seq.finish_reason or "stop")
                    return
        except Exception as e:  # e.g. a tokenizer fault on this request's text
            log.exception("request %s failed", seq.request_id)
            seq.error = str(e)
            self._finish(seq, "error")

    def _propose(self, seqs: list[Sequence]) -> None:
        """Proposals for each decode row that can speculate, to verify in its next step."""
        assert self.proposer is not None and self.speculative is not None
        seqs = [s for s in seqs if s.group is None and can_speculate(s.params)]
        room = [
            min(
                self.speculative.num_speculative_tokens,
                seq.params.max_tokens - seq.num_output_tokens - 1,
                self.max_model_len - len(seq.token_ids) - 1,
            )
            for seq in seqs
        ]
        for seq, proposal in zip(seqs, self.proposer.propose(seqs, room), strict=True):
            seq.spec_tokens, seq.spec_probs = proposal.tokens, proposal.probs
            if seq.constraint is not None:  # verify only what the grammar allows
                n = seq.constraint.valid_prefix(proposal.tokens)
                seq.spec_tokens = proposal.tokens[:n]
                seq.spec_probs = proposal.probs[:n] if proposal.probs is not None and n else None

    def _finish(self, seq: Sequence, reason: str) -> None:
        """Free `seq` (all beams of its request) and queue its final output."""
        if seq.group is not None:
            if self.beams.is_live(seq.group):  # else ended already: several beams can be doomed at once
                self._pending.append(self.beams.finish(seq.group, reason))
                self.requests.pop(seq.group.request_id, None)
            return
        self.scheduler.remove(seq)
        if self.proposer is not None:
            self.proposer.on_finished(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self._pending.append(seq.take_output())
        del self.requests[seq.request_id]

    def _take_pending(self) -> list[RequestOutput]:
        out, self._pending = self._pending, []
        return out

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
        s, blocks = self.scheduler, self.cache.blocks
        return EngineStats(
            num_waiting=len(s.waiting) - s.num_swapped,
            num_swapped=s.num_swapped,
            num_running=len(s.running),
            kv_blocks_total=blocks.num_blocks,
            kv_blocks_free=blocks.num_free,
            kv_blocks_cached=blocks.num_cached,
            prefix_cache_query_tokens=s.prefix_query_tokens,
            prefix_cache_hit_tokens=s.prefix_hit_tokens,
            num_preemptions=s.num_preemptions,
            num_computed_tokens=self.num_computed_tokens,
            num_steps=self.num_steps,
            spec_proposed_tokens=self.spec_proposed,
            spec_accepted_tokens=self.spec_accepted,
            adapter_drains=self.adapters.num_drains,
            adapter_loads=self.lora.num_loads,
            adapter_load_seconds=self.lora.load_seconds,
            adapter_evictions=self.lora.num_evictions,
            state_slots_total=self.cache.num_state_slots,
            state_slots_free=self.cache.num_free_state_slots + self.cache.num_cached_states,
            state_slots_cached=self.cache.num_cached_states,
        )

    # --- conveniences ---------------------------------------------------------------------

    def add_request_dict(self, r: dict[str, Any]) -> str:
        """`add_request` from one request object (prompt/messages/prompt_token_ids, sampling fields,
        request_id, priority, adapter), as `--requests` files and `generate` spell them."""
        return self.add_request(
            r.get("prompt"),
            messages=r.get("messages"),
            prompt_token_ids=r.get("prompt_token_ids"),
            params=SamplingParams.from_dict(r),
            request_id=r.get("request_id"),
            priority=int(r.get("priority", 0)),
            adapter=r.get("adapter"),
        )

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
            self._pending = [o for o in self._pending if o.request_id not in ids]  # nobody awaits them
            raise
        final = self.run_to_completion()
        return [final[i] for i in ids]


def _async_scheduling(config: EngineConfig, device: torch.device, without_speculation: bool) -> bool:
    """Whether steps may overlap (engine/overlap.py): asked for, or by default on CUDA, one GPU or
    several (rank 0 sends the in-flight tokens on over the device group: TP = 2 on the 8B shape
    went 227.9 -> 279.3 tok/s at batch 1, 11,348 -> 15,341 at 64). On the CPU the host is the
    device, so there is nothing to overlap. Speculation needs each step's tokens on the host."""
    if config.async_scheduling == "off" or not without_speculation:
        return False
    return config.async_scheduling == "on" or device.type == "cuda"
