"""`EngineHandle`: everything the model pod and `AsyncEngine` may use of an engine, as one typed protocol.

`AsyncEngine` drives an engine through it on the engine thread, and the pod reaches the engine
only through that, so any engine that offers it can be served: the real `Engine`, or the fake
fast engine of `bench/gateway.py`. Nothing else is probed for: no `hasattr`, no reaching into
`engine.model`.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

from model_service.engine.config import EngineConfig
from model_service.engine.engine import AdapterMemory, EngineStats
from model_service.engine.requests import Resume
from model_service.engine.sampling_params import SamplingParams
from model_service.engine.sequence import RequestOutput
from model_service.lora.control import ControlOp, ControlResult
from model_service.lora.pool import AdapterInfo
from model_service.models.tokenizer import Tokenizer


class EngineHandle(Protocol):
    @property
    def config(self) -> EngineConfig: ...

    @property
    def adapter_memory(self) -> AdapterMemory:
        """The adapters' device memory (the LoRA pool's byte counts); read on the engine thread."""
        ...

    @property
    def max_model_len(self) -> int:
        """The longest prompt + output a request may have."""
        ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def tokenizer(self) -> Tokenizer | None:
        """None for token-id serving. The pod names logprob tokens with it (`decode` is pure)."""
        ...

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
        """Validate and queue a request; raises a SpindleError (see `pod.status`) and changes nothing.
        `resume`: output another pod already streamed; only what follows it is produced."""
        ...

    def step(self) -> list[RequestOutput]: ...

    def abort(self, request_id: str) -> bool: ...

    def has_unfinished(self) -> bool: ...

    def stats(self) -> EngineStats: ...

    def list_adapters(self) -> list[AdapterInfo]: ...

    def on_lost(self, callback: Callable[[str], None]) -> None:
        """Call `callback(why)` from any thread if the engine can no longer serve (a lost rank)."""
        ...

    def submit_control(self, op: ControlOp) -> Future[ControlResult]:
        """Queue an adapter operation; it runs between two steps."""
        ...
