"""What every windowed family's test checks against HF the same way (test_gemma.py,
test_gpt_oss.py): greedy tokens of a mixed-length batch, chunked, after a prefix-cache hit,
under a PEFT adapter, through the Triton backend, and on CUDA."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from model_service.attention.triton_backend import TritonBackend
from model_service.models.loader import LoadedModel, load_model
from tests.conftest import assert_all_blocks_free, make_engine
from tests.test_tiny_models import MAX_NEW, PROMPTS, random_prompt, request

LONG = random_prompt(30, seed=7)  # past a window of 8 and several 4-token blocks


def hf_greedy(hf: Any, ids: list[int], n: int = MAX_NEW) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids) :].tolist()


def check_batched_and_chunked(hf: Any, ours: LoadedModel) -> None:
    """Mixed-length prompts in one batch, and the same prompts prefilled in 5-token chunks over
    4-token blocks, decode HF's greedy tokens."""
    prompts = [*PROMPTS[:4], LONG]
    expected = [hf_greedy(hf, ids) for ids in prompts]
    for overrides in ({}, {"max_num_batched_tokens": 5, "block_size": 4}):
        engine = make_engine(ours, **overrides)
        assert [o.token_ids for o in engine.generate([request(ids) for ids in prompts])] == expected
        assert_all_blocks_free(engine)


def check_prefix_cache_hit(hf: Any, ours: LoadedModel) -> None:
    """A prompt that shares a cached 24-token prefix decodes as HF does from scratch."""
    engine = make_engine(ours, block_size=4)
    engine.generate([request(LONG)])
    longer = [*LONG[:24], *random_prompt(6, seed=8)]
    before = engine.stats().prefix_cache_hit_tokens
    assert engine.generate([request(longer)])[0].token_ids == hf_greedy(hf, longer)
    assert engine.stats().prefix_cache_hit_tokens - before >= 16
    assert_all_blocks_free(engine)


def check_lora_matches_peft(hf: Any, ours: LoadedModel, targets: list[str], root: Path) -> None:
    """A PEFT adapter on `targets` decodes PEFT's greedy tokens, which differ from the base's."""
    from tests.test_lora import make_adapter, peft_greedy

    adapter = make_adapter(hf, root / "lora", 5, scale=0.1, r=4, lora_alpha=8, target_modules=targets)
    engine = make_engine(ours, max_loras=1, lora_modules={"a": str(adapter)})
    prompts = [PROMPTS[0], LONG]
    got = [o.token_ids for o in engine.generate([{**request(ids), "adapter": "a"} for ids in prompts])]
    assert got == peft_greedy(hf, adapter, prompts, MAX_NEW, eos=None)
    assert got != [hf_greedy(hf, ids) for ids in prompts]  # the adapter changes the answer


def check_triton_backend(hf: Any, ours: LoadedModel, monkeypatch: Any, graphs: bool) -> TritonBackend:
    """Where the Triton kernels apply (CUDA and a power-of-two head width; faked here, the
    backends only built on the CPU) the family keeps the Triton backend, its soft-cap or sinks
    switched on in the kernels, and CUDA graphs where `graphs`. That backend decodes HF's greedy tokens over
    chunked prefills beside decodes, with the reference backend's logprobs (tokens alone miss
    a dropped sink): on the CPU its kernel calls run the kernels' references, and under Triton's
    interpreter (`TRITON_INTERPRET=1`) the kernels themselves. Returns the backend built."""
    from model_service.engine.executor import ModelExecutor

    prompts, steps = [PROMPTS[1], LONG], {"max_num_batched_tokens": 12, "block_size": 4}
    reqs = [{**request(ids), "max_tokens": 4, "logprobs": 1, "prompt_logprobs": 1} for ids in prompts]
    want = _tokens_and_logprobs(make_engine(ours, **steps), reqs)  # the torch reference backend
    monkeypatch.setattr(ModelExecutor, "_kernels_apply", lambda self: True)
    # graphs need CUDA to be built: each kind stands for itself by the backend it would capture
    monkeypatch.setattr(ModelExecutor, "_decode_graphs", lambda self, config, backend: backend)
    monkeypatch.setattr(ModelExecutor, "_piecewise_graphs", lambda self, config, backend: backend)
    built = make_engine(ours).executor
    assert isinstance(built.attention, TritonBackend)
    assert (built.graphs, built.pieces) == ((built.attention,) * 2 if graphs else (None, None))
    assert built.attention.softcap == ours.config.attn_logit_softcapping
    _kernels_on_the_cpu(monkeypatch)
    got = _tokens_and_logprobs(make_engine(ours, enforce_eager=True, **steps), reqs)
    assert [tokens for tokens, _ in got] == [hf_greedy(hf, ids, 4) for ids in prompts]
    for ids, (_, g), (_, w) in zip(prompts, got, want, strict=True):
        assert len(w) == len(ids) - 1 + 4 and g == pytest.approx(w, abs=1e-4)
    return built.attention


def _tokens_and_logprobs(engine: Any, reqs: list[dict[str, Any]]) -> list[tuple[list[int], list[float]]]:
    """Each request's tokens, and the logprobs of its prompt's tokens and then of its own."""
    ids = [engine.add_request_dict(r) for r in reqs]
    logprobs: dict[str, list[float]] = {i: [] for i in ids}
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            logprobs[out.request_id] += [t.logprob for t in (out.prompt_logprobs or []) if t is not None]
            logprobs[out.request_id] += [t.logprob for t in out.new_logprobs or []]
            tokens[out.request_id] = list(out.token_ids)
    return [(tokens[i], logprobs[i]) for i in ids]


def check_cuda_matches_cpu(ours: LoadedModel, graphs: bool) -> None:
    """float32 on CUDA (the Triton attention kernels with the family's soft-cap or sinks and
    sliding windows, decode steps replayed from CUDA graphs where `graphs`, chunked prefills
    beside decodes) gives the CPU engine's greedy tokens."""
    reqs = [request(ids) for ids in [*PROMPTS, LONG]]
    hit = [request([*LONG[:24], 7, 9, 11])]  # after LONG: a prefix-cache hit past the window
    config = {"max_num_batched_tokens": 12}
    cpu = make_engine(ours, **config)
    want = [o.token_ids for o in cpu.generate(reqs) + cpu.generate(hit)]
    cuda32 = load_model(ours.name, torch.float32, torch.device("cuda"))
    engine = make_engine(cuda32, device="cuda", **config)
    assert isinstance(engine.executor.attention, TritonBackend)
    assert (engine.executor.graphs is not None) == graphs
    torch.backends.cuda.matmul.allow_tf32 = False
    assert [o.token_ids for o in engine.generate(reqs) + engine.generate(hit)] == want
    assert_all_blocks_free(engine)


def _kernels_on_the_cpu(monkeypatch: Any) -> None:
    """Under Triton's interpreter, the Triton backend's attention calls launch the kernels on CPU
    tensors (their wrappers take the references off CUDA); elsewhere nothing changes."""
    import os

    from model_service.attention import triton_backend
    from model_service.kernels import fused, paged_attention, prefill_attention

    if paged_attention.triton is None or os.environ.get("TRITON_INTERPRET") != "1":
        return

    def decode(q, k_cache, v_cache, block_table, seq_lens, block_size, scale, window=None, num_splits=1,
               out=None, **terms):  # fmt: skip
        out = torch.empty_like(q) if out is None else out
        return paged_attention.decode_attention_triton(
            q, k_cache, v_cache, block_table, seq_lens, block_size, scale, window, num_splits, out, **terms
        )

    def prefill(*args, out=None, softcap=None, sinks=None):
        out = torch.empty_like(args[0]) if out is None else out
        return prefill_attention.prefill_attention_triton(*args, out, softcap, sinks)

    monkeypatch.setattr(triton_backend, "paged_decode_attention", decode)
    monkeypatch.setattr(fused, "paged_decode_attention", decode)  # the RoPE path's, after its RoPE
    monkeypatch.setattr(triton_backend, "paged_prefill_attention", prefill)
