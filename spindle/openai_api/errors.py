"""Refusals as OpenAI's error JSON, with the HTTP status each `openai` SDK maps to its exception
class (400 BadRequestError, 401 AuthenticationError, 403 PermissionDeniedError, 404
NotFoundError, 429 RateLimitError, 5xx InternalServerError). The gRPC path decides what is
wrong; this module only says it in HTTP, so both APIs refuse the same requests the same way."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import grpc

Code = grpc.StatusCode

# gRPC status -> (HTTP status, OpenAI error `type`)
_HTTP = {
    Code.INVALID_ARGUMENT: (400, "invalid_request_error"),
    Code.FAILED_PRECONDITION: (400, "invalid_request_error"),
    Code.OUT_OF_RANGE: (400, "invalid_request_error"),
    Code.UNAUTHENTICATED: (401, "authentication_error"),
    Code.PERMISSION_DENIED: (403, "permission_error"),
    Code.NOT_FOUND: (404, "not_found_error"),
    Code.ALREADY_EXISTS: (409, "conflict_error"),
    Code.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    Code.UNIMPLEMENTED: (501, "not_implemented_error"),
    Code.UNAVAILABLE: (503, "service_unavailable_error"),
    Code.DEADLINE_EXCEEDED: (504, "timeout_error"),
}


class ApiError(Exception):
    """A refusal: HTTP status, OpenAI error type, code (the gRPC status name, as the gRPC API
    would answer), message, the field at fault, and extra headers (`retry-after`)."""

    def __init__(
        self,
        status: int,
        type_: str,
        code: str,
        message: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.type, self.code, self.message, self.param = status, type_, code, message, param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, "invalid_request_error", Code.INVALID_ARGUMENT.name, message, param)


def from_status(code: grpc.StatusCode, details: str, trailers: Sequence[tuple[str, Any]] = ()) -> ApiError:
    """The refusal for a gRPC status; RESOURCE_EXHAUSTED's `retry-after-ms` trailer becomes the
    `retry-after` (seconds, rounded up) and `retry-after-ms` headers the SDKs wait on."""
    headers = {}
    for key, value in trailers:
        if key == "retry-after-ms":
            headers = {"retry-after-ms": str(value), "retry-after": str(math.ceil(int(value) / 1000))}
    status, type_ = _HTTP.get(code, (500, "server_error"))
    return ApiError(status, type_, code.name, details, headers=headers)
