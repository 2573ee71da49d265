"""The registry: the index of registered adapters, pod leases, and the staging copies.

Two implementations behind one interface: Redis (redis-py asyncio) for a cluster, and an
in-process one for `spindle up`. Neither is the source of truth: the store is. The index is
rebuilt from it whenever the `built` mark is missing (a new, flushed or replaced Redis).

- index: name -> the latest Version (JSON), names kept sorted for paged listing;
- leases: which pod holds which version in which tier, each with an expiry; a lease is renewed
  by every successful poll of the pod, so a crashed pod's leases lapse on their own;
- staging: a bounded hot copy of small adapters' weights by sha256, so placing one does not
  always go to S3; the oldest copies go first when the bound is reached;
- generation: a token that changes with every change to the index, so a reader of the whole
  index (the controller, every poll) reads and decodes it again only when it changed: with
  10,000 adapters that was most of the service's CPU;
- locks: named leases held by one replica of the service (`acquire`, `renew`, `release`; see
  adapter_service/leases.py), and the two steps of a registration that must be atomic across
  replicas: `assign_version` (the next version of a name, only for the holder of the name's
  registration lease) and `commit` (index it, only while still holding that lease). In Redis
  each is one Lua script, so no replica acts on what another changed between a read and a write.

The index never goes back: a rebuild or a commit leaves a name whose indexed version is higher
alone (a rebuild racing a registration on another replica must not undo it).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from adapter_service.deadlines import Bounds, track
from adapter_service.store import Version
from spindle import redis_client

_P = "spindle:adapters:"

# KEYS: the lock; ARGV: owner, ttl in ms. The lock renewed only by its holder.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
# KEYS: the lock; ARGV: owner. Released only by its holder (an expired one may be another's now).
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# KEYS: the name's registration lock, the index; ARGV: owner, name, floor (the highest version
# in storage). The next version: one past both the index's and storage's; -1 without the lock.
_ASSIGN = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
local indexed = redis.call('HGET', KEYS[2], ARGV[2])
local top = tonumber(ARGV[3])
if indexed then top = math.max(top, cjson.decode(indexed)['version']) end
return top + 1
"""
# KEYS: the lock, index, names, generation; ARGV: owner, name, version JSON, version, token.
# 1 = indexed, 0 = the lock is not the caller's (expired, taken, or Redis restarted).
_COMMIT = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local indexed = redis.call('HGET', KEYS[2], ARGV[2])
if indexed and cjson.decode(indexed)['version'] > tonumber(ARGV[4]) then return 1 end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
redis.call('ZADD', KEYS[3], 0, ARGV[2])
redis.call('SET', KEYS[4], ARGV[5])
return 1
"""
# KEYS: index, names, built, generation; ARGV: token, then (name, version, JSON) triples.
_REBUILD = """
for i = 2, #ARGV, 3 do
  local indexed = redis.call('HGET', KEYS[1], ARGV[i])
  if not indexed or cjson.decode(indexed)['version'] < tonumber(ARGV[i + 1]) then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 2])
    redis.call('ZADD', KEYS[2], 0, ARGV[i])
  end
end
redis.call('SET', KEYS[3], '1')
redis.call('SET', KEYS[4], ARGV[1])
return 1
"""
# KEYS: staged:SHA, staging (sha -> when), staging:size (sha -> bytes), staging:total; ARGV: sha,
# the copy, now. Stores the copy and returns the staged total, each sha counted once; a total
# missing (first use, or a Redis staged into before it was kept) is summed from the sizes first.
_STAGE = """
if redis.call('EXISTS', KEYS[4]) == 0 then
  local total = 0
  for _, n in ipairs(redis.call('HVALS', KEYS[3])) do total = total + tonumber(n) end
  redis.call('SET', KEYS[4], total)
end
local before = tonumber(redis.call('HGET', KEYS[3], ARGV[1]) or '0')
redis.call('SET', KEYS[1], ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], string.len(ARGV[2]))
return redis.call('INCRBY', KEYS[4], string.len(ARGV[2]) - before)
"""
# KEYS: as _STAGE's; ARGV: sha. Drops the copy and returns the staged total: a copy two callers
# drop at once is subtracted once.
_UNSTAGE = """
local n = redis.call('HGET', KEYS[3], ARGV[1])
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
if n then
  redis.call('HDEL', KEYS[3], ARGV[1])
  return redis.call('DECRBY', KEYS[4], n)
end
return tonumber(redis.call('GET', KEYS[4]) or '0')
"""


async def cancel_and_wait(task: asyncio.Task) -> None:
    """Cancel `task` and wait until it has ended, cancelling it again while it runs on. A loop of
    registry calls can outlive one cancellation on Python 3.11: redis-py bounds each command's
    write with `asyncio.wait_for`, which there hands the write's result to a task cancelled while
    the write finished (python/cpython#86296), and the command goes on as if nothing happened.
    The controller's poll loop and a lease's renewals then ran on, and whoever awaited them (the
    service's shutdown, at SIGTERM) waited forever: the likely cause of an adapter service that
    sat 30 s after SIGTERM in a test run."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.1)
    await asyncio.gather(task, return_exceptions=True)  # its exception, retrieved


@track
class MemoryRegistry:
    """The embedded registry: this process's memory (lost on restart, rebuilt from the store)."""

    label = "registry (in-process)"

    def __init__(self) -> None:
        self.index: dict[str, Version] = {}
        self.locks: dict[str, tuple[str, float]] = {}  # key -> (owner, expiry)
        self.built = False
        self.lease_table: dict[str, dict[str, tuple[float, dict[str, Any]]]] = {}
        self.staging: dict[str, bytes] = {}
        self.changed = ""  # the index's generation

    async def generation(self) -> str | None:
        return self.changed

    async def check(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def is_built(self) -> bool:
        return self.built

    async def rebuild(self, versions: list[Version]) -> None:
        for v in versions:
            if v.name not in self.index or self.index[v.name].version < v.version:
                self.index[v.name] = v
        self.built, self.changed = True, uuid.uuid4().hex

    def _holder(self, key: str) -> str | None:
        owner, expiry = self.locks.get(key, ("", 0.0))
        return owner if expiry > time.monotonic() else None

    async def indexed_version(self, name: str) -> int | None:
        """The version of `name` in the index (0: none); None while the index is not built."""
        if not self.built:
            return None
        return self.index[name].version if name in self.index else 0

    async def acquire(self, key: str, owner: str, ttl: float) -> bool:
        if self._holder(key) is not None:
            return False
        self.locks[key] = (owner, time.monotonic() + ttl)
        return True

    async def renew(self, key: str, owner: str, ttl: float) -> bool:
        if self._holder(key) != owner:
            return False
        self.locks[key] = (owner, time.monotonic() + ttl)
        return True

    async def release(self, key: str, owner: str) -> None:
        if self._holder(key) == owner:
            del self.locks[key]

    async def assign_version(self, name: str, owner: str, floor: int) -> int | None:
        if self._holder(f"register:{name}") != owner:
            return None
        indexed = self.index.get(name)
        return max(floor, indexed.version if indexed else 0) + 1

    async def commit(self, v: Version, owner: str) -> bool:
        if self._holder(f"register:{v.name}") != owner:
            return False
        indexed = self.index.get(v.name)
        if indexed is None or indexed.version <= v.version:
            await self.put(v)
        return True

    async def put(self, v: Version) -> None:
        self.index[v.name] = v
        self.changed = uuid.uuid4().hex

    async def get(self, name: str) -> Version | None:
        return self.index.get(name)

    async def get_many(self, names: list[str]) -> dict[str, Version]:
        return {n: self.index[n] for n in names if n in self.index}

    async def remove(self, name: str) -> None:
        self.index.pop(name, None)
        self.lease_table.pop(name, None)
        self.changed = uuid.uuid4().hex

    async def page(self, after: str, limit: int) -> list[Version]:
        return [self.index[n] for n in sorted(self.index) if n > after][:limit]

    async def lease(self, name: str, pod: str, info: dict[str, Any], ttl: float) -> None:
        await self.lease_many(pod, {name: info}, ttl)

    async def lease_many(self, pod: str, infos: dict[str, dict[str, Any]], ttl: float) -> None:
        expiry = time.time() + ttl
        for name, info in infos.items():
            self.lease_table.setdefault(name, {})[pod] = (expiry, info)

    async def leases(self, name: str) -> dict[str, dict[str, Any]]:
        now = time.time()
        table = self.lease_table.get(name, {})
        for pod in [p for p, (exp, _) in table.items() if exp <= now]:
            del table[pod]
        return {pod: info for pod, (_, info) in table.items()}

    async def leases_of(self, names: list[str]) -> dict[str, dict[str, dict[str, Any]]]:
        return {name: await self.leases(name) for name in names}

    async def stage(self, sha: str, data: bytes, max_total: int) -> None:
        if len(data) > max_total:
            return
        self.staging.pop(sha, None)
        self.staging[sha] = data
        while sum(map(len, self.staging.values())) > max_total:
            del self.staging[next(iter(self.staging))]

    async def staged(self, sha: str) -> bytes | None:
        return self.staging.get(sha)

    async def is_staged(self, sha: str) -> bool:
        return sha in self.staging


@track
class RedisRegistry:
    """Redis: shared by every replica of the service; survives a service restart."""

    label = "registry (Redis)"

    def __init__(
        self,
        url: str,
        password: str = "",
        lease_key_ttl: float = 3600,
        max_connections: int = 64,
        bounds: Bounds | None = None,
    ) -> None:
        b = bounds or Bounds()
        self.r = redis_client.connect(url, password, b.redis, b.redis_attempts, max_connections)
        self.key_ttl = int(lease_key_ttl)
        self._renew, self._release = self.r.register_script(_RENEW), self.r.register_script(_RELEASE)
        self._assign, self._commit = self.r.register_script(_ASSIGN), self.r.register_script(_COMMIT)
        self._rebuild = self.r.register_script(_REBUILD)
        self._stage, self._unstage = self.r.register_script(_STAGE), self.r.register_script(_UNSTAGE)

    async def check(self) -> None:
        await self.r.ping()

    async def is_built(self) -> bool:
        return bool(await self.r.exists(_P + "built"))

    async def generation(self) -> str | None:
        """None when unknown (a flushed Redis): the reader must read the index again."""
        raw = await self.r.get(_P + "generation")
        return raw.decode() if raw is not None else None

    async def rebuild(self, versions: list[Version]) -> None:
        latest = {v.name: v for v in versions}  # oldest first: the latest wins
        triples = [x for v in latest.values() for x in (v.name, v.version, v.to_json())]
        keys = [_P + "index", _P + "names", _P + "built", _P + "generation"]
        await self._rebuild(keys=keys, args=[uuid.uuid4().hex, *triples])

    async def indexed_version(self, name: str) -> int | None:
        """The version of `name` in the index (0: none); None while the index is not built. Read
        in one transaction: a Redis restarted in between must not read as "not registered"."""
        async with self.r.pipeline(transaction=True) as p:
            p.exists(_P + "built")
            p.hget(_P + "index", name)
            built, raw = await p.execute()
        if not built:
            return None
        return Version.from_json(raw).version if raw is not None else 0

    async def acquire(self, key: str, owner: str, ttl: float) -> bool:
        return bool(await self.r.set(_P + f"lock:{key}", owner, nx=True, px=int(ttl * 1000)))

    async def renew(self, key: str, owner: str, ttl: float) -> bool:
        return bool(await self._renew(keys=[_P + f"lock:{key}"], args=[owner, int(ttl * 1000)]))

    async def release(self, key: str, owner: str) -> None:
        await self._release(keys=[_P + f"lock:{key}"], args=[owner])

    async def assign_version(self, name: str, owner: str, floor: int) -> int | None:
        """The next version of `name`, if `owner` holds its registration lease; else None."""
        keys = [_P + f"lock:register:{name}", _P + "index"]
        version = int(await self._assign(keys=keys, args=[owner, name, floor]))
        return version if version > 0 else None

    async def commit(self, v: Version, owner: str) -> bool:
        """Index `v` if `owner` still holds the name's registration lease (False if not)."""
        keys = [_P + f"lock:register:{v.name}", _P + "index", _P + "names", _P + "generation"]
        return bool(
            await self._commit(keys=keys, args=[owner, v.name, v.to_json(), v.version, uuid.uuid4().hex])
        )

    async def put(self, v: Version) -> None:
        async with self.r.pipeline(transaction=True) as p:
            p.hset(_P + "index", v.name, v.to_json())
            p.zadd(_P + "names", {v.name: 0})
            p.set(_P + "generation", uuid.uuid4().hex)
            await p.execute()

    async def get(self, name: str) -> Version | None:
        raw = await self.r.hget(_P + "index", name)
        return None if raw is None else Version.from_json(raw)

    async def get_many(self, names: list[str]) -> dict[str, Version]:
        """The latest versions of those of `names` that are registered, in one round trip."""
        if not names:
            return {}
        raws = await self.r.hmget(_P + "index", names)
        return {n: Version.from_json(r) for n, r in zip(names, raws, strict=True) if r is not None}

    async def remove(self, name: str) -> None:
        async with self.r.pipeline(transaction=True) as p:
            p.hdel(_P + "index", name)
            p.zrem(_P + "names", name)
            p.delete(_P + f"lease:{name}", _P + f"leaseinfo:{name}")
            p.set(_P + "generation", uuid.uuid4().hex)
            await p.execute()

    async def page(self, after: str, limit: int) -> list[Version]:
        lo = f"({after}" if after else "-"
        names = await self.r.zrangebylex(_P + "names", lo, "+", start=0, num=limit)
        if not names:
            return []
        raws = await self.r.hmget(_P + "index", names)
        return [Version.from_json(r) for r in raws if r is not None]

    async def lease(self, name: str, pod: str, info: dict[str, Any], ttl: float) -> None:
        await self.lease_many(pod, {name: info}, ttl)

    async def lease_many(self, pod: str, infos: dict[str, dict[str, Any]], ttl: float) -> None:
        """Every lease of one pod's poll in one round trip (a pod may hold hundreds of adapters)."""
        if not infos:
            return
        expiry = time.time() + ttl
        # The whole keys also expire, so a name nobody renews leaves nothing behind.
        async with self.r.pipeline(transaction=False) as p:
            for name, info in infos.items():
                p.zadd(_P + f"lease:{name}", {pod: expiry})
                p.hset(_P + f"leaseinfo:{name}", pod, json.dumps(info))
                p.expire(_P + f"lease:{name}", self.key_ttl)
                p.expire(_P + f"leaseinfo:{name}", self.key_ttl)
            await p.execute()

    async def leases(self, name: str) -> dict[str, dict[str, Any]]:
        now = time.time()
        expired = await self.r.zrangebyscore(_P + f"lease:{name}", "-inf", now)
        if expired:
            await self.r.zrem(_P + f"lease:{name}", *expired)
            await self.r.hdel(_P + f"leaseinfo:{name}", *expired)
        live = await self.r.zrangebyscore(_P + f"lease:{name}", f"({now}", "+inf")
        if not live:
            return {}
        raws = await self.r.hmget(_P + f"leaseinfo:{name}", live)
        return {p.decode(): json.loads(r) for p, r in zip(live, raws, strict=True) if r is not None}

    async def leases_of(self, names: list[str]) -> dict[str, dict[str, dict[str, Any]]]:
        """Each name's live leases (pod -> info), in one round trip: a List page of 1,000 read
        them with three a name. Expired ones are left out here, and dropped by `leases`."""
        now = time.time()
        async with self.r.pipeline(transaction=False) as p:
            for name in names:
                p.zrangebyscore(_P + f"lease:{name}", f"({now}", "+inf")
                p.hgetall(_P + f"leaseinfo:{name}")
            replies = await p.execute()
        out = {}
        for name, live, infos in zip(names, replies[::2], replies[1::2], strict=True):
            out[name] = {pod.decode(): json.loads(infos[pod]) for pod in live if pod in infos}
        return out

    async def stage(self, sha: str, data: bytes, max_total: int) -> None:
        """Keep a hot copy; the oldest go while the total is over `max_total`. The total is a
        key of its own (`staging:total`): summing every staged size at each stage made staging
        10,000 adapters quadratic. Each copy is added and dropped by a script, so it is counted
        once: two pods fetching one adapter at once (a spread, or two replicas) each read its old
        size, then both added it, and the total drifted up for good; past `max_total` every copy
        was dropped as soon as it was staged, and placements went to storage."""
        if len(data) > max_total:
            return
        total = int(await self._stage(keys=self._staging_keys(sha), args=[sha, data, time.time()]))
        while total > max_total:
            oldest = [o.decode() for o in await self.r.zrange(_P + "staging", 0, 31)]
            if not oldest:
                return
            for old in oldest:
                total = int(await self._unstage(keys=self._staging_keys(old), args=[old]))
                if total <= max_total:
                    break

    @staticmethod
    def _staging_keys(sha: str) -> list[str]:
        return [_P + f"staged:{sha}", _P + "staging", _P + "staging:size", _P + "staging:total"]

    async def staged(self, sha: str) -> bytes | None:
        return await self.r.get(_P + f"staged:{sha}")

    async def is_staged(self, sha: str) -> bool:
        return bool(await self.r.exists(_P + f"staged:{sha}"))

    async def close(self) -> None:
        await self.r.aclose()


Registry = MemoryRegistry | RedisRegistry
