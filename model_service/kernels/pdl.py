"""Programmatic dependent launch (PDL, Hopper and later): a decode step's kernels start before the
kernel ahead of them ends.

A batch-1 decode step of a MoE model is ~10 small kernels a layer (a few microseconds each), and
in a CUDA graph each still pays the gap between one kernel's last block and the next one's first:
blocks scheduled, registers set, prologue run. With PDL a kernel launched with the attribute
(`launch_pdl`) may be scheduled once every block of the kernel ahead has started and called
`gdc_launch_dependents`; it then waits in `gdc_wait` until that kernel has finished and its
writes are visible. Every kernel here that opts in waits at its very top, before any load and
on every path (a program that returned without waiting would let the kernel "finish" before the
one ahead of it, and the next kernel would read stale data), so the order of reads and writes is
exactly a plain launch's, only the launch latency overlaps. Where the dependents are let in is
the mode: `SPINDLE_PDL=1` at once, after the wait; `SPINDLE_PDL=2` after each main loop (GEMVs,
few-row GEMMs, the experts' kernels, paged decode: `admit_dependents`), or at exit in kernels
without one, so a dependent's blocks do not take SM slots from a kernel still streaming.
Kernels launched without the attribute (torch's, cuBLAS's) keep the stream's full ordering on
both sides. CUDA graphs record the same edges.

Off unless `SPINDLE_PDL` is 1 or 2: measured on an H100 (2026-12-07 ag, `docs/gpu-notebook.md`) it is
mixed. A chain of 48 x 4 small dependent kernels in a graph: 20.8 -> 18.0 us a layer. The
engine at batch 1: the dense 8B shape's bf16 +3.5% (170.9 -> 176.9 tok/s), its FP8 -2.4%
(291.0 -> 283.9), the Qwen3-30B-A3B shape -5% (516.1 -> 489.0, 24 layers). Letting them in
after the main loops instead (mode 2, 2026-12-07 ah, another H100, one process each): MoE
483.6 / 484.8 off, 498.9 / 472.6 on; FP8 305.1 off, 303.4 on; bf16 176.5 -> 178.7: inside the
runs' spread, no gain. The waits are right in both modes (the GPU tests pass with each on);
the kernel boundary is not where batch-1 decode loses its time on these shapes.
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
        """The first statement of a kernel that opts in: wait for the kernel ahead, then (`PDL`
        1) let the next one be scheduled at once. Compiled away when `PDL` is 0."""
        if PDL > 0:
            gdc_wait()
        if PDL == 1:
            gdc_launch_dependents()

    @triton.jit
    def admit_dependents(PDL: tl.constexpr):
        """Where a kernel's main loop has issued its loads (`PDL` 2): the next kernel may be
        scheduled from here; a program that never gets here admits it when it exits."""
        if PDL == 2:
            gdc_launch_dependents()

elif triton is not None:
    import triton.language as tl

    @triton.jit
    def wait_for_producers(PDL: tl.constexpr):
        """Without PDL in this Triton: nothing to wait for (`pdl_args` never sets `PDL`)."""
        pass

    @triton.jit
    def admit_dependents(PDL: tl.constexpr):
        """Without PDL in this Triton: nothing to admit."""
        pass


@functools.cache
def _device_has_pdl(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def pdl_args(device: torch.device) -> dict[str, Any]:
    """A launch's keyword arguments: `PDL` for the kernel (a `tl.constexpr`: 0 off, 1 dependents
    admitted at the top, 2 after the main loop) and, where it is on, Triton's `launch_pdl`. On
    with `SPINDLE_PDL=1` or `2` for CUDA devices of compute capability 9.0 and later with a
    Triton that has the instructions; off elsewhere (the CPU's interpreter)."""
    mode = {"1": 1, "2": 2}.get(os.environ.get("SPINDLE_PDL", "0"), 0)
    on = (
        mode
        and device.type == "cuda"
        and gdc_wait is not None
        and not os.environ.get("TRITON_INTERPRET")
        and _device_has_pdl(device)
    )
    return {"PDL": mode, "launch_pdl": True} if on else {"PDL": 0}
