"""One request's life in the engine: its tokens, its settings, its KV state and its output."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from model_service.engine.beam_search import BeamGroup
from model_service.engine.detokenizer import IncrementalDetokenizer
from model_service.engine.grammar import Constraint
from model_service.engine.sampler import TokenLogprobs
from model_service.engine.sampling_params import SamplingParams
from model_service.engine.seq_state import SequenceState


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


# A request's output ids as of one step, (source, start, end): `source[start:end]` of the
# sequence's own token list, which only ever grows (a forked beam gets a new list). Copied only
# when read: copying the whole output into every step's output cost O(output length) per
# sequence per step. A plain tuple: a NamedTuple's constructor is a Python call.
OutputIds = tuple[list[int], int, int]


class RequestOutput:
    """What one step produced for one request. `text`/`token_ids` are cumulative; `new_*` are the delta."""

    __slots__ = (
        "_token_ids",
        "error",
        "finish_reason",  # "stop" | "length" | "abort" | "error" | "capacity"
        "finished",
        "first_scheduled_at",  # time.monotonic() of the first step that ran it
        "new_logprobs",
        "new_text",
        "new_token_ids",
        "num_prompt_tokens",
        "request_id",
        "stop_reason",  # the stop string or token id that ended it
        "text",
    )

    def __init__(
        self,
        request_id: str,
        new_token_ids: list[int],
        new_text: str,
        token_ids: list[int] | OutputIds,
        text: str,
        finished: bool,
        finish_reason: str | None,
        num_prompt_tokens: int,
        new_logprobs: list[TokenLogprobs] | None = None,
        stop_reason: str | int | None = None,
        error: str | None = None,
        first_scheduled_at: float | None = None,
    ) -> None:
        self.request_id, self.new_token_ids, self.new_text = request_id, new_token_ids, new_text
        self._token_ids, self.text, self.finished = token_ids, text, finished
        self.finish_reason, self.num_prompt_tokens = finish_reason, num_prompt_tokens
        self.new_logprobs = new_logprobs if new_logprobs is not None else []
        self.stop_reason, self.error, self.first_scheduled_at = stop_reason, error, first_scheduled_at

    @property
    def token_ids(self) -> list[int]:
        ids = self._token_ids
        if isinstance(ids, tuple):
            source, start, end = ids
            ids = self._token_ids = source[start:end]
        return ids

    def __repr__(self) -> str:
        names = [slot.lstrip("_") for slot in self.__slots__]  # `token_ids`, not its lazy form
        return "RequestOutput(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in names) + ")"


@dataclass
class Proposal:
    """Tokens to verify, and the distribution each was drawn from: `probs` [len(tokens), vocab]
    (row i is q for token i), or None for tokens chosen deterministically (argmax, lookup)."""

    tokens: list[int]
    probs: torch.Tensor | None = None


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
        self.adapter_name: str | None = None  # the LoRA adapter requested (None = base model)
        self.adapter_id = 0  # content identity of the weights serving it (0 = base model)
        self.first_scheduled_at: float | None = None  # end of its queue wait
        # When the scheduler first found it waiting for its adapter (not resident, or draining);
        # None once its adapter can serve it. Starvation is measured from here (engine/adapters.py).
        self.adapter_blocked_since: float | None = None
        self.group: BeamGroup | None = None  # set for the beams of a beam-search request
        self.beam_logits: torch.Tensor | None = None  # this beam's next-token logits, awaiting siblings
        self.proposal: Proposal | None = None  # to verify in its next step (engine/speculation.py)
        self.in_flight = 0  # tokens sampled on the device and not yet appended (engine/overlap.py)
        # Its structured output's matcher (engine/grammar.py); it waits in the queue until ready.
        self.constraint: Constraint | None = None
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
        """Tokens not yet in the KV cache (1 for a sequence in decode); 0 once the token on the
        device is its last by `max_tokens`, so that async scheduling gives it no row that would
        be computed and dropped (a stop token cannot be foreseen; that row is still paid)."""
        computed = self.state.num_computed if self.state is not None else 0  # hot: no property hop
        total = len(self.token_ids) + self.in_flight
        if self.in_flight and total - self.num_prompt_tokens >= self.params.max_tokens:
            return 0
        return total - computed

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def sort_key(self) -> tuple[int, int]:
        return (self.priority, self.arrival)

    def fork(self) -> Sequence:
        """A sibling beam: same request and tokens so far; the caller gives it KV state."""
        child = self.from_prompt()
        child.token_ids = list(self.token_ids)
        child.group, child.status = self.group, self.status
        return child

    def from_prompt(self) -> Sequence:
        """The same request (prompt, adapter, place in the queue) with no output and no state:
        a beam search started over (engine/beams.py) or a fork's base."""
        twin = Sequence(
            self.request_id,
            self.token_ids[: self.num_prompt_tokens],
            self.params,
            self.detokenizer,
            self.arrival,
            self.priority,
        )
        twin.adapter_name, twin.adapter_id = self.adapter_name, self.adapter_id
        twin.first_scheduled_at = self.first_scheduled_at
        return twin

    def take_output(self) -> RequestOutput:
        """The delta since the last call. Text that could still become a stop string is held back."""
        finished, stop = self.status is Status.FINISHED, self.params.stop
        hold = max(map(len, stop)) - 1 if stop and not finished else 0
        end = max(self.emitted_chars, len(self.text) - hold)
        ids, first = self.token_ids, self.num_prompt_tokens
        out = RequestOutput(
            self.request_id,
            ids[first + self.emitted_tokens :],
            self.text[self.emitted_chars : end],
            (ids, first, len(ids)),
            self.text,
            finished,
            self.finish_reason,
            first,
            self.logprobs[self.emitted_logprobs :],
            self.stop_reason,
            self.error,
            self.first_scheduled_at,
        )
        self.emitted_tokens, self.emitted_chars = len(ids) - first, end
        self.emitted_logprobs = len(self.logprobs)
        return out
