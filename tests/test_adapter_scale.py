"""The adapter service at a platform's scale, without a cluster: what thousands of adapters and
several replicas sharing one Redis and one storage do to staging, to an index rebuilt from
storage, and to deletion (a real Redis, and moto's S3 server where S3's own semantics matter)."""

from __future__ import annotations

import asyncio

import pytest

from adapter_service.registry import RedisRegistry


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
