"""Several adapter-service replicas on one registry, and bounded backend calls, without a cluster:
the leases and version scripts against both registries (a real Redis), concurrent registrations
and placements from two replicas, a registration given up by its bound, a dead replica's lease
and what it left unindexed, Redis and S3 calls to a server that accepts and never answers, a
cancellation that a Redis write drops (the poll loop and a lease's renewals still end), and the
CLI's --timeout."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from adapter_service import client as adapters_cli
from adapter_service.controller import Controller
from adapter_service.deadlines import BoundExceeded, Bounds, within
from adapter_service.leases import Leases
from adapter_service.registration import register
from adapter_service.registry import MemoryRegistry, RedisRegistry, cancel_and_wait
from adapter_service.store import LocalStore, S3Store, Version
from spindle import envflags
from spindle.v1 import model_control_pb2_grpc
from tests.service_helpers import free_port
from tests.test_adapter_service_units import _FakePod


@pytest.fixture(params=["memory", "redis"])
def registries(request):
    """A factory of registry clients that share one registry (replicas of the service)."""
    if request.param == "memory":
        shared = MemoryRegistry()
        return lambda: shared
    url = request.getfixturevalue("redis_url")
    import redis

    redis.Redis.from_url(url).flushall()
    return lambda: RedisRegistry(url)


def _v(name: str, n: int, sha: str = "") -> Version:
    return Version(name, n, sha or f"sha{n}", 4, 8, ["q_proj"], "base", 0.0)


def test_versions_only_for_the_lease_holder_and_the_index_never_goes_back(registries):
    async def go() -> None:
        a, b = registries(), registries()
        assert await a.acquire("register:x", "A", ttl=0.5)
        assert not await b.acquire("register:x", "B", ttl=5)
        assert await b.assign_version("x", "B", floor=0) is None  # not B's lease
        assert await a.assign_version("x", "A", floor=3) == 4  # past what storage holds
        assert not await b.commit(_v("x", 4), "B")
        assert await a.commit(_v("x", 4), "A") and (await b.get("x")).version == 4
        assert await a.assign_version("x", "A", floor=0) == 5  # past the index too
        assert await a.commit(_v("x", 3), "A") and (await b.get("x")).version == 4  # never back
        await b.release("register:x", "B")  # not B's to release
        assert not await b.acquire("register:x", "B", ttl=5)
        await asyncio.sleep(0.6)  # A stopped renewing (died): the lease expires
        assert not await a.renew("register:x", "A", ttl=5)
        assert await b.acquire("register:x", "B", ttl=5)
        await a.rebuild([_v("x", 2), _v("y", 1)])  # a rebuild from a stale listing undoes nothing
        assert (await a.get("x")).version == 4 and (await a.get("y")).version == 1

    asyncio.run(go())


def test_a_hold_whose_lease_lapsed_cannot_renew_release_or_commit_under_the_next_holders():
    """Leases are owned per hold, not per replica: after the registry lost a lease (restarted)
    and another attempt on the same replica took the name, the first attempt's renewals,
    release and commit are refused, and the second's lease and versions stand."""

    async def go() -> None:
        registry = MemoryRegistry()
        leases = Leases(registry, ttl=5.0, owner="replica")
        async with leases.hold("register:x", "x") as first:
            registry.locks.clear()  # the registry restarted: every lease is gone
            async with leases.hold("register:x", "x") as second:
                assert first != second and second.startswith("replica")
                assert not await registry.renew("register:x", first, 5.0)
                assert await registry.assign_version("x", first, 0) is None
                assert not await registry.commit(_v("x", 1), first)
                await registry.release("register:x", first)
                assert not await registry.acquire("register:x", "another replica", 5.0)  # still held
                assert await registry.assign_version("x", second, 0) == 1
                assert await registry.commit(_v("x", 1), second)
            assert await registry.acquire("register:x", "another replica", 5.0)  # released on exit
        assert (await registry.get("x")).version == 1

    asyncio.run(go())


def test_one_leader_at_a_time_and_another_takes_over(registries):
    async def go() -> None:
        first, second = Leases(registries(), owner="first"), Leases(registries(), owner="second")
        assert await first.lead(0.4) and not await second.lead(0.4)
        await asyncio.sleep(0.25)
        assert await first.lead(0.4) and not await second.lead(0.4)  # renewed in time: still first's
        await asyncio.sleep(0.5)  # first stops (dies)
        assert await second.lead(0.4) and not await first.lead(0.4)

    asyncio.run(go())


class _SlowPod(_FakePod):
    """A pod whose weight copy takes a while, so two placements overlap; counts the copies."""

    def __init__(self) -> None:
        super().__init__()
        self.copies = 0

    async def PromoteFromPeer(self, request, context):
        self.copies += 1
        await asyncio.sleep(0.3)
        return await super().PromoteFromPeer(request, context)


def test_two_replicas_asked_to_place_one_adapter_at_once_load_it_once(registries, tmp_path):
    address = f"127.0.0.1:{free_port()}"

    async def go() -> None:
        pod, server = _SlowPod(), grpc.aio.server()
        model_control_pb2_grpc.add_ModelControlServicer_to_server(pod, server)
        server.add_insecure_port(address)
        await server.start()
        store = LocalStore(tmp_path / "store")
        replicas = [
            Controller(r, store, discover=lambda: asyncio.sleep(0, [address]), advertise="127.0.0.1:1")
            for r in (registries(), registries())
        ]
        try:
            await replicas[0].registry.rebuild([_v("a", 1, "sha-a")])
            placed = await asyncio.gather(*(c.place("a", []) for c in replicas))
            assert pod.copies == 1  # one replica placed it; the other waited and found it there
            assert [list(p.pods) for p in placed] == [[address], [address]]
            assert sorted(p.source for p in placed) == ["resident", "storage"]
        finally:
            for c in replicas:
                await c.close()
            await server.stop(None)

    asyncio.run(go())


def _replica(registry, store, ttl: float = 5.0) -> Controller:
    return Controller(
        registry, store, discover=lambda: asyncio.sleep(0, []), advertise="127.0.0.1:1", lease_ttl=ttl
    )


def _describe(name: str, sha: str):
    return lambda number, latest: _v(name, number, sha)


def test_two_replicas_registering_one_name_at_once_get_dense_unique_versions(registries, tmp_path):
    weights = tmp_path / "w"
    weights.write_bytes(b"weights")

    async def go() -> None:
        store = LocalStore(tmp_path / "store")
        replicas = [_replica(registries(), store), _replica(registries(), store)]

        async def one(i: int):
            c = replicas[i % 2]
            sha = f"{i:064x}"
            return await register(c, c.leases, "x", sha, b"{}", weights, _describe("x", sha))

        done = await asyncio.gather(*(one(i) for i in range(12)))
        assert sorted(d.version.version for d in done) == list(range(1, 13)) and all(d.new for d in done)
        stored = await store.versions("x")
        assert [v.version for v in stored] == list(range(1, 13))
        assert {v.version: v.sha256 for v in stored} == {d.version.version: d.version.sha256 for d in done}
        assert (await replicas[1].registry.get("x")).version == 12
        again = await register(replicas[1], replicas[1].leases, "x", stored[-1].sha256, b"{}", weights,
                               _describe("x", stored[-1].sha256))  # fmt: skip
        assert (again.new, again.version.version) == (False, 12)  # a retry makes no second version

    asyncio.run(go())


class _CountingStore(LocalStore):
    """Counts the files it reads."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.reads = 0

    def _read(self, key: str) -> bytes:
        self.reads += 1
        return super()._read(key)


def test_a_registrations_storage_reads_do_not_grow_with_the_names_history(registries, tmp_path):
    """Under the name's lease a registration reads the latest commit mark only: the 30th version
    costs the reads the 2nd did (it read every version's meta.json until 2026-12-06, while the
    name's other registrations waited on the lease: the chaos test's CI failure)."""
    weights = tmp_path / "w"
    weights.write_bytes(b"weights")

    async def go() -> None:
        store = _CountingStore(tmp_path / "store")
        c = _replica(registries(), store)
        reads = []
        for i in range(30):
            sha, before = f"{i:064x}", store.reads
            done = await register(c, c.leases, "x", sha, b"{}", weights, _describe("x", sha))
            assert done.version.version == i + 1
            reads.append(store.reads - before)
        assert reads[1] <= 1 and reads[-1] == reads[1], reads

    asyncio.run(go())


class _BlockedStore(LocalStore):
    """Its writes wait until `go` is set: a storage that stopped answering."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.go = threading.Event()

    def _write(self, key: str, data: bytes | Path) -> None:
        self.go.wait(10)
        super()._write(key, data)


def test_a_registration_past_its_bound_names_storage_and_stores_nothing(tmp_path):
    weights = tmp_path / "w"
    weights.write_bytes(b"weights")

    async def go() -> None:
        store, registry = _BlockedStore(tmp_path / "store"), MemoryRegistry()
        c = _replica(registry, store)
        started = time.monotonic()
        with pytest.raises(BoundExceeded) as e:
            await within(0.3, register(c, c.leases, "x", "a" * 64, b"{}", weights, _describe("x", "a" * 64)))
        assert time.monotonic() - started < 1.0
        assert f"storage (directory {store.root}) did not answer within 0.3 s" in str(e.value)
        assert not await registry.acquire("register:x", "other", ttl=5)  # held while the write runs
        store.go.set()  # storage answers again: the given-up registration writes no commit mark
        deadline = time.monotonic() + 5
        while not await registry.acquire("register:x", "other", ttl=5):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        assert store._keys("") == [] and await registry.get("x") is None

    asyncio.run(go())


def test_a_dead_replicas_lease_expires_and_what_it_left_unindexed_is_rolled_back(registries, tmp_path):
    weights = tmp_path / "w"
    weights.write_bytes(b"weights")

    async def go() -> None:
        store = LocalStore(tmp_path / "store")
        registry = registries()
        await registry.rebuild([])  # the index is built: it has no "x"
        await store.put(_v("x", 1, "c" * 64), b"{}", weights)  # stored, never indexed: not acknowledged
        store._write("x/v000002/adapter_model.safetensors", b"half")  # no commit mark
        assert await registry.acquire("register:x", "dead-replica", ttl=0.3)
        c = _replica(registry, store)
        started = time.monotonic()
        done = await register(c, c.leases, "x", "b" * 64, b"{}", weights, _describe("x", "b" * 64))
        assert time.monotonic() - started >= 0.2  # waited for the dead replica's lease
        assert done.version.version == 1 and done.version.sha256 == "b" * 64
        assert [v.sha256 for v in await store.versions("x")] == ["b" * 64]
        assert store._keys("x/v000002/") == []

    asyncio.run(go())


@contextlib.contextmanager
def _silent_server() -> Iterator[int]:
    """A TCP port that accepts connections and never answers (a frozen process looks so)."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                accepted.append(listener.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        for s in [listener, *accepted]:
            s.close()


def test_redis_and_s3_calls_to_a_server_that_never_answers_end_within_their_bounds(monkeypatch):
    import botocore.exceptions
    import redis.exceptions

    bounds = Bounds(s3_connect=0.2, s3_read=0.2, s3_attempts=2, redis=0.2, redis_attempts=2)
    for k, v in {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x"}.items():
        monkeypatch.setenv(k, v)
    with _silent_server() as port:
        started = time.monotonic()
        with pytest.raises(redis.exceptions.TimeoutError):
            asyncio.run(RedisRegistry(f"redis://127.0.0.1:{port}/0", bounds=bounds).get("x"))
        assert time.monotonic() - started < 2 * 0.2 + 1.0
        store = S3Store("bucket", "p/", f"http://127.0.0.1:{port}", "us-east-1", bounds)
        started = time.monotonic()
        with pytest.raises(botocore.exceptions.ReadTimeoutError):
            asyncio.run(store.check())
        assert time.monotonic() - started < bounds.s3_call_seconds()


@pytest.fixture
def lose_a_cancel(monkeypatch) -> list[Callable[[], None]]:
    """Callbacks run (once each) by the next Redis command's write from inside it, just as the write
    finishes: a cancellation they cause then meets that command where Python 3.11's `wait_for`
    (around redis-py's writes) drops it, and a loop of registry calls runs on
    (registry.cancel_and_wait)."""
    from redis.asyncio.connection import Connection

    write, armed = Connection._send_packed_command, []

    async def write_then(self: Connection, command: Any) -> None:
        await write(self, command)
        while armed:
            armed.pop()()

    monkeypatch.setattr(Connection, "_send_packed_command", write_then)
    return armed


async def _ended_within(seconds: float, task: asyncio.Task) -> bool:
    """Whether `task` ended within `seconds`; every other task is stopped after, so a loop that
    outlived its cancel does not hold up `asyncio.run`."""
    done, _ = await asyncio.wait({task}, timeout=seconds)
    for t in asyncio.all_tasks() - {asyncio.current_task()}:
        await cancel_and_wait(t)
    return bool(done)


def test_close_ends_the_poll_loop_when_its_cancel_meets_a_redis_write(redis_url, tmp_path, lose_a_cancel):
    async def go() -> None:
        c = Controller(
            RedisRegistry(redis_url), LocalStore(tmp_path), discover=lambda: asyncio.sleep(0, []),
            advertise="127.0.0.1:1", poll_interval=0.01,
        )  # fmt: skip
        await c.start()
        closing: list[asyncio.Task] = []
        lose_a_cancel.append(lambda: closing.append(asyncio.ensure_future(c.close())))
        while not closing:  # the loop's next registry call
            await asyncio.sleep(0.01)
        assert await _ended_within(2.0, closing[0]), "Controller.close waited on a poll loop that went on"

    asyncio.run(go())


def test_a_hold_ends_when_its_renewals_cancel_meets_a_redis_write(redis_url, lose_a_cancel):
    async def go() -> None:
        leases = Leases(RedisRegistry(redis_url), ttl=0.3)  # renewed every 0.1 s

        async def hold() -> None:
            async with leases.hold("k", "a test"):
                renewing = asyncio.Event()
                lose_a_cancel.append(renewing.set)
                await renewing.wait()  # the block ends as a renewal's write finishes

        assert await _ended_within(2.0, asyncio.create_task(hold())), "the hold waited on its renewals"

    asyncio.run(go())


def test_the_adapters_cli_takes_timeout_before_or_after_the_action():
    parser = adapters_cli.build_parser(argparse.ArgumentParser())
    assert parser.parse_args(["list"]).timeout == adapters_cli.TIMEOUT
    assert parser.parse_args(["--timeout", "5", "list"]).timeout == 5
    assert parser.parse_args(["register", "x", "d", "--timeout", "7"]).timeout == 7
    assert parser.parse_args(["--timeout", "5", "pin", "x", "--timeout", "9"]).timeout == 9
    envflags.apply_env(parser, {"SPINDLE_TIMEOUT": "3"})
    assert parser.parse_args(["get", "x"]).timeout == 3
