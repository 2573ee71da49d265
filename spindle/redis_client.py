"""How every Spindle process talks to Redis (the adapter service's registry, the gateway's stored
Responses API responses): one recipe, so that a timeout or retry fixed for one is fixed for both.

Every command is bounded (connect and read timeouts, a few attempts): redis-py waits forever by
default, and a Redis that stops answering must become an error the caller can name, not a hang.
The password comes from the URL or SPINDLE_REDIS_PASSWORD (a Kubernetes Secret's key: a flag's
value would show in `ps` and in the pod spec). `redis` is imported only here and only when a
client is made: the gateway and the embedded adapter service run without it installed.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlsplit

PASSWORD_VARIABLE = "SPINDLE_REDIS_PASSWORD"
TIMEOUT_S = 3.0  # connect and read timeout of one command
ATTEMPTS = 2  # tries of one command, the first included


def env_password() -> str:
    """The password SPINDLE_REDIS_PASSWORD gives ("" = the URL's, or none)."""
    return os.environ.get(PASSWORD_VARIABLE, "")


def connect(
    url: str,
    password: str = "",
    timeout: float = TIMEOUT_S,
    attempts: int = ATTEMPTS,
    max_connections: int = 64,
) -> Any:
    """A `redis.asyncio.Redis` for `url` (redis://HOST:PORT/DB, rediss:// for TLS); connections
    are made on first use. A burst of commands waits for one of `max_connections` connections
    rather than failing (a plain pool refuses one past its bound with MaxConnectionsError); each
    command has `timeout` to connect and to answer and `attempts` tries in all, backing off
    briefly (redis-py's own default backs off up to 10 s). ValueError: a URL redis-py refuses."""
    import redis.asyncio as redis
    from redis.asyncio.retry import Retry
    from redis.backoff import ExponentialBackoff

    pool = redis.BlockingConnectionPool.from_url(
        url,
        password=password or None,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), max(attempts - 1, 0)),
        max_connections=max_connections,
        timeout=timeout,
    )
    return redis.Redis.from_pool(pool)  # the pool is closed with the client


def address(url: str) -> str:
    """`url` as a message may show it: scheme, host, port and database, never the password."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    if parts.port is not None:
        netloc += f":{parts.port}"
    return parts._replace(netloc=netloc, query="", fragment="").geturl()
