"""Spindle model service: the LLM engine (`engine/`, `models/`, `lora/`) and the model pod that
serves it over gRPC (`pod/`)."""

import os

# OpenMP threads that spin while waiting make small CPU matmuls up to 100x slower when cores are
# shared (seen on 2-core VMs: a [3, 576] x [576, 1536] GEMM took 16 ms instead of 0.15 ms).
# Must be set before torch loads its OpenMP runtime; an operator's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
