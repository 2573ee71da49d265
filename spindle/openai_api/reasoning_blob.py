"""The `encrypted_content` of a Responses API `reasoning` item: its reasoning text, for a
stateless client (Codex: `store: false`, `include: ["reasoning.encrypted_content"]`) to send
back in the next turn's `input`, where it is the assistant turn's reasoning again.

Spindle keeps no state and, unless the deployment gives it a key, no secret: the blob is the
text ENCODED, not encrypted. `spindle.r1.<base64url UTF-8 text>.<base64url SHA-256[:16]>`:
anyone holding it can read it (as they can read the `reasoning_text` beside it), and the digest
only catches a blob truncated or corrupted on its way. With a key (`--reasoning-key-file`) the
blob is `spindle.r1k.<text>.<HMAC-SHA256>`, and only blobs signed with that key are accepted,
so a client cannot put words in the model's thinking; every gateway and pod that must accept
each other's blobs shares the key. A blob that does not open (another provider's, truncated,
another version, a wrong signature, signed where no key is set or unsigned where one is) is a
400 naming the input item, never dropped: the model would answer without the thinking it led to.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
from typing import Any

from spindle.openai_api.errors import bad_request

_PLAIN, _KEYED = "spindle.r1.", "spindle.r1k."  # the format's version, and how its check is made
_B64URL = re.compile(r"[A-Za-z0-9_-]*")


def seal(text: str, key: bytes | None) -> str:
    """The blob holding `text`: encoded, and signed when the deployment has a `key`."""
    payload = _b64(text.encode())
    return f"{_KEYED if key else _PLAIN}{payload}.{_check(payload, key)}"


def opened(blob: Any, key: bytes | None, where: str) -> str:
    """The reasoning text `blob` (the `encrypted_content` of input item `where`) holds; a 400
    naming the item when it holds none this server sealed."""
    field = f"`{where}.encrypted_content`"
    if not isinstance(blob, str):
        raise bad_request(f"{field} must be a string", where)
    expected, other = (_KEYED, _PLAIN) if key else (_PLAIN, _KEYED)
    if blob.startswith(other):
        why = "is not signed, and this server accepts only" if key else "is signed, and this server has no"
        raise bad_request(f"{field} {why} `--reasoning-key-file` key's blobs", where)
    payload, _, check = blob.removeprefix(expected).partition(".")
    if not blob.startswith(expected) or not _B64URL.fullmatch(payload):
        raise bad_request(f"{field} is not reasoning this server sealed (a {expected}... blob): another "
                          "provider's, or another version's, cannot be read here", where)  # fmt: skip
    # compare_digest raises on a str that is not ASCII: a check that is no base64url fails first
    if not (_B64URL.fullmatch(check) and hmac.compare_digest(check, _check(payload, key))):
        why = "its signature is not this server's key's" if key else "it was truncated or changed"
        raise bad_request(f"{field} does not open: {why}", where)
    return _text(payload, field, where)


def _check(payload: str, key: bytes | None) -> str:
    """The keyed blob's HMAC-SHA256, or the plain blob's digest (16 bytes: corruption, not forgery)."""
    if key:
        return _b64(hmac.new(key, payload.encode(), hashlib.sha256).digest())
    return _b64(hashlib.sha256(payload.encode()).digest()[:16])


def _text(payload: str, field: str, where: str) -> str:
    try:
        return base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)).decode()
    except (ValueError, UnicodeDecodeError) as e:  # a checked blob never fails here but a forged one
        raise bad_request(f"{field} does not hold UTF-8 text", where) from e


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")
