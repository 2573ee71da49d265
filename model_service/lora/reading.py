"""Reading an adapter's weights file: into a reused buffer, in chunks read and hashed in parallel.

The weights are read and hashed before an adapter is used: its `adapter_id` (in prefix-cache
keys) comes from their digest, and a read for admission must show that the file is still the
version registered. A plain sha256 cannot be split (~100 ms for the 168 MB of a float32 rank-16
adapter on all seven projections of the 8B shape: the whole budget of a load), so the id comes
from the *chunked digest*: the sha256 of the file's length and of the sha256 of each
`HASH_CHUNK` bytes, which threads compute at once (hashlib lets go of the GIL), each right after
reading its chunk. The chunks depend on nothing but the length, so the same bytes give the same
digest in every process, and different bytes a different one. The plain sha256, which peers and
the adapter service compare, is computed at registration (`sha256_of`, beside the parse); a
later read whose chunked digest is the registered one has the registered sha256 without a hash.

Why read, not mmap: a file truncated while it is mapped (the pod rewrites a peer's files in
place, and so does an operator's `cp`) kills the process with SIGBUS at the next access to the
mapping, where a read just comes back short. A fresh buffer would cost more than the read (page
faults: ~120 ms for 168 MB, against ~30 ms into memory already faulted in), so buffers are lent
by `HostBuffers`.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from model_service.lora.buffers import HostBuffers
from model_service.lora.files import opened_regular

HASH_CHUNK = 4 << 20  # part of the chunked digest's definition: changing it changes every adapter_id
_HASHERS = ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="lora-hash")
# Read buffers (never sent to a device): one per read in flight; two are kept for the next reads,
# each holding as much memory as the largest file it has held.
_BUFFERS = HostBuffers(torch.device("cpu"), spare=2)


@dataclass
class WeightsFile:
    data: torch.Tensor  # uint8: the file's bytes, in a buffer lent by `_BUFFERS`
    chunked: bytes  # the chunked digest of those bytes


def read_weights(path: Path, max_bytes: int) -> WeightsFile:
    """The bytes of `path` (checked as `files.opened_regular` checks it) and their chunked
    digest. OSError when the file shrinks while it is read."""
    with opened_regular(path, max_bytes) as (f, size):
        data = _BUFFERS.take(size, torch.uint8)
        into = memoryview(data.numpy())
        chunks = [
            _HASHERS.submit(_read_chunk, f.fileno(), into[at : at + HASH_CHUNK], at)
            for at in range(0, size, HASH_CHUNK)
        ]
        concurrent.futures.wait(chunks)  # none may read the descriptor once it is closed
        digests = [c.result() for c in chunks]
    whole = hashlib.sha256(b"spindle-chunked-sha256\0" + size.to_bytes(8, "little"))
    for d in digests:
        whole.update(d)
    return WeightsFile(data, whole.digest())


def sha256_of(data: torch.Tensor) -> Future[str]:
    """The plain sha256 (hex) of `data`'s bytes, computed in a hashing thread."""
    return _HASHERS.submit(lambda: hashlib.sha256(memoryview(data.numpy())).hexdigest())


def _read_chunk(fd: int, into: memoryview, offset: int) -> bytes:
    """Fill `into` from `offset` of the file, and hash it while it is in cache."""
    done = 0
    while done < len(into):
        n = os.preadv(fd, [into[done:]], offset + done)
        if n == 0:
            raise OSError(
                f"the file ended at byte {offset + done}, not {offset + len(into)}: it changed while read"
            )
        done += n
    return hashlib.sha256(into).digest()
