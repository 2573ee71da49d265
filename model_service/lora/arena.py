"""Where each resident adapter lies in the adapter arena: host-side bookkeeping of one flat
range of elements (the device copy is `lora.layers.LoraLayers`).

An adapter takes one extent, as many elements as its own tensors (each targeted module's A
and B at its own rank), rounded up to `ALIGN`. Extents are placed first-fit. When no gap is
large enough but the free elements are, `compaction` slides every extent towards the start in
address order; the pool runs it at a quiescent point, so no step reads an adapter while it
moves. Why extents and not pages: a kernel then finds a projection's A and B with one table
read per (row, part), and a load is one contiguous copy; the price, a compaction now and then,
is a device copy of the resident bytes (~10 ms for 14 GB at the H200's copy bandwidth), paid
only when the arena is full and fragmented.
"""

from __future__ import annotations

import bisect

ALIGN = 64  # elements: 128 bytes of bf16, so every extent starts on a cache line


def aligned(elements: int) -> int:
    """An extent's length: whole `ALIGN` units, at least one (so extents never share an offset)."""
    return max(1, -(-elements // ALIGN)) * ALIGN


class ArenaSpace:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity - capacity % ALIGN
        self._starts: list[int] = []  # extent offsets, sorted
        self._extents: dict[int, tuple[int, int, int]] = {}  # offset -> (end, slot, size)
        self._offset_of: dict[int, int] = {}  # slot -> offset

    @property
    def used(self) -> int:
        return sum(end - start for start, (end, _, _) in self._extents.items())

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def compacting_frees(self, size: int) -> bool:
        """Whether the free elements, once compacted into one gap, would hold `size`."""
        return self.free >= aligned(size)

    def place(self, slot: int, size: int) -> int | None:
        """Give `slot` an extent of `size` elements at the first gap that holds it (None: none does)."""
        need, cursor = aligned(size), 0
        for start in self._starts:
            if start - cursor >= need:
                break
            cursor = self._extents[start][0]
        else:
            if self.capacity - cursor < need:
                return None
        self._take(slot, cursor, size)
        return cursor

    def release(self, slot: int) -> None:
        offset = self._offset_of.pop(slot, None)
        if offset is not None:
            del self._extents[offset]
            self._starts.remove(offset)

    def compaction(self) -> list[tuple[int, int]]:
        """Slide every extent to the lowest address it can take, in address order; returns the
        moves (slot, new offset) for the device copy to make in that order."""
        moves, cursor = [], 0
        for start in list(self._starts):
            end, slot, size = self._extents[start]
            if start != cursor:
                self.release(slot)
                self._take(slot, cursor, size)
                moves.append((slot, cursor))
            cursor += end - start
        return moves

    def _take(self, slot: int, offset: int, size: int) -> None:
        self._extents[offset] = (offset + aligned(size), slot, size)
        self._offset_of[slot] = offset
        bisect.insort(self._starts, offset)
