"""Fake fast engines for the serving benchmarks: the surface the model pod uses
(`model_service.engine.handle.EngineHandle`), no model behind it.

Every running request gets one token per step (ids 100, 101, ...; text "x" per token) and a
step sleeps `step_s`, so a benchmark measures the serving path (pod, gateway), not a model.
`FakeFastEngine` serves the adapters it is given (all resident) and refuses a request with
CapacityError (RESOURCE_EXHAUSTED) when `max_running` requests are running already, as an
overloaded pod does. `FakeLoraEngine` (the fleet simulation's, bench/fleet.py) serves adapters
that take device memory and load time (bench/fake_lora.py) and that the adapter service places.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import queue
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from bench.fake_lora import BYTES_PER_RANK, AdapterTiers, Known
from model_service.engine.config import EngineConfig
from model_service.engine.engine import NOT_COUNTED, AdapterMemory, EngineStats
from model_service.engine.requests import Resume
from model_service.engine.sampling_params import SamplingParams
from model_service.engine.sequence import RequestOutput
from model_service.errors import CapacityError, NotFoundError
from model_service.lora.control import (
    ControlOp,
    ControlResult,
    EvictAdapter,
    LoadAdapter,
    PinAdapter,
    RegisterAdapter,
)
from model_service.lora.pool import AdapterInfo, AdapterNotFoundError, SlotsBusyError


class FakeFastEngine:
    max_model_len = 4096
    vocab_size = 32000
    tokenizer = None

    def __init__(self, step_s: float, adapters: tuple[str, ...] = (), max_running: int = 1 << 30) -> None:
        self.step_s, self.adapters, self.max_running = step_s, adapters, max_running
        self.config = EngineConfig(max_loras=len(adapters))
        self.running: dict[str, list] = {}  # request id -> [prompt length, max tokens, tokens, admitted]
        self._pending: list[RequestOutput] = []

    def add_request(self, prompt=None, *, messages=None, tools=None, chat_template_kwargs=None,
                    prompt_token_ids=None, params=None,
                    request_id=None, priority=0, adapter=None,
                    resume: Resume | None = None) -> str:  # fmt: skip
        """EngineHandle.add_request (same parameters; tests/test_service_units.py checks)."""
        if adapter is not None and adapter not in self.adapters:
            raise NotFoundError(f"unknown adapter {adapter!r}; this engine serves {list(self.adapters)}")
        if len(self.running) >= self.max_running:
            raise CapacityError(f"the fake engine runs at most {self.max_running} requests; retry later")
        n = len(prompt_token_ids or []) or len(prompt or "") or 1
        request_id = request_id or uuid.uuid4().hex
        tokens = list(resume.output_token_ids) if resume is not None else []
        max_tokens = (params or SamplingParams()).max_tokens
        self.running[request_id] = [n, max_tokens, tokens, time.monotonic()]
        return request_id

    def abort(self, request_id: str) -> bool:
        entry = self.running.pop(request_id, None)
        if entry is not None:
            self._pending.append(self._out(request_id, entry, [], "abort"))
        return entry is not None

    def has_unfinished(self) -> bool:
        return bool(self.running or self._pending)

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_s)
        outputs, self._pending = self._pending, []
        for rid, entry in list(self.running.items()):
            token = 100 + len(entry[2])
            entry[2].append(token)
            done = len(entry[2]) >= entry[1]
            if done:
                del self.running[rid]
            outputs.append(self._out(rid, entry, [token], "length" if done else None))
        return outputs

    @staticmethod
    def _out(rid: str, entry: list, new: list[int], reason: str | None) -> RequestOutput:
        text = "x" * len(entry[2])
        return RequestOutput(
            rid, new, "x" * len(new), list(entry[2]), text, reason is not None, reason, entry[0],
            first_scheduled_at=entry[3],
        )  # fmt: skip

    def stats(self) -> EngineStats:
        return EngineStats(0, 0, len(self.running), 1000, 1000, 0, 0, 0, 0, 0, 0)

    def list_adapters(self) -> list[AdapterInfo]:
        return [AdapterInfo(name, i + 1, "gpu", i, 0, False) for i, name in enumerate(self.adapters)]

    @property
    def adapter_memory(self) -> AdapterMemory:
        """Not counted: the adapters it serves take no memory."""
        return NOT_COUNTED

    def on_lost(self, callback: Callable[[str], None]) -> None:
        """No device to lose."""

    def submit_control(self, op: ControlOp) -> Future[ControlResult]:
        future: Future[ControlResult] = Future()
        future.set_exception(AdapterNotFoundError(f"{op!r}: the fake engine takes no adapter operations"))
        return future


@dataclass
class _Waiting:
    """A request whose adapter is not on the device yet (or still loading)."""

    adapter: str
    entry: list
    held: bool = False  # it holds a reference on the adapter's device copy


class FakeLoraEngine(FakeFastEngine):
    """The fake fast engine with adapters that take memory and time (bench/fake_lora.py): a
    request for an adapter that is not on the device waits while it is loaded (in a time in
    proportion to its bytes, once least recently used idle adapters made room), and the adapter
    service's control operations (register, load, evict, pin) work on the same tiers.

    `found`: request id -> whether the request found its adapter resident (loaded on the
    device) when it arrived: the residency hit ratio of a fleet simulation (bench/fleet.py),
    which pops each entry once its request has ended."""

    def __init__(self, step_s: float, tiers: AdapterTiers) -> None:
        super().__init__(step_s)
        self.tiers = tiers
        self.config = EngineConfig(max_loras=tiers.max_slots)
        self.waiting: dict[str, _Waiting] = {}
        self.holding: dict[str, str] = {}  # running request id -> the adapter it holds
        self.found: dict[str, bool] = {}
        self._ops: queue.SimpleQueue[tuple[ControlOp, Future[ControlResult]]] = queue.SimpleQueue()
        self._loading: list[tuple[str, Future[ControlResult]]] = []  # LoadAdapter ops until ready
        self._ids = itertools.count(1)

    @property
    def adapter_memory(self) -> AdapterMemory:
        return self.tiers

    def list_adapters(self) -> list[AdapterInfo]:
        return self.tiers.report()

    def add_request(self, prompt=None, *, messages=None, tools=None, chat_template_kwargs=None,
                    prompt_token_ids=None, params=None,
                    request_id=None, priority=0, adapter=None,
                    resume: Resume | None = None) -> str:  # fmt: skip
        if adapter is not None and not self.tiers.known(adapter):
            raise NotFoundError(f"unknown adapter {adapter!r} on this pod")
        rid = super().add_request(prompt, prompt_token_ids=prompt_token_ids, params=params,
                                  request_id=request_id, resume=resume)  # fmt: skip
        if adapter is not None:
            self.found[rid] = self.tiers.ready(adapter, time.monotonic())
            self.waiting[rid] = _Waiting(adapter, self.running.pop(rid))
        return rid

    def abort(self, request_id: str) -> bool:
        waiting = self.waiting.pop(request_id, None)
        if waiting is None:
            return super().abort(request_id)
        if waiting.held:
            self.tiers.release(waiting.adapter)
        self._pending.append(self._out(request_id, waiting.entry, [], "abort"))
        return True

    def has_unfinished(self) -> bool:
        return super().has_unfinished() or bool(self.waiting or self._loading or not self._ops.empty())

    def step(self) -> list[RequestOutput]:
        now = time.monotonic()
        self._run_control(now)
        for rid, w in list(self.waiting.items()):
            w.held = w.held or self.tiers.hold(w.adapter, now)
            if w.held and self.tiers.ready(w.adapter, now):
                w.entry[3] = now  # first scheduled: the end of its wait
                self.running[rid], self.holding[rid] = w.entry, w.adapter
                del self.waiting[rid]
        outputs = super().step()
        for out in outputs:
            if out.finished and out.request_id in self.holding:
                self.tiers.release(self.holding.pop(out.request_id))
        return outputs

    def stats(self) -> EngineStats:
        return EngineStats(len(self.waiting), 0, len(self.running), 1000, 1000, 0, 0, 0, 0, 0, 0)

    def submit_control(self, op: ControlOp) -> Future[ControlResult]:
        future: Future[ControlResult] = Future()
        self._ops.put((op, future))
        return future

    def _run_control(self, now: float) -> None:
        """Queued control operations, and LoadAdapter answers whose load has finished."""
        while not self._ops.empty():
            op, future = self._ops.get()
            try:
                self._control(op, future, now)
            except Exception as e:  # the pod maps it to a status (pod/status.py)
                future.set_exception(e)
        loading, self._loading = self._loading, []
        for name, future in loading:
            if self.tiers.ready(name, now) or name not in self.tiers.device:
                entry = self.tiers.device.get(name)
                future.set_result(ControlResult(slot=entry.slot if entry else None))
            else:
                self._loading.append((name, future))

    def _control(self, op: ControlOp, future: Future[ControlResult], now: float) -> None:
        if isinstance(op, RegisterAdapter) or (isinstance(op, LoadAdapter) and op.path is not None):
            self.tiers.register(op.name, self._read(Path(op.path)))
        if isinstance(op, RegisterAdapter):
            future.set_result(ControlResult())
        elif isinstance(op, LoadAdapter):
            if self.tiers.load(op.name, now) is None:
                raise SlotsBusyError(f"cannot load adapter {op.name!r}: the adapter memory is in use")
            self._loading.append((op.name, future))
        elif isinstance(op, EvictAdapter):
            if op.name not in self.tiers.device and not (op.from_host or op.from_disk):
                raise AdapterNotFoundError(f"adapter {op.name!r} is not resident")
            self.tiers.evict(op.name)
            if op.from_host or op.from_disk:
                self.tiers.drop_host_copy(op.name)
            if op.from_disk:
                self.tiers.forget(op.name)
            future.set_result(ControlResult())
        elif isinstance(op, PinAdapter):
            future.set_result(ControlResult(slot=self.tiers.pin(op.name, op.pinned)))
        else:
            raise AdapterNotFoundError(f"{op!r}: the fake engine has no active adapter")

    def _read(self, path: Path) -> Known:
        """An adapter's rank from its config, its identity from its weights file."""
        rank = int(json.loads((path / "adapter_config.json").read_text())["r"])
        sha = hashlib.sha256((path / "adapter_model.safetensors").read_bytes()).hexdigest()
        return Known(next(self._ids), rank, sha, rank * BYTES_PER_RANK)


async def run_pod(port: int, engine: FakeFastEngine, stream_interval: int = 1) -> None:
    """A real model-pod server (grpc.aio, AsyncEngine thread, servicers, metrics) over `engine`,
    until SIGTERM."""
    from model_service.pod import server
    from model_service.pod.state import ModelPod
    from spindle import serving, telemetry

    pod = ModelPod("fake-fast-engine", drain_timeout=1.0, stream_interval=stream_interval)
    srv = await server.start(pod, "127.0.0.1", port, 0, telemetry.tracer_provider_from_env("bench-pod"))
    await pod.load(lambda: engine)
    serving.on_shutdown_signal(pod.request_exit)
    await pod.exit_requested.wait()
    await srv.stop(0)
    pod.close()
