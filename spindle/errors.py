"""`SpindleError`, the base of every error Spindle raises on purpose: the `spindle` command prints
one as a message (exit code 2) rather than a traceback. It lives here, in the torch-free shared
package, so that the services derive their errors from it (model_service/errors.py) and the
command catches them without importing a service."""

import errno


class SpindleError(Exception):
    """Base class: every error a command, the engine or a loader raises on purpose."""


class ListenError(SpindleError, OSError):
    """A service cannot listen on a port it was given (in use, or not this host's address): the
    command prints it as one line naming the port and the flag to change, not a traceback."""


def listen_hint(error: OSError) -> str:
    """A bind's OS error as a person reads it: "is the port in use?" only where it is (it misled
    where the host was another machine's address or a name that does not resolve)."""
    reason = error.strerror or str(error)
    return f"{reason} (is the port in use?)" if error.errno == errno.EADDRINUSE else reason


class ConfigError(SpindleError, ValueError):
    """A setting (a flag or its SPINDLE_ variable, a file it names) is wrong: fixing the setting
    fixes it. A ValueError too, as what raised it before it named its flag."""
