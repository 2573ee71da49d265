"""The engine, plus when each watched request first joined a step (the end of its queue wait).

Tracing splits a request's time into queue, prefill and decode. The first token marks the end
of prefill; the start of prefill is only visible inside the engine thread, right after a step
schedules the request. This subclass notes it there, for the requests the server watches.
"""

from __future__ import annotations

import time
from typing import Any

from model_service.engine.engine import Engine
from model_service.engine.sequence import RequestOutput


class TimedEngine(Engine):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Written on the engine thread, read and cleared on the event loop: single dict/set
        # operations, atomic under the GIL. Only watched ids are noted, so nothing leaks.
        self._watched: set[str] = set()
        self._admitted: dict[str, float] = {}

    def watch(self, request_id: str) -> None:
        self._watched.add(request_id)

    def admitted_at(self, request_id: str) -> float | None:
        """`time.monotonic()` at the start of the first step that ran this request."""
        return self._admitted.get(request_id)

    def forget(self, request_id: str) -> None:
        self._watched.discard(request_id)
        self._admitted.pop(request_id, None)

    def step(self) -> list[RequestOutput]:
        started = time.monotonic()
        outputs = super().step()
        if self._watched:
            # A request that finished within this step has left `running`; its output shows it ran.
            ran = [s.request_id for s in self.scheduler.running] + [
                o.request_id for o in outputs if o.new_token_ids
            ]
            for rid in ran:
                if rid in self._watched and rid not in self._admitted:
                    self._admitted[rid] = started
        return outputs
