"""The gateway in front of two model pods, all real processes on loopback (tiny random Llama)."""

from __future__ import annotations

import time

import grpc
import pytest

from spindle.v1 import generation_pb2 as pb
from tests.conftest import make_engine
from tests.service_helpers import collect, load, stub, token_request, wait_idle

Code = grpc.StatusCode


def _md(key: str = "key-alice"):
    return (("authorization", f"Bearer {key}"),)


def _generate(gateway, req, key="key-alice", timeout=20):
    with gateway.channel() as ch:
        return collect(stub(ch).Generate(req, metadata=_md(key), timeout=timeout))


def test_tokens_through_the_gateway_equal_the_engine_run_directly(tiny_llama, tiny_cluster):
    _, gateway = tiny_cluster
    engine = make_engine(tiny_llama)
    for sampling, seed in (({"temperature": 0.0}, None), ({"temperature": 0.8, "top_k": 40}, 99)):
        req = token_request([3, 1, 4, 1, 5, 9, 2, 6], 16, **sampling)
        if seed is not None:
            req.seed = seed
        tokens, msgs = _generate(gateway, req)
        direct = {
            "prompt_token_ids": [3, 1, 4, 1, 5, 9, 2, 6],
            "max_tokens": 16,
            "ignore_eos": True,
            "seed": seed,
        }
        assert tokens == engine.generate([{**direct, **sampling}])[0].token_ids
        assert [m.WhichOneof("kind") for m in msgs][-1] == "final"
        assert msgs[-1].final.usage.completion_tokens == 16 and msgs[-1].final.usage.prompt_tokens == 8


def test_api_keys_and_adapter_permissions(tiny_cluster):
    _, gateway = tiny_cluster
    req = token_request([5, 6, 7], 2)
    with gateway.channel() as ch:
        g = stub(ch)
        for md, code in (((), Code.UNAUTHENTICATED), (_md("wrong"), Code.UNAUTHENTICATED)):
            with pytest.raises(grpc.RpcError) as e:
                list(g.Generate(req, metadata=md, timeout=5))
            assert e.value.code() == code and "API key" in e.value.details()
            with pytest.raises(grpc.RpcError) as e:
                g.ListModels(pb.ListModelsRequest(), metadata=md, timeout=5)
            assert e.value.code() == code
        with_adapter = token_request([5, 6, 7], 2)
        with_adapter.adapter = "sql-lora"
        with pytest.raises(grpc.RpcError) as e:
            list(g.Generate(with_adapter, metadata=_md("key-bob"), timeout=5))
        assert e.value.code() == Code.PERMISSION_DENIED and "'bob'" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:  # allowed to carol, but no pod has it
            list(g.Generate(with_adapter, metadata=_md("key-carol"), timeout=5))
        assert e.value.code() == Code.NOT_FOUND and "sql-lora" in e.value.details()
        models = g.ListModels(pb.ListModelsRequest(), metadata=_md("key-bob"), timeout=5).models
        assert [m.kind for m in models] == [pb.MODEL_KIND_BASE]


def test_bad_input_is_relayed_with_its_code_and_the_gateway_keeps_serving(tiny_cluster):
    _, gateway = tiny_cluster
    with gateway.channel() as ch:
        g = stub(ch)
        for req, code in (
            (pb.GenerateRequest(max_tokens=2), Code.INVALID_ARGUMENT),
            (token_request([5, 6], 2, temperature=-3.0), Code.INVALID_ARGUMENT),
            (token_request([5, 99999], 2), Code.INVALID_ARGUMENT),
            (pb.GenerateRequest(request_id="é", text="x"), Code.INVALID_ARGUMENT),  # was INTERNAL (metadata)
            (pb.GenerateRequest(request_id="a\nb", text="x"), Code.INVALID_ARGUMENT),
            (pb.GenerateRequest(text="x", adapter=""), Code.INVALID_ARGUMENT),  # was NOT_FOUND
        ):
            with pytest.raises(grpc.RpcError) as e:
                list(g.Generate(req, metadata=_md(), timeout=5))
            assert e.value.code() == code and e.value.details()
        for rid, code in (("", Code.INVALID_ARGUMENT), ("nope", Code.NOT_FOUND)):
            with pytest.raises(grpc.RpcError) as e:
                g.Abort(pb.AbortRequest(request_id=rid), metadata=_md(), timeout=5)
            assert e.value.code() == code
    assert len(_generate(gateway, token_request([5, 6], 2))[0]) == 2


def _long(rid: str) -> pb.GenerateRequest:
    req = token_request([7, 7, 7], 450, temperature=0.0)
    req.request_id = rid
    return req


def test_abort_cancel_and_deadline_through_the_gateway_free_the_pods_blocks(tiny_cluster):
    pods, gateway = tiny_cluster
    with gateway.channel() as ch:
        g = stub(ch)
        stream = g.Generate(_long("gw-abort"), metadata=_md(), timeout=20)
        next(stream)
        with pytest.raises(grpc.RpcError) as e:  # another caller cannot abort it
            g.Abort(pb.AbortRequest(request_id="gw-abort"), metadata=_md("key-bob"), timeout=5)
        assert e.value.code() == Code.NOT_FOUND
        g.Abort(pb.AbortRequest(request_id="gw-abort"), metadata=_md(), timeout=5)
        assert list(stream)[-1].final.finish_reason == pb.FINISH_REASON_ABORT
        for p in pods:
            wait_idle(p)
        stream = g.Generate(_long("gw-cancel"), metadata=_md(), timeout=20)
        next(stream)
        stream.cancel()
        for p in pods:
            wait_idle(p)
        with pytest.raises(grpc.RpcError) as e:
            list(g.Generate(_long("gw-deadline"), metadata=_md(), timeout=0.2))
        assert e.value.code() == Code.DEADLINE_EXCEEDED
        for p in pods:
            wait_idle(p)


def _served(pods) -> list[int]:
    return [load(p).requests_total for p in pods]


def test_requests_follow_prefix_locality_and_queue_depth(tiny_cluster):
    pods, gateway = tiny_cluster
    # Prefix: a long shared prefix keeps going to the pod that served it first.
    shared = [10 + i % 200 for i in range(160)]  # 40 blocks of 16 ids
    before = _served(pods)
    _generate(gateway, token_request(shared, 2))
    first = [a - b for a, b in zip(_served(pods), before, strict=True)].index(1)
    for tail in range(5):
        _generate(gateway, token_request([*shared, 250 + tail, 251], 2))
    after = _served(pods)
    assert after[first] - before[first] == 6 and after[1 - first] == before[1 - first]
    # Queue depth: with pod `first` saturated (its 64 KV blocks hold two of these requests, so the
    # rest wait), new prompts go to the other pod, shared prefix or not.
    busy = pods[first]
    with busy.channel() as ch:
        streams = [stub(ch).Generate(_long(f"hog{i}"), timeout=30) for i in range(40)]
        for s in streams[:1]:
            next(s)
        deadline = time.monotonic() + 10
        while load(busy).num_waiting < 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.5)  # two load polls
        before = _served(pods)
        for i in range(4):
            _generate(gateway, token_request([*shared, 260 + i], 2))
        after = _served(pods)
        for s in streams:
            s.cancel()
    assert after[1 - first] - before[1 - first] == 4 and after[first] == before[first]
    wait_idle(busy)
