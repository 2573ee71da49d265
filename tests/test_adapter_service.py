"""The adapter service end to end: real Redis, moto's S3 server, two model pods, the service and
the gateway, all processes on loopback (tiny random Llama). Outputs are compared token for token
with the engine run directly on the adapter directory."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import signal
import struct
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from adapter_service.client import AdaptersClient
from spindle.v1 import adapters_pb2 as apb
from spindle.v1 import adapters_pb2_grpc, model_control_pb2_grpc
from spindle.v1 import generation_pb2 as pb
from spindle.v1 import model_control_pb2 as mc
from tests import chaos_helpers as chaos
from tests.adapter_helpers import aws_env, redis_server, s3_server
from tests.conftest import make_engine
from tests.fault_helpers import RestartableRedis
from tests.service_helpers import (
    NOT_SERVING,
    SERVING,
    Service,
    collect,
    free_port,
    load,
    spawn,
    spawn_pod,
    stop_all,
    stub,
    token_request,
    wait_serving,
)

Code = grpc.StatusCode
PROMPT = [5, 6, 7, 8, 9]
KEYS = "admin key-admin * admin\nuser key-user *\n"
ADMIN, USER = "key-admin", "key-user"
AS_USER = (("authorization", f"Bearer {USER}"),)  # a Generate or ListModels call as the user key


RPC_BOUND = 3.0  # the replicas' --rpc-timeout


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory):
    """Its own Redis (restartable) and moto (freezable), two pods, two replicas of the service
    sharing them (the gateway knows both), the gateway. Everything starts at once: the replicas
    wait NOT_SERVING for the pods and Redis."""
    logs = tmp_path_factory.mktemp("svc")
    redis_proc = RestartableRedis(logs)
    redis_proc.start()
    with s3_server(logs) as s3:
        pods = [spawn_pod(tiny_llama.name, logs, f"pod{i}", "--max-loras", "2") for i in range(2)]
        ports, metrics = [free_port(), free_port()], [free_port(), free_port()]
        service_args = [
            "--pods", ",".join(p.control_address for p in pods), "--redis-url", redis_proc.url,
            "--s3-bucket", s3.bucket, "--s3-endpoint-url", s3.endpoint, "--s3-region", "us-east-1",
            "--base-model", tiny_llama.name, "--poll-interval", "0.3",
            "--lease-ttl", "1.5", "--max-adapter-bytes", "2000000", "--max-lora-rank", "16",
            "--slot-idle-seconds", "0.5", "--host-idle-seconds", "1",
            "--hot-share", "1",  # a few adapters draw all the traffic here: replicas only where asked
            "--rpc-timeout", str(RPC_BOUND), "--s3-connect-timeout", "0.5", "--s3-read-timeout", "1",
            "--s3-max-attempts", "2", "--redis-timeout", "0.5", "--redis-max-attempts", "2",
        ]  # fmt: skip
        state = {
            "pods": pods,
            "replicas": [],
            "service_args": service_args,
            "ports": ports,
            "logs": logs,
            "metrics_ports": metrics,
            "redis": redis_proc,
            "s3": s3,
        }
        for i in range(2):
            state["replicas"].append(_replica(state, i))
        keys = logs / "keys"
        keys.write_text(KEYS)
        targets = ",".join(f"127.0.0.1:{p}" for p in ports)
        gateway = spawn(
            "gateway",
            ["--pods", ",".join(p.address for p in pods), "--api-keys-file", str(keys),
             "--adapter-service", f"ipv4:{targets}", "--health-interval", "0.2"],
            logs, "gateway",
        )  # fmt: skip
        state["gateway"] = gateway
        for service in [*pods, *state["replicas"], gateway]:
            wait_serving(service)
        state["service"] = state["replicas"][0]
        deadline = time.monotonic() + 10
        while gateway.output().count("is healthy") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        yield state
        gateway.stop()
        stop_all([*state["replicas"], *pods])
    redis_proc.stop()


def _replica(cluster: dict, i: int, tag: str = "") -> Service:
    """Replica `i` of the service, started (or restarted) on its port; `cluster["service"]` is the
    first. Not waited for."""
    metrics = str(cluster["metrics_ports"][i])
    replica = spawn(
        "adapter-service", [*cluster["service_args"], "--metrics-port", metrics], cluster["logs"],
        f"adapter-service{i}{tag}", env=aws_env(), port=cluster["ports"][i],
    )  # fmt: skip
    if len(cluster["replicas"]) > i:
        cluster["replicas"][i] = replica
    if i == 0 and "service" in cluster:
        cluster["service"] = replica
    return replica


@pytest.fixture
def redis_url(cluster) -> str:
    """The cluster's Redis, not the session's (this module restarts it)."""
    return cluster["redis"].url


@pytest.fixture
def s3(cluster):
    """The cluster's S3, not the session's (this module freezes it)."""
    return cluster["s3"]


_references: dict[tuple[str, int], list[int]] = {}


def _reference(tiny_llama, directory: Path, n: int = 8) -> list[int]:
    key = (str(directory), n)
    if key not in _references:
        engine = make_engine(tiny_llama, lora_modules={"x": str(directory)})
        req = {
            "prompt_token_ids": PROMPT,
            "max_tokens": n,
            "temperature": 0,
            "ignore_eos": True,
            "adapter": "x",
        }
        _references[key] = engine.generate([req])[0].token_ids
    return _references[key]


def _generate(gateway, adapter: str, n: int = 8, key: str = USER) -> list[int]:
    req = token_request(PROMPT, n, temperature=0.0)
    req.adapter = adapter
    with gateway.channel() as ch:
        return collect(stub(ch).Generate(req, timeout=60, metadata=(("authorization", f"Bearer {key}"),)))[0]


def _admin(target: str, key: str | None = ADMIN) -> AdaptersClient:
    return AdaptersClient(target, key)


def _place(service, adapter: str, pods: list[str]) -> apb.PlaceResponse:
    with service.channel() as ch:
        hints = [apb.PodHint(address=p) for p in pods]
        return adapters_pb2_grpc.PlacementStub(ch).Place(
            apb.PlaceRequest(adapter=adapter, pods=hints), timeout=60
        )


def test_register_through_the_gateway_then_generate(cluster, lora_dirs, tiny_llama):
    gateway = cluster["gateway"]
    with _admin(gateway.address, USER) as c, pytest.raises(grpc.RpcError) as e:
        c.register("a", lora_dirs["a"])
    assert e.value.code() == Code.PERMISSION_DENIED and "admin" in e.value.details()
    with _admin(gateway.address) as c:
        a = c.register("a", lora_dirs["a"], description="first")
        assert (a.name, a.version, a.rank) == ("a", 1, 4)
        assert (
            a.sha256
            == hashlib.sha256((lora_dirs["a"] / "adapter_model.safetensors").read_bytes()).hexdigest()
        )
        assert [x.name for x in c.list()] == ["a"]
    with gateway.channel() as ch:  # registered, placed nowhere yet: listed all the same
        models = stub(ch).ListModels(pb.ListModelsRequest(), metadata=AS_USER)
    assert [m.id for m in models.models if m.kind == pb.MODEL_KIND_ADAPTER] == ["a"]
    assert _generate(gateway, "a") == _reference(tiny_llama, lora_dirs["a"])
    with pytest.raises(grpc.RpcError) as e:
        _generate(gateway, "never-registered")
    assert e.value.code() == Code.NOT_FOUND and "not registered" in e.value.details()


def test_active_is_the_pods_own_name_not_the_registrys(cluster, lora_dirs, tiny_llama):
    """`@active` (SetActive on a pod) passes the gateway's registry check and is never placed."""
    from spindle.v1 import model_control_pb2 as mc
    from spindle.v1 import model_control_pb2_grpc

    gateway, service = cluster["gateway"], cluster["service"]
    assert _generate(gateway, "a") == _reference(tiny_llama, lora_dirs["a"])
    with _admin(gateway.address) as c:
        c.pin("a")  # kept in its slot while the test runs
    holder = _place(service, "a", []).pods[0]
    with grpc.insecure_channel(holder) as ch:
        control = model_control_pb2_grpc.ModelControlStub(ch)
        control.SetActive(mc.SetActiveRequest(name="a"), timeout=10)
        try:
            deadline = time.monotonic() + 10
            while True:  # until the gateway's next poll sees `@active` on that pod
                try:
                    assert _generate(gateway, "@active") == _reference(tiny_llama, lora_dirs["a"])
                    break
                except grpc.RpcError as e:
                    assert e.code() == Code.NOT_FOUND and time.monotonic() < deadline, e
                    time.sleep(0.2)
        finally:
            control.SetActive(mc.SetActiveRequest(name=""), timeout=10)
            with _admin(gateway.address) as c:
                c.pin("a", False)


def test_cold_adapter_from_a_peer_then_from_staging_and_storage(cluster, lora_dirs, tiny_llama, redis_url):
    import redis

    service, (p0, p1) = cluster["service"], cluster["pods"]
    holder = _place(service, "a", [])
    assert holder.pods and holder.source == "resident"
    other = p1.control_address if holder.pods[0] == p0.control_address else p0.control_address
    placed = _place(service, "a", [other])  # only `other` is routable: the weights come from the peer
    assert (placed.pods, placed.source) == ([other], "peer")
    with _admin(service.address, None) as c:
        c.register("b", lora_dirs["b"])
    assert _place(service, "b", []).source == "staging"  # staged when registered
    with _admin(service.address, None) as c:
        c.register("c", lora_dirs["c"])
    redis.Redis.from_url(redis_url).flushall()  # registry and staging gone: rebuilt from S3
    placed = _place(service, "c", [])
    assert placed.source == "storage" and placed.version == 1
    with _admin(service.address, None) as c:
        assert [x.name for x in c.list()] == ["a", "b", "c"]
        assert [x.name for x in c.list(page_size=1)] == ["a", "b", "c"]  # three pages, by token
    gateway = cluster["gateway"]
    for name in ("a", "b", "c"):
        assert _generate(gateway, name) == _reference(tiny_llama, lora_dirs[name])


def test_under_load_nothing_in_use_is_evicted(cluster, lora_dirs, tiny_llama):
    """Three adapters on pods of two slots, cooled after 0.5 s idle: the controller keeps evicting
    while requests run. Every answer must be right and none refused."""
    gateway = cluster["gateway"]
    want = {n: _reference(tiny_llama, lora_dirs[n], 24) for n in ("a", "b", "c")}
    wrong, errors = [], []

    def worker(i: int) -> None:
        for j in range(4):
            name = "abc"[(i + j) % 3]
            try:
                got = _generate(gateway, name, 24)
                if got != want[name]:
                    wrong.append((name, got))
            except grpc.RpcError as e:
                errors.append(f"{name}: {e.code().name}: {e.details()}")
            time.sleep(0.3 * (i % 3))  # let the idle timer fire between some requests

    cooled_before = _metric(cluster, "spindle_adapter_cooled_total")
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (wrong, errors) == ([], [])
    assert _metric(cluster, "spindle_adapter_cooled_total") > cooled_before  # it did evict meanwhile


def _metric(cluster, name: str) -> float:
    """The sum of a Prometheus counter's series on the replicas of the adapter service."""
    from urllib.request import urlopen

    urls = [f"http://127.0.0.1:{port}/metrics" for port in cluster["metrics_ports"]]
    texts = [urlopen(url, timeout=5).read().decode() for url in urls]
    return sum(
        float(line.rsplit(" ", 1)[1]) for text in texts for line in text.splitlines() if line.startswith(name)
    )


def test_new_version_rotates_in_flight_old_ones_finish_on_old_weights(cluster, lora_dirs, tiny_llama):
    gateway = cluster["gateway"]
    assert _generate(gateway, "a") == _reference(tiny_llama, lora_dirs["a"])  # resident somewhere
    n = 480  # long enough to still run while the new version is registered and rotated
    old = _reference(tiny_llama, lora_dirs["a"], n)
    req = _greedy_request("a", n)
    with gateway.channel() as ch:
        stream = stub(ch).Generate(req, timeout=120, metadata=AS_USER)
        first = next(stream)
        with _admin(gateway.address) as c:
            v2 = c.register("a", lora_dirs["a2"])
        assert v2.version == 2
        assert sum(load(p).requests_in_flight for p in cluster["pods"]) == 1  # rotated under it
        rest, _ = collect(stream)
    tokens = [*first.chunk.token_ids, *rest]
    assert tokens == old  # the in-flight request finished on version 1
    assert _generate(gateway, "a") == _reference(tiny_llama, lora_dirs["a2"])  # new ones get version 2


def _greedy_request(adapter: str, n: int) -> pb.GenerateRequest:
    req = token_request(PROMPT, n, temperature=0.0)
    req.adapter = adapter
    return req


def _held(cluster, name: str) -> dict[str, mc.AdapterState]:
    """What each pod that has `name` reports of it (GetSlots)."""
    out = {}
    for pod in cluster["pods"]:
        with pod.control_channel() as cc:
            report = model_control_pb2_grpc.ModelControlStub(cc).GetSlots(mc.GetSlotsRequest(), timeout=10)
        out.update((pod.control_address, a) for a in report.adapters if a.name == name)
    return out


def test_delete_in_flight_then_the_name_registered_again_over_a_kept_copy(cluster, lora_dirs, tiny_llama):
    """A Delete while a request runs: the request finishes on the deleted weights, new ones get
    NOT_FOUND, and the pods forget the name at once (the pod refused while the slot was in use,
    and kept the deleted adapter). The name registered again with other weights is version 1
    again; a pod that kept the old weights (unreachable during the Delete) must not serve them
    once that registration is acknowledged (version 1 was never rotated)."""
    gateway, kept = cluster["gateway"], cluster["pods"][0]
    with _admin(gateway.address) as c:
        c.register("d", lora_dirs["a"])
    n = 480  # long enough to still run while the adapter is deleted
    req = _greedy_request("d", n)
    with gateway.channel() as ch:
        stream = stub(ch).Generate(req, timeout=120, metadata=AS_USER)
        first = next(stream)
        with _admin(gateway.address) as c:
            assert c.delete("d") == 1
        with pytest.raises(grpc.RpcError) as e:
            _generate(gateway, "d")
        assert e.value.code() == Code.NOT_FOUND and "'d' is not registered" in e.value.details()
        assert _held(cluster, "d") == {}  # forgotten by the pods while its request runs
        rest, _ = collect(stream)
    assert [*first.chunk.token_ids, *rest] == _reference(tiny_llama, lora_dirs["a"], n)
    with kept.control_channel() as cc:  # the deleted weights, as a pod the Delete missed keeps them
        promote = mc.PromoteFromDiskRequest(name="d", path=str(lora_dirs["a"]))
        model_control_pb2_grpc.ModelControlStub(cc).PromoteFromDisk(promote, timeout=30)
    time.sleep(1.0)  # the gateway's next polls see "d" on that pod
    with _admin(gateway.address) as c:
        again = c.register("d", lora_dirs["b"])
        assert again.version == 1
        assert _generate(gateway, "d") == _reference(tiny_llama, lora_dirs["b"])
        assert {a.sha256 for a in _held(cluster, "d").values()} == {again.sha256}
        c.delete("d")


def test_a_pinned_adapter_stays_pinned_across_a_new_version(cluster, lora_dirs, tiny_llama):
    """The pin was the old version's slot: after an update the adapter was pinned nowhere (and
    the old slot stayed pinned on the pod, its memory never freed)."""
    gateway = cluster["gateway"]
    with _admin(gateway.address) as c:
        c.register("p", lora_dirs["a"])
        assert _generate(gateway, "p") == _reference(tiny_llama, lora_dirs["a"])
        c.pin("p")
        v2 = c.register("p", lora_dirs["a2"])
        held = _held(cluster, "p")
        assert held and {(a.sha256, a.tier, a.pinned) for a in held.values()} == {
            (v2.sha256, mc.TIER_DEVICE, True)
        }
        assert _generate(gateway, "p") == _reference(tiny_llama, lora_dirs["a2"])
        c.delete("p")


def _header(name: str, config: bytes, data: bytes, sha: str | None = None) -> apb.RegisterChunk:
    return apb.RegisterChunk(
        header=apb.RegisterHeader(
            name=name,
            config_json=config,
            total_bytes=len(data),
            sha256=sha or hashlib.sha256(data).hexdigest(),
        )
    )


def _upload(service, name: str, config: bytes, data: bytes, sha: str | None = None) -> grpc.RpcError:
    with service.channel() as ch, pytest.raises(grpc.RpcError) as e:
        adapters_pb2_grpc.AdaptersStub(ch).Register(
            iter([_header(name, config, data, sha), apb.RegisterChunk(data=data)]), timeout=30
        )
    return e.value


def test_bad_uploads_are_refused_and_leave_nothing(cluster, lora_dirs, s3, redis_url, tmp_path):
    import redis

    service = cluster["service"]
    config = (lora_dirs["b"] / "adapter_config.json").read_bytes()
    good = (lora_dirs["b"] / "adapter_model.safetensors").read_bytes()
    n = struct.unpack("<Q", good[:8])[0]
    header = json.loads(good[8 : 8 + n])
    key = next(k for k in header if k != "__metadata__")
    header[key]["data_offsets"][1] += 1 << 20  # points past the end of the file
    text = json.dumps(header).encode()
    lying = struct.pack("<Q", len(text)) + text + good[8 + n :]
    wide = json.loads(good[8 : 8 + n])
    for t in wide.values():  # same bytes, shapes for a model twice as wide
        if isinstance(t, dict) and "shape" in t:
            t["shape"] = [d * 2 if d == 64 else d for d in t["shape"]]
    before = s3.keys()
    cases = [
        ("bad-sha", config, good, "0" * 64, Code.DATA_LOSS, "sha256"),
        ("pickle", config, b"\x80\x04\x95" + good[3:], None, Code.INVALID_ARGUMENT, "pickle"),
        ("../escape", config, good, None, Code.INVALID_ARGUMENT, "not allowed"),
        ("lying", config, lying, None, Code.INVALID_ARGUMENT, "lies"),
        ("wide", config, struct.pack("<Q", len(json.dumps(wide))) + json.dumps(wide).encode() + good[8 + n :],
         None, Code.INVALID_ARGUMENT, ""),
        ("too-big", config, good + b"\0" * 2_000_000, None, Code.OUT_OF_RANGE, "max-adapter-bytes"),
        ("not-lora", b'{"peft_type": "IA3"}', good, None, Code.INVALID_ARGUMENT, "IA3"),
    ]  # fmt: skip
    for name, cfg, data, sha, code, words in cases:
        err = _upload(service, name, cfg, data, sha)
        assert err.code() == code and words in err.details(), (name, err.code(), err.details())
    assert s3.keys() == before
    r = redis.Redis.from_url(redis_url)
    names = {k.decode() for k in r.hkeys("spindle:adapters:index")}
    assert not names & {c[0] for c in cases}
    rank = make_rank_64(lora_dirs, tmp_path)
    with _admin(service.address, None) as c, pytest.raises(grpc.RpcError) as e:
        c.register("rank64", rank)
    assert e.value.code() == Code.INVALID_ARGUMENT and "rank 64" in e.value.details()
    with _admin(service.address, None) as c, pytest.raises(grpc.RpcError) as e:
        c.register("b", lora_dirs["b"])  # the same weights again: nothing new
    assert e.value.code() == Code.ALREADY_EXISTS


def test_an_upload_refused_early_keeps_its_reason_through_the_gateway(cluster, lora_dirs, s3):
    """The service refuses these on the header or mid-stream, while the client (here the
    gateway's grpc.aio relay) is still sending 8 MB of chunks; it reads them before answering,
    so the caller gets the service's own code and words, not grpc.aio's "Internal error from
    Core" (docs/reliability.md)."""
    gateway = cluster["gateway"]
    config = (lora_dirs["b"] / "adapter_config.json").read_bytes()
    data = [apb.RegisterChunk(data=bytes([i]) * (256 << 10)) for i in range(32)]
    blob = b"".join(c.data for c in data)

    def header(name: str, total_bytes: int) -> apb.RegisterChunk:
        chunk = _header(name, config, blob)
        chunk.header.total_bytes = total_bytes
        return chunk

    cases = [
        ([header("../escape", 1000), *data], Code.INVALID_ARGUMENT, "not allowed"),
        ([header("early", len(blob)), *data], Code.OUT_OF_RANGE, "--max-adapter-bytes"),
        ([header("early", 1000), *data], Code.INVALID_ARGUMENT, "more than the announced 1000 bytes"),
        ([header("early", 1000), header("early", 1000), *data], Code.INVALID_ARGUMENT, "only the first"),
    ]
    before = s3.keys()
    with gateway.channel() as ch:
        admin = adapters_pb2_grpc.AdaptersStub(ch)
        for chunks, code, words in cases * 10:  # the reason was lost now and then: a race
            with pytest.raises(grpc.RpcError) as e:
                admin.Register(iter(chunks), metadata=(("authorization", f"Bearer {ADMIN}"),), timeout=30)
            assert e.value.code() == code and words in e.value.details(), (e.value.code(), e.value.details())
    assert s3.keys() == before


def make_rank_64(lora_dirs, tmp_path) -> Path:
    """An adapter above the service's --max-lora-rank 16 (zeros: only the shapes matter)."""
    import numpy as np
    from safetensors.numpy import save_file

    d = tmp_path / "rank64"
    d.mkdir()
    (d / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 64, "target_modules": ["q_proj"]})
    )
    save_file(
        {
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": np.zeros((64, 64), np.float32),
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": np.zeros((64, 64), np.float32),
        },
        str(d / "adapter_model.safetensors"),
    )
    return d


def test_import_from_s3_pin_and_a_service_restart(cluster, lora_dirs, tiny_llama, s3):
    service, gateway = cluster["service"], cluster["gateway"]
    client = s3.client()
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        client.upload_file(str(lora_dirs["c"] / f), s3.bucket, f"uploads/team-x/{f}")
    with service.channel() as ch:
        admin = adapters_pb2_grpc.AdaptersStub(ch)
        imported = admin.Import(
            apb.ImportRequest(name="imported", uri=f"s3://{s3.bucket}/uploads/team-x/"), timeout=30
        )
        assert imported.version == 1 and imported.rank == 4
        with pytest.raises(grpc.RpcError) as e:
            admin.Import(apb.ImportRequest(name="missing", uri=f"s3://{s3.bucket}/nothing-here/"), timeout=30)
        assert e.value.code() == Code.NOT_FOUND
    assert _generate(gateway, "imported") == _reference(tiny_llama, lora_dirs["c"])
    with _admin(gateway.address) as c:
        assert c.pin("imported").pinned
    # A restart of the service (same port): the index comes back from Redis, the pods' view from
    # their slot reports; the pin is kept in storage.
    service.stop()
    wait_serving(_replica(cluster, 0, "-restarted"))
    with _admin(gateway.address) as c:
        deadline = time.monotonic() + 10
        while True:  # until the gateway has reconnected and the service has polled the pods
            try:
                got = c.get("imported")
                if got.placements:
                    break
            except grpc.RpcError as e:
                assert e.code() == Code.UNAVAILABLE, e
            assert time.monotonic() < deadline, "the restarted service never saw the pods' slots"
            time.sleep(0.2)
        assert got.pinned and got.placements[0].tier == apb.PLACEMENT_TIER_DEVICE
        assert c.pin("imported", False).pinned is False
    assert _generate(gateway, "imported") == _reference(tiny_llama, lora_dirs["c"])


def test_registrations_survive_a_killed_replica_a_restarted_redis_and_a_frozen_s3(
    cluster, lora_dirs, tiny_llama, tmp_path
):
    """Three clients register new versions of two adapters (one through the gateway, two straight
    to a replica each; every call retried until acknowledged, as a careful client does) and a
    fourth generates with them through the gateway, while one
    replica is killed (SIGKILL, then restarted on its port), Redis is killed and restarted empty,
    and S3 is frozen (SIGSTOP) for 2.5 s. Afterwards: every acknowledged version is in S3 with its
    sha256, the index holds each name's latest, versions are dense and unique per name, every pod
    holding an adapter holds its latest version and serves it token for token, nothing failed
    outside a fault's window, every failed call returned within the service's bound. Prints the
    counts and the recovery times (docs/reliability.md, "The adapter manager")."""
    import redis

    gateway, pods, replicas, s3 = cluster["gateway"], cluster["pods"], cluster["replicas"], cluster["s3"]
    versions = chaos.variants(lora_dirs, tmp_path)
    by_sha = {chaos.sha256_of(d): d for ds in versions.values() for d in ds}
    log, stop, taken, pick = (
        chaos.Log(),
        threading.Event(),
        {name: 1 for name in chaos.NAMES},
        threading.Lock(),
    )
    with _admin(gateway.address) as c:
        for name in chaos.NAMES:
            chaos.register_until_acked(c, name, versions[name][0], log)
    for name in chaos.NAMES:
        _generate(gateway, name)  # placed on a pod: the later versions rotate it there

    def client(k: int) -> None:
        """Client 0 goes through the gateway (to one replica: its channel picks the first that
        answers); 1 and 2 straight to replica 0 and 1, so both replicas register at once."""
        target = gateway.address if k == 0 else f"127.0.0.1:{cluster['ports'][k - 1]}"
        with _admin(target, ADMIN if k == 0 else None) as c:
            for i in itertools.count(k):
                name = list(chaos.NAMES)[i % 2]
                with pick:
                    n, taken[name] = taken[name], taken[name] + 1
                if stop.is_set() or n >= chaos.VERSIONS:
                    return
                chaos.register_until_acked(c, name, versions[name][n], log)

    def generator() -> None:
        for i in itertools.count():
            if stop.is_set():
                return
            start = time.monotonic()
            try:
                _generate(gateway, list(chaos.NAMES)[i % 2], key=USER)
                log.counts["generated"] += 1
            except grpc.RpcError as e:
                log.fail("generate", start, e)
            time.sleep(0.05)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(3)] + [
        threading.Thread(target=generator)
    ]
    for t in threads:
        t.start()
    recovery: dict[str, float] = {}

    def diagnose() -> str:
        return chaos.diagnosis(log, replicas)

    try:
        time.sleep(1.0)
        killed = time.monotonic()
        replicas[0].stop(signal.SIGKILL)
        chaos.until(lambda: log.first_ack_after(killed) < float("inf"), why=diagnose)
        recovery["replica killed: next acknowledged registration"] = log.first_ack_after(killed)
        restarted = _replica(cluster, 0, "-after-chaos-kill")  # on its port, as Kubernetes restarts it
        log.faults["replica killed"] = (killed, float("inf"))  # until its restart serves (below)
        serving = threading.Thread(target=wait_serving, args=(restarted, 30))
        serving.start()  # while the next fault runs

        time.sleep(0.5)
        down = time.monotonic()
        cluster["redis"].kill()
        time.sleep(0.5)
        cluster["redis"].start()  # same port, empty: the index is rebuilt from S3
        up = time.monotonic()
        log.faults["redis restarted empty"] = (down, up)
        chaos.until(lambda: log.first_ack_after(up) < float("inf"), why=diagnose)
        recovery["redis restarted: next acknowledged registration"] = log.first_ack_after(up)
        serving.join()
        # The replica was down until its restart listened: on a loaded host that is seconds
        # after the process started, and a client's connection refused meanwhile is this fault's.
        log.faults["replica killed"] = (killed, time.monotonic())
        recovery["replica killed: its restart SERVING (Redis restarted meanwhile)"] = (
            time.monotonic() - killed
        )

        frozen = time.monotonic()
        os.kill(s3.proc.pid, signal.SIGSTOP)
        try:
            recovery["s3 frozen: both replicas NOT_SERVING after"] = chaos.until(
                lambda: all(chaos.health(r) == NOT_SERVING for r in replicas), timeout=10
            )
            time.sleep(max(0.0, 2.5 - (time.monotonic() - frozen)))
        finally:
            os.kill(s3.proc.pid, signal.SIGCONT)
        thawed = time.monotonic()
        log.faults["s3 frozen (SIGSTOP)"] = (frozen, thawed)
        recovery["s3 thawed: both replicas SERVING after"] = chaos.until(
            lambda: all(chaos.health(r) == SERVING for r in replicas), timeout=10
        )
        chaos.until(lambda: log.first_ack_after(thawed) < float("inf"), why=diagnose)
        recovery["s3 thawed: next acknowledged registration"] = log.first_ack_after(thawed)
    finally:
        stop.set()
        for t in threads:
            t.join()

    stored = chaos.stored_versions(s3)
    indexed = chaos.indexed_versions(cluster["redis"].url)
    acked = {(n, v): sha for n, v, sha, _ in log.acked}
    for name in chaos.NAMES:
        numbers = sorted(v for n, v in stored if n == name)
        assert numbers == list(range(1, len(numbers) + 1)), f"{name}: versions not dense: {numbers}"
        assert indexed[name] == (numbers[-1], stored[(name, numbers[-1])]), (name, indexed[name])
    lost = {k: sha for k, sha in acked.items() if stored.get(k) != sha}
    assert not lost, f"acknowledged versions not in S3 as acknowledged: {lost}"
    unacked = {k: sha for k, sha in stored.items() if k not in acked and k[0] in chaos.NAMES}
    # Seen twice under load: a client's retries refused for 30 s after the faults ended. The last
    # refusals (when each began, code, text) go with the message, to say what refused them.
    for k, sha in unacked.items():  # indexed, but its answer was lost; the retry made another
        assert sha in set(acked.values()), (
            f"{k} stored, never acknowledged nor retried; {log.last_refusals()}"
        )
    latest = {name: indexed[name][1] for name in chaos.NAMES}

    def pods_hold_latest() -> bool:
        return all(h.get(n, latest[n]) == latest[n] for h in map(chaos.held, pods) for n in chaos.NAMES)

    recovery["after the faults: every holding pod on the latest version"] = chaos.until(pods_hold_latest)
    for name in chaos.NAMES:  # twice: whichever holding pod the gateway picks
        want = _reference(tiny_llama, by_sha[latest[name]])
        assert _generate(gateway, name) == want and _generate(gateway, name) == want
    r = redis.Redis.from_url(cluster["redis"].url)
    assert all(r.ttl(k) > 0 for k in r.keys("spindle:adapters:lock:*")), "a lease without expiry"

    expected, unexpected = Counter(), []
    for op, start, end, code, text in log.failures:
        fault = log.fault_of(start, end)
        bounded = end - start <= RPC_BOUND + chaos.SLACK
        if fault is None or not bounded or code not in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
            unexpected.append((op, round(start - log.started, 2), round(end - start, 2), code, text))
        else:
            expected[f"{op} {code} during {fault}"] += 1
    report = {
        "operations": dict(log.counts, versions_in_s3=len([k for k in stored if k[0] in chaos.NAMES]),
                           stored_but_answer_lost=len(unacked)),
        "faults": list(log.faults),
        "failures_expected": dict(expected),
        "failures_unexpected": unexpected,
        "longest_failed_call_s": round(max((e - s for _, s, e, *_ in log.failures), default=0.0), 2),
        "recovery_s": {k: round(v, 2) for k, v in recovery.items()},
        "messages": sorted({f"{code}: {text[:160]}" for *_, code, text in log.failures}),
    }  # fmt: skip
    print("CHAOS", json.dumps(report, indent=1))
    assert not unexpected, unexpected
    assert not [f for f in log.failures if f[0] == "generate"], "serving must go on through every fault"
    assert log.counts["acknowledged"] >= 10 and log.counts["generated"] >= 10
    with _admin(gateway.address) as c:  # what the next tests expect: only their adapters
        for name in chaos.NAMES:
            c.delete(name)


def test_delete_then_a_killed_pods_adapters_are_placed_elsewhere(cluster, lora_dirs, tiny_llama, s3):
    service, gateway, (p0, p1) = cluster["service"], cluster["gateway"], cluster["pods"]
    with _admin(gateway.address) as c:
        assert c.delete("c") >= 1
        with pytest.raises(grpc.RpcError) as e:
            c.get("c")
        assert e.value.code() == Code.NOT_FOUND
    assert not s3.keys("adapters/c/")
    with pytest.raises(grpc.RpcError) as e:
        _generate(gateway, "c")
    assert e.value.code() == Code.NOT_FOUND
    for pod in (p0, p1):  # forgotten by the pods too, not just hidden by the gateway
        with pod.control_channel() as cc:
            report = model_control_pb2_grpc.ModelControlStub(cc).GetSlots(mc.GetSlotsRequest(), timeout=10)
        assert "c" not in [a.name for a in report.adapters]
    placed = _place(service, "b", [])
    victim = p0 if placed.pods[0] == p0.control_address else p1
    survivor = p1 if victim is p0 else p0
    victim.stop(signal.SIGKILL)
    deadline = time.monotonic() + 10
    with _admin(service.address, None) as c:
        while any(p.pod == victim.control_address for p in c.get("b").placements):
            assert time.monotonic() < deadline, "the killed pod's lease never expired"
            time.sleep(0.2)
    assert _generate(gateway, "b") == _reference(tiny_llama, lora_dirs["b"])
    with _admin(service.address, None) as c:
        assert [p.pod for p in c.get("b").placements] == [survivor.control_address]


def test_not_serving_until_the_registry_answers(tmp_path, tiny_llama):
    """Started before its Redis (as Kubernetes may): it waits NOT_SERVING, then serves."""
    port = free_port()
    service = spawn(
        "adapter-service",
        ["--redis-url", f"redis://127.0.0.1:{port}/0", "--storage-dir", str(tmp_path / "store"),
         "--base-model", tiny_llama.name, "--metrics-port", "0"],
        tmp_path, "late-redis",
    )  # fmt: skip
    try:
        with service.channel() as ch:
            health = health_pb2_grpc.HealthStub(ch)
            deadline = time.monotonic() + 30
            while True:
                try:
                    if health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == NOT_SERVING:
                        break
                except grpc.RpcError:
                    pass
                assert time.monotonic() < deadline and service.proc.poll() is None, service.output()
                time.sleep(0.1)
        with redis_server(tmp_path, port):
            wait_serving(service, timeout=30)
            with _admin(service.address, None) as c:
                assert c.list() == []
    finally:
        service.stop()
