"""Ending an RPC with a status, shared by every gRPC server (gateway, model pod); no torch."""

from __future__ import annotations

import math
from typing import NoReturn

import grpc
from google.protobuf.duration_pb2 import Duration
from google.rpc import code_pb2, error_details_pb2, status_pb2


async def abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    """End the RPC with `code` and an actionable `message` (`context.abort` raises)."""
    await context.abort(code, message)
    raise AssertionError("unreachable: context.abort raises")


async def abort_exhausted(context: grpc.aio.ServicerContext, message: str, retry_after: float) -> NoReturn:
    """RESOURCE_EXHAUSTED with when to retry: `retry-after-ms` trailing metadata for any client, and
    google.rpc.RetryInfo in `grpc-status-details-bin` for clients that read rich errors."""
    ms = max(1, math.ceil(retry_after * 1000))
    status = status_pb2.Status(code=code_pb2.RESOURCE_EXHAUSTED, message=message)
    delay = Duration(seconds=ms // 1000, nanos=(ms % 1000) * 1_000_000)
    status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
    trailers = (("retry-after-ms", str(ms)), ("grpc-status-details-bin", status.SerializeToString()))
    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message, trailing_metadata=trailers)
    raise AssertionError("unreachable: context.abort raises")
