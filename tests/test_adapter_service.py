"""The adapter service end to end: real Redis, moto's S3 server, two model pods, the service and
the gateway, all processes on loopback (tiny random Llama). Outputs are compared token for token
with the engine run directly on the adapter directory."""

from __future__ import annotations

import hashlib
import json
import signal
import struct
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from adapter_service.client import AdaptersClient
from spindle.v1 import adapters_pb2 as apb
from spindle.v1 import adapters_pb2_grpc, model_control_pb2_grpc
from spindle.v1 import generation_pb2 as pb
from spindle.v1 import model_control_pb2 as mc
from tests.adapter_helpers import aws_env, redis_server
from tests.conftest import make_engine
from tests.service_helpers import (
    NOT_SERVING,
    collect,
    free_port,
    load,
    spawn,
    spawn_pod,
    stub,
    token_request,
    wait_serving,
)

Code = grpc.StatusCode
PROMPT = [5, 6, 7, 8, 9]
KEYS = "admin key-admin * admin\nuser key-user *\n"
ADMIN, USER = "key-admin", "key-user"


@pytest.fixture(scope="module")
def cluster(tiny_llama, redis_url, s3, tmp_path_factory):
    import redis

    redis.Redis.from_url(redis_url).flushall()  # the session's Redis may hold other tests' registries
    logs = tmp_path_factory.mktemp("svc")
    metrics = free_port()
    pods = [spawn_pod(tiny_llama.name, logs, f"pod{i}", "--max-loras", "2") for i in range(2)]
    for p in pods:
        wait_serving(p)
    service_args = [
        "--pods", ",".join(p.control_address for p in pods), "--redis-url", redis_url,
        "--s3-bucket", s3.bucket, "--s3-endpoint-url", s3.endpoint, "--s3-region", "us-east-1",
        "--base-model", tiny_llama.name, "--metrics-port", str(metrics), "--poll-interval", "0.3",
        "--lease-ttl", "1.5", "--max-adapter-bytes", "2000000", "--max-lora-rank", "16",
        "--slot-idle-seconds", "0.5", "--host-idle-seconds", "1",
        "--hot-share", "1",  # a few adapters draw all the traffic here: replicas only where asked
    ]  # fmt: skip
    service = spawn("adapter-service", service_args, logs, "adapter-service", env=aws_env())
    keys = logs / "keys"
    keys.write_text(KEYS)
    gateway = spawn(
        "gateway",
        ["--pods", ",".join(p.address for p in pods), "--api-keys-file", str(keys),
         "--adapter-service", wait_serving(service).address, "--health-interval", "0.2"],
        logs, "gateway",
    )  # fmt: skip
    wait_serving(gateway)
    deadline = time.monotonic() + 10
    while gateway.output().count("is healthy") < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    state = {
        "pods": pods,
        "service": service,
        "gateway": gateway,
        "service_args": service_args,
        "logs": logs,
        "metrics": f"http://127.0.0.1:{metrics}/metrics",
    }
    yield state
    for s in (gateway, state["service"], *pods):
        s.stop()


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
        models = stub(ch).ListModels(pb.ListModelsRequest(), metadata=(("authorization", f"Bearer {USER}"),))
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
    """The sum of a Prometheus counter's series on the adapter service."""
    from urllib.request import urlopen

    text = urlopen(cluster["metrics"], timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_new_version_rotates_in_flight_old_ones_finish_on_old_weights(cluster, lora_dirs, tiny_llama):
    gateway = cluster["gateway"]
    assert _generate(gateway, "a") == _reference(tiny_llama, lora_dirs["a"])  # resident somewhere
    n = 480  # long enough to still run while the new version is registered and rotated
    old = _reference(tiny_llama, lora_dirs["a"], n)
    req = token_request(PROMPT, n, temperature=0.0)
    req.adapter = "a"
    with gateway.channel() as ch:
        stream = stub(ch).Generate(req, timeout=120, metadata=(("authorization", f"Bearer {USER}"),))
        first = next(stream)
        with _admin(gateway.address) as c:
            v2 = c.register("a", lora_dirs["a2"])
        assert v2.version == 2
        assert sum(load(p).requests_in_flight for p in cluster["pods"]) == 1  # rotated under it
        rest, _ = collect(stream)
    tokens = [*first.chunk.token_ids, *rest]
    assert tokens == old  # the in-flight request finished on version 1
    assert _generate(gateway, "a") == _reference(tiny_llama, lora_dirs["a2"])  # new ones get version 2


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
        ("too-big", config, good + b"\0" * 2_000_000, None, Code.RESOURCE_EXHAUSTED, "max-adapter-bytes"),
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
        ([header("early", len(blob)), *data], Code.RESOURCE_EXHAUSTED, "--max-adapter-bytes"),
        ([header("early", 1000), *data], Code.RESOURCE_EXHAUSTED, "more than the announced 1000 bytes"),
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
    port = service.address.rsplit(":", 1)[1]
    service.stop()
    restarted = spawn("adapter-service", [*cluster["service_args"], "--port", port], cluster["logs"],
                      "adapter-service-2", env=aws_env())  # fmt: skip
    restarted.address = service.address  # the later --port wins over the one spawn() chose
    cluster["service"] = wait_serving(restarted)
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
