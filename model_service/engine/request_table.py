"""The requests an engine serves, by id, and their way out: the "process outputs" stage.

A request's end has one owner. Tokens are appended here (through `OutputProcessor`: text, stop
conditions); a request that they finish, or that fails or is aborted, is freed here (its beams,
its cache through the scheduler, its proposals and what the proposer holds for it) and its final
output queued; the loop collects each step's outputs here.
"""

from __future__ import annotations

import logging

from model_service.engine.beams import BeamSearch
from model_service.engine.output_processor import OutputProcessor, take_output
from model_service.engine.sampler import TokenLogprobs
from model_service.engine.scheduler import Scheduler
from model_service.engine.sequence import RequestOutput, Sequence
from model_service.engine.speculation import Speculation

log = logging.getLogger(__name__)


class RequestTable:
    def __init__(
        self,
        scheduler: Scheduler,
        beams: BeamSearch,
        outputs: OutputProcessor,
        speculation: Speculation | None,
    ) -> None:
        self.scheduler, self.beams, self.outputs, self.speculation = scheduler, beams, outputs, speculation
        self.by_id: dict[str, Sequence] = {}  # each live request's sequence (a beam search's root)
        self._pending: list[RequestOutput] = []  # outputs for the next step to return

    def add(self, seq: Sequence) -> None:
        self.by_id[seq.request_id] = seq

    def emit(self, seq: Sequence, tokens: list[int], logprobs: TokenLogprobs | None) -> None:
        """Append tokens until one finishes the request."""
        try:
            for token in tokens:
                if self.outputs.append(seq, token, logprobs):
                    self.finish(seq, seq.output.finish_reason or "stop")
                    return
        except Exception as e:  # e.g. a tokenizer fault on this request's text
            log.exception("request %s failed", seq.request_id)
            self.finish(seq, "error", str(e))

    def finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """Free `seq` (all beams of its request) and queue its final output; `error` says why
        it failed. A request whose resumed output ended it was never added: only its output is left."""
        if error is not None:
            seq.output.error = error
        if seq.group is not None:
            if self.beams.is_live(seq.group):  # else ended already: several beams can be doomed at once
                self.ended(self.beams.finish(seq.group, reason))
            return
        self.scheduler.remove(seq)  # which marks it finished
        if self.speculation is not None:
            self.speculation.forget(seq)
        seq.output.finish_reason = reason
        self._pending.append(take_output(seq))
        self.by_id.pop(seq.request_id, None)

    def finish_scored_only(self, rows: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
        """A step's sampling rows less those of requests that asked for no output (`max_tokens`
        0, with prompt logprobs): their prompt is scored now; they finish "length" unsampled."""
        if all(seq.params.max_tokens for seq, _ in rows):
            return rows
        for seq, _ in rows:
            if not seq.params.max_tokens:
                self.finish(seq, "length")
        return [(seq, r) for seq, r in rows if seq.params.max_tokens]

    def ended(self, out: RequestOutput) -> None:
        """Queue a final output made elsewhere (a beam search that ended, a resumed output that
        was complete already); its request id is free again."""
        self.by_id.pop(out.request_id, None)
        self._pending.append(out)

    def fail(self, seqs: list[Sequence], error: str) -> None:
        """Finish each of `seqs` that still runs with `error`."""
        for seq in seqs:
            if not seq.finished:
                self.finish(seq, "error", error)

    def fail_in_flight(self, error: str) -> None:
        """After a failed step whose step before could not be read: a sequence whose token is lost
        fails rather than run on without it."""
        lost = [seq for seq in self.by_id.values() if seq.in_flight and not seq.finished]
        for seq in lost:
            seq.in_flight = 0
        self.fail(lost, error)

    def unstall(self, stalled: list[Sequence]) -> None:
        """The youngest search of `stalled` starts over, or ends ("capacity"): nothing was
        scheduled and nothing is in flight, yet sequences run (beams waiting for each other), or
        the scheduler found beams preempting themselves with no way on. None: nothing to do."""
        found = self.beams.unstall(stalled)
        if isinstance(found, RequestOutput):
            self.ended(found)
        elif found is not None:
            self.add(found)  # the restarted search's root

    def arrived(self, got: list[tuple[Sequence, int]]) -> list[Sequence]:
        """Append the tokens of a step read from the device (`Overlap.drain`); returns the
        sequences that got one."""
        for seq, token in got:
            self.emit(seq, [token], None)
        return [seq for seq, _ in got]

    def outputs_of(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """The new output of each sequence that produced tokens and goes on (once each)."""
        return [take_output(seq) for seq in dict.fromkeys(seqs) if not seq.finished]

    def report(self, seqs: list[Sequence]) -> None:
        """Queue `outputs_of(seqs)` for the next step to return."""
        self._pending += self.outputs_of(seqs)

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def take(self) -> list[RequestOutput]:
        """The queued outputs, in order; the queue is empty after."""
        out, self._pending = self._pending, []
        return out

    def withdraw(self, request_ids: list[str]) -> None:
        """Drop the queued outputs of `request_ids`: nobody awaits them."""
        self._pending = [o for o in self._pending if o.request_id not in request_ids]
