"""Programmatic dependent launch (PDL, Hopper and later): a decode step's kernels start before the
kernel ahead of them ends.

A batch-1 decode step of a MoE model is ~10 small kernels a layer (a few microseconds each), and
in a CUDA graph each still pays the gap between one kernel's last block and the next one's first:
blocks scheduled, registers set, prologue run. With PDL a kernel launched with the attribute
(`launch_pdl`) may be scheduled once every block of the kernel ahead has started and called
`gdc_launch_dependents`; it then waits in `gdc_wait` until that kernel has finished and its
writes are visible. Every kernel here that opts in waits at its very top, before any load and
on every path (a program that returned without waiting would let the kernel "finish" before the
one ahead of it, and the next kernel would read stale data), and lets its dependents in at once:
the order of reads and writes is exactly a plain launch's, only the launch latency overlaps.
Kernels launched without the attribute (torch's, cuBLAS's) keep the stream's full ordering on
both sides. CUDA graphs record the same edges.

Off unless `SPINDLE_PDL=1`: measured on an H100 (2026-12-07 ag, `docs/gpu-notebook.md`) it is
mixed. A chain of 48 x 4 small dependent kernels in a graph: 20.8 -> 18.0 us a layer. The
engine at batch 1: the dense 8B shape's bf16 +3.5% (170.9 -> 176.9 tok/s), its FP8 -2.4%
(291.0 -> 283.9), the Qwen3-30B-A3B shape -5% (516.1 -> 489.0, 24 layers). Kernels that let
their dependents in at once take SM slots and bandwidth from the kernel still running; where
each should trigger is the open question, not whether the waits are right (the GPU tests pass
with it on).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

try:
    import triton
except ImportError:  # CPU-only installs
    triton = None
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # no Triton, or one too old for PDL: `pdl_args` keeps it off
    gdc_launch_dependents = gdc_wait = None

if triton is not None and gdc_wait is not None:
    import triton.language as tl

    @triton.jit
    def wait_for_producers(PDL: tl.constexpr):
        """The first statement of a kernel that opts in: wait for the kernel ahead, then let the
        next one be scheduled (compiled away when `PDL` is off)."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()

elif triton is not None:
    import triton.language as tl

    @triton.jit
    def wait_for_producers(PDL: tl.constexpr):
        """Without PDL in this Triton: nothing to wait for (`pdl_args` never sets `PDL`)."""
        pass


@functools.cache
def _device_has_pdl(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def pdl_args(device: torch.device) -> dict[str, Any]:
    """A launch's keyword arguments: `PDL` for the kernel (a `tl.constexpr`) and, where it is on,
    Triton's `launch_pdl`. On with `SPINDLE_PDL=1` for CUDA devices of compute capability 9.0 and
    later with a Triton that has the instructions; off elsewhere (the CPU's interpreter)."""
    on = (
        device.type == "cuda"
        and gdc_wait is not None
        and os.environ.get("SPINDLE_PDL", "0") == "1"
        and not os.environ.get("TRITON_INTERPRET")
        and _device_has_pdl(device)
    )
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
