"""Host memory for adapters, lent and taken back instead of allocated for each adapter.

A fresh buffer costs more than filling it: pageable memory is faulted in page by page on its
first write (an 84 MB bf16 adapter of the 8B shape: ~35 ms, against ~17 ms to convert the
adapter into memory already faulted in), and page-locked memory comes from the driver
(`cudaHostAlloc`, 10-30 ms for 84 MB). So `HostBuffers` lends buffers out of blocks it keeps, and
a block comes back when nothing uses it any more.

Nobody gives a buffer back by hand: the host tier, the slots and tensor-parallel copies just drop
their adapters. A buffer is a tensor over its block made through the buffer protocol
(`torch.frombuffer` of a numpy view made for that loan alone), so its storage holds the view for
as long as any tensor shares it (the packed buffer, each module's A and B, views of views), and a
finalizer on the view returns the block when the last of them goes.

A page-locked block may still be read by a copy to the device queued before its adapter was
dropped (`LoraLayers.load_slot` copies asynchronously, on its load stream). So on a GPU a
returned block carries a fence (a CUDA event recorded when it came back, on the compute stream,
which waits for every load's copy: `LoadStream.copying`) and is lent again only once the fence
has passed.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

log = logging.getLogger(__name__)


class Fence(Protocol):
    def query(self) -> bool:
        """Whether every device copy queued before the fence has finished."""
        ...


def cuda_fence(device: torch.device) -> Fence:
    """An event on `device`'s current stream, the compute stream (the engine queues its steps on
    the default stream, and each load's copy is followed by the compute stream's wait for it):
    it passes once every copy queued before it has read its host memory."""
    return torch.cuda.current_stream(device).record_event()


@dataclass(eq=False)  # a block is itself: `==` on its memory would compare every byte
class _Block:
    memory: np.ndarray  # uint8, over the tensor that owns (and, page-locked, pins) the memory
    pinned: bool
    fence: Fence | None = None  # set when a page-locked block comes back

    @property
    def capacity(self) -> int:
        return self.memory.nbytes


class HostBuffers:
    def __init__(
        self, device: torch.device, spare: int = 4, fence: Callable[[], Fence] | None = None
    ) -> None:
        """`device`: where the buffers' contents are copied to; for a GPU, blocks are
        page-locked (pageable where the driver refuses). `spare`: free blocks kept for later
        loans (the rest go back to the allocator once their fence has passed). `fence`: what a
        returned page-locked block waits for (`cuda_fence` on `device` by default)."""
        self.pin, self.spare = device.type == "cuda", spare
        self._fence = fence or functools.partial(cuda_fence, device)
        self._free: list[_Block] = []
        self._lock = threading.Lock()  # blocks come back on whichever thread drops the last tensor
        self.allocated = 0  # blocks allocated so far: the count reuse keeps low

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D buffer of `numel` elements of `dtype`, contents undefined: from a free block
        of its size class (a power of two of bytes) whose fence has passed, else a new block."""
        nbytes = numel * dtype.itemsize
        if nbytes == 0:
            return torch.empty(0, dtype=dtype)
        capacity = 1 << (nbytes - 1).bit_length()
        with self._lock:
            block = next((b for b in self._free if b.capacity == capacity and _passed(b)), None)
            if block is not None:
                self._free.remove(block)
        block = block or self._allocate(capacity)
        view = block.memory[:nbytes]
        weakref.finalize(view, self._returned, block).atexit = False  # nothing to return at exit
        return torch.frombuffer(view, dtype=dtype, count=numel)

    def _allocate(self, capacity: int) -> _Block:
        self.allocated += 1
        if self.pin:
            try:
                return _Block(torch.empty(capacity, dtype=torch.uint8, pin_memory=True).numpy(), pinned=True)
            except RuntimeError as e:  # the driver's page-locked allocation failed
                log.warning("adapters stay in pageable host memory (%s): slower slot loads", e)
        return _Block(torch.empty(capacity, dtype=torch.uint8).numpy(), pinned=False)

    def _returned(self, block: _Block) -> None:
        """The last tensor over `block`'s loan is gone: keep it for the next loan."""
        if block.pinned:
            try:
                block.fence = self._fence()
            except RuntimeError:  # no device any more (interpreter shutdown): the block is not reused
                return
        with self._lock:
            self._free.append(block)
            # Past `spare`, the oldest free blocks go back to the allocator, but only once no
            # copy can still read them: page-locked memory is reused by other allocations.
            extra, kept = len(self._free) - self.spare, []
            for b in self._free:
                if extra > 0 and _passed(b):
                    extra -= 1
                else:
                    kept.append(b)
            self._free = kept


def _passed(block: _Block) -> bool:
    return block.fence is None or block.fence.query()
