"""Ending an RPC with a status, shared by every gRPC server (gateway, model pod); no torch."""

from __future__ import annotations

import logging
import math
import uuid
from typing import NoReturn

import grpc
from google.protobuf.duration_pb2 import Duration
from google.rpc import code_pb2, error_details_pb2, status_pb2

# A status message travels in the trailers, percent-encoded (up to 3 bytes a byte); past gRPC's
# 8 KiB metadata limit the caller gets RESOURCE_EXHAUSTED "received metadata size exceeds ..."
# in place of the code. Messages echo the caller's input (an id, a name): it may be 1 MB.
MAX_MESSAGE_BYTES = 2_000
# Trailing metadata of a pod's refusal of a prompt past its context: the prompt's length in tokens.
PROMPT_TOKENS = "spindle-prompt-tokens"


def internal_error(error: BaseException | str, log: logging.Logger, what: str = "") -> str:
    """What a caller is told of an unexpected failure (a bug): an error id and nothing of the
    error's own text, which may carry file paths, tensor shapes or a prompt's words. The log line
    has the id with the error and its traceback, for the operator to find."""
    error_id = uuid.uuid4().hex[:16]
    if isinstance(error, BaseException):
        log.error("internal error (id %s)%s", error_id, f": {what}" if what else "", exc_info=error)
    else:
        log.error("internal error (id %s): %s%s", error_id, f"{what}: " if what else "", error)
    return f"internal error (id {error_id}); the server's log has the details"


def bounded(message: str) -> str:
    """`message`, cut to MAX_MESSAGE_BYTES of UTF-8 with a note of how much was left out."""
    data = message.encode()
    if len(data) <= MAX_MESSAGE_BYTES:
        return message
    kept = data[:MAX_MESSAGE_BYTES].decode(errors="ignore")
    return f"{kept}... ({len(message) - len(kept)} more characters)"


async def abort(
    context: grpc.aio.ServicerContext,
    code: grpc.StatusCode,
    message: str,
    trailers: tuple[tuple[str, str], ...] = (),
) -> NoReturn:
    """End the RPC with `code` and an actionable `message` (`context.abort` raises)."""
    await context.abort(code, bounded(message), trailing_metadata=trailers)
    raise AssertionError("unreachable: context.abort raises")


async def abort_exhausted(context: grpc.aio.ServicerContext, message: str, retry_after: float) -> NoReturn:
    """RESOURCE_EXHAUSTED with when to retry: `retry-after-ms` trailing metadata for any client, and
    google.rpc.RetryInfo in `grpc-status-details-bin` for clients that read rich errors."""
    ms, message = max(1, math.ceil(retry_after * 1000)), bounded(message)
    status = status_pb2.Status(code=code_pb2.RESOURCE_EXHAUSTED, message=message)
    delay = Duration(seconds=ms // 1000, nanos=(ms % 1000) * 1_000_000)
    status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
    trailers = (("retry-after-ms", str(ms)), ("grpc-status-details-bin", status.SerializeToString()))
    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message, trailing_metadata=trailers)
    raise AssertionError("unreachable: context.abort raises")
