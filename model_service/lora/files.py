"""Reading an adapter's files from a path an operator named: regular files of bounded size only.

A FIFO blocks its reader until someone writes (on the engine thread every request would stall),
a device such as `/dev/zero` never ends (the pod runs out of memory), and a socket or a
directory cannot be read at all. So the name is stat'ed (following symlinks: a mounted Secret's
links are fine, their targets are checked) and refused before it is opened, and the opened file
is checked again, since the name may have been swapped in between. The caps are the adapter
service's upload limits (`--max-adapter-bytes`, 1 MiB for the config), so what the service
accepts a pod can load.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from model_service.errors import InvalidRequestError

MAX_ADAPTER_BYTES = 1 << 30  # the adapter service's --max-adapter-bytes default
MAX_CONFIG_BYTES = 1 << 20  # the adapter service's limit on adapter_config.json

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class UnsafeFileError(InvalidRequestError):
    """A path that is not a regular file, or one over the size cap (INVALID_ARGUMENT)."""


def _check(path: Path, st: os.stat_result, max_bytes: int, flag: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        kind = next((k for test, k in _KINDS if test(st.st_mode)), "not a regular file")
        raise UnsafeFileError(
            f"{str(path)[:200]!r} is {kind}, not a regular file: name a directory whose "
            "adapter_config.json and adapter_model.safetensors are regular files"
        )
    if st.st_size > max_bytes:
        raise UnsafeFileError(
            f"{str(path)[:200]!r} is {st.st_size} bytes, above the limit of {max_bytes} ({flag})"
        )


@contextlib.contextmanager
def opened_regular(
    path: Path, max_bytes: int, flag: str = "--max-adapter-bytes"
) -> Iterator[tuple[BinaryIO, int]]:
    """`path` opened for reading, and its size: a regular file of at most `max_bytes`;
    UnsafeFileError otherwise (OSError when it cannot be stat'ed or opened). `flag` names the
    setting that raises the cap."""
    _check(path, os.stat(path), max_bytes, flag)
    # O_NONBLOCK: should the name have become a FIFO since the stat, opening it does not wait.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        _check(path, st, max_bytes, flag)
        yield f, st.st_size


def read_regular(path: Path, max_bytes: int, flag: str = "--max-adapter-bytes") -> bytes:
    """The bytes of `path`, checked as `opened_regular` checks it."""
    with opened_regular(path, max_bytes, flag) as (f, _):
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:  # it grew after the checks
        raise UnsafeFileError(f"{str(path)[:200]!r} is above the limit of {max_bytes} bytes ({flag})")
    return data
