"""What a request id may be: the gateway and the pod echo it as `x-request-id` metadata, and
metadata values are printable ASCII, so anything else would end the stream INTERNAL instead of
being refused up front. Torch-free (the gateway imports it)."""

from __future__ import annotations

import re
import uuid

_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,256}")


def request_id(given: str) -> tuple[str, str | None]:
    """The id to use (the caller's, or a new one) and why the caller's is refused, or None."""
    rid = given or uuid.uuid4().hex
    if _REQUEST_ID.fullmatch(rid):  # (match with "$" would accept a trailing newline)
        return rid, None
    return rid, f"request_id {rid[:80]!r} must be 1-256 printable ASCII characters without spaces"
