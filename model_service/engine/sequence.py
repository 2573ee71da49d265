"""One request in the engine: its identity, tokens, params and status (`Sequence`), the small
records that the units owning each concern write (`Admission`, `Emission`, `Sampling`), and
the output a step hands back for it (`RequestOutput`)."""

from __future__ import annotations

import enum
import operator

import torch

from model_service.engine.beam_search import BeamGroup
from model_service.engine.detokenizer import IncrementalDetokenizer
from model_service.engine.grammar import Constraint
from model_service.engine.logits_processors import LogitsProcessors
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
        "finish_reason",  # "stop" | "length" | "abort" | "error" | "capacity" | "invalid"
        "finished",
        "first_scheduled_at",  # time.monotonic() of the first step that ran it
        "new_logprobs",
        "new_text",
        "new_token_ids",
        "num_prompt_tokens",
        "prompt_logprobs",  # each prompt token's after the first, in the request's first output only
        "prompt_token_ids",  # the prompt, beside `prompt_logprobs` only (else None)
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
        prompt: tuple[list[int], list[TokenLogprobs]] | None = None,
    ) -> None:
        """`prompt`: the prompt's ids and the logprobs of all but its first (`prompt_logprobs`)."""
        self.request_id, self.new_token_ids, self.new_text = request_id, new_token_ids, new_text
        self.prompt_token_ids, self.prompt_logprobs = prompt if prompt is not None else (None, None)
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


class Emission:
    """What a request has produced, and how much of it its caller has been sent. Written by the
    output processor (appending tokens, stop conditions, `take_output`) and the request table
    (how a request ended: `finish_reason`, `error`)."""

    __slots__ = (
        "detokenizer",
        "error",
        "finish_reason",
        "logprobs",
        "prompt_logprobs",
        "prompt_logprobs_sent",
        "sent_chars",
        "sent_logprobs",
        "sent_tokens",
        "stop_reason",
        "text",
    )

    def __init__(self, detokenizer: IncrementalDetokenizer) -> None:
        self.detokenizer = detokenizer
        self.text = ""
        self.logprobs: list[TokenLogprobs] = []
        self.sent_tokens = self.sent_chars = self.sent_logprobs = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None  # the stop string or token id that ended it
        self.error: str | None = None
        # With `prompt_logprobs`: those of prompt tokens 1, 2, ... as the prefill computes them
        # (engine/prompt_logprobs.py); sent once, in the first output after the last of them.
        self.prompt_logprobs: list[TokenLogprobs] | None = None
        self.prompt_logprobs_sent = False


class Admission:
    """A request's way into the running batch: its place in the queue and what its adapter asks
    of admission. Written by the scheduler (engine/adapters.py reads the waits it records)."""

    __slots__ = ("adapter", "adapter_id", "blocked_since", "first_scheduled_at", "held_slot", "rank")

    def __init__(self, priority: int, arrival: int, adapter: str | None) -> None:
        # Lower runs first: priority (vLLM's convention: lower value = served first), then
        # arrival, the engine's admission counter.
        self.rank = (priority, arrival)
        self.adapter = adapter  # the LoRA adapter requested (None = base model)
        self.adapter_id = 0  # content identity of the weights serving it (0 = base model)
        # The LoRA slot a preempted request keeps its reference on (-1 = none): it resumes on the
        # weights it began with, whatever its adapter's name means by then (engine/scheduler.py).
        self.held_slot = -1
        # When the scheduler first found it waiting for its adapter (not resident, or draining);
        # None once its adapter can serve it. Starvation is measured from here (engine/adapters.py).
        self.blocked_since: float | None = None
        self.first_scheduled_at: float | None = None  # end of its queue wait


class Sampling:
    """What drawing the request's next token takes beyond its params and tokens: a seeded
    request's generator, its logits processors, and its structured output's matcher
    (engine/grammar.py; set by the grammar wait, engine/requests.py, while the request waits for
    it to compile)."""

    __slots__ = ("constraint", "generator", "processors")

    def __init__(self, seed: int | None, device: torch.device | None) -> None:
        self.constraint: Constraint | None = None
        # logit_bias, allowed ids, min_tokens, bad words (engine/logits_processors.py; set at admission)
        self.processors: LogitsProcessors | None = None
        self.generator: torch.Generator | None = None
        if seed is not None:
            self.generator = torch.Generator(device=device or "cpu")
            self.generator.manual_seed(seed)


# The order of the queues: lower runs first (`Admission.rank`); a C call, no Python frame.
by_rank = operator.attrgetter("admission.rank")


class Sequence:
    """One request in the engine: its identity, tokens, params and status; its KV state is the
    scheduler's (`state`), and each concern's state a small record that its owner writes (each
    record's docstring names it; docs/architecture.md has the table). What a feature keeps
    beside it lives in that feature's unit, keyed by the sequence (proposals, beam logits).
    `__slots__`: a decode step at batch 256 reads
    these 256 times over, and nothing can be added from outside."""

    __slots__ = (
        "admission",  # Admission: the scheduler's
        "group",  # the beam search it is a beam of (engine/beams.py), else None
        "in_flight",  # tokens sampled on the device, not yet appended (engine/overlap.py)
        "num_prompt_tokens",
        "output",  # Emission: the output processor's
        "params",
        "request_id",
        "sampling",  # Sampling: generator and grammar matcher
        "state",  # SequenceState: the scheduler's, through the cache manager
        "status",
        "token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        detokenizer: IncrementalDetokenizer,
        arrival: int,
        priority: int = 0,
        device: torch.device | None = None,
        adapter: str | None = None,
    ) -> None:
        """`arrival`: the engine's admission counter; `adapter`: the LoRA adapter asked for."""
        self.request_id = request_id
        self.token_ids = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self.params = params
        self.status = Status.WAITING
        self.state: SequenceState | None = None
        self.admission = Admission(priority, arrival, adapter)
        self.output = Emission(detokenizer)
        if params.prompt_logprobs is not None:
            self.output.prompt_logprobs = []
        self.sampling = Sampling(params.seed, device)
        self.group: BeamGroup | None = None
        self.in_flight = 0

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

    def fork(self) -> Sequence:
        """A sibling beam: same request and tokens so far; the caller gives it KV state."""
        child = self.from_prompt()
        child.token_ids = list(self.token_ids)
        child.group, child.status = self.group, self.status
        return child

    def from_prompt(self) -> Sequence:
        """The same request (prompt, adapter, place in the queue) with no output and no state:
        a beam search started over (engine/beams.py) or a fork's base."""
        a = self.admission
        priority, arrival = a.rank
        prompt, detokenizer = self.token_ids[: self.num_prompt_tokens], self.output.detokenizer
        twin = Sequence(self.request_id, prompt, self.params, detokenizer, arrival, priority, None, a.adapter)
        twin.admission.adapter_id, twin.admission.first_scheduled_at = a.adapter_id, a.first_scheduled_at
        return twin
