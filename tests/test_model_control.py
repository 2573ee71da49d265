"""ModelControl on real pod processes: load, pin, evict, slots, weights streaming, peer promotion."""

from __future__ import annotations

import hashlib
import time

import grpc
import pytest

from spindle.v1 import model_control_pb2 as mc
from spindle.v1 import model_control_pb2_grpc
from tests.conftest import make_engine
from tests.service_helpers import (
    collect,
    load,
    spawn,
    spawn_pod,
    stub,
    token_request,
    wait_idle,
    wait_serving,
)
from tests.test_lora import arena_bytes, make_adapter

Code = grpc.StatusCode
PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama.name, dtype="float32")
    root = tmp_path_factory.mktemp("control_adapters")
    return {
        "a": make_adapter(
            hf, root / "a", seed=1, scale=0.3, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]
        ),
        "b": make_adapter(hf, root / "b", seed=2, scale=0.3, r=8, lora_alpha=8, target_modules=["down_proj"]),
    }


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """Where the second pod writes the adapter files it receives (--adapter-cache-dir)."""
    return tmp_path_factory.mktemp("second_cache")


@pytest.fixture(scope="module")
def pods(tiny_llama, adapters, cache, tmp_path_factory):
    logs = tmp_path_factory.mktemp("pods")
    room = str(max(arena_bytes(tiny_llama, adapters["a"]), arena_bytes(tiny_llama, adapters["b"])))
    first = spawn_pod(
        tiny_llama.name, logs, "first", "--lora-memory-bytes", room, "--lora", f"a={adapters['a']}"
    )
    second = spawn_pod(tiny_llama.name, logs, "second", "--max-loras", "2", "--adapter-cache-dir", str(cache))
    yield wait_serving(first), wait_serving(second)
    for p in (first, second):
        assert p.stop() == 0, p.output()


def _reference(tiny_llama, adapters, name):
    engine = make_engine(tiny_llama, lora_modules={name: str(adapters[name])})
    request = {
        "prompt_token_ids": PROMPT,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "adapter": name,
    }
    return engine.generate([request])[0].token_ids


def _generate(channel, adapter):
    req = token_request(PROMPT, 8, temperature=0.0)
    req.adapter = adapter
    return collect(stub(channel).Generate(req, timeout=30))[0]


def _gateway(pods, tmp_path):
    """A gateway in front of `pods`, once it has polled them all."""
    addresses = ",".join(p.address for p in pods)
    args = ["--pods", addresses, "--allow-unauthenticated", "--health-interval", "0.2"]
    gateway = wait_serving(spawn("gateway", args, tmp_path, "gateway"))
    deadline = time.monotonic() + 10
    while gateway.output().count("is healthy") < len(pods) and time.monotonic() < deadline:
        time.sleep(0.05)
    return gateway


def _control(channel):
    return model_control_pb2_grpc.ModelControlStub(channel)


def test_load_pin_evict_and_slot_report(pods, tiny_llama, adapters):
    first, _ = pods
    with first.channel() as ch, first.control_channel() as cc:
        ctl = _control(cc)
        change = ctl.LoadAdapter(mc.LoadAdapterRequest(name="a"), timeout=10)
        assert change.slot == 0 and change.adapter.tier == mc.TIER_DEVICE and change.adapter.rank == 4
        sha = hashlib.sha256((adapters["a"] / "adapter_model.safetensors").read_bytes()).hexdigest()
        assert change.adapter.sha256 == sha
        assert _generate(ch, "a") == _reference(tiny_llama, adapters, "a")
        ctl.Pin(mc.PinRequest(name="a", pinned=True), timeout=10)
        with pytest.raises(grpc.RpcError) as e:
            ctl.Evict(mc.EvictRequest(name="a"), timeout=10)
        assert e.value.code() == Code.FAILED_PRECONDITION and "pinned" in e.value.details()
        # b does not fit beside a, which is pinned: the load says why.
        with pytest.raises(grpc.RpcError) as e:
            ctl.LoadAdapter(mc.LoadAdapterRequest(name="b", path=str(adapters["b"])), timeout=10)
        assert e.value.code() == Code.FAILED_PRECONDITION
        ctl.Pin(mc.PinRequest(name="a", pinned=False), timeout=10)
        change = ctl.LoadAdapter(mc.LoadAdapterRequest(name="b"), timeout=10)
        assert (change.slot, change.evicted) == (1, "a")  # a free table row, a's memory
        report = ctl.GetSlots(mc.GetSlotsRequest(), timeout=10)
        room_left = arena_bytes(tiny_llama, adapters["b"]) < arena_bytes(tiny_llama, adapters["a"])
        free = [(0, "", 0)] if room_left else []  # the occupied slots, then one free if memory is left
        assert [(s.index, s.adapter, s.refcount) for s in report.slots] == [(1, "b", 0), *free]
        assert {a.name: a.tier for a in report.adapters} == {"b": mc.TIER_DEVICE, "a": mc.TIER_HOST}
        assert {a.name: a.requests_total for a in report.adapters} == {"b": 0, "a": 1}  # popularity
        where = load(first)  # the same residency, as the gateway sees it
        assert (list(where.resident_adapters), list(where.host_adapters)) == (["b"], ["a"])
        assert ctl.Evict(mc.EvictRequest(name="b"), timeout=10).slot == 1
        wait_idle(first)


def test_bad_control_requests_get_codes(pods):
    first, _ = pods
    with first.channel() as ch, first.control_channel() as cc:
        ctl = _control(cc)
        cases = [
            (lambda: ctl.LoadAdapter(mc.LoadAdapterRequest(name="nope"), timeout=10), Code.NOT_FOUND),
            (lambda: ctl.LoadAdapter(mc.LoadAdapterRequest(name=""), timeout=10), Code.INVALID_ARGUMENT),
            (
                lambda: ctl.LoadAdapter(mc.LoadAdapterRequest(name="x", slot=7, path="/nope"), timeout=10),
                Code.INVALID_ARGUMENT,
            ),
            (
                lambda: ctl.PromoteFromDisk(mc.PromoteFromDiskRequest(name="x"), timeout=10),
                Code.INVALID_ARGUMENT,
            ),
            (lambda: ctl.Pin(mc.PinRequest(name="nope", pinned=True), timeout=10), Code.NOT_FOUND),
            (
                lambda: list(ctl.FetchAdapterWeights(mc.FetchAdapterWeightsRequest(name="nope"), timeout=10)),
                Code.NOT_FOUND,
            ),
        ]
        for call, code in cases:
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == code and e.value.details()
        assert _generate(ch, "a")  # still serving


def test_paths_that_are_not_regular_files_are_refused_promptly(pods, tiny_llama, adapters, tmp_path):
    """A FIFO, /dev/zero (symlinked as the weights), a directory, a 1 GiB + 1 sparse file: every
    RPC that reads a path is INVALID_ARGUMENT within its short deadline (a read would block or
    exhaust memory: DEADLINE_EXCEEDED or a dead pod), and the pod keeps serving `a` unchanged."""
    import os

    from tests.test_upload_hardening import _special_dirs

    first, _ = pods
    cases = _special_dirs(adapters["a"], tmp_path)
    big = tmp_path / "big"
    big.mkdir()
    (big / "adapter_config.json").write_bytes((adapters["a"] / "adapter_config.json").read_bytes())
    with open(big / "adapter_model.safetensors", "wb") as f:
        os.truncate(f.fileno(), (1 << 30) + 1)  # sparse: no disk used, never read
    cases["big"] = (big, "above the limit")
    with first.channel() as ch, first.control_channel() as cc:
        ctl = _control(cc)
        for what, (d, words) in cases.items():
            calls = {
                "LoadAdapter": lambda d=d: ctl.LoadAdapter(
                    mc.LoadAdapterRequest(name="x", path=str(d)), timeout=5
                ),
                "PromoteFromDisk": lambda d=d: ctl.PromoteFromDisk(
                    mc.PromoteFromDiskRequest(name="x", path=str(d)), timeout=5
                ),
                "Rotate": lambda d=d: ctl.Rotate(mc.RotateRequest(name="a", path=str(d)), timeout=5),
                "Rotate+sha256": lambda d=d: ctl.Rotate(
                    mc.RotateRequest(name="a", path=str(d), sha256="0" * 64), timeout=5
                ),
            }
            for rpc, call in calls.items():
                if what == "fifo-config" and rpc == "Rotate+sha256":
                    continue  # reads only the weights: refused by their checksum
                with pytest.raises(grpc.RpcError) as e:
                    call()
                assert e.value.code() == Code.INVALID_ARGUMENT, (what, rpc, e.value.code(), e.value.details())
                assert words in e.value.details(), (what, rpc, e.value.details())
        assert _generate(ch, "a") == _reference(tiny_llama, adapters, "a")
    assert first.proc.poll() is None


def test_gateway_sends_adapter_requests_only_to_pods_that_have_it(pods, tiny_llama, adapters, tmp_path):
    second = pods[1]
    gateway = _gateway(pods, tmp_path)
    try:
        with gateway.channel() as ch:
            for _ in range(4):  # the second pod is idle and would win on load alone
                assert _generate(ch, "a") == _reference(tiny_llama, adapters, "a")
            with pytest.raises(grpc.RpcError) as e:
                _generate(ch, "unknown-adapter")
            assert e.value.code() == Code.NOT_FOUND and "unknown-adapter" in e.value.details()
        assert load(second).requests_total == 0  # the warm-up does not count; no request reached it
    finally:
        gateway.stop()


def test_weights_stream_and_peer_promotion(pods, tiny_llama, adapters):
    first, second = pods
    data = (adapters["a"] / "adapter_model.safetensors").read_bytes()
    with first.control_channel() as cc:
        chunks = list(
            _control(cc).FetchAdapterWeights(mc.FetchAdapterWeightsRequest(name="a", chunk_bytes=1000))
        )
    assert len(chunks) == -(-len(data) // 1000) and chunks[-1].last
    assert b"".join(c.data for c in chunks) == data and chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    with second.channel() as ch, second.control_channel() as cc:
        ctl = _control(cc)
        with pytest.raises(grpc.RpcError) as e:
            ctl.PromoteFromPeer(
                mc.PromoteFromPeerRequest(name="a", peer=first.control_address, sha256="0" * 64), timeout=30
            )
        assert e.value.code() == Code.DATA_LOSS
        sha = hashlib.sha256(data).hexdigest()
        state = ctl.PromoteFromPeer(
            mc.PromoteFromPeerRequest(name="a", peer=first.control_address, sha256=sha),
            timeout=30,
        )
        assert state.tier == mc.TIER_HOST and state.sha256 == hashlib.sha256(data).hexdigest()
        assert _generate(ch, "a") == _reference(tiny_llama, adapters, "a")  # promoted on demand
        # Rotate: the same name now means b's weights.
        rotated = ctl.Rotate(mc.RotateRequest(name="a", path=str(adapters["b"])), timeout=30)
        assert (
            rotated.sha256
            == hashlib.sha256((adapters["b"] / "adapter_model.safetensors").read_bytes()).hexdigest()
        )
        engine = make_engine(tiny_llama, lora_modules={"a": str(adapters["b"])})
        expected = engine.generate(
            [
                {
                    "prompt_token_ids": PROMPT,
                    "max_tokens": 8,
                    "temperature": 0,
                    "ignore_eos": True,
                    "adapter": "a",
                }
            ]
        )[0].token_ids
        assert _generate(ch, "a") == expected
        wait_idle(second)
        # Forget it on this pod: no tier holds it any more, and requests for it are NOT_FOUND.
        ctl.Evict(mc.EvictRequest(name="a", from_disk=True), timeout=30)
        assert "a" not in [a.name for a in ctl.GetSlots(mc.GetSlotsRequest(), timeout=10).adapters]
        with pytest.raises(grpc.RpcError) as e:
            _generate(ch, "a")
        assert e.value.code() == Code.NOT_FOUND


def test_a_new_version_deletes_the_files_the_pod_wrote_for_the_old_one(pods, adapters, cache):
    """The files a pod wrote for a version (fetched from a peer or the service) stayed in its
    cache directory once a new version replaced them: its disk filled with every update."""
    first, second = pods
    sha = hashlib.sha256((adapters["a"] / "adapter_model.safetensors").read_bytes()).hexdigest()
    with second.control_channel() as cc:
        ctl = _control(cc)
        fetch = mc.PromoteFromPeerRequest(name="a", peer=first.control_address, sha256=sha)
        ctl.PromoteFromPeer(fetch, timeout=30)  # written to the cache (a peer transfer)
        assert [p.name for p in cache.iterdir()] == [f"a-{sha[:16]}"]
        ctl.Rotate(mc.RotateRequest(name="a", path=str(adapters["b"])), timeout=30)
        assert list(cache.iterdir()) == []
        assert adapters["b"].exists()  # the operator's own directory is left alone
        ctl.Evict(mc.EvictRequest(name="a", from_disk=True), timeout=30)


def test_set_active_makes_the_active_adapter_reachable_end_to_end(pods, tiny_llama, adapters, tmp_path):
    """SetActive names the adapter that `@active` requests get; the pod then advertises `@active`,
    so the gateway routes such requests only to pods that have one active."""
    first, second = pods
    expected = _reference(tiny_llama, adapters, "b")
    with second.channel() as ch, second.control_channel() as cc:
        ctl = _control(cc)
        assert ctl.GetSlots(mc.GetSlotsRequest(), timeout=10).active_adapter == ""
        assert "@active" not in load(second).available_adapters
        with pytest.raises(grpc.RpcError) as e:
            _generate(ch, "@active")
        assert e.value.code() == Code.FAILED_PRECONDITION and "SetActive" in e.value.details()
        for name, code in (("b", Code.NOT_FOUND), ("@active", Code.INVALID_ARGUMENT)):
            with pytest.raises(grpc.RpcError) as e:  # b is not resident yet; @active is no adapter
                ctl.SetActive(mc.SetActiveRequest(name=name), timeout=10)
            assert e.value.code() == code and e.value.details()
        ctl.LoadAdapter(mc.LoadAdapterRequest(name="b", path=str(adapters["b"])), timeout=10)
        state = ctl.SetActive(mc.SetActiveRequest(name="b"), timeout=10)
        assert state.name == "b" and state.tier == mc.TIER_DEVICE
        assert ctl.GetSlots(mc.GetSlotsRequest(), timeout=10).active_adapter == "b"
        report = load(second)
        assert "@active" in report.available_adapters and "@active" in report.resident_adapters
        assert "@active" not in load(first).available_adapters
        assert _generate(ch, "@active") == expected
    gateway = _gateway(pods, tmp_path)
    try:
        with gateway.channel() as ch:
            for _ in range(3):  # only the second pod has an active adapter
                assert _generate(ch, "@active") == expected
    finally:
        gateway.stop()
    with second.control_channel() as cc:
        ctl = _control(cc)
        wait_idle(second)
        ctl.Evict(mc.EvictRequest(name="b"), timeout=10)  # evicting it clears `@active`
        assert ctl.GetSlots(mc.GetSlotsRequest(), timeout=10).active_adapter == ""
        assert "@active" not in load(second).available_adapters
        ctl.LoadAdapter(mc.LoadAdapterRequest(name="b"), timeout=10)
        ctl.SetActive(mc.SetActiveRequest(name="b"), timeout=10)
        assert ctl.SetActive(mc.SetActiveRequest(name=""), timeout=10).name == ""  # cleared on request
        assert ctl.GetSlots(mc.GetSlotsRequest(), timeout=10).active_adapter == ""
        with second.channel() as ch, pytest.raises(grpc.RpcError) as e:
            _generate(ch, "@active")
        assert e.value.code() == Code.FAILED_PRECONDITION
        ctl.Evict(mc.EvictRequest(name="b"), timeout=10)
