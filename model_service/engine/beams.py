"""Runs beam search (beam_search.BeamGroup) over live sequences.

A beam request starts as one sequence. Each beam reports its next-token logits as its row comes
out of a step; once every live beam of a group has reported, the group advances: the first
child of a parent continues as the parent, later children are forks that share the parent's
KV blocks (the cache manager copies a shared partial block before a beam writes into it), and
parents with no child leave. Beams wait for their siblings (one can be preempted alone).
"""

from __future__ import annotations

import logging

import torch

from model_service.engine.beam_search import BeamGroup
from model_service.engine.detokenizer import IncrementalDetokenizer
from model_service.engine.scheduler import Scheduler
from model_service.engine.sequence import RequestOutput, Sequence, by_rank
from model_service.errors import CapacityError
from model_service.models.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class BeamSearch:
    def __init__(self, scheduler: Scheduler, tokenizer: Tokenizer | None) -> None:
        self.scheduler, self.tokenizer = scheduler, tokenizer
        self.live: dict[str, list[Sequence]] = {}  # request id -> live beams, in the group's score order
        self.logits: dict[Sequence, torch.Tensor] = {}  # each beam's next-token logits, awaiting siblings

    def start(self, root: Sequence, eos_token_ids: set[int], max_model_len: int) -> None:
        """Start `root`'s request as a search of `root.params.num_beams` beams."""
        p = root.params
        max_tokens = min(p.max_tokens, max_model_len - root.num_prompt_tokens)
        # A stop token ends a hypothesis as EOS does (HF's list of eos_token_id), ignore_eos or not.
        eos = set(p.stop_token_ids) | (set() if p.ignore_eos else eos_token_ids)
        group = BeamGroup(root.request_id, p.num_beams, p.length_penalty, p.early_stopping, max_tokens, eos)
        self._track(root, group)

    def _track(self, root: Sequence, group: BeamGroup) -> None:
        root.group = group
        self.live[group.request_id] = [root]

    def report(self, rows: list[tuple[Sequence, torch.Tensor]]) -> list[RequestOutput]:
        """Record each beam's logits; advance every group whose beams have all reported.
        Returns the final outputs of the groups that finished."""
        for seq, logits in rows:
            self.logits[seq] = logits
        finished = []
        for group in {id(s.group): s.group for s, _ in rows if s.group is not None}.values():
            beams = self.live[group.request_id]
            if not all(self._reported(b) for b in beams):
                continue
            try:
                if not self._advance(group, beams):
                    finished.append(self.finish(group, "length"))
            except CapacityError as e:
                log.warning("request %s: %s", group.request_id, e)
                finished.append(self.finish(group, "capacity", str(e)))
            except Exception as e:  # one beam request's fault fails that request only
                log.exception("beam search for %s failed", group.request_id)
                finished.append(self.finish(group, "error", f"beam search failed: {e}"))
        return finished

    def _reported(self, beam: Sequence) -> bool:
        """Whether `beam`'s logits are in and still its own: a beam preempted since it reported
        has tokens to recompute (its logits come again once it has)."""
        return beam in self.logits and beam.num_pending == 0

    def _advance(self, group: BeamGroup, parents: list[Sequence]) -> bool:
        """One search step; False once the search is done. Parents with no child leave before the
        forks are made, so that a search never holds more than its beams' K/V and state slots
        (a hybrid model's fork takes a recurrent-state slot: forking first needed one slot more
        per dropped parent, and failed where the beams themselves fit)."""
        logits = torch.stack([self.logits.pop(b) for b in parents])
        choices = group.advance(logits, [b.output_ids for b in parents])
        if group.done:
            return False
        kept = {c.parent for c in choices}
        for i, parent in enumerate(parents):
            if i not in kept:
                self.scheduler.remove(parent)
        self._check_state_slots(group, len(choices) - len(kept))
        children, taken = [], set()
        for c in choices:
            if c.parent in taken:
                child = self.scheduler.fork(parents[c.parent])
            else:
                child = parents[c.parent]
                taken.add(c.parent)
            children.append((child, c.token))
        for child, token in children:  # extend only after every fork copied its parent's tokens
            child.token_ids.append(token)
        self.live[group.request_id] = [child for child, _ in children]
        return True

    def _check_state_slots(self, group: BeamGroup, forks: int) -> None:
        """Raise CapacityError if a model with recurrent layers has no state slot left for each
        of `forks` new beams (they are taken by other requests' sequences and checkpoints)."""
        cache = self.scheduler.cache
        if cache.can_allocate(forks):
            return
        raise CapacityError(
            f"beam search of {group.num_beams} beams needs a recurrent-state slot per beam, and "
            f"{cache.num_spare_state_slots} of this engine's {cache.num_state_slots} are free for it "
            "(--max-num-seqs sets how many there are): ask for fewer beams, or retry"
        )

    def restart(self, group: BeamGroup) -> Sequence:
        """Start `group`'s search over from its prompt: free every live beam and queue one new
        root (returned), in the search's old place. Its output is unchanged (the search is
        deterministic); the compute is paid again, the prompt's blocks mostly from the prefix
        cache. Beams preempted one by one come back without the blocks they shared (each is
        recomputed on its own), so a search can stall after a preemption although it fits when
        it runs whole: on 28 blocks of 4, two searches of 8 beams of 40 tokens (the older ran,
        preempting the younger's beams; those beams then stalled it)."""
        beams = self.live[group.request_id]
        self._drop(beams)
        root = beams[0].from_prompt()
        group.restart()
        self._track(root, group)
        self.scheduler.requeue(root)
        return root

    def unstall(self, running: list[Sequence]) -> Sequence | RequestOutput | None:
        """Called when nothing was scheduled and nothing is in flight, yet `running` sequences
        run: they are beams waiting for siblings that cannot be admitted, because the K/V blocks
        they need are held by running beams, which wait too. Nothing would free them, and the
        pod would hang (holding those blocks from every other request). So the youngest stalled
        search starts over from its prompt, whole (`restart`: beams preempted one by one may be
        what stalls it); if it stalls again, it cannot run as it is. On 28 blocks of 4, two
        searches of 8 beams of 40 tokens now both finish, where the younger used to end; on 24
        the older, which cannot run even alone, ends and the younger finishes (it used to end
        too). Returns the sequence that now stands for the request: the restarted search's new
        root, or the final output of the search that cannot run ("capacity"); None when no beam
        is running."""
        stalled = [s for s in running if s.group is not None and self.is_live(s.group)]
        if not stalled:
            return None
        beam = max(stalled, key=by_rank)
        group = beam.group
        assert group is not None
        if not group.restarted:
            log.info("request %s: beam search starts over, for lack of K/V blocks", group.request_id)
            return self.restart(group)
        cache = self.scheduler.cache
        error = (
            f"beam search of {group.num_beams} beams needs more K/V cache at once than is free for "
            f"it (this engine has {cache.num_total_blocks} blocks of {cache.block_size} tokens): "
            "ask for fewer beams or fewer max_tokens, or retry"
        )
        log.warning("request %s: %s", group.request_id, error)
        return self.finish(group, "capacity", error)

    def is_live(self, group: BeamGroup) -> bool:
        """Whether `group`'s search is still on (its request id may since name a new request)."""
        beams = self.live.get(group.request_id)
        return beams is not None and beams[0].group is group

    def finish(self, group: BeamGroup, reason: str, error: str | None = None) -> RequestOutput:
        """End the search: free every live beam; the output is the best finished hypothesis.
        Its error: `error`, else the first a beam's failure set (engine/request_table.py)."""
        beams = self.live.pop(group.request_id)
        self._drop(beams)
        best = group.best()
        ids = best.token_ids
        stop = ids[-1] if ids and ids[-1] in group.eos_token_ids else None
        if reason == "length" and stop is not None:
            reason = "stop"
        errors = [e for e in [error, *(b.output.error for b in beams)] if e]
        text = self._text(beams[0], ids, stop)
        return RequestOutput(
            request_id=group.request_id,
            new_token_ids=ids,
            new_text=text,
            token_ids=ids,
            text=text,
            finished=True,
            finish_reason=reason,
            num_prompt_tokens=beams[0].num_prompt_tokens,
            stop_reason=stop if reason == "stop" else None,
            error=errors[0] if errors else None,
            first_scheduled_at=beams[0].admission.first_scheduled_at,
        )

    def _text(self, beam: Sequence, ids: list[int], stop: int | None) -> str:
        """The text of output `ids` as a sampled request's would be (engine/output_processor.py),
        so that num_beams does not change how the same tokens read: decoded after the prompt, with
        the request's skip_special_tokens, and without its stop token's text unless
        include_stop_str_in_output."""
        if self.tokenizer is None:
            return ""
        p = beam.params
        if stop is not None and not p.include_stop_str_in_output:
            ids = ids[:-1]
        prompt = beam.token_ids[: beam.num_prompt_tokens]
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt, p.skip_special_tokens)
        return "".join(detokenizer.push(t) for t in ids) + detokenizer.flush()  # the output has ended

    def _drop(self, beams: list[Sequence]) -> None:
        """Free `beams` (finished, through the scheduler) and forget their logits."""
        for beam in beams:
            self.scheduler.remove(beam)
            self.logits.pop(beam, None)
