"""The engine's adapter duties: control operations and the adapters waiting requests need.

Both run at the start of a step, a quiescent point (no forward pass in flight), so slot
contents change only between passes. Control operations come from other threads through a
queue; each answers its caller's future. Demand comes from the scheduler: a waiting request
whose adapter has no slot. Its adapter is promoted from host or disk when a slot is idle; the
request keeps waiting while every slot is busy, and fails once it has waited
`adapter_wait_timeout_s` or its adapter cannot be loaded at all.
"""

from __future__ import annotations

import queue
import time
from concurrent.futures import Future

from model_service.engine.scheduler import Scheduler
from model_service.engine.sequence import Sequence
from model_service.lora.adapter import AdapterError
from model_service.lora.control import ControlOp, ControlResult, execute
from model_service.lora.pool import LoraPool, SlotsBusyError


class AdapterControl:
    def __init__(self, pool: LoraPool, scheduler: Scheduler, wait_timeout_s: float) -> None:
        self.pool, self.scheduler, self.wait_timeout_s = pool, scheduler, wait_timeout_s
        self._control: queue.Queue[tuple[ControlOp, Future[ControlResult]]] = queue.Queue()

    def submit(self, op: ControlOp) -> Future[ControlResult]:
        """Queue an operation (thread-safe); it runs at the start of the next step."""
        future: Future[ControlResult] = Future()
        self._control.put((op, future))
        return future

    def has_work(self) -> bool:
        """Whether `at_quiescent_point` has operations to run or adapters to promote."""
        return not self._control.empty() or bool(self.scheduler.adapter_demand)

    def at_quiescent_point(self) -> list[Sequence]:
        """Run queued operations and promote demanded adapters. Returns the waiting requests that
        must fail (their `error` says why); the caller finishes them."""
        while not self._control.empty():
            op, future = self._control.get_nowait()
            try:
                future.set_result(execute(op, self.pool))
            except Exception as e:  # a failed operation fails its caller, not the engine
                future.set_exception(e)
        return self._serve_demand()

    def _serve_demand(self) -> list[Sequence]:
        demand, self.scheduler.adapter_demand = self.scheduler.adapter_demand, {}
        failed: dict[str, str] = {}
        for name in demand:
            try:
                self.pool.load(name)
            except SlotsBusyError:
                pass  # its requests keep waiting, up to the deadline
            except AdapterError as e:
                failed[name] = str(e)
        deadline = time.monotonic() - self.wait_timeout_s
        doomed = []
        for seq in self.scheduler.waiting:
            name = seq.adapter_name
            if name is None or self.pool.slot_of(name) is not None:
                continue
            if name in failed or seq.created < deadline:
                reason = failed.get(name, f"no LoRA slot freed within {self.wait_timeout_s:g} s")
                seq.error = f"adapter {name!r} could not be loaded: {reason}"
                doomed.append(seq)
        return doomed
