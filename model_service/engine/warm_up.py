"""The requests a GPU engine runs before it serves, so that its first requests compile no kernel.

Capturing the decode graphs compiles what a decode step runs, but Triton compiles the kernels of
prefill and mixed steps at first use, once for each variant the step picks: the fused MoE
tilings and the experts' path go by rows an expert, the decode rows' split count by how many
there are, and Triton specializes integer and pointer arguments (divisible by 16 or not, one or
not; the kernels leave the per-step counts unspecialized where they can). Measured on an H200
(2026-12-03 aa in docs/gpu-notebook.md), after the graphs were captured, before these requests:
the first prompts of 100, 777 and 2,048 tokens took 1,081 / 1,980 / 2,181 ms to their first
token on an 8-layer Qwen3-30B-A3B shape against 11-13 ms once compiled, 2,567 ms (100 tokens)
and 2,101 (2,048) on an 8-layer Qwen3-Next shape against 29 and 44, and 1,529 ms for the first
100-token prompt of an 8-layer dense 8B shape against 3. With them, the first requests take
what the next ones do; a pod reports SERVING only after they ran (~15 s more at start-up).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from model_service.engine.config import EngineConfig
from model_service.engine.scheduler import Scheduler
from model_service.engine.sequence import RequestOutput
from model_service.engine.speculation import Speculation

MIN_LADDER = 16  # Triton's divisibility specialization: below it, only the 1-token case differs


class WarmedEngine(Protocol):
    """What the warm-up uses of `engine.Engine` (which imports this module, so is not imported here)."""

    config: EngineConfig
    max_model_len: int
    scheduler: Scheduler
    speculation: Speculation | None

    @property
    def vocab_size(self) -> int: ...

    def has_unfinished(self) -> bool: ...

    def generate(self, requests: list[dict[str, Any]]) -> list[RequestOutput]: ...


def prefill_lengths(token_budget: int, longest: int) -> list[int]:
    """Prompt lengths whose prefills reach every token-count variant of a prefill step: one token,
    each power of two from 16 up to the step's `token_budget` and one less than it (both sides
    of the divisibility split, in every power-of-two bucket a kernel's tiling may key on). At most
    `longest` tokens each (the context, which leaves room for the generated ones)."""
    lengths = [1]
    size = MIN_LADDER
    while size <= token_budget:
        lengths += [size - 1, size]
        size *= 2
    return [n for n in lengths if n <= longest]


def warm_up_batches(token_budget: int, longest: int, vocab: int, max_seqs: int) -> list[list[dict[str, Any]]]:
    """The request batches of a warm-up, each run to completion in turn. First one prompt a
    length of `prefill_lengths`, two output tokens (so each also decodes once). Then steps that
    mix prefill and decode rows, for each of `decode_counts` (the decode kernel's launch goes by
    the number of decode rows, and mixed steps run it eagerly): that many short prompts, sampled
    with and without top-p (the two sampling kernels), four tokens each, queued before a prompt
    longer than the token budget, whose later chunks run beside their decodes and attend to the
    chunks before. Token ids are random: nothing matches a real prompt's prefix."""
    g = torch.Generator().manual_seed(0)

    def prompt(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    greedy = {"max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
    batches = [
        [{"prompt_token_ids": prompt(n), **greedy}] for n in prefill_lengths(token_budget, longest - 2)
    ]
    sampled = [
        {"temperature": 0.8, "ignore_eos": True},
        {"temperature": 0.8, "top_p": 0.9, "ignore_eos": True},
    ]
    chunked = min(longest - 2, token_budget + token_budget // 2 + 3)
    for decodes in decode_counts(max_seqs) if longest >= 8 else []:  # a short one: 4 tokens, 4 more
        short = [
            {"prompt_token_ids": prompt(1 + i % 4), "max_tokens": 4, **sampled[i % 2]} for i in range(decodes)
        ]
        batches.append([*short, {"prompt_token_ids": prompt(chunked), **greedy}])
    return batches


def decode_counts(max_seqs: int) -> list[int]:
    """How many sequences decode beside a prefill chunk in the warm-up's mixed steps: each power
    of two below `max_seqs`, and the most there can be (one sequence is the chunk's)."""
    most = max_seqs - 1
    counts = [1 << i for i in range(most.bit_length())]
    return [*counts, most] if counts and most > counts[-1] else counts


def run_requests(engine: WarmedEngine) -> None:
    """Run `warm_up_batches` for `engine`'s limits to completion (after its graphs are captured:
    `Engine.warm_up`), then forget what they leave that no client sent: their prefix-cache
    entries and the scheduler's and speculation's counts (`num_steps` keeps their steps)."""
    assert not engine.has_unfinished(), "warm up before any request is added"
    budget, seqs = engine.config.max_num_batched_tokens, engine.config.max_num_seqs
    for batch in warm_up_batches(budget, engine.max_model_len, engine.vocab_size, seqs):
        failed = [out.error for out in engine.generate(batch) if out.error]
        if failed:
            raise RuntimeError(f"a warm-up request failed: {failed[0]}")
    engine.scheduler.forget_history()
    if engine.speculation is not None:
        engine.speculation.forget_history()
