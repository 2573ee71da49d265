"""Beam search over ordinary sequences that share KV blocks.

A beam request starts as one sequence (its prompt prefill). Each time every live beam has its
next-token logits, `BeamGroup.advance` picks the next beams exactly as HF `generate` does
(`num_beams`, `length_penalty`, `early_stopping` with its heuristics): the top
max(2, 1 + #eos) * num_beams continuations over all beams; those ending in EOS (or at the
length limit) among the top num_beams become finished hypotheses, scored by
sum_logprobs / generated_len ** length_penalty; the best num_beams others continue.

This module is the algorithm only; engine/beams.py runs it over live sequences (forks that
share KV blocks, copy-on-write), advancing a group once all its live beams have logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class BeamHypothesis:
    token_ids: list[int]  # generated tokens only
    score: float


@dataclass
class BeamChoice:
    """One continuing beam: extend parent beam `parent` with `token`; cumulative log-prob `score`."""

    parent: int
    token: int
    score: float


@dataclass
class BeamGroup:
    request_id: str
    num_beams: int
    length_penalty: float
    early_stopping: bool | str
    max_tokens: int
    eos_token_ids: set[int]
    scores: list[float] = field(default_factory=lambda: [0.0])  # cumulative log-prob per live beam
    finished: list[BeamHypothesis] = field(default_factory=list)
    generated: int = 0  # tokens generated so far by every live beam
    improvable: bool = True  # HF's is_early_stop_heuristic_unsatisfied
    done: bool = False
    restarted: bool = False  # started over once for lack of K/V blocks (engine/beams.py)

    def restart(self) -> None:
        """Back to the first step, as if the search had just been admitted."""
        self.scores, self.finished, self.generated = [0.0], [], 0
        self.improvable, self.done, self.restarted = True, False, True

    def advance(self, logits: torch.Tensor, outputs: list[list[int]]) -> list[BeamChoice]:
        """logits: [live beams, vocab]; outputs: each live beam's generated tokens so far.
        Returns the next live beams (empty once the search is done)."""
        vocab = logits.shape[1]
        scores = (
            torch.log_softmax(logits.float(), dim=-1)
            + torch.tensor(self.scores, device=logits.device)[:, None]
        )
        keep = max(2, 1 + len(self.eos_token_ids)) * self.num_beams
        top_scores, top_index = scores.reshape(-1).topk(min(keep, scores.numel()))
        new_len = self.generated + 1
        at_limit = new_len >= self.max_tokens
        candidates = [
            (float(s), int(i) // vocab, int(i) % vocab) for s, i in zip(top_scores, top_index, strict=True)
        ]
        stops = [at_limit or tok in self.eos_token_ids for _, _, tok in candidates]

        full = len(self.finished) >= self.num_beams and self.early_stopping is True
        if self.improvable and not full:
            for rank, ((score, beam, tok), stop) in enumerate(zip(candidates, stops, strict=True)):
                if stop and rank < self.num_beams:
                    self._add_finished(outputs[beam] + [tok], score / new_len**self.length_penalty)

        running = [c for c, stop in zip(candidates, stops, strict=True) if not stop][: self.num_beams]
        self.generated = new_len
        self.scores = [score for score, _, _ in running]
        if running:
            self._update_improvable(running[0][0])
        all_finished = len(self.finished) >= self.num_beams
        self.done = not self.improvable or (all_finished and self.early_stopping is True) or all(stops)
        if self.done:
            return []
        return [BeamChoice(beam, tok, score) for score, beam, tok in running]

    def _add_finished(self, tokens: list[int], score: float) -> None:
        self.finished.append(BeamHypothesis(tokens, score))
        self.finished.sort(key=lambda h: -h.score)
        del self.finished[self.num_beams :]

    def _update_improvable(self, best_running: float) -> None:
        if len(self.finished) < self.num_beams:
            return  # an empty hypothesis slot can always be filled
        if self.early_stopping == "never" and self.length_penalty > 0:
            length = self.max_tokens
        else:
            length = self.generated
        best_possible = best_running / length**self.length_penalty
        self.improvable = self.improvable and best_possible > self.finished[-1].score

    def best(self) -> BeamHypothesis:
        return self.finished[0] if self.finished else BeamHypothesis([], -math.inf)
