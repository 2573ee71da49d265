"""Shared fixtures: the embedded SmolLM2 (ours and HF's, same GGUF), tiny random checkpoints."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from model_service.startup import configure_process


def _worker_threads() -> int | None:
    """A pytest-xdist worker's share of the cores, for torch in it and in every process it starts
    (pods, gateways and tensor-parallel ranks inherit OMP_NUM_THREADS); None outside xdist. Two
    workers of two threads each on two cores wait on each other's threads: test_tp_async and
    test_speculation side by side took 70 s with one thread each, 88-115 s with two; and a
    SmolLM2 decode is no slower on one thread than on two even when the other core is idle."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    return max(1, (os.cpu_count() or 1) // int(workers)) if workers else None


if (_threads := _worker_threads()) is not None:
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))  # an operator's own setting wins
# Before torch loads OpenMP: spinning waits make small matmuls ~100x slower on shared 2-core
# machines (model_service/startup.py); the engine's processes make the same settings.
configure_process()
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# One GGUF conversion cache (model_service/models/gguf_cache.py) for the session's workers and the
# pods they start, outside the user's own ~/.cache: SmolLM2 is loaded a dozen times a run.
os.environ.setdefault("SPINDLE_CACHE_DIR", os.path.join(tempfile.gettempdir(), "spindle-test-cache"))

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

if _threads is not None:  # also where a plugin imported torch before this file set the variable
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
torch.manual_seed(0)
# The same examples on every run, so CI does not fail on whichever new counterexample a random
# run happens to draw (one did: a float ULP edge in test_rope). Exploratory runs that look for
# new ones: HYPOTHESIS_PROFILE=explore (and SPINDLE_FUZZ_EXAMPLES=1000 for the RPC fuzzer).
settings.register_profile("ci", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# the Redis and S3 servers of the adapter service tests; the RPC fuzzers' processes and checks;
# one `spindle up` cluster for the quickstart and HTTP API tests; one tiny pods-and-gateway
# cluster for the gateway tests; which files share an xdist worker and which start first; the
# fixtures GPU tests use (apart, for the device machines)
pytest_plugins = [
    "tests.adapter_helpers",
    "tests.fuzz_harness",
    "tests.up_cluster",
    "tests.service_helpers",
    "tests.xdist_scheduling",
    "tests.torch_fixtures",
]

from model_service.engine.batch_builder import StepItem  # noqa: E402
from model_service.engine.config import EngineConfig  # noqa: E402
from model_service.engine.engine import Engine  # noqa: E402
from model_service.engine.seq_state import SequenceState  # noqa: E402
from model_service.models.loader import LoadedModel, load_model, resolve_model_path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """Our SmolLM2 load (float32, CPU), shared by every engine a test builds."""
    return load_model("smollm2", torch.float32, torch.device("cpu"))


@pytest.fixture(scope="session")
def tp_adapters(smollm2, tmp_path_factory) -> dict[str, str]:
    """The shipped pirate adapter (q/v) and a random one on all seven projections, large enough
    that a missing or mis-sliced delta changes greedy tokens."""
    from bench.lora import write_adapter

    path = write_adapter(tmp_path_factory.mktemp("tp_adapter") / "all", smollm2.config, rank=8, seed=3)
    weights = path / "adapter_model.safetensors"
    save_file({k: v * 8 for k, v in load_file(str(weights)).items()}, str(weights))
    return {"pirate": str(ROOT / "adapters" / "smollm2-pirate"), "all": str(path)}


@pytest.fixture(scope="session")
def tp_weights(smollm2, tmp_path_factory) -> LoadedModel:
    """SmolLM2 whose workers load the test's float32 weights from one torch file (a second GGUF
    dequantization per worker would cost more than the test)."""
    path = tmp_path_factory.mktemp("tp_weights") / "smollm2.pt"
    torch.save(dataclasses.replace(smollm2, tokenizer=None), path)
    return dataclasses.replace(smollm2, source=functools.partial(torch.load, str(path), weights_only=False))


@pytest.fixture(scope="session")
def hf_smollm2() -> Any:
    """HF transformers' own load of the same GGUF file: the oracle."""
    from transformers import AutoModelForCausalLM

    path = resolve_model_path("smollm2")
    with _gguf_parsed_once():
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return hf.eval()


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """HF's GGUF load parses the file's header twice (config, then weights) and builds gguf-py's
    tensor-name table once per module (397 times for SmolLM2): ~13 of the load's ~28 s of CPU, on
    the worker that also runs the beam-search and parity tests. Both are pure functions of their
    arguments (a read-only memory map; a table of names), so they are memoized for this one load:
    HF reads and converts exactly what it would, only not twice."""
    import gguf

    with pytest.MonkeyPatch.context() as patch:
        for name in ("GGUFReader", "get_tensor_name_map"):
            patch.setattr(gguf, name, functools.cache(getattr(gguf, name)))
        yield


def make_engine(loaded: LoadedModel, **overrides: Any) -> Engine:
    """A fresh engine (own KV cache and scheduler) over already-loaded weights."""
    cfg = {"model": loaded.name, "device": "cpu", "dtype": "float32", "num_kv_blocks": 256, **overrides}
    return Engine(EngineConfig(**cfg), loaded=loaded)


def assert_all_blocks_free(engine: Engine) -> None:
    assert not engine.has_unfinished()
    assert engine.cache.num_free_blocks == engine.cache.num_total_blocks


def new_sequence(engine: Engine, num_tokens: int) -> SequenceState:
    """A sequence with blocks for `num_tokens`, straight from the cache manager (no scheduler)."""
    state = engine.cache.allocate()
    assert engine.cache.reserve(state, num_tokens)
    return state


def forward(engine: Engine, items: list[tuple[SequenceState, list[int], int]]) -> torch.Tensor:
    """One forward pass of (sequence, tokens, logits rows wanted) items through the executor, as
    the engine runs a step; returns the logits rows in item order."""
    logits = engine.executor.execute(engine.builder.build([StepItem(s, t, n) for s, t, n in items]))
    for state, tokens, _ in items:
        state.num_computed += len(tokens)
    return logits


def prefill_logits(engine: Engine, ids: list[int], chunk: int | None = None) -> torch.Tensor:
    """Last-token logits of `ids` prefilled in chunks of `chunk` tokens (one pass when None)."""
    state = new_sequence(engine, len(ids))
    step = chunk or len(ids)
    for start in range(0, len(ids), step):
        part = ids[start : start + step]
        logits = forward(engine, [(state, part, int(start + step >= len(ids)))])
    engine.cache.free(state)
    return logits[0]


TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {"cls": "LlamaConfig", "arch": "LlamaForCausalLM"},
    "mistral": {"cls": "MistralConfig", "arch": "MistralForCausalLM"},
    "qwen2": {"cls": "Qwen2Config", "arch": "Qwen2ForCausalLM"},
    "qwen3": {"cls": "Qwen3Config", "arch": "Qwen3ForCausalLM"},
    "mixtral": {"cls": "MixtralConfig", "arch": "MixtralForCausalLM"},
    "qwen2_moe": {"cls": "Qwen2MoeConfig", "arch": "Qwen2MoeForCausalLM"},
    "qwen3_moe": {"cls": "Qwen3MoeConfig", "arch": "Qwen3MoeForCausalLM"},
    "qwen3_next": {"cls": "Qwen3NextConfig", "arch": "Qwen3NextForCausalLM"},
    "deepseek_v2": {"cls": "DeepseekV2Config", "arch": "DeepseekV2ForCausalLM"},
    "deepseek_v3": {"cls": "DeepseekV3Config", "arch": "DeepseekV3ForCausalLM"},
    "granite": {"cls": "GraniteConfig", "arch": "GraniteForCausalLM"},
    "olmo2": {"cls": "Olmo2Config", "arch": "Olmo2ForCausalLM"},
    "phi3": {"cls": "Phi3Config", "arch": "Phi3ForCausalLM"},
    "gemma2": {"cls": "Gemma2Config", "arch": "Gemma2ForCausalLM"},
    "gemma3_text": {"cls": "Gemma3TextConfig", "arch": "Gemma3ForCausalLM"},
}


def make_tiny_checkpoint(family: str, path: Path, seed: int = 0, **overrides: Any) -> Path:
    """Save a tiny random HF model of `family` to `path` (safetensors) and return the path."""
    import transformers

    spec = TINY_CONFIGS[family]
    kwargs: dict[str, Any] = {
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "head_dim": 16,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "architectures": [spec["arch"]],
        **overrides,
    }
    config = getattr(transformers, spec["cls"])(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init is near-zero; widen it so logits spread and greedy ties are vanishingly rare.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return path


def write_tiny_smollm2(smollm2: LoadedModel, path: Path, extra_rows: int = 0, **overrides: Any) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer files (chat template included) and
    `extra_rows` more (or fewer) rows in its embedding table than SmolLM2 (padding rows, as the
    sizes of one family may differ)."""
    vocab_size = smollm2.config.vocab_size + extra_rows
    make_tiny_checkpoint("llama", path, seed=3, vocab_size=vocab_size, **overrides)
    smollm2.tokenizer.hf.save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def tiny_smollm2(smollm2, tmp_path_factory) -> LoadedModel:
    """SmolLM2's tokens on a tiny random Llama: its tokenizer, chat template, EOS and context
    length (8,192). For tests that need text, chat and stop strings through the real tokenizer and
    detokenizer but not SmolLM2's answers: a pod of it is serving after ~7 s of CPU, not ~17
    (SmolLM2's GGUF is parsed twice on load), and its steps cost a fraction of SmolLM2's."""
    path = write_tiny_smollm2(smollm2, tmp_path_factory.mktemp("tiny_smollm2"), max_position_embeddings=8192)
    return load_model(str(path), torch.float32, torch.device("cpu"))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> LoadedModel:
    """A tiny random Llama (no tokenizer): fast enough for randomized scheduling tests."""
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny_llama"))
    return load_model(str(path), torch.float32, torch.device("cpu"))
