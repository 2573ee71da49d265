"""Ending an RPC with a status, shared by every gRPC server (gateway, model pod); no torch."""

from __future__ import annotations

from typing import NoReturn

import grpc


async def abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    """End the RPC with `code` and an actionable `message` (`context.abort` raises)."""
    await context.abort(code, message)
    raise AssertionError("unreachable: context.abort raises")
