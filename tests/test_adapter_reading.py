"""Adapters' host memory: buffers lent out of reused blocks and taken back when no tensor over
them is left (and, page-locked, once the device copies that may read them are done)."""

from __future__ import annotations

import torch

from model_service.lora.buffers import HostBuffers

CPU = torch.device("cpu")


class _Fence:
    def __init__(self) -> None:
        self.passed = False

    def query(self) -> bool:
        return self.passed


def test_a_buffer_is_lent_again_only_when_no_tensor_over_it_is_left():
    buffers = HostBuffers(CPU)
    first = buffers.take(1000, torch.bfloat16)
    block = first.data_ptr()
    view = first[10:20].view(2, 5)[1:]  # a view of a view holds the block too
    del first
    other = buffers.take(1000, torch.bfloat16)
    assert other.data_ptr() != block
    del view
    again = buffers.take(500, torch.float32)  # the same size class (2,048 bytes), another dtype
    assert again.data_ptr() == block and again.numel() == 500 and buffers.allocated == 2


def test_a_page_locked_block_waits_for_its_fence_and_spares_are_bounded(monkeypatch):
    """The GPU's path on this CPU: blocks "page-locked" (the allocation is faked), so a block that
    comes back is lent again only once the device copies queued before it have finished."""
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *args, pin_memory=False, **kwargs: empty(*args, **kwargs))
    fences: list[_Fence] = []

    def fence() -> _Fence:
        fences.append(_Fence())
        return fences[-1]

    buffers = HostBuffers(torch.device("cuda"), fence=fence)
    t = buffers.take(100, torch.float32)
    block = t.data_ptr()
    del t  # a copy to the device queued before may still read it
    assert buffers.take(100, torch.float32).data_ptr() != block
    fences[0].passed = True
    assert buffers.take(100, torch.float32).data_ptr() == block
    buffers = HostBuffers(CPU, spare=1)
    held = [buffers.take(100, torch.float32) for _ in range(3)]
    del held  # three come back, one is kept
    again = [buffers.take(100, torch.float32) for _ in range(3)]
    assert len({t.data_ptr() for t in again}) == 3 and buffers.allocated == 5
