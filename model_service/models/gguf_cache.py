"""What loading a GGUF file converts, kept on disk for the next process that loads it.

A GGUF file is read in two slow conversions: its quantized tensors dequantized to float32
(`gguf_weights.read_gguf`, numpy) and its tokenizer rebuilt from the file's vocabulary by HF
`transformers`; for the embedded SmolLM2 each takes ~4 s of CPU, which every `spindle generate`,
every pod start and every test that loads it paid again. The results depend only on the file
and the converting libraries' versions, so they are stored under a key of those (the file's
resolved path, size, modification and change times; the `gguf` and `transformers` versions) and
read back in well under a second.

The cache lives in `$SPINDLE_CACHE_DIR`, else `$XDG_CACHE_HOME/spindle`, else
`~/.cache/spindle`. An entry is built in a temporary directory beside it and renamed into place,
so no process ever reads half an entry, under a lock (`converting`), so processes loading the
same file at once (two test workers, pods sharing a node's cache) convert it once; a cache that
cannot be written (a read-only home in a container) only costs the conversion, never the load.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

log = logging.getLogger(__name__)


def cache_root() -> Path:
    if explicit := os.environ.get("SPINDLE_CACHE_DIR"):
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "spindle"


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "none"


def entry(gguf: Path, kind: str, salt: str = "") -> Path:
    """The directory that holds (or will hold) `kind` converted from the file `gguf`; `salt`: what
    else the conversion depends on (the converting code's own digest, so a fix to it is never
    answered from an entry the old code wrote)."""
    stat = gguf.stat()
    # The change time too: a file replaced under its old mtime (`cp -p`, `rsync -a`, an image built
    # with fixed timestamps) has a new ctime, which no copy can set. Not the inode: FUSE mounts
    # (gcsfuse, s3fs) number a model's file anew at each mount, which would miss every time.
    file = (gguf.resolve(), stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
    parts = (*file, _version("gguf"), _version("transformers"), salt)
    return cache_root() / kind / hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:24]


def lookup(gguf: Path, kind: str, salt: str = "") -> Path | None:
    """The entry's directory if a complete one exists."""
    try:
        path = entry(gguf, kind, salt)
    except OSError:
        return None
    return path if path.is_dir() else None


def discard(entry_dir: Path) -> None:
    """Remove an entry that cannot be read back (an older version renamed entries into place
    unsynced: a crash could leave their files empty), so the conversion that follows can store a
    good one; a damaged entry left in place would block that `store` (a rename onto a full
    directory fails) for good."""
    log.warning("GGUF conversion cache entry %s is damaged: converting again", entry_dir)
    shutil.rmtree(entry_dir, ignore_errors=True)


def store(gguf: Path, kind: str, write: Callable[[Path], None], salt: str = "") -> None:
    """Make the entry with `write(directory)`; a failure is logged and the entry left absent."""
    tmp = None
    try:
        final = entry(gguf, kind, salt)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=final.parent))
        write(tmp)
        _sync(tmp)
        os.rename(tmp, final)  # atomic; another process's identical entry may have won the race
        tmp = None
    except OSError as e:
        log.debug("GGUF conversion cache not written (%s): the next load converts again", e)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _sync(directory: Path) -> None:
    """The entry's files on disk before its rename publishes it: a crash after an unsynced rename
    can leave them empty, or (XFS) their full length of zeros, which would load as weights."""
    for file in (f for f in directory.iterdir() if f.is_file()):
        with open(file, "rb") as f:
            os.fsync(f.fileno())
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def converting(gguf: Path, kind: str, salt: str = "") -> Iterator[None]:
    """Held around a lookup and, on a miss, the conversion and `store`: a second process
    loading the same file meanwhile waits, then finds the entry. No lock (and no wait) where
    the cache cannot be written."""
    try:
        final = entry(gguf, kind, salt)
        final.parent.mkdir(parents=True, exist_ok=True)
        lock = open(final.with_name(final.name + ".lock"), "w")  # noqa: SIM115 (closed below)
    except OSError:
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
