"""The glue around Qwen3-Next's gated full attention, one Triton launch each on CUDA, with the torch
references that run everywhere else (and that the CPU tests check the kernels against).

Before attention, the qkv projection's rows hold, per query head, its query and its output gate,
then the keys and values. The query and key heads get a zero-centered RMSNorm each, then RoPE on
their first `rotary_dim` dims (partial rotary), and attention wants q, k, v as [T, heads, D]. In
torch that is two norms of ~10 launches, two rotations with a `torch.cat` each and the copies of
the strided views: ~25 launches a layer, one here (`gated_heads`). After attention, the output
times sigmoid(gate) is three more (the strided gate's copy, the sigmoid, the product), one here
(`sigmoid_gate`).
"""

from __future__ import annotations

import torch

from model_service.kernels.fused import apply_rotary, rms_norm_reference
from model_service.kernels.paged_attention import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _gated_heads_kernel(
        QKV, QW, KW, Cos, Sin, Q, K, V, row, cos_row, eps, H: tl.constexpr, KV: tl.constexpr,
        D: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """Program (token, head of q, then of k, then of v): a q or k head normalized and rotated
        into Q or K, a v head copied into V, all [T, heads, D] contiguous."""
        t, head = tl.program_id(0), tl.program_id(1)
        d = tl.arange(0, BLOCK)
        mask = d < D
        src = QKV + t * row
        if head < H:
            _norm_rope(src + head * 2 * D, QW, Cos + t * cos_row, Sin + t * cos_row, Q + (t * H + head) * D,
                       d, mask, eps, D, HALF)  # fmt: skip
        elif head < H + KV:
            kv = head - H
            _norm_rope(src + 2 * H * D + kv * D, KW, Cos + t * cos_row, Sin + t * cos_row,
                       K + (t * KV + kv) * D, d, mask, eps, D, HALF)  # fmt: skip
        else:
            kv = head - H - KV
            x = tl.load(src + (2 * H + KV + kv) * D + d, mask=mask)
            tl.store(V + (t * KV + kv) * D + d, x, mask=mask)

    @triton.jit
    def _norm_rope(X, W, Cos, Sin, Out, d, mask, eps, D: tl.constexpr, HALF: tl.constexpr):
        """One head: zero-centered RMSNorm (`rms_norm_reference`'s rounding), then RoPE on its first
        2 HALF dims, each partner element normalized again rather than moved between lanes."""
        x = tl.load(X + d, mask=mask, other=0.0)
        h = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / D + eps)
        y = (h * rstd * (1.0 + tl.load(W + d, mask=mask, other=0.0).to(tl.float32))).to(x.dtype)
        rot = d < 2 * HALF
        partner = tl.where(d < HALF, d + HALF, d - HALF)
        xp = tl.load(X + partner, mask=rot, other=0.0).to(tl.float32)
        wp = tl.load(W + partner, mask=rot, other=0.0).to(tl.float32)
        yp = (xp * rstd * (1.0 + wp)).to(x.dtype).to(tl.float32)
        cos = tl.load(Cos + d, mask=rot, other=1.0).to(tl.float32)
        sin = tl.load(Sin + d, mask=rot, other=0.0).to(tl.float32)
        rotated = y.to(tl.float32) * cos + tl.where(d < HALF, -yp, yp) * sin
        tl.store(Out + d, tl.where(rot, rotated.to(x.dtype), y), mask=mask)

    @triton.jit
    def _sigmoid_gate_kernel(X, G, Out, g_row, g_head, H: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
        """Program (token, head): x times sigmoid(gate), each rounded where torch rounds."""
        t, head = tl.program_id(0), tl.program_id(1)
        d = tl.arange(0, BLOCK)
        mask = d < D
        x = tl.load(X + (t * H + head) * D + d, mask=mask, other=0.0)
        g = tl.load(G + t * g_row + head * g_head + d, mask=mask, other=0.0).to(tl.float32)
        gate = tl.sigmoid(g).to(x.dtype).to(tl.float32)
        tl.store(Out + (t * H + head) * D + d, (x.to(tl.float32) * gate).to(x.dtype), mask=mask)


HeadShape = tuple[int, int, int]  # (query heads, KV heads, head_dim)
Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin [T, rotary_dim]


def rotate_partial(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """RoPE on the first cos.shape[-1] dims of each head of x [T, H, D]; the rest pass through."""
    dim = rope[0].shape[-1]
    if dim == x.shape[-1]:
        return apply_rotary(x, *rope)
    return torch.cat([apply_rotary(x[..., :dim], *rope), x[..., dim:]], dim=-1)


def gated_heads_reference(
    qkv: torch.Tensor, norms: tuple[torch.Tensor, torch.Tensor], eps: float, rope: Rope, shape: HeadShape
) -> tuple[torch.Tensor, ...]:
    """(q, k, v [T, heads, D], gate [T, H, D]) from the qkv projection's rows [T, 2 H D + 2 KV D]:
    q and k normalized (zero-centered, weights `norms`) and partially rotated; gate a view."""
    heads, kv_heads, dim = shape
    n = qkv.shape[0]
    q_gate, k, v = qkv.split((2 * heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
    q, gate = q_gate.reshape(n, heads, 2 * dim).chunk(2, dim=-1)
    q, k = (
        rotate_partial(rms_norm_reference(x, w, eps, zero_centered=True), rope)
        for x, w in zip((q, k.reshape(n, kv_heads, dim)), norms, strict=True)
    )
    return q.contiguous(), k.contiguous(), v.reshape(n, kv_heads, dim), gate


def gated_heads(
    qkv: torch.Tensor, norms: tuple[torch.Tensor, torch.Tensor], eps: float, rope: Rope, shape: HeadShape
) -> tuple[torch.Tensor, ...]:
    """`gated_heads_reference`; on CUDA one launch (a power-of-two half rotary dim)."""
    half = rope[0].shape[-1] // 2
    if triton is None or not qkv.is_cuda or half & (half - 1) or qkv.stride(-1) != 1:
        return gated_heads_reference(qkv, norms, eps, rope, shape)
    return gated_heads_triton(qkv, norms, eps, rope, shape)


def gated_heads_triton(
    qkv: torch.Tensor, norms: tuple[torch.Tensor, torch.Tensor], eps: float, rope: Rope, shape: HeadShape
) -> tuple[torch.Tensor, ...]:
    """`gated_heads`' kernel, wherever Triton runs (its interpreter included: the CPU tests)."""
    heads, kv_heads, dim = shape
    n = qkv.shape[0]
    cos, sin = (t.contiguous() for t in rope)
    q = torch.empty(n, heads, dim, dtype=qkv.dtype, device=qkv.device)
    k, v = (torch.empty(n, kv_heads, dim, dtype=qkv.dtype, device=qkv.device) for _ in range(2))
    _gated_heads_kernel[(n, heads + 2 * kv_heads)](
        qkv, norms[0], norms[1], cos, sin, q, k, v, qkv.stride(0), cos.stride(0), eps, H=heads, KV=kv_heads,
        D=dim, HALF=cos.shape[-1] // 2, BLOCK=triton.next_power_of_2(dim),
    )  # fmt: skip
    gate = qkv[:, : 2 * heads * dim].unflatten(-1, (heads, 2 * dim))[..., dim:]
    return q, k, v, gate


def sigmoid_gate_reference(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] times sigmoid(gate [T, H, D]), flattened to [T, H D] for o_proj."""
    n = x.shape[0]
    return x.reshape(n, -1) * torch.sigmoid(gate.reshape(n, -1))


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """`sigmoid_gate_reference`; on CUDA one launch that reads the gate where qkv left it."""
    if triton is None or not x.is_cuda or gate.stride(-1) != 1:
        return sigmoid_gate_reference(x, gate)
    return sigmoid_gate_triton(x, gate)


def sigmoid_gate_triton(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """`sigmoid_gate`'s kernel, wherever Triton runs (its interpreter included: the CPU tests)."""
    n, heads, dim = x.shape
    x = x.contiguous()
    out = torch.empty(n, heads * dim, dtype=x.dtype, device=x.device)
    _sigmoid_gate_kernel[(n, heads)](
        x, gate, out, gate.stride(0), gate.stride(1), H=heads, D=dim, BLOCK=triton.next_power_of_2(dim)
    )
    return out
