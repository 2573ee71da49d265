"""Gated DeltaNet's short runs (decode rows, verify runs, short prefill chunks) in Triton, reading
and writing the recurrent state in place.

Two kernels per linear-attention layer: the causal depthwise conv over the conv state, then the
gated delta rule over the delta-rule state with its gates and the query readout (the math and the
torch references: `models/gated_delta.py`). A step is described by `StateRuns`, device tensors
only: each run's rows, its state slot (negative: a padding run, which starts from zeros and writes
no state), whether it starts from zeros, and the slot that receives the state after each token
(the checkpoints of verify runs and the prefix cache's snapshots). Every program loops over its
run's tokens with bounds read on the device and keeps the state in registers between them, so the
same launch serves every step of a CUDA graph: no host sync, no shape that depends on the data.
Beside them, for the rows of any step, the gated RMSNorm of the layer's output (`gated_rms_norm`):
one launch where torch takes a dozen."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model_service.kernels.paged_attention import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _conv_step_kernel(
        X, Out, State, W, QueryStart, Slots, Fresh, Snapshots, x_row, x_head, k_at, v_at, C,
        HK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        """Program (run, channel block): SiLU(conv) of each token of the run over the K - 1 inputs
        before it (the state's, then the run's own), then the last K - 1 inputs into the state.
        Channel c is q's, k's or v's (in that order, head after head), read where the projection
        left it: column `col` of the input rows."""
        run = tl.program_id(0)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = c < C
        in_k, in_v = (c >= HK * DK) & (c < 2 * HK * DK), c >= 2 * HK * DK
        own = tl.where(in_v, c - 2 * HK * DK, tl.where(in_k, c - HK * DK, c))  # channel within q, k or v
        width = tl.where(in_v, DV, DK)
        col = tl.where(in_v, v_at, tl.where(in_k, k_at, 0)) + (own // width) * x_head + own % width
        start, end = tl.load(QueryStart + run), tl.load(QueryStart + run + 1)
        slot = tl.load(Slots + run)
        has_past = (slot >= 0) & (tl.load(Fresh + run) == 0)
        state = State + slot * (K - 1) * C
        rows = tl.arange(0, KP)
        w = tl.load(W + c[None, :] * K + rows[:, None], mask=(rows < K)[:, None] & cmask[None, :], other=0.0)
        w = w.to(tl.float32)
        keep = (rows < K - 1)[:, None] & cmask[None, :]
        for t in range(start, end):
            taps = _last_inputs(X, state, start, t + 1, x_row, C, c, col, cmask, has_past, K, K, KP)
            acc = tl.sum(taps * w, axis=0)
            tl.store(Out + t * C + c, (acc * tl.sigmoid(acc)).to(Out.dtype.element_ty), mask=cmask)
            snap = tl.load(Snapshots + t)
            window = _last_inputs(X, state, start, t + 1, x_row, C, c, col, cmask, has_past, K - 1, K, KP)
            dst = State + (snap * (K - 1) + rows)[:, None] * C + c[None, :]
            tl.store(dst, window, mask=tl.where(snap >= 0, keep, False))
        window = _last_inputs(X, state, start, end, x_row, C, c, col, cmask, has_past, K - 1, K, KP)
        tl.debug_barrier()  # every read of the slot's old inputs is done before they are overwritten
        tl.store(state + rows[:, None] * C + c[None, :], window, mask=tl.where(slot >= 0, keep, False))

    @triton.jit
    def _last_inputs(
        X, state, start, stop, x_row, C, c, col, cmask, has_past,
        N: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
    ):  # fmt: skip
        """[KP, BLOCK_C] float32: the N conv inputs before the run's row `stop`, oldest first (from
        the state where they precede the run, zeros without one), then zero rows."""
        i = tl.arange(0, KP)
        p = stop - start - N + i  # position in the run; negative: the state's row K - 1 + p
        live = (i < N)[:, None] & cmask[None, :]
        xv = tl.load(
            X + (start + p)[:, None] * x_row + col[None, :], mask=live & (p >= 0)[:, None], other=0.0
        )
        past = tl.where(has_past, live & (p < 0)[:, None], False)
        sv = tl.load(state + (K - 1 + p)[:, None] * C + c[None, :], mask=past, other=0.0)
        return xv.to(tl.float32) + sv

    @triton.jit
    def _delta_step_kernel(
        Q, Kx, V, BA, ALog, DtBias, Out, State, QueryStart, Slots, Fresh, Snapshots, q_row, k_row, v_row,
        ba_row, scale, HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
        BK: tl.constexpr, BV: tl.constexpr,
    ):  # fmt: skip
        """Program (run, value head, value block): the head's state columns in registers across
        the run's tokens; per token the gates, decay, delta-rule write, readout, and checkpoint if
        asked."""
        run, head = tl.program_id(0), tl.program_id(1)
        dk = tl.arange(0, BK)
        dv = tl.program_id(2) * BV + tl.arange(0, BV)
        kmask, vmask = dk < DK, dv < DV
        tile = kmask[:, None] & vmask[None, :]
        cell = head * DK * DV + dk[:, None] * DV + dv[None, :]
        start, end = tl.load(QueryStart + run), tl.load(QueryStart + run + 1)
        slot = tl.load(Slots + run)
        has_past = (slot >= 0) & (tl.load(Fresh + run) == 0)
        s = tl.load(State + slot * HV * DK * DV + cell, mask=tl.where(has_past, tile, False), other=0.0)
        key_head = head // GROUP
        b_col = key_head * 2 * GROUP + head % GROUP  # in_proj_ba: per key head, its heads' b, then a
        decay_rate = tl.exp(tl.load(ALog + head).to(tl.float32))
        dt_bias = tl.load(DtBias + head).to(tl.float32)
        for t in range(start, end):
            q = tl.load(Q + t * q_row + key_head * DK + dk, mask=kmask, other=0.0).to(tl.float32)
            k = tl.load(Kx + t * k_row + key_head * DK + dk, mask=kmask, other=0.0).to(tl.float32)
            q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
            k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
            v = tl.load(V + t * v_row + head * DV + dv, mask=vmask, other=0.0).to(tl.float32)
            a = tl.load(BA + t * ba_row + b_col + GROUP).to(tl.float32) + dt_bias
            g = -decay_rate * tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))  # softplus, as torch's
            beta = tl.sigmoid(tl.load(BA + t * ba_row + b_col).to(tl.float32))
            s = s * tl.exp(g)
            delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
            s = s + k[:, None] * delta[None, :]
            out = tl.sum(s * q[:, None], axis=0)
            tl.store(Out + (t * HV + head) * DV + dv, out.to(Out.dtype.element_ty), mask=vmask)
            snap = tl.load(Snapshots + t)
            tl.store(State + snap * HV * DK * DV + cell, s, mask=tl.where(snap >= 0, tile, False))
        tl.store(State + slot * HV * DK * DV + cell, s, mask=tl.where(slot >= 0, tile, False))

    @triton.jit
    def _gated_norm_kernel(
        X, Z, W, Out, z_row, z_head, eps, HV: tl.constexpr, GROUP: tl.constexpr, DV: tl.constexpr,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        """Program (row, value head): RMSNorm of the head's output times SiLU of its gate, rounding
        where the torch module does (the normalized row, its product with the weight, the result)."""
        row, head = tl.program_id(0), tl.program_id(1)
        d = tl.arange(0, BLOCK)
        mask = d < DV
        x = tl.load(X + (row * HV + head) * DV + d, mask=mask, other=0.0).to(tl.float32)
        normed = (x * tl.rsqrt(tl.sum(x * x, axis=0) / DV + eps)).to(Out.dtype.element_ty)
        w = tl.load(W + d, mask=mask, other=0.0).to(tl.float32)
        h = (w * normed.to(tl.float32)).to(Out.dtype.element_ty)
        z_at = Z + row * z_row + (head // GROUP) * z_head + (head % GROUP) * DV
        z = tl.load(z_at + d, mask=mask, other=0.0).to(tl.float32)
        out = h.to(tl.float32) * z * tl.sigmoid(z)
        tl.store(Out + (row * HV + head) * DV + d, out.to(Out.dtype.element_ty), mask=mask)


@dataclass
class StateRuns:
    """A step's rows as runs of consecutive tokens of one sequence each, as the kernels read them."""

    query_start: torch.Tensor  # [R + 1] first row of each run (R programs per head and block)
    slots: torch.Tensor  # [R] state slot of each run (negative: padding, from zeros, writes nothing)
    fresh: torch.Tensor  # [R] bool: the run starts at position 0 (state starts at zero)
    snapshots: torch.Tensor  # [T] slot that receives the state once the row's token is in (-1: none)

    @property
    def num_runs(self) -> int:
        return int(self.slots.shape[0])


def causal_conv_step(
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    runs: StateRuns,
) -> torch.Tensor:
    """`models.gated_delta.causal_conv` on the GPU: SiLU(depthwise causal conv) [T, C] of q, k, v
    ([T, Hk, width] views of one tensor, in_proj_qkvz's output, read in place: no gather launch),
    continuing conv_state [slots, K - 1, C] (float32) in place; weight [C, 1, K]."""
    q, k, v = qkv
    channels, width = weight.shape[0], weight.shape[-1]
    for t in (k, v):
        assert t.stride() == q.stride() and t.untyped_storage().data_ptr() == q.untyped_storage().data_ptr()
    assert q.stride(-1) == 1 and k.shape[-1] == q.shape[-1]
    assert conv_state.is_contiguous() and weight.is_contiguous()
    out = torch.empty(q.shape[0], channels, dtype=q.dtype, device=q.device)
    k_at, v_at = ((t.data_ptr() - q.data_ptr()) // q.element_size() for t in (k, v))
    block = min(triton.next_power_of_2(channels), 256)
    _conv_step_kernel[(runs.num_runs, triton.cdiv(channels, block))](
        q, out, conv_state, weight, runs.query_start, runs.slots, runs.fresh, runs.snapshots, q.stride(0),
        q.stride(1), k_at, v_at, channels, HK=q.shape[1], DK=q.shape[2], DV=v.shape[2], K=width,
        KP=triton.next_power_of_2(width), BLOCK_C=block,
    )  # fmt: skip
    return out


def gated_delta_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ba: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_state: torch.Tensor,
    runs: StateRuns,
) -> torch.Tensor:
    """`models.gated_delta.gated_delta_rule` on the GPU: outputs [T, Hv, Dv] in v's dtype for rows
    q, k [T, Hk, Dk], v [T, Hv, Dv] (heads packed in each row, rows may be strided: views of the
    conv output) and ba [T, 2 Hv] (the gates' inputs, `models.gated_delta.gates`, computed here:
    no launches of their own); continues ssm_state [slots, Hv, Dk, Dv] (float32) in place."""
    num_rows, heads, dv = v.shape
    dk = q.shape[-1]
    for t in (q, k, v):
        assert t.stride(-1) == 1 and t.stride(-2) == t.shape[-1], "heads packed in each row"
    assert ba.stride(-1) == 1 and ssm_state.is_contiguous()
    out = torch.empty(num_rows, heads, dv, dtype=v.dtype, device=v.device)
    block_v = min(triton.next_power_of_2(dv), 32)
    _delta_step_kernel[(runs.num_runs, heads, triton.cdiv(dv, block_v))](
        q, k, v, ba, a_log, dt_bias, out, ssm_state, runs.query_start, runs.slots, runs.fresh, runs.snapshots,
        q.stride(0), k.stride(0), v.stride(0), ba.stride(0), dk**-0.5, HV=heads, GROUP=heads // k.shape[1],
        DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=block_v,
    )  # fmt: skip
    return out


def gated_rms_norm_reference(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    h = x.float()
    h = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (h * F.silu(gate.reshape(x.shape).float())).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each value head's output x [T, Hv, Dv] (contiguous), scaled by weight [Dv], times
    SiLU of its gate, in x's dtype; gate [T, Hk, Hv / Hk, Dv] is a view of in_proj_qkvz's output
    (each key head's z, no copy). On the GPU one launch for what torch runs as a dozen."""
    if triton is None or not x.is_cuda:
        return gated_rms_norm_reference(x, gate, weight, eps)
    return gated_rms_norm_triton(x, gate, weight, eps)


def gated_rms_norm_triton(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """`gated_rms_norm`'s kernel, wherever Triton runs (its interpreter included: the tests)."""
    rows, heads, dim = x.shape
    assert x.is_contiguous() and gate.stride(-1) == 1 and gate.stride(-2) == dim
    out = torch.empty_like(x)
    _gated_norm_kernel[(rows, heads)](
        x, gate, weight, out, gate.stride(0), gate.stride(1), eps, HV=heads, GROUP=gate.shape[2], DV=dim,
        BLOCK=triton.next_power_of_2(dim),
    )  # fmt: skip
    return out
