"""One request's life in the engine: its tokens, its settings, its KV state and its output."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from model_service.engine.beam_search import BeamGroup
from model_service.engine.cache_manager import SwappedState
from model_service.engine.detokenizer import IncrementalDetokenizer
from model_service.engine.sampler import TokenLogprobs
from model_service.engine.sampling_params import SamplingParams
from model_service.engine.seq_state import SequenceState


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """What one step produced for one request. `text`/`token_ids` are cumulative; `new_*` are the delta."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    error: str | None = None
    first_scheduled_at: float | None = None  # time.monotonic() of the first step that ran it


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        detokenizer: IncrementalDetokenizer,
        arrival: int,
        priority: int = 0,
        device: torch.device | None = None,
    ) -> None:
        self.request_id = request_id
        self.token_ids = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self.params = params
        self.detokenizer = detokenizer
        self.arrival = arrival  # monotonically increasing admission counter
        self.priority = priority  # lower value = served first (vLLM's convention)
        self.status = Status.WAITING
        self.state: SequenceState | None = None
        self.swapped: SwappedState | None = None  # host copy of the KV while swapped out
        self.adapter_name: str | None = None  # the LoRA adapter requested (None = base model)
        self.adapter_id = 0  # content identity of the weights serving it (0 = base model)
        self.created = time.monotonic()
        self.first_scheduled_at: float | None = None  # end of its queue wait
        self.group: BeamGroup | None = None  # set for the beams of a beam-search request
        self.beam_logits: torch.Tensor | None = None  # this beam's next-token logits, awaiting siblings
        self.spec_tokens: list[int] = []  # proposed continuation to verify in its next step
        self.spec_probs: torch.Tensor | None = None  # the draft's q for each (None: point masses)
        self.in_flight = 0  # tokens sampled on the device and not yet appended (engine/overlap.py)
        self.text = ""
        self.emitted_tokens = 0
        self.emitted_chars = 0
        self.emitted_logprobs = 0
        self.logprobs: list[TokenLogprobs] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.error: str | None = None
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator(device=device or "cpu")
            self.generator.manual_seed(params.seed)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens  # without copying `output_ids`

    @property
    def num_computed(self) -> int:
        return self.state.num_computed if self.state is not None else 0

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the KV cache (1 for a sequence in decode)."""
        return len(self.token_ids) + self.in_flight - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def sort_key(self) -> tuple[int, int]:
        return (self.priority, self.arrival)

    def fork(self) -> Sequence:
        """A sibling beam: same request and tokens so far; the caller gives it KV state."""
        child = Sequence(
            self.request_id,
            self.token_ids[: self.num_prompt_tokens],
            self.params,
            self.detokenizer,
            self.arrival,
            self.priority,
        )
        child.token_ids = list(self.token_ids)
        child.adapter_name, child.adapter_id = self.adapter_name, self.adapter_id
        child.group, child.status = self.group, self.status
        child.first_scheduled_at = self.first_scheduled_at
        return child

    def take_output(self) -> RequestOutput:
        """The delta since the last call. Text that could still become a stop string is held back."""
        hold = 0 if self.finished or not self.params.stop else max(map(len, self.params.stop)) - 1
        end = max(self.emitted_chars, len(self.text) - hold)
        output_ids = self.output_ids  # a fresh copy: the output keeps it as the sequence grows
        out = RequestOutput(
            request_id=self.request_id,
            new_token_ids=output_ids[self.emitted_tokens :],
            new_text=self.text[self.emitted_chars : end],
            token_ids=output_ids,
            text=self.text,
            finished=self.finished,
            finish_reason=self.finish_reason,
            num_prompt_tokens=self.num_prompt_tokens,
            new_logprobs=self.logprobs[self.emitted_logprobs :],
            stop_reason=self.stop_reason,
            error=self.error,
            first_scheduled_at=self.first_scheduled_at,
        )
        self.emitted_tokens, self.emitted_chars = len(output_ids), end
        self.emitted_logprobs = len(self.logprobs)
        return out
