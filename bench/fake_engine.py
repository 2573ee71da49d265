"""A fake fast engine for the serving benchmarks: the surface the model pod uses
(`model_service.pod.handle.EngineHandle`), no model behind it.

Every running request gets one token per step (ids 100, 101, ...; text "x" per token) and a
step sleeps `step_s`, so a benchmark measures the serving path (pod, gateway), not a model. It
serves the adapters it is given (all resident) and refuses a request with CapacityError
(RESOURCE_EXHAUSTED) when `max_running` requests are running already, as an overloaded pod does.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future

from model_service.engine.config import EngineConfig
from model_service.engine.engine import NOT_COUNTED, AdapterMemory, EngineStats
from model_service.engine.requests import Resume
from model_service.engine.sampling_params import SamplingParams
from model_service.engine.sequence import RequestOutput
from model_service.errors import CapacityError, NotFoundError
from model_service.lora.control import ControlOp, ControlResult
from model_service.lora.pool import AdapterInfo, AdapterNotFoundError


class FakeFastEngine:
    max_model_len = 4096
    vocab_size = 32000

    def __init__(self, step_s: float, adapters: tuple[str, ...] = (), max_running: int = 1 << 30) -> None:
        self.step_s, self.adapters, self.max_running = step_s, adapters, max_running
        self.config = EngineConfig(max_loras=len(adapters))
        self.running: dict[str, list] = {}  # request id -> [prompt length, max tokens, tokens, admitted]
        self._pending: list[RequestOutput] = []

    def add_request(self, prompt=None, *, messages=None, prompt_token_ids=None, params=None, request_id=None,
                    priority=0, adapter=None, resume: Resume | None = None) -> str:  # fmt: skip
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
