"""Admission checks and prompt tokenization: everything a request must pass before it is queued;
and the wait of a queued request for its grammar's matcher.

Each refusal is an `InvalidRequestError`, `NotFoundError` or `CapacityError` whose message says
what to change; nothing is queued or allocated for a refused request.
"""

from __future__ import annotations

import json
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from model_service.engine.grammar import Constraint, GrammarCompiler, GrammarError
from model_service.engine.sampling_params import SamplingParams
from model_service.engine.sequence import Sequence
from model_service.errors import BeyondCapacityError, ContextLengthError, InvalidRequestError
from model_service.models.tokenizer import Tokenizer


@dataclass
class Resume:
    """Output another engine already produced for this request, which the caller has received:
    a pod that died mid-stream costs the caller nothing when the next one starts from here."""

    output_token_ids: list[int]
    text_chars: int = 0  # how much of the output text the caller has (Unicode code points)


class PromptReader:
    def __init__(
        self,
        tokenizer: Tokenizer | None,
        vocab_size: int,
        max_model_len: int,
        num_blocks: int,
        block_size: int,
        num_state_slots: int = 0,
    ):
        """`num_state_slots`: a hybrid model's recurrent-state slots (0: none, no recurrent layers)."""
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len
        self.max_kv_tokens, self.block_size = num_blocks * block_size, block_size
        self.num_state_slots = num_state_slots
        # Tokenizing costs time and memory in the text's length, on the engine thread (a 40 MB
        # prompt: 37 s with every stream of the pod stalled, and 3 GB), so a text too long for the
        # context is refused by its length first. Twice the most a context of the longest tokens
        # could hold: room for a normalizer that composes characters.
        self.max_prompt_chars = 2 * max_model_len * tokenizer.max_token_chars if tokenizer else 0

    def token_ids(
        self,
        prompt: str | None,
        messages: list[dict[str, Any]] | None,
        token_ids: list[int] | None,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The prompt as token ids, from exactly one of the three forms, checked against the context;
        `tools` and `template_kwargs` (with `messages` only) go to the chat template."""
        for name, value in (("tools", tools), ("chat_template_kwargs", template_kwargs)):
            if value is not None and messages is None:
                raise InvalidRequestError(f"`{name}` go to the chat template: send them with `messages`")
        ids = self._read(prompt, messages, token_ids, tools, template_kwargs)
        if token_ids is None:
            self._check_tokenized(ids)
        if len(ids) >= self.max_model_len:
            raise ContextLengthError(
                f"prompt has {len(ids)} tokens; this engine's context is {self.max_model_len} tokens "
                "and the prompt must leave room for at least one generated token",
                len(ids),
            )
        if len(ids) + 1 > self.max_kv_tokens:
            raise BeyondCapacityError(self._past_the_cache(f"prompt of {len(ids)} tokens", len(ids) + 1))
        return ids

    def _past_the_cache(self, what: str, tokens: int) -> str:
        return (
            f"{what} needs {tokens} tokens of K/V cache and this engine's whole cache holds "
            f"{self.max_kv_tokens} ({tokens - self.max_kv_tokens} too many): it can never run here"
        )

    def check_beams(self, params: SamplingParams, num_prompt_tokens: int) -> None:
        """A beam search that can never have all its beams at once is refused now: its beams
        share the prompt's full blocks and need one block each beside them from the first step
        (they waited for each other holding every block, and ended only after a restart)."""
        blocks = num_prompt_tokens // self.block_size + params.num_beams
        total = self.max_kv_tokens // self.block_size
        if params.num_beams > 1 and blocks > total:
            raise BeyondCapacityError(
                f"beam search of {params.num_beams} beams on a prompt of {num_prompt_tokens} tokens needs "
                f"at least {blocks} K/V blocks of {self.block_size} tokens and this engine has {total} "
                f"({blocks - total} too many): ask for fewer beams or a shorter prompt"
            )

    def check_state_slots(self, params: SamplingParams) -> None:
        """A hybrid model's beam search needs a recurrent-state slot per beam at once: more beams
        than the engine has slots can never run. It was queued, computed its prompt, and ended
        "capacity" (RESOURCE_EXHAUSTED, "retry") at its first fork, however idle the engine."""
        if self.num_state_slots and params.num_beams > self.num_state_slots:
            raise BeyondCapacityError(
                f"beam search of {params.num_beams} beams needs a recurrent-state slot per beam and "
                f"this engine has {self.num_state_slots} ({params.num_beams - self.num_state_slots} too "
                "many; --max-num-seqs sets how many there are): ask for fewer beams"
            )

    def check_room(self, resume: Resume | None, params: SamplingParams, num_prompt_tokens: int) -> None:
        """Refuse now what this engine can never hold: a beam search (its K/V blocks, its
        recurrent-state slots), a resume."""
        self.check_beams(params, num_prompt_tokens)
        self.check_state_slots(params)
        self.check_resume(resume, params, num_prompt_tokens)

    def check_resume(self, resume: Resume | None, params: SamplingParams, num_prompt_tokens: int) -> None:
        """A resume this request can continue from (if it has one): one stream, ids in the
        vocabulary, within max_tokens, and room in the KV cache to recompute prompt and output."""
        if resume is None:
            return
        if params.num_beams > 1:
            raise InvalidRequestError("resume continues one stream; beam search (num_beams > 1) has none")
        vocab = self.vocab_size
        bad = [t for t in resume.output_token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"resume.output_token_ids has ids outside [0, {vocab}): {bad[:5]}")
        if len(resume.output_token_ids) > params.max_tokens:
            raise InvalidRequestError(
                f"resume has {len(resume.output_token_ids)} output tokens, more than max_tokens "
                f"({params.max_tokens}): send the request's own max_tokens, not what is left of it"
            )
        if resume.text_chars < 0:
            raise InvalidRequestError(f"resume.text_chars must be >= 0, got {resume.text_chars}")
        total = num_prompt_tokens + len(resume.output_token_ids)
        if total + 1 > self.max_kv_tokens:
            raise BeyondCapacityError(
                self._past_the_cache(f"prompt and resumed output ({total} tokens)", total + 1)
            )

    def _read(
        self,
        prompt: str | None,
        messages: list[dict[str, Any]] | None,
        token_ids: list[int] | None,
        tools: list[dict[str, Any]] | None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        given = [x is not None for x in (prompt, messages, token_ids)]
        if sum(given) != 1:
            raise InvalidRequestError("give exactly one of `prompt`, `messages` or `prompt_token_ids`")
        if token_ids is not None:
            if not token_ids:
                raise InvalidRequestError("prompt_token_ids is empty")
            vocab = self.vocab_size
            bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(f"prompt_token_ids has ids outside [0, {vocab}): {bad[:5]}")
            return list(token_ids)
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer; send `prompt_token_ids`")
        if messages is not None:
            if not messages:
                raise InvalidRequestError("messages is empty")
            self._check_chars("messages", _chat_chars(messages, tools, template_kwargs))
            ids = self.tokenizer.apply_chat_template(messages, tools, template_kwargs)
            if not ids:  # e.g. a template that renders only user turns, given a system message
                raise InvalidRequestError("the model's chat template renders these messages as no tokens")
            return ids
        if not prompt:
            raise InvalidRequestError("prompt is empty")
        self._check_chars("prompt", len(prompt))
        ids = self.tokenizer.encode(prompt)
        if not ids:
            raise InvalidRequestError("prompt encodes to zero tokens")
        return ids

    def _check_tokenized(self, ids: list[int]) -> None:
        """A tokenizer may have more tokens than the model has embedding rows (tokens added to it
        without resizing the model): a prompt that spells one would fail the step, and with it
        every request batched with it (on a GPU, an out-of-bounds index may take the device)."""
        if not ids or max(ids) < self.vocab_size:
            return
        assert self.tokenizer is not None
        outside = sorted({t for t in ids if t >= self.vocab_size})
        names = self.tokenizer.hf.convert_ids_to_tokens(outside[:5])
        raise InvalidRequestError(
            f"the prompt has tokens this model has no embedding for (ids {outside[:5]}: {names}); its "
            f"tokenizer has tokens past the model's vocabulary of {self.vocab_size}"
        )

    def _check_chars(self, what: str, chars: int) -> None:
        if chars > self.max_prompt_chars:
            raise InvalidRequestError(
                f"{what} has {chars} characters; this engine's context is {self.max_model_len} tokens, "
                f"and a text of more than {self.max_prompt_chars} characters cannot fit it"
            )


def _chat_chars(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, template_kwargs: dict[str, Any] | None
) -> int:
    """The characters a chat's template renders from its caller: contents, calls, tools and the
    template's variables."""
    texts = ("content", "reasoning_content")
    chars = sum(len(str(m.get(k, ""))) for m in messages if isinstance(m, dict) for k in texts)
    calls = [m["tool_calls"] for m in messages if isinstance(m, dict) and m.get("tool_calls")]
    extra = [calls, tools, template_kwargs]
    return chars + (len(json.dumps(extra, default=str)) if calls or tools or template_kwargs else 0)


class GrammarWait:
    """Requests whose structured output waits for its matcher: the grammar compiles off the
    step's path (engine/grammar.py) and the request waits in the queue, the scheduler skipping
    it, until its matcher is started here."""

    def __init__(self, compiler: GrammarCompiler | None) -> None:
        self.compiler = compiler  # none without a tokenizer (token-id serving)
        self.waiting: list[Sequence] = []

    def check(self, params: SamplingParams) -> None:
        if params.structured_output is not None and self.compiler is None:
            raise InvalidRequestError(
                "structured_output needs the model's tokenizer, and this model has none"
            )

    def add(self, seq: Sequence) -> None:
        """Start compiling a queued request's grammar, if it has one."""
        if seq.params.structured_output is not None:
            assert self.compiler is not None  # `check` refused it otherwise
            seq.sampling.constraint = self.compiler.constraint(seq.params.structured_output)
            self.waiting.append(seq)

    def start_compiled(self) -> list[tuple[Sequence, str, str | None]]:
        """Start the matchers whose grammars have compiled, so their requests can be admitted.
        Returns the requests to finish, each with its reason and error: "stop" for a resumed
        output that was complete already, "invalid" (and why) for a grammar that does not compile
        for this vocabulary (a special token it lacks: the request's fault, so the pod answers
        INVALID_ARGUMENT, not INTERNAL), "error" for a resumed output the grammar refuses."""
        if not self.waiting:
            return []
        assert self.compiler is not None
        ended, waiting, gone = [], [], []
        for seq in self.waiting:
            constraint = seq.sampling.constraint
            if seq.finished or constraint is None:
                gone.append(constraint)
                continue
            try:
                if not self.compiler.poll(constraint, seq.output_ids):
                    waiting.append(seq)
                elif constraint.done:
                    ended.append((seq, "stop", None))
            except InvalidRequestError as e:
                ended.append((seq, "invalid", str(e)))
            except GrammarError as e:
                ended.append((seq, "error", str(e)))
        self.waiting = waiting
        self._release(gone)
        return ended

    def _release(self, gone: list[Constraint | None]) -> None:
        """The compiles of requests that ended while they waited (aborted, cancelled), where no
        waiting request shares them: not run, or not kept (`GrammarCompiler.release`)."""
        assert self.compiler is not None
        wanted = {s.sampling.constraint.grammar for s in self.waiting if s.sampling.constraint is not None}
        for constraint in gone:
            if constraint is not None and constraint.grammar not in wanted:
                self.compiler.release(constraint)

    def compiles(self) -> list[Future[Any]]:
        """The compiles the waiting requests wait for."""
        return [s.sampling.constraint.compiled for s in self.waiting if s.sampling.constraint is not None]
