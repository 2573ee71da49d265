"""The process-wide settings a process that runs the engine wants, made in one place, at start-up.

Nothing else in `model_service` changes a setting of the whole process as a side effect of being
imported or constructed: a program that builds an `Engine` in its own process keeps its own
settings unless it calls `configure_process`. Spindle's entry points do: the `spindle generate`
and `spindle serve` commands (spindle/cli.py), each tensor-parallel worker process
(distributed/worker.py), the test suite (tests/conftest.py) and the benchmarks that run an engine.
"""

from __future__ import annotations

import os


def configure_process() -> None:
    """Set, for this whole process (an operator's own `OMP_WAIT_POLICY` wins):

    - `OMP_WAIT_POLICY=PASSIVE`: OpenMP threads that spin while waiting make small CPU matmuls
      up to 100x slower when cores are shared (seen on 2-core VMs: a [3, 576] x [576, 1536] GEMM
      took 16 ms instead of 0.15 ms). OpenMP reads it once, when torch loads its runtime: call
      this before anything imports torch, or export the variable (the images do).
    - cuDNN's scaled-dot-product attention off: it builds a new graph for every new context
      length, 2.2 ms of CPU per layer call on an H200, 25x the GPU time; the flash and
      memory-efficient kernels torch falls back to have no such cost.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch  # only now: see the first item above

    torch.backends.cuda.enable_cudnn_sdp(False)
