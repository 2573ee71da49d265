"""The adapter service at a platform's scale, without a cluster: what thousands of adapters and
several replicas sharing one Redis and one storage do to staging, to an index rebuilt from
storage, and to deletion (a real Redis, and moto's S3 server where S3's own semantics matter)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from adapter_service.controller import Controller
from adapter_service.registry import MemoryRegistry, RedisRegistry
from adapter_service.server import AdaptersService
from adapter_service.store import LocalStore, S3Store, Version
from spindle.v1 import adapters_pb2 as apb
from tests.adapter_helpers import aws_env


@pytest.fixture
def redis_registry(redis_url):
    import redis

    redis.Redis.from_url(redis_url).flushall()
    return lambda: RedisRegistry(redis_url)


def test_a_copy_staged_by_many_callers_at_once_is_counted_once(redis_registry):
    """Pods fetching one adapter at once (a spread to four pods, or two replicas) each staged it:
    each read the copy's old size, then each added its size to the total, which drifted up for
    good (8 at once: 800 counted for 100 staged). Past the bound, every copy was dropped as soon
    as it was staged. Evictions racing each other must subtract a copy once, too."""

    async def go() -> None:
        a, b = redis_registry(), redis_registry()
        await asyncio.gather(*(r.stage("s1", b"x" * 100, max_total=1000) for r in (a, b) * 4))
        assert int(await a.r.get("spindle:adapters:staging:total")) == 100
        copies = [(f"s{i}", b"y" * 300) for i in range(2, 8)]
        await asyncio.gather(*(r.stage(sha, data, max_total=1000) for sha, data in copies for r in (a, b)))
        sizes = await a.r.hvals("spindle:adapters:staging:size")
        total = int(await a.r.get("spindle:adapters:staging:total"))
        assert total == sum(map(int, sizes)) <= 1000
        await a.stage("new", b"z" * 400, max_total=1000)  # staging still keeps what fits
        assert await b.staged("new") == b"z" * 400
        await a.close()
        await b.close()

    asyncio.run(go())


class _SlowStore(LocalStore):
    """A storage whose reads take an S3 round trip: counts full listings and reads in flight."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.scans, self.in_flight, self.most_in_flight = 0, 0, 0
        self._lock = threading.Lock()

    def _keys(self, prefix: str) -> list[str]:
        self.scans += prefix == ""
        return super()._keys(prefix)

    def _read(self, key: str) -> bytes:
        with self._lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        time.sleep(0.01)
        with self._lock:
            self.in_flight -= 1
        return super()._read(key)


def _meta(store: LocalStore, i: int) -> Version:
    v = Version(f"ad-{i:04d}", 1, f"{i:064x}", 4, 8, ["q_proj"], "base", 0.0)
    store._write(f"{v.name}/v000001/meta.json", v.to_json().encode())
    return v


def test_a_flushed_index_is_rebuilt_once_for_concurrent_lookups_reading_storage_concurrently(
    redis_registry, tmp_path
):
    """Redis flushed under 10,000 adapters: every lookup that missed (each Place, Get, List,
    Catalog) rebuilt the whole index itself, each a listing and one read per adapter, one read at
    a time: 2,000 adapters on moto took 12 s a rebuild, and 8 lookups at once 56 s (8 rebuilds);
    10,000 on S3 outlast every RPC's bound. Now concurrent lookups share one rebuild, which reads
    the commit marks concurrently, and each finds its adapter."""
    store = _SlowStore(tmp_path / "store")
    names = [_meta(store, i).name for i in range(64)]

    async def go() -> None:
        c = Controller(redis_registry(), store, discover=lambda: asyncio.sleep(0, []), advertise="x:1")
        found = await asyncio.gather(*(c.lookup(n) for n in names[:8]))
        assert [v.name if v else None for v in found] == names[:8]
        assert store.scans == 1 and store.most_in_flight >= 8
        assert sorted(await c.latest()) == names
        await c.registry.close()

    asyncio.run(go())


class _Aborted(Exception):
    pass


class _Context:
    """What the admin handlers use of a grpc.aio context: abort raises with the status."""

    async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata: tuple = ()) -> None:
        raise _Aborted(code, details)


class _FailingDeletes(LocalStore):
    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.failures = 1

    def _delete(self, keys: list[str]) -> None:
        if self.failures:
            self.failures -= 1
            raise OSError("storage refused the delete")
        super()._delete(keys)


def test_a_delete_that_storage_failed_is_finished_by_its_retry(tmp_path):
    """Delete unindexes first, then deletes from storage (the truth). Storage failing answered
    UNAVAILABLE "not deleted, retry", but the retry answered NOT_FOUND (the index no longer had
    it) and the files stayed, to come back at the next rebuild of the index. The retry now
    finds what storage still holds and deletes it."""
    store = _FailingDeletes(tmp_path / "store")
    _meta(store, 1)

    async def go() -> None:
        c = Controller(MemoryRegistry(), store, discover=lambda: asyncio.sleep(0, []), advertise="x:1")
        await c.ensure_built()
        admin = AdaptersService(c, None, max_rank=64, max_adapter_bytes=1 << 20)
        request = apb.DeleteAdapterRequest(name="ad-0001")
        with pytest.raises(_Aborted) as failed:
            await admin.Delete(request, _Context())
        assert failed.value.args[0] == grpc.StatusCode.UNAVAILABLE
        assert (await admin.Delete(request, _Context())).versions_deleted == 1
        assert store._keys("") == []
        with pytest.raises(_Aborted) as gone:
            await admin.Delete(request, _Context())
        assert gone.value.args[0] == grpc.StatusCode.NOT_FOUND

    asyncio.run(go())


@pytest.mark.parametrize("refusals", [1, 99])
def test_objects_s3_did_not_delete_are_retried_then_reported(s3, monkeypatch, refusals):
    """DeleteObjects answers 200 and lists the keys it could not delete in `Errors` (boto3 raises
    nothing). They were ignored: a Delete answered done while storage kept the version, which
    came back at the next rebuild of the index. They are retried, and still there: an error."""
    for k, v in aws_env().items():
        monkeypatch.setenv(k, v)
    store = S3Store(s3.bucket, f"scale-{time.monotonic_ns()}/", s3.endpoint, "us-east-1")
    _meta(store, 1)
    store._write("ad-0001/v000001/adapter_config.json", b"{}")
    delete, stuck = store.s3.delete_objects, store.prefix + "ad-0001/v000001/meta.json"
    left = [refusals]

    def partly(**call: Any) -> dict:  # one key refused `refusals` times, as S3 may
        refused = [o for o in call["Delete"]["Objects"] if o["Key"] == stuck and left[0] > 0]
        left[0] -= bool(refused)
        kept = [o for o in call["Delete"]["Objects"] if o not in refused]
        reply = delete(Bucket=call["Bucket"], Delete={**call["Delete"], "Objects": kept}) if kept else {}
        errors = [{"Key": stuck, "Code": "InternalError", "Message": "retry"} for _ in refused]
        return {**reply, "Errors": errors}

    store.s3.delete_objects = partly
    if refusals == 1:
        assert asyncio.run(store.remove("ad-0001")) == 1 and store._keys("") == []
    else:
        with pytest.raises(OSError, match=r"ad-0001/v000001/meta\.json: InternalError"):
            asyncio.run(store.remove("ad-0001"))
        assert store._keys("") == ["ad-0001/v000001/meta.json"]


def test_a_list_of_thousands_is_paged_in_order_with_placements_in_a_few_round_trips(
    redis_registry, monkeypatch, tmp_path
):
    """Listing 1,500 adapters held by 16 pods: a page_size above the most (1,000) is coerced to
    it, as AIP-158 asks (it was INVALID_ARGUMENT); the pages hold every adapter once, in order,
    each with its placement; and a page costs a few Redis round trips, not three per adapter
    (a page of 1,000 took 3,000 round trips: 0.5 s on loopback)."""
    from redis.asyncio.connection import Connection

    names = [f"ad-{i:04d}" for i in range(1500)]
    round_trips = [0]
    send = Connection.send_packed_command

    async def counted(self: Connection, *args: Any, **kwargs: Any) -> None:
        round_trips[0] += 1
        await send(self, *args, **kwargs)

    async def go() -> None:
        reg = redis_registry()
        await reg.rebuild([Version(n, 1, "s", 4, 8, ["q_proj"], "base", 0.0) for n in names])
        for pod in range(16):
            held = {n: {"tier": 3, "version": 1, "refcount": pod, "sha256": ""} for n in names[pod::16]}
            await reg.lease_many(f"pod{pod}:50053", held, ttl=30)
        store = LocalStore(tmp_path / "store")
        c = Controller(reg, store, discover=lambda: asyncio.sleep(0, []), advertise="x:1")
        admin = AdaptersService(c, None, max_rank=64, max_adapter_bytes=1 << 20)
        monkeypatch.setattr(Connection, "send_packed_command", counted)
        listed, token, pages = [], "", []
        while True:
            before = round_trips[0]
            page = await admin.List(apb.ListAdaptersRequest(page_size=5000, page_token=token), _Context())
            pages.append((len(page.adapters), round_trips[0] - before))
            listed += [(a.name, [(p.pod, p.refcount) for p in a.placements]) for a in page.adapters]
            if not (token := page.next_page_token):
                break
        assert [n for n, _ in pages] == [1000, 500] and all(trips <= 8 for _, trips in pages), pages
        assert listed == [(n, [(f"pod{i % 16}:50053", i % 16)]) for i, n in enumerate(names)]
        await reg.close()

    asyncio.run(go())


def test_a_list_answer_fits_any_grpc_clients_default_message_limit(tmp_path):
    """A page of 1,000 adapters with 4 KiB descriptions was one 4.1 MB answer, past the 4 MiB that
    gRPC clients receive by default (grpcurl, Go, Java, `spindle adapters list`) with a few
    placements, and descriptions had no bound: the listing failed RESOURCE_EXHAUSTED for all.
    A page now ends before it would pass 3 MiB (AIP-158: a page may hold fewer than page_size),
    and a description is at most 4 KiB."""
    from adapter_service.server import _Refused

    names = [f"ad-{i:04d}" for i in range(1000)]

    async def go() -> None:
        reg = MemoryRegistry()
        versions = [Version(n, 1, "s", 4, 8, ["q_proj"], "base", 0.0, description="d" * 4096) for n in names]
        await reg.rebuild(versions)
        c = Controller(
            reg, LocalStore(tmp_path / "store"), discover=lambda: asyncio.sleep(0, []), advertise="x:1"
        )
        admin = AdaptersService(c, None, max_rank=64, max_adapter_bytes=1 << 20)
        listed, token = [], ""
        while True:
            page = await admin.List(apb.ListAdaptersRequest(page_size=1000, page_token=token), _Context())
            assert 0 < page.ByteSize() <= 3 << 20
            listed += [a.name for a in page.adapters]
            if not (token := page.next_page_token):
                break
        assert listed == names
        header = apb.RegisterHeader(name="x", config_json=b"{}", total_bytes=1, sha256="0" * 64)
        header.description = "d" * 4097
        with pytest.raises(_Refused, match="description"):
            admin._header(apb.RegisterChunk(header=header))

    asyncio.run(go())


def test_only_the_layouts_keys_are_read_as_adapters(tmp_path, monkeypatch):
    """Under an empty prefix (a bucket's root) or beside other tools' files, any key ending in
    `/meta.json` was parsed as a version: one unrelated `models/x/config/meta.json` made every
    rebuild of the index fail (TypeError), so after a Redis flush nothing was served. Only
    `NAME/vNNNNNN/meta.json` is read now. A prefix that is not a folder (`adapters`, no '/')
    also listed its neighbours (`adapters-canary/...`): it is refused, naming the flag."""
    store = LocalStore(tmp_path / "store")
    _meta(store, 1)
    store._write("models/x/config/meta.json", b'{"framework": "other"}')
    store._write("notes/meta.json", b"not json")
    assert [v.name for v in asyncio.run(store.versions(latest=True))] == ["ad-0001"]
    for k, v in aws_env().items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match="--s3-prefix 'adapters' must end with '/'"):
        S3Store("bucket", "adapters", "http://127.0.0.1:1", "us-east-1")
