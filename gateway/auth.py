"""API keys: who may call the gateway, and which adapters each caller may use.

Keys come from a file, or a directory of files (a Kubernetes Secret mounted as a volume: one
file per Secret key). Each non-blank, non-comment line is

    NAME  KEY  ADAPTERS  [SCOPES]  [rate=R] [burst=B] [concurrency=C] [priority=P]

NAME labels the caller in logs and traces (the key itself is never logged); ADAPTERS is `*`
(any), `-` (the base model only) or a comma-separated list. SCOPES, optional, is a
comma-separated list; `admin` lets the key use the adapter admin API (register, delete, ...)
that the gateway forwards to the adapter service. The optional limits (gateway/limits.py):
`rate` requests per second with bursts of `burst` (default: the rate, rounded up), and at most
`concurrency` open Generate streams; absent or 0 means unlimited. `priority` is the most urgent
`GenerateRequest.priority` the key may ask for (lower is served first, and preempts): absent, 0,
so a key may put its own requests back but not ahead of other keys' (any key could starve and
preempt every other with a negative priority). Lines without them keep their old meaning.
The files are re-read when they change, so rotating a Secret needs no restart. Callers send
`authorization: Bearer KEY` (or `x-api-key: KEY`), one key per call.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


class AuthError(Exception):
    """`unauthenticated` = no valid key (UNAUTHENTICATED); else a known caller asked too much."""

    def __init__(self, message: str, unauthenticated: bool) -> None:
        super().__init__(message)
        self.unauthenticated = unauthenticated


@dataclass(frozen=True)
class Caller:
    name: str
    adapters: frozenset[str] | None  # None = any adapter
    admin: bool = False  # may call the adapter admin API
    rate: float = 0.0  # requests per second; 0 = unlimited
    burst: int = 0  # token-bucket size; 0 = the rate, rounded up
    concurrency: int = 0  # open Generate streams; 0 = unlimited
    priority: int = 0  # the most urgent GenerateRequest.priority it may ask for (lower is first)

    def may_use(self, adapter: str | None) -> bool:
        return adapter is None or self.adapters is None or adapter in self.adapters


ANONYMOUS = Caller("anonymous", None, admin=True, priority=-(2**31))  # --allow-unauthenticated: all allowed
SCOPES = ("admin",)
LIMITS = {"rate": float, "burst": int, "concurrency": int, "priority": int}
SIGNED = {"priority"}  # options that may be negative


def _digest(key: str) -> bytes:
    # Fixed-length digests, compared with hmac.compare_digest against every key (authenticate).
    return hashlib.sha256(key.encode()).digest()


def _limits(options: list[str], where: str) -> dict[str, float | int]:
    out: dict[str, float | int] = {}
    for option in options:
        name, _, value = option.partition("=")
        try:
            out[name] = LIMITS[name](value)
        except ValueError:
            raise ValueError(f"{where}: {option!r} is not a number") from None
        if name not in SIGNED and not 0 <= out[name] < math.inf:
            raise ValueError(f"{where}: {option!r} must be a finite number >= 0")
    return out


def parse_keys(text: str, source: str) -> dict[bytes, Caller]:
    keys: dict[bytes, Caller] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()  # a key may hold `=` (base64): only words after the third are limits
        options = [p for p in parts[3:] if p.partition("=")[0] in LIMITS and "=" in p]
        parts = parts[:3] + [p for p in parts[3:] if p not in options]
        if len(parts) not in (3, 4):
            raise ValueError(
                f"{source}:{n}: expected `NAME KEY ADAPTERS [SCOPES] [rate=R burst=B concurrency=C "
                "priority=P]` (ADAPTERS: *, - or a,b,c; SCOPE: admin)"
            )
        limits = _limits(options, f"{source}:{n}")
        name, key, adapters = parts[:3]
        scopes = set(parts[3].split(",")) if len(parts) == 4 else set()
        if scopes - set(SCOPES):
            raise ValueError(
                f"{source}:{n}: unknown scope(s) {sorted(scopes - set(SCOPES))}; known: {SCOPES}"
            )
        allowed = (
            None if adapters == "*" else frozenset() if adapters == "-" else frozenset(adapters.split(","))
        )
        digest = _digest(key)
        if digest in keys:  # the later line won: a key meant for one caller served as another
            raise ValueError(
                f"{source}:{n}: this key is also {keys[digest].name!r}'s; each key names one caller"
            )
        keys[digest] = Caller(name, allowed, admin="admin" in scopes, **limits)
    return keys


def _merged(keys: dict[bytes, Caller], more: dict[bytes, Caller], source: str) -> dict[bytes, Caller]:
    """`keys` and another file's `more`; a key in both is refused, as within one file."""
    for digest in keys.keys() & more.keys():
        raise ValueError(f"{source}: a key of {more[digest].name!r} is also {keys[digest].name!r}'s")
    return keys | more


class ApiKeys:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._stamp: tuple = ()
        self._keys: dict[bytes, Caller] = {}
        self.reload()
        if not self._keys:
            raise ValueError(f"{self.path}: no API keys found")

    def _files(self) -> list[Path]:
        if self.path.is_dir():  # skip Kubernetes' ..data links and other hidden entries
            return sorted(p for p in self.path.iterdir() if p.is_file() and not p.name.startswith("."))
        return [self.path]

    def reload(self) -> bool:
        """Re-read the keys if a file changed; True when they did. A broken edit keeps the old keys."""
        files = self._files()
        stamp = tuple((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in files)
        if stamp == self._stamp:
            return False
        keys: dict[bytes, Caller] = {}
        try:
            for p in files:
                keys = _merged(keys, parse_keys(p.read_text(), str(p)), str(p))
        except (OSError, ValueError) as e:
            if not self._keys:
                raise
            log.error("API keys not reloaded, keeping the previous ones: %s", e)
            return False
        self._keys, self._stamp = keys, stamp
        log.info("loaded %d API keys from %s", len(keys), self.path)
        return True

    def authenticate(self, metadata: tuple[tuple[str, str | bytes], ...] | None) -> Caller:
        key = _offered_key(metadata)
        offered, caller = _digest(key), None
        for digest, candidate in self._keys.items():  # every key, no early exit: constant time
            if hmac.compare_digest(digest, offered):
                caller = candidate
        if caller is None:
            raise AuthError("invalid API key", unauthenticated=True)
        return caller


def _offered_key(metadata: tuple[tuple[str, str | bytes], ...] | None) -> str:
    """The one API key a call offers, from `authorization: Bearer KEY` or `x-api-key: KEY`.

    Two different keys (both headers, or a header twice) are refused rather than one picked: the
    last one used to win, so a proxy in front that checked the first and the gateway could take
    the call for two different callers (RFC 6750 section 2: one method per request). The same key
    sent twice is one key; a blank value offers none."""
    keys = set()
    for k, value in metadata or ():
        if not isinstance(value, str):  # a `-bin` header's bytes (may be any bytes): never a key
            continue
        if k == "authorization" and value.lower().startswith("bearer "):
            keys.add(value[7:].strip())
        elif k == "x-api-key":
            keys.add(value.strip())
    keys.discard("")
    if not keys:
        raise AuthError("missing API key: send metadata `authorization: Bearer <key>`", unauthenticated=True)
    if len(keys) > 1:
        raise AuthError(
            f"{len(keys)} different API keys were sent (`authorization: Bearer` and/or `x-api-key`, "
            "or one of them repeated): send one",
            unauthenticated=True,
        )
    return keys.pop()
