"""Error types shared by the engine, the loaders and the model pod.

Each maps to one gRPC status code (model_service/pod/status.py), so a caller gets a code it can
act on rather than INTERNAL. Their base, `SpindleError`, is the shared one (spindle/errors.py).
"""

# The services' errors derive from SpindleError; importers find it (and ConfigError) here too.
from spindle.errors import ConfigError, SpindleError  # noqa: F401


class InvalidRequestError(SpindleError, ValueError):
    """The request itself is wrong (INVALID_ARGUMENT): fixing the request fixes it."""


class ContextLengthError(InvalidRequestError):
    """A prompt longer than this engine's context (INVALID_ARGUMENT). Its token count travels with
    the status (`spindle.grpc_status.PROMPT_TOKENS`): pods of one model may have different
    contexts, and the gateway sends the request on to one where it fits."""

    def __init__(self, message: str, prompt_tokens: int) -> None:
        super().__init__(message)
        self.prompt_tokens = prompt_tokens


class CapacityError(SpindleError):
    """The engine cannot take this request now (RESOURCE_EXHAUSTED, with a retry hint): its queue
    is full, or other requests hold what it needs. Retrying later, or on another pod, may work."""


class BeyondCapacityError(InvalidRequestError):
    """A request larger than this engine can hold however idle it is (OUT_OF_RANGE; HTTP 400):
    a prompt past the K/V cache's total size, a beam search needing more blocks (or, on a hybrid
    model, more recurrent-state slots) than there are.
    Never RESOURCE_EXHAUSTED, which clients and the gateway retry: retrying cannot help. The
    message names the limit and by how much the request passes it."""


class ModelLoadError(SpindleError):
    """A model path, checkpoint or GGUF file cannot be loaded (FAILED_PRECONDITION / NOT_FOUND)."""


class PreconditionError(SpindleError):
    """The server's state does not allow the request now (FAILED_PRECONDITION): change the state
    (for instance make an adapter active) or the request."""


class UnavailableError(SpindleError):
    """The engine can no longer serve (UNAVAILABLE): a tensor-parallel rank is gone. Retry elsewhere."""


class NotFoundError(InvalidRequestError, LookupError):
    """The request names something this server does not have, e.g. an adapter (NOT_FOUND)."""
