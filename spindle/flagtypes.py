"""Argument types for the services' numeric flags: a value out of range is argparse's usage error
(exit 2, naming the flag, from the command line or its SPINDLE_ variable) rather than a value the
service takes as given. `--port 70000` listened on port 4464 (gRPC keeps the low 16 bits), `--port
-1` on 65535, and `--health-interval 0` polled every pod in a busy loop."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable


def port(value: str) -> int:
    """A TCP port, 0 to 65535 (0: a free port, or off, as each flag says)."""
    n = int(value)
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535, got {n}")
    return n


def host_and_port(address: str) -> tuple[str, int]:
    """HOST and PORT of a gRPC HOST:PORT target, an IPv6 host's brackets taken off (a resolver
    wants "::1", not "[::1]"); ValueError saying what is wrong. gRPC reads an IPv6 address out of
    brackets ("::1:50051", "fd00::5") as one on port 443: taken, it was dialled and never reached."""
    host, _, port = address.rpartition(":")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise ValueError(f"{address!r} has no port, or an IPv6 host out of brackets: give [::1]:PORT")
    host = host.removeprefix("[").removesuffix("]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r} has no port")
    return host, int(port)


def at_least(least: int, most: int | None = None) -> Callable[[str], int]:
    """An integer of at least `least` (a count: attempts, replicas, failures in a row), and at most
    `most` where the value goes into a request's field of that size."""

    def convert(value: str) -> int:
        n = int(value)
        if n < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {n}")
        if most is not None and n > most:
            raise argparse.ArgumentTypeError(f"must be at most {most}, got {n}")
        return n

    convert.__name__ = "int"  # argparse's "invalid int value: 'x'" for what is not a number
    return convert


def signed(bits: int) -> Callable[[str], int]:
    """An integer a signed field of `bits` bits holds (a request's int32 / int64): past it protobuf
    raised a ValueError, a traceback, while the request was built; what the value means (max_tokens
    >= 1, a seed not negative) is the server's to judge, as for any other client."""
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1

    def convert(value: str) -> int:
        n = int(value)
        if not low <= n <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {n}")
        return n

    convert.__name__ = "int"
    return convert


def positive(value: str) -> float:
    """A number more than 0 (a threshold, a share) that a service divides by or compares against:
    at 0 the adapter service's placement divided by zero every round."""
    x = float(value)
    if not x > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {value}")
    return x


def share(value: str) -> float:
    """A share of something (of recent requests), more than 0 and at most 1: at 0 the adapter
    service's placement divided by zero every round, and above 1 no adapter could ever pass it."""
    x = float(value)
    if not 0 < x <= 1:
        raise argparse.ArgumentTypeError(f"must be more than 0 and at most 1, got {value}")
    return x


def seconds(value: str) -> float:
    """A duration that must pass: more than 0 seconds (an interval, a timeout)."""
    s = float(value)
    if not s > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {value}")
    return s


def seconds_or_none(value: str) -> float:
    """A duration that may be 0 (a drain that waits for nothing), not negative."""
    s = float(value)
    if not s >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 seconds or more, got {value}")
    return s


def gib(value: str) -> float:
    """A size in GiB, 0 or more (`--swap-space`): NaN and infinity were tracebacks when the size
    became bytes, and a negative one was refused in bytes (-1073741824) rather than as typed."""
    x = float(value)
    if not 0 <= x < float("inf"):
        raise argparse.ArgumentTypeError(f"must be 0 GiB or more (and finite), got {value}")
    return x


positive.__name__ = share.__name__ = seconds.__name__ = seconds_or_none.__name__ = gib.__name__ = "float"


def log_level(value: str) -> str:
    """A logging level's name, in any case (`info`), as the services' logging takes it: an unknown
    one was a ValueError traceback from `logging.basicConfig` once the command had begun, and
    `spindle up` passed it on to its three services, which each died of it."""
    name = value.strip().upper()
    if not isinstance(logging.getLevelName(name), int):
        raise argparse.ArgumentTypeError(f"expected DEBUG, INFO, WARNING, ERROR or CRITICAL, got {value!r}")
    return name
