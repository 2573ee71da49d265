"""The part of `grpc.aio.ServicerContext` the Generation servicers use, for a call that came in
over HTTP: so an HTTP request runs through the very `Generate` / `ListModels` code a gRPC
request does (the gateway's auth, limits, routing and retries; the pod's admission), instead
of a second copy of it. `abort` raises `Refused`, which the HTTP layer answers as OpenAI's error
JSON (errors.py)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NoReturn

import grpc


class Refused(Exception):
    """The servicer ended the call with a status (context.abort)."""

    def __init__(self, code: grpc.StatusCode, details: str, trailers: tuple[tuple[str, Any], ...]) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details, self.trailers = code, details, trailers


class HttpCallContext:
    """One HTTP call, as a servicer sees a gRPC call: its headers are the invocation metadata
    (`authorization`, `x-api-key`, `traceparent`), and it has no deadline (HTTP sends none; a
    client that gives up disconnects, which cancels the call)."""

    def __init__(self, headers: Mapping[str, str]) -> None:
        self._metadata = tuple((k.lower(), v) for k, v in headers.items())
        self.initial_metadata: tuple[tuple[str, Any], ...] = ()

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None

    async def send_initial_metadata(self, metadata: Iterable[tuple[str, Any]]) -> None:
        self.initial_metadata = tuple(metadata)

    def request_id(self) -> str | None:
        """The `x-request-id` the servicer sent (it does before the first message)."""
        return next((v for k, v in self.initial_metadata if k == "x-request-id"), None)

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Iterable[tuple[str, Any]] = ()
    ) -> NoReturn:
        raise Refused(code, details, tuple(trailing_metadata))
