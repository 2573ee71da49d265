"""Checks shared by the tests of the proposers that read the target's hidden states (MTP's
layers, EAGLE-3's head): both keep a paged cache of their own behind `HiddenStateProposer`, so
both must roll it back the same way."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from model_service.engine.engine import Engine
from tests.conftest import assert_all_blocks_free

CacheRows = Callable[[Engine, Any, int], Any]  # (engine, a follow's cache state, n) -> its first n rows


def assert_rollback_leaves_no_stale_kv(make: Callable[[int], Engine], request: dict, rows: CacheRows) -> None:
    """Mid-generation, after rejections, the proposer's cache rows for the positions the target
    confirmed are what one pass over the whole history computes: the chained rows of rejected
    (and accepted) proposals were cut and rewritten from the target's states. `make(k)`: an
    engine proposing k tokens; `rows`: the cache rows compared (tensors, or tuples of them)."""
    engine = make(3)
    rid = engine.add_request_dict(request)
    seq = engine.requests[rid]
    for _ in range(6):
        engine.step()
    spec = engine.speculation
    assert 0 < spec.accepted < spec.proposed
    follow = spec.proposer.follows[rid]
    assert follow.confirmed == len(seq.token_ids) - 1
    assert follow.state.num_computed == follow.confirmed + 3 - 1  # then the chained positions
    spec.proposer.on_verified(seq, 0)
    assert follow.state.num_computed == follow.confirmed  # rolled back to what the target made
    fresh = make(1)
    again = fresh.add_request_dict({"prompt_token_ids": seq.token_ids, "max_tokens": 3, "temperature": 0})
    fresh.step()
    fresh_follow = fresh.speculation.proposer.follows[again]
    assert fresh_follow.confirmed == len(seq.token_ids)
    n = follow.confirmed
    torch.testing.assert_close(rows(engine, follow.state, n), rows(fresh, fresh_follow.state, n))


def assert_proposer_blocks_free(engine: Engine, kind: type) -> None:
    """Every block free, the target's and the proposer's (of class `kind`), and no sequence
    still followed by it."""
    assert_all_blocks_free(engine)
    proposer = engine.speculation.proposer
    assert isinstance(proposer, kind) and not proposer.follows and not proposer.unaided
    assert proposer.cache.num_free_blocks == proposer.cache.num_total_blocks
