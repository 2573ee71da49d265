"""Structured output in the engine: grammars compiled off the step's critical path, one matcher per
constrained sequence, and the bitmask of the tokens each may take next.

The grammar engine is llguidance (docs/architecture.md "Structured output" says why). A request's
grammar is checked when it is read (engine/structured_output.py); compiling it against the
model's vocabulary runs on `GrammarCompiler`'s worker thread, so a step never waits for a
compile: the request waits in the waiting queue until its matcher is ready (the scheduler skips
it, the requests behind it are admitted), as a request waits for its adapter. Compiled grammars
are cached by their text (LRU), so a repeated schema starts at once: each request gets a copy of
the cached matcher. The llguidance view of the vocabulary (2 s for SmolLM2's 49k tokens, once
per tokenizer) is built by the first compile, on that thread too.

Each step the engine asks `allowed_tokens` for the constrained rows' bitmasks (computed on the
host, in parallel across rows by llguidance's executor; one pinned buffer, one copy to the
device), the sampler sets the forbidden logits to -inf on the device, and every appended token
advances its sequence's matcher (`Constraint.accept`). A matcher that can take nothing but EOS
ends its request ("stop"). With speculative decoding, proposals are cut at the first token the
grammar refuses before they are verified, and each verify row's k + 1 masks are computed by
advancing a copy of the matcher over the proposals (`verify_bitmask`).
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Iterable
from concurrent.futures import Future

import llguidance
import llguidance.hf

# llguidance.numpy, not llguidance.torch: the latter defines a torch.compile'd function at import,
# which imports dynamo and inductor (~5 s of CPU in every process that imports the engine).
import llguidance.numpy
import torch

from model_service.engine.sampler import AllowedTokens
from model_service.engine.structured_output import StructuredOutput, grammar_thread
from model_service.errors import InvalidRequestError
from model_service.models.tokenizer import Tokenizer


class GrammarError(RuntimeError):
    """A matcher refused a token, or failed: the request cannot go on under its grammar."""


class Constraint:
    """One sequence's grammar: its matcher once compiled (None until then)."""

    def __init__(self, grammar: str, compiled: Future[llguidance.LLMatcher]) -> None:
        self.grammar, self.compiled = grammar, compiled
        self.matcher: llguidance.LLMatcher | None = None

    @property
    def ready(self) -> bool:
        return self.matcher is not None

    def start(self, template: llguidance.LLMatcher, output_ids: list[int]) -> None:
        """Take a copy of the compiled matcher and advance it over output the request already has
        (a resumed request's replayed tokens)."""
        self.matcher = template.deep_copy()
        for token in output_ids:
            self.accept(token)

    def accept(self, token: int) -> None:
        """Advance over `token`. A matcher in error fails the request: one that failed while
        computing a mask (a schema whose `$ref`s loop, a grammar that cannot go on) allows EOS
        alone and reads as stopped, so it would otherwise end the request "stop" with output
        outside its language."""
        assert self.matcher is not None
        if not self.matcher.consume_token(token):
            raise GrammarError(f"structured output: token {token} is not allowed here ({self._error()})")
        if self.matcher.is_error():
            raise GrammarError(f"structured output: the grammar cannot go on here ({self._error()})")

    def _error(self) -> str:
        """llguidance's error without the state dump and the whole grammar it appends."""
        assert self.matcher is not None
        return self.matcher.get_error().split("\n", 1)[0]

    @property
    def done(self) -> bool:
        """Whether the output is complete: only EOS could follow."""
        return self.matcher is not None and self.matcher.is_stopped()

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` the grammar accepts from here, in order (the matcher is unchanged):
        consumed by a copy, as llguidance's `validate_tokens` does not count a rule's
        `max_tokens=` past its first token."""
        assert self.matcher is not None
        return self.matcher.deep_copy().try_consume_tokens(tokens)

    def verify_bitmask(self, proposals: list[int], vocab_size: int) -> torch.Tensor:
        """[k + 1, words]: the mask before each proposal and after the last, computed by a copy
        of the matcher advanced over the proposals (all valid: `valid_prefix` cut them). A copy
        (a few µs), not an advance and a rollback: llguidance cannot roll back over a rule with
        `max_tokens=` or `stop=`, and the failed rollback left the matcher in error."""
        assert self.matcher is not None
        ahead = Constraint(self.grammar, self.compiled)
        ahead.matcher = self.matcher.deep_copy()
        bits = torch.empty((len(proposals) + 1, _words(vocab_size)), dtype=torch.int32)
        for i in range(len(proposals) + 1):
            llguidance.numpy.fill_next_token_bitmask(ahead.matcher, bits.numpy(), i)
            if i < len(proposals):
                ahead.accept(proposals[i])
        return bits


class GrammarCompiler:
    """Compiles grammars against one tokenizer on a worker thread and caches them by text. Used
    from the engine thread only (the worker runs `_compile` and touches nothing else)."""

    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Iterable[int], cache_size: int = 256
    ) -> None:
        self.tokenizer, self.vocab_size, self.cache_size = tokenizer, vocab_size, cache_size
        self.eos_token_ids = tuple(sorted(eos_token_ids))
        self._cache: collections.OrderedDict[str, llguidance.LLMatcher] = collections.OrderedDict()
        self._compiling: dict[str, Future[llguidance.LLMatcher]] = {}
        self._worker = grammar_thread("spindle-grammar")  # a stack for the deepest grammar served
        self._executor: llguidance.LLExecutor | None = None

    def constraint(self, structured: StructuredOutput) -> Constraint:
        """A constraint whose matcher is compiled (or found in the cache) in the background."""
        grammar = structured.grammar
        cached = self._cache.get(grammar)
        if cached is not None:
            self._cache.move_to_end(grammar)
            done: Future[llguidance.LLMatcher] = Future()
            done.set_result(cached)
            return Constraint(grammar, done)
        future = self._compiling.get(grammar)  # requests with one grammar share its compile
        if future is None:
            future = self._compiling[grammar] = self._worker.submit(self._compile, grammar)
        return Constraint(grammar, future)

    def poll(self, constraint: Constraint, output_ids: list[int]) -> bool:
        """Start `constraint`'s matcher if its compile has finished; True once it is ready.
        Raises InvalidRequestError when the grammar does not compile for this vocabulary."""
        if constraint.ready:
            return True
        if not constraint.compiled.done():
            return False
        if self._compiling.pop(constraint.grammar, None) is not None:
            self._remember(constraint)
        constraint.start(constraint.compiled.result(), output_ids)  # raises the compile's error
        return True

    def release(self, constraint: Constraint) -> None:
        """Forget the compile of a grammar no waiting request needs any more (they ended while it
        compiled): cancelled if it has not started, cached if it has compiled; a running one
        finishes unread. Kept here, each would have been held for good, outside the bounded
        cache, and each would have run, delaying the compiles queued behind it."""
        if self._compiling.get(constraint.grammar) is not constraint.compiled:
            return
        del self._compiling[constraint.grammar]
        if not constraint.compiled.cancel() and constraint.compiled.done():
            self._remember(constraint)

    def _remember(self, constraint: Constraint) -> None:
        """Cache a finished compile's matcher (LRU), unless the compile failed."""
        if constraint.compiled.exception() is None:
            self._cache[constraint.grammar] = constraint.compiled.result()
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)

    def allowed_tokens(self, constraints: list[Constraint | None]) -> AllowedTokens | None:
        """The next-token bitmask of every constrained row of a step (rows are the list's
        indices), computed in parallel; None when no row is constrained."""
        rows = [i for i, c in enumerate(constraints) if c is not None]
        if not rows:
            return None
        bits = torch.empty(
            (len(rows), _words(self.vocab_size)), dtype=torch.int32, pin_memory=torch.cuda.is_available()
        )
        matchers = [(c.matcher, k) for k, c in enumerate(c for c in constraints if c is not None)]
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        llguidance.numpy.fill_next_token_bitmask_par(self._executor, matchers, bits.numpy())
        return AllowedTokens(rows, bits)

    def _compile(self, grammar: str) -> llguidance.LLMatcher:
        llg = _llg_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_ids)
        matcher = llguidance.LLMatcher(llg, grammar)
        if matcher.is_error():
            raise InvalidRequestError(f"structured_output: {matcher.get_error()}")
        return matcher


_tokenizer_lock = threading.Lock()


def _llg_tokenizer(tokenizer: Tokenizer, vocab_size: int, eos: tuple[int, ...]) -> llguidance.LLTokenizer:
    """llguidance's view of the vocabulary: built once per tokenizer (engines over one loaded model
    share it), under a lock so that two engines' workers do not both build it. Its EOS tokens are
    the engine's (the generation config's), not the tokenizer's one `eos_token`: where output
    may end, the mask allows every token the engine stops on (Gemma ends a turn with
    `<end_of_turn>`, its tokenizer's EOS is `<eos>`)."""
    with _tokenizer_lock:
        return _build_llg_tokenizer(tokenizer, vocab_size, eos)


@functools.lru_cache(maxsize=4)
def _build_llg_tokenizer(
    tokenizer: Tokenizer, vocab_size: int, eos: tuple[int, ...]
) -> llguidance.LLTokenizer:
    return llguidance.hf.from_tokenizer(tokenizer.hf, n_vocab=vocab_size, eos_token=list(eos) or None)


def _words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32
