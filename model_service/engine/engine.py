"""The synchronous engine: add requests, step, abort. One thread drives it (see AsyncEngine).

A step = schedule -> one mixed forward pass -> sample the rows that completed their pending
tokens -> append, detokenize, check stop conditions -> free what finished.
A fault confined to one request finishes that request with `finish_reason="error"`;
a fault in the forward pass fails the requests of that batch, never the engine.
"""

from __future__ import annotations

import itertools
import logging
import queue
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from model_service.engine.beam_search import BeamGroup
from model_service.engine.config import EngineConfig
from model_service.engine.detokenizer import IncrementalDetokenizer
from model_service.engine.model_runner import ModelRunner
from model_service.engine.sampler import SampleRow, sample
from model_service.engine.sampling_params import SamplingParams
from model_service.engine.scheduler import Scheduler
from model_service.engine.sequence import RequestOutput, Sequence, Status
from model_service.errors import CapacityError, InvalidRequestError, NotFoundError
from model_service.lora.adapter import AdapterError
from model_service.lora.control import ControlOp, ControlResult, execute
from model_service.lora.pool import AdapterInfo, SlotsBusyError
from model_service.models.loader import LoadedModel, load_model
from model_service.models.protocol import PrefillChunk

log = logging.getLogger(__name__)


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

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.kv_blocks_free / self.kv_blocks_total

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hit_tokens / max(self.prefix_cache_query_tokens, 1)


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.loaded = loaded or load_model(config.model, config.torch_dtype(), config.torch_device())
        self.tokenizer = self.loaded.tokenizer
        self.model = ModelRunner(self.loaded, config)
        self.scheduler = Scheduler(self.model, config)
        mc = self.loaded.config
        kv_capacity = self.model.num_total_blocks() * config.block_size
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, kv_capacity)
        self.eos_token_ids = set(mc.eos_token_ids)
        self.requests: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        self._pending: list[RequestOutput] = []
        self._control: queue.Queue[tuple[ControlOp, Future[ControlResult]]] = queue.Queue()
        for name, path in config.lora_modules.items():
            self.model.lora.register(name, Path(path))
        self.num_computed_tokens = 0  # tokens run through the model (prefix-cache hits excluded)
        self.num_steps = 0

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

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
    ) -> str:
        """Validate and queue a request; raises InvalidRequestError / CapacityError, changing nothing."""
        params = params or SamplingParams()
        params.validate(self.model.vocab_size)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if adapter is not None and not self.model.lora.known(adapter):
            names = sorted(a.name for a in self.model.lora.report())
            raise NotFoundError(f"unknown adapter {adapter!r}; this server has {names or 'no adapters'}")
        ids = self._prompt_ids(prompt, messages, prompt_token_ids)
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens; this engine's context is {self.max_model_len} tokens "
                "and the prompt must leave room for at least one generated token"
            )
        if self.model.block_manager.blocks_for(len(ids) + 1) > self.model.num_total_blocks():
            raise CapacityError(f"prompt of {len(ids)} tokens can never fit in the KV cache")
        seq = Sequence(
            request_id,
            ids,
            params,
            IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens),
            arrival=next(self._arrivals),
            priority=priority,
            device=self.model.device,
        )
        seq.adapter_name = adapter
        if params.num_beams > 1:
            seq.group = BeamGroup(
                request_id,
                params.num_beams,
                params.length_penalty,
                params.early_stopping,
                min(params.max_tokens, self.max_model_len - len(ids)),
                set() if params.ignore_eos else self.eos_token_ids,
                beams=[seq],
            )
        self.scheduler.add(seq)
        self.requests[request_id] = seq
        return request_id

    def _prompt_ids(
        self, prompt: str | None, messages: list[dict[str, Any]] | None, token_ids: list[int] | None
    ) -> list[int]:
        given = [x is not None for x in (prompt, messages, token_ids)]
        if sum(given) != 1:
            raise InvalidRequestError("give exactly one of `prompt`, `messages` or `prompt_token_ids`")
        if token_ids is not None:
            if not token_ids:
                raise InvalidRequestError("prompt_token_ids is empty")
            vocab = self.model.vocab_size
            bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(f"prompt_token_ids has ids outside [0, {vocab}): {bad[:5]}")
            return list(token_ids)
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer; send `prompt_token_ids`")
        if messages is not None:
            if not messages:
                raise InvalidRequestError("messages is empty")
            return self.tokenizer.apply_chat_template(messages)
        if not prompt:
            raise InvalidRequestError("prompt is empty")
        ids = self.tokenizer.encode(prompt)
        if not ids:
            raise InvalidRequestError("prompt encodes to zero tokens")
        return ids

    def abort(self, request_id: str) -> bool:
        """Stop a request and free everything it holds; its stream ends with finish_reason "abort"."""
        seq = self.requests.get(request_id)
        if seq is None or seq.finished:
            return False
        if seq.group is not None:
            self._finish_beams(seq.group, "abort")
        else:
            self._finish(seq, "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending)

    # --- stepping -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        # Quiescent point: no forward pass is in flight, so adapter slots may change here.
        self._run_control()
        self._promote_demanded_adapters()
        outputs, self._pending = self._pending, []
        batch = self.scheduler.schedule()
        if not batch.work:
            return outputs
        self.num_steps += 1
        try:
            sampled = self._run(batch.work)
        except Exception as e:  # a bad batch fails its requests, not the engine
            log.exception("forward pass failed; failing %d requests", len(batch.work))
            for seq, _ in batch.work:
                if not seq.finished:
                    seq.error = f"engine error: {e}"
                    self._fail(seq)
            return outputs + self._pending_drain()
        for seq in sampled:
            if not seq.finished:
                outputs.append(seq.take_output())
        return outputs + self._pending_drain()

    # --- adapters -------------------------------------------------------------------------

    def submit_control(self, op: ControlOp) -> Future[ControlResult]:
        """Queue an adapter operation (thread-safe); it runs at the start of the next step."""
        future: Future[ControlResult] = Future()
        self._control.put((op, future))
        return future

    def list_adapters(self) -> list[AdapterInfo]:
        return self.model.lora.report()

    def _run_control(self) -> None:
        while not self._control.empty():
            op, future = self._control.get_nowait()
            try:
                future.set_result(execute(op, self.model.lora))
            except Exception as e:  # a failed operation fails its caller, not the engine
                future.set_exception(e)

    def _promote_demanded_adapters(self) -> None:
        """Load the adapters waiting requests need; fail requests that waited too long."""
        demand, self.scheduler.adapter_demand = self.scheduler.adapter_demand, {}
        failed: dict[str, str] = {}
        for name in demand:
            try:
                self.model.promote_lora_from_disk(name)
            except SlotsBusyError:
                pass  # its requests keep waiting, up to the deadline
            except AdapterError as e:
                failed[name] = str(e)
        deadline = time.monotonic() - self.config.adapter_wait_timeout_s
        for seq in list(self.scheduler.waiting):
            name = seq.adapter_name
            if name is None or self.model.lora.slot_of(name) is not None:
                continue
            if name in failed or seq.created < deadline:
                reason = failed.get(
                    name, f"no LoRA slot freed within {self.config.adapter_wait_timeout_s:g} s"
                )
                seq.error = f"adapter {name!r} could not be loaded: {reason}"
                self._fail(seq)

    def _pending_drain(self) -> list[RequestOutput]:
        out, self._pending = self._pending, []
        return out

    def _run(self, work: list[tuple[Sequence, int]]) -> list[Sequence]:
        chunks, decodes = [], []
        for seq, n in work:
            assert seq.state is not None
            start = seq.num_computed
            if seq.num_pending == 1:
                decodes.append(seq)
            else:
                is_last = start + n == len(seq.token_ids)
                chunks.append((seq, PrefillChunk(seq.state, seq.token_ids[start : start + n], is_last)))
        decode_logits, chunk_logits = self.model.mixed_forward_batch(
            [s.state for s in decodes], [s.token_ids[-1] for s in decodes], [c for _, c in chunks]
        )
        self.num_computed_tokens += sum(n for _, n in work)
        for seq, _ in work:
            assert seq.state is not None
            self.model.block_manager.register_full_blocks(seq.state, seq.token_ids, seq.adapter_id)
        rows = [(seq, lg) for (seq, _), lg in zip(chunks, chunk_logits, strict=True) if lg is not None]
        rows += list(zip(decodes, decode_logits, strict=True))
        beam_rows = [(seq, lg) for seq, lg in rows if seq.group is not None]
        rows = [(seq, lg) for seq, lg in rows if seq.group is None]
        self._step_beams(beam_rows)
        to_sample = [seq for seq, _ in rows]
        if not to_sample:
            return []
        logits = torch.stack([lg for _, lg in rows])
        tokens, logprobs = sample(
            logits,
            [
                SampleRow(s.params, s.generator, s.token_ids[: s.num_prompt_tokens], s.output_ids)
                for s in to_sample
            ],
        )
        for seq, token, lp in zip(to_sample, tokens, logprobs, strict=True):
            try:
                self._append(seq, token, lp)
            except Exception as e:  # e.g. a tokenizer fault on this request's text
                log.exception("request %s failed", seq.request_id)
                seq.error = str(e)
                self._fail(seq)
        return to_sample

    def _step_beams(self, rows: list[tuple[Sequence, torch.Tensor]]) -> None:
        """Record beam logits; advance each group whose beams have all reported."""
        for seq, logits in rows:
            seq.beam_logits = logits
        for group in {id(s.group): s.group for s, _ in rows if s.group is not None}.values():
            if not group.ready():
                continue
            try:
                self._advance_beams(group)
            except Exception as e:  # one beam request's fault fails that request only
                log.exception("beam search for %s failed", group.request_id)
                group.beams[0].error = f"beam search failed: {e}"
                self._finish_beams(group, "error")

    def _advance_beams(self, group: BeamGroup) -> None:
        parents = group.beams
        choices = group.advance(
            torch.stack([b.beam_logits for b in parents]), [b.output_ids for b in parents]
        )
        for b in parents:
            b.beam_logits = None
        if group.done:
            return self._finish_beams(group, "length")
        # The first child of a parent continues as the parent; later children fork its KV blocks.
        children, taken = [], set()
        for c in choices:
            parent = parents[c.parent]
            if c.parent in taken:
                child = parent.fork()
                assert parent.state is not None
                child.state = self.model.fork_sequence(parent.state)
                self.scheduler.running.append(child)
            else:
                child = parent
                taken.add(c.parent)
            children.append((child, c.token))
        for child, token in children:  # extend only after every fork copied its parent's tokens
            child.token_ids.append(token)
        for i, parent in enumerate(parents):
            if i not in taken:
                self.scheduler.remove(parent)
        group.beams = [child for child, _ in children]
        return None

    def _finish_beams(self, group: BeamGroup, reason: str) -> None:
        for beam in group.beams:
            self.scheduler.remove(beam)
            beam.status = Status.FINISHED
        best = group.best()
        if reason == "length" and best.token_ids and best.token_ids[-1] in group.eos_token_ids:
            reason = "stop"
        root = self.requests.pop(group.request_id)
        errors = [b.error for b in group.beams if b.error]
        text = self.tokenizer.decode(best.token_ids) if self.tokenizer else ""
        self._pending.append(
            RequestOutput(
                request_id=group.request_id,
                new_token_ids=best.token_ids,
                new_text=text,
                token_ids=best.token_ids,
                text=text,
                finished=True,
                finish_reason=reason,
                num_prompt_tokens=root.num_prompt_tokens,
                error=errors[0] if errors else None,
                first_scheduled_at=root.first_scheduled_at,
            )
        )

    def _append(self, seq: Sequence, token: int, lp: Any) -> None:
        seq.token_ids.append(token)
        if lp is not None:
            seq.logprobs.append(lp)
        p = seq.params
        stop_token = token in p.stop_token_ids or (token in self.eos_token_ids and not p.ignore_eos)
        if stop_token and not p.include_stop_str_in_output:
            return self._finish(seq, "stop", stop_reason=token)  # its text is not part of the answer
        delta = seq.detokenizer.push(token)
        seq.text += delta
        if stop_token:
            return self._finish(seq, "stop", stop_reason=token)
        if p.stop and self._match_stop_string(seq, len(delta)):
            return None
        if len(seq.output_ids) >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return self._finish(seq, "length")
        return None

    def _match_stop_string(self, seq: Sequence, new_chars: int) -> bool:
        # A stop string can only end inside the new text, so it starts at most len(stop)-1 before it.
        longest = max(map(len, seq.params.stop))
        search_from = max(0, len(seq.text) - new_chars - longest + 1)
        hits = [(seq.text.find(s, search_from), s) for s in seq.params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        i, s = min(hits)
        seq.text = seq.text[: i + len(s)] if seq.params.include_stop_str_in_output else seq.text[:i]
        self._finish(seq, "stop", stop_reason=s)
        return True

    def _fail(self, seq: Sequence) -> None:
        if seq.group is not None:
            self._finish_beams(seq.group, "error")
        else:
            self._finish(seq, "error")

    def _finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        self.scheduler.remove(seq)
        seq.status = Status.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self._pending.append(seq.take_output())
        del self.requests[seq.request_id]

    def stats(self) -> EngineStats:
        s, bm = self.scheduler, self.model.block_manager
        return EngineStats(
            num_waiting=len(s.waiting) - s.num_swapped,
            num_swapped=s.num_swapped,
            num_running=len(s.running),
            kv_blocks_total=bm.num_blocks,
            kv_blocks_free=bm.num_free,
            kv_blocks_cached=bm.num_cached,
            prefix_cache_query_tokens=s.prefix_query_tokens,
            prefix_cache_hit_tokens=s.prefix_hit_tokens,
            num_preemptions=s.num_preemptions,
            num_computed_tokens=self.num_computed_tokens,
            num_steps=self.num_steps,
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
