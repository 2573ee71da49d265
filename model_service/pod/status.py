"""The one mapping from errors the engine raises to the gRPC status a caller can act on.

A SpindleError says what went wrong on purpose; anything else is a bug in the pod or the engine
(a TypeError included) and is INTERNAL "internal error (id ...)", the details (text, traceback)
only in the pod's log under that id: an exception's text may carry paths, shapes, a prompt's words.
"""

from __future__ import annotations

import logging
from typing import NoReturn

import grpc

from model_service.errors import (
    BeyondCapacityError,
    CapacityError,
    ContextLengthError,
    InvalidRequestError,
    ModelLoadError,
    PreconditionError,
    SpindleError,
    UnavailableError,
)
from model_service.lora.adapter import AdapterError
from model_service.lora.pool import AdapterBusyError
from spindle.grpc_status import PROMPT_TOKENS, abort, abort_exhausted, internal_error

log = logging.getLogger(__name__)
Code = grpc.StatusCode
CAPACITY_RETRY_S = 1.0  # the retry hint of a CapacityError (a full queue drains in about a second)


def status_for(e: Exception) -> tuple[grpc.StatusCode, str]:
    """The status code and message for `e`, raised by an engine call or a control operation."""
    if isinstance(e, SpindleError) and isinstance(e, LookupError):
        return Code.NOT_FOUND, str(e)  # an unknown adapter (NotFoundError, AdapterNotFoundError)
    if isinstance(e, (AdapterBusyError, PreconditionError)):
        return Code.FAILED_PRECONDITION, str(e)  # a slot in use or pinned: retry once released
    if isinstance(e, BeyondCapacityError):
        return Code.OUT_OF_RANGE, str(e)  # never fits this pod: not retried (RESOURCE_EXHAUSTED is)
    if isinstance(e, (InvalidRequestError, AdapterError)):
        return Code.INVALID_ARGUMENT, str(e)
    if isinstance(e, CapacityError):
        return Code.RESOURCE_EXHAUSTED, str(e)
    if isinstance(e, UnavailableError):
        return Code.UNAVAILABLE, str(e)
    if isinstance(e, ModelLoadError):
        return Code.FAILED_PRECONDITION, str(e)
    return Code.INTERNAL, internal_error(e, log)  # logged here with its id and traceback


async def abort_for(context: grpc.aio.ServicerContext, e: Exception) -> NoReturn:
    """End the RPC with the status for `e`; a bug (INTERNAL) is logged with its traceback and an
    id, and the caller gets only the id (`status_for`)."""
    code, message = status_for(e)
    if code == Code.RESOURCE_EXHAUSTED:  # transient (CapacityError): say when to retry
        await abort_exhausted(context, message, CAPACITY_RETRY_S)
    trailers = ((PROMPT_TOKENS, str(e.prompt_tokens)),) if isinstance(e, ContextLengthError) else ()
    await abort(context, code, message, trailers)
