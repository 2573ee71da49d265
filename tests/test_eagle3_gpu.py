"""CUDA: EAGLE-3 speculation (the target's verify steps and the head's steps replayed from CUDA
graphs, or eager; the head's attention through the Triton backend) gives plain greedy's tokens,
and the head's logits on CUDA match its CPU logits. Skipped without a GPU; no conftest fixtures
(run with `python3 -m pytest --noconftest -m gpu`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model_service.engine.batch_builder import StepItem
from model_service.engine.config import EngineConfig
from model_service.engine.engine import Engine
from model_service.models.loader import LoadedModel, load_model
from tests.eagle3_models import VOCAB, eagle3_config, make_head, make_target
from tests.graph_replays import assert_graphs_equal_eager

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _engine(loaded: LoadedModel, device: str, **config: object) -> Engine:
    cfg = {"model": loaded.name, "device": device, "dtype": "float32", "num_kv_blocks": 256, "block_size": 16}
    return Engine(EngineConfig(**cfg, **config), loaded=loaded)


def _requests() -> list[dict]:
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (20, 7, 13, 23, 40, 3)]
    return [{"prompt_token_ids": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True} for p in prompts]


def test_eagle3_on_cuda_gives_plain_greedy_tokens_and_the_cpu_heads_logits(tmp_path: Path):
    torch.backends.cuda.matmul.allow_tf32 = False
    target = make_target(tmp_path / "target", agree=True)
    head = make_head(tmp_path / "head", target, agree=True)
    loaded = load_model(str(target), torch.float32, torch.device("cuda"))
    expected = [o.token_ids for o in _engine(loaded, "cuda").generate(_requests())]
    for k in (1, 3):
        engine = _engine(loaded, "cuda", speculative_config=eagle3_config(head, k))
        assert [o.token_ids for o in engine.generate(_requests())] == expected
        assert 0 < engine.speculation.accepted < engine.speculation.proposed

    logits = {}
    ids = _requests()[4]["prompt_token_ids"]
    for device in ("cpu", "cuda"):
        model = loaded if device == "cuda" else load_model(str(target), torch.float32, torch.device("cpu"))
        engine = _engine(model, device, speculative_config=eagle3_config(head, 1))
        state = engine.cache.allocate()
        assert engine.cache.reserve(state, len(ids))
        engine.executor.execute(engine.builder.build([StepItem(state, ids, 1)]))
        proposer = engine.speculation.proposer
        hidden = proposer.fuse(engine.executor.hidden)[:-1]
        draft = proposer.cache.allocate()
        assert proposer.cache.reserve(draft, len(ids) - 1)
        batch = proposer.builder.build([StepItem(draft, ids[1:], len(ids) - 1)])
        logits[device] = proposer.executor.run_head(batch, hidden)[0].cpu()
    torch.testing.assert_close(logits["cuda"], logits["cpu"], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("k", [1, 3])
def test_eagle3_graphs_give_the_eager_steps_tokens_and_proposals(tmp_path: Path, k: int, monkeypatch):
    """float32: the target's verify steps (keeping the three layers' states in the graph's own
    tensors) and the head's steps (feeds of verified runs, chained steps) replayed from graphs
    propose and emit what the eager steps do: plain greedy's tokens."""
    torch.backends.cuda.matmul.allow_tf32 = False
    target = make_target(tmp_path / "target", agree=True)
    head = make_head(tmp_path / "head", target, agree=True)
    loaded = load_model(str(target), torch.float32, torch.device("cuda"))
    expected = [o.token_ids for o in _engine(loaded, "cuda", max_num_seqs=8).generate(_requests())]

    def make(eager: bool) -> Engine:
        spec = eagle3_config(head, k)
        return _engine(loaded, "cuda", max_num_seqs=8, enforce_eager=eager, speculative_config=spec)

    assert_graphs_equal_eager(make, _requests(), expected, monkeypatch)
