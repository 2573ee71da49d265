"""Split reductions in one launch, with no zeroed buffer: each program of a split stores its
partial result, then arrives at a counter; the last to arrive adds every part in a fixed order,
so the result is deterministic (atomic float adds are not), and resets the counter, so the next
call, or a CUDA graph's replay, finds it at zero. The few-row GEMM and the FP8 GEMV (K split),
the LoRA shrink (K split) and the MoE router (the hidden size split) sum their slices so.
"""

from __future__ import annotations

from model_service.kernels.paged_attention import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def last_to_arrive(counter, arrivals):
        """Whether this program, its part stored, is the last of `arrivals` to reach `counter`. The
        barrier puts every thread's stores before the arrival; acquire-release makes the others'
        visible to the last, which reads the parts past the L1 (`cache_modifier=".cg"`), then
        resets the counter (`tl.atomic_xchg(counter, 0)`)."""
        tl.debug_barrier()
        return tl.atomic_add(counter, 1, sem="acq_rel") == arrivals - 1
