"""Paged attention for decode steps, in Triton, with the torch references CI runs.

`store_kv` writes each new token's K/V into its pool slot (a negative slot writes nothing: the
padding rows of a CUDA-graph batch). `paged_decode_attention` attends one query token per
sequence to that sequence's context through its block table, reading K/V in place (no gather).

The decode kernel is split-KV: program (sequence, kv head, split) walks its share of the context
in tiles of BLOCK_N tokens, keeps an online softmax for all query heads of its KV head (GQA
packing: the group's queries share every K/V load), and writes a partial output and its
log-sum-exp; a small reduction merges the splits. Splitting keeps the 132 SMs busy at batch 1,
where one program per (sequence, kv head) would start only 8 programs for an 8B model. Every
length is read from device tensors, so one launch shape serves every step of a CUDA graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from model_service.kernels.pdl import pdl_args

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the references below are the implementation there
    triton = None


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot`'s input precision: float32 inputs stay IEEE float32 (TF32 would cost float32
    models their agreement with the CPU); half-precision inputs ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"


# An FP8 K/V cache (attention/kv_cache.py) stores e4m3 with no scale: values beyond its largest
# finite magnitude saturate there instead of overflowing.
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0

# A decode step's k [S, KVH, D], v [S, KVH, D], cos and sin [S, D] (contiguous) and slots [S].
RopeKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class DecodeTiling(NamedTuple):
    """The decode kernel's launch: context tokens a tile, warps, software-pipeline stages, and
    whether an FP8 cache's K/V widen to float16 (one `cvt` from e4m3 on sm90; q is rounded to
    float16 too, saturated at its largest finite value) rather than bfloat16. Chosen by
    `decode_tiling`; `bench/decode_splits.py --sweep` times the alternatives."""

    block_n: int = 64
    warps: int = 4
    stages: int = 3
    f16: bool = False


def decode_tiling(cache: torch.dtype) -> DecodeTiling:
    """The tiling for a K/V cache of dtype `cache`. H200 sweep (2026-12-02 y, 8B heads, us a
    layer at the engine's split count; 32-128 tokens, 4 / 8 warps, 2 / 3 stages, widened to bf16
    or fp16, plain or transposed products): an FP8 cache at today's bf16 tiling read 994-1,438
    GB/s of its bytes, 20.9 / 91.0 / 478.9 us at 64 rows of 128-192 tokens / 256 of 128-256 /
    256 of 64-2,500; 128-token tiles, 2 stages, widened to fp16: **16.5 / 65.6 / 317.8** (best or
    within 15% of it in every case; bf16 K/V take 354.3 at 256 of 64-2,500). Each e4m3 tile
    is half a bf16 tile's bytes, so twice the tokens keep as many bytes in flight. bf16 keeps
    64 tokens, 4 warps, 3 stages: 128 tokens gained 5% at 256 rows and lost 9% at batch 1."""
    if cache == FP8:
        return DecodeTiling(block_n=128, warps=4, stages=2, f16=True)
    return DecodeTiling()


class HeadNorms(NamedTuple):
    """Qwen3's per-head RMSNorms of queries and keys (q_norm, k_norm: a weight [D] each, one
    eps), which the RoPE kernels apply to the heads they read before rotating them."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float


def to_cache(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """`x` as `cache` stores it."""
    if cache.dtype == FP8:
        x = x.clamp(-FP8_MAX, FP8_MAX)
    return x.to(cache.dtype)


def indexable(t: torch.Tensor) -> torch.Tensor:
    """`t`, an FP8 one as its bytes: torch's float8 support in indexing kernels varies by version
    and device (index_put, index_cpu and index_cuda each came in a different release)."""
    return t.view(torch.uint8) if t.dtype == FP8 else t


def cache_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache[slots], in the cache's dtype."""
    return indexable(cache)[slots].view(cache.dtype)


def write_cache_rows(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """cache[slots] = x, as the cache stores it."""
    indexable(cache)[slots] = indexable(to_cache(x, cache))


def store_kv_reference(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    keep = slots >= 0
    write_cache_rows(k_cache, slots[keep], k[keep])
    write_cache_rows(v_cache, slots[keep], v[keep])


def paged_decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [S, H, D] (one token per sequence, at position seq_len - 1); returns [S, H, D] in
    q's dtype, computed in float32. A sequence of length 0 (padding) gets zeros. `softcap` and
    `sinks`: `attention_probs`'."""
    out = torch.zeros_like(q)
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    for i, n in enumerate(seq_lens.tolist()):
        if n == 0:
            continue
        lo = max(0, n - window) if window else 0
        pos = torch.arange(lo, n, device=q.device)
        slots = block_table[i, pos // block_size] * block_size + pos % block_size
        k = cache_rows(k_cache, slots).float().repeat_interleave(heads // kv_heads, dim=1)  # [N, H, D]
        v = cache_rows(v_cache, slots).float().repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[i].float(), k) * scale
        out[i] = torch.einsum("hn,nhd->hd", attention_probs(scores, None, softcap, sinks), v).to(q.dtype)
    return out


def attention_probs(
    scores: torch.Tensor, allowed: torch.Tensor | None, softcap: float | None, sinks: torch.Tensor | None
) -> torch.Tensor:
    """The float32 softmax over the keys (last dim) of scores [H, ..., N] where `allowed` (all if
    None): soft-capped first when `softcap` (Gemma 2's cap * tanh(scores / cap)); with `sinks`
    [H] (gpt-oss's), each head's sink logit joins the denominator and has no value."""
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is None:
        return scores.softmax(-1)
    sink = sinks.float().view(-1, *[1] * (scores.dim() - 1)).expand(*scores.shape[:-1], 1)
    return torch.cat((scores, sink), dim=-1).softmax(-1)[..., :-1]


if triton is not None:
    from model_service.kernels.pdl import admit_dependents, wait_for_producers

    @triton.jit
    def cache_value(x, TO_FP8: tl.constexpr):
        """`x` as the K/V cache stores it (tl.store then casts): saturated for an FP8 cache."""
        if TO_FP8:
            x = tl.minimum(tl.maximum(x.to(tl.float32), -448.0), 448.0)
        return x

    @triton.jit
    def soft_capped(s, cap, SOFTCAP: tl.constexpr):
        """Gemma 2's cap * tanh(s / cap) under SOFTCAP, else s. tanh(x) as 1 - 2 / (exp(2x) + 1):
        finite for every logit, where (exp(x) - exp(-x)) / (exp(x) + exp(-x)) is inf / inf past
        |x| ~ 88, and no libdevice call (the interpreter runs this too)."""
        if SOFTCAP:
            s = cap * (1.0 - 2.0 / (tl.exp(2.0 * s / cap) + 1.0))
        return s

    @triton.jit
    def join_sink(m, denom, acc, sink):
        """The online softmax's step for gpt-oss's sink (one logit a row: [R] or a scalar): it
        joins the denominator like one more key whose value is zero. A row with no key yet
        (m = -inf) ends with denominator 1 and output 0, the reference's."""
        m_new = tl.maximum(m, sink)
        alpha = tl.exp(m - m_new)
        return m_new, denom * alpha + tl.exp(sink - m_new), acc * alpha[:, None]

    @triton.jit
    def _store_kv_kernel(
        K, V, KC, VC, Slots, row_stride, cache_stride, width, BLOCK: tl.constexpr, TO_FP8: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        wait_for_producers(PDL)
        t = tl.program_id(0)
        slot = tl.load(Slots + t)
        if slot >= 0:
            offs = tl.arange(0, BLOCK)
            m = offs < width
            k = cache_value(tl.load(K + t * row_stride + offs, mask=m), TO_FP8)
            v = cache_value(tl.load(V + t * row_stride + offs, mask=m), TO_FP8)
            tl.store(KC + slot * cache_stride + offs, k, mask=m)
            tl.store(VC + slot * cache_stride + offs, v, mask=m)

    @triton.jit
    def rms_scale(x, dim, eps):
        """1 / RMS of each row of x [R, D] (zeros past `dim` add nothing), in float32."""
        h = x.to(tl.float32)
        return 1.0 / tl.sqrt(tl.sum(h * h, axis=1) / dim + eps)

    @triton.jit
    def rms_apply(x, rstd, w):
        """x [R, D] times its rows' `rstd`, rounded to x's dtype, times the weight w [D], rounded
        again: the arithmetic of `fused.rms_norm_reference` (HF's)."""
        normed = (x.to(tl.float32) * rstd[:, None]).to(x.dtype).to(tl.float32)
        return (normed * w.to(tl.float32)[None, :]).to(x.dtype)

    @triton.jit
    def rotated_rows(X, rows, d, cos, sin, mask, NormW, eps, HALF: tl.constexpr, NORM: tl.constexpr):
        """The head vectors at X + rows (offsets [R]) with RoPE applied (half-rotation layout),
        RMS-normalized first with weight NormW under NORM (Qwen3's q_norm / k_norm): the
        arithmetic of the separate kernels in fused.py, so both paths round alike."""
        x = tl.load(X + rows[:, None] + d[None, :], mask=mask[:, None], other=0.0)
        turned = (d + HALF) % (2 * HALF)
        partner = tl.load(X + rows[:, None] + turned[None, :], mask=mask[:, None], other=0.0)
        if NORM:
            rstd = rms_scale(x, 2 * HALF, eps)  # the partner is the same row: the same scale
            x = rms_apply(x, rstd, tl.load(NormW + d))
            partner = rms_apply(partner, rstd, tl.load(NormW + turned))
        c, s = cos[None, :], sin[None, :]
        return tl.where(d[None, :] < HALF, x * c - partner * s, x * c + partner * s)

    @triton.jit
    def _new_token_kv(
        K, V, KC, VC, cos, sin, seq, kvh, d, slot, write, k_row, k_head, v_row, v_head,
        kc_stride_slot, kc_stride_h, NormK, eps, HEAD_DIM: tl.constexpr, TO_FP8: tl.constexpr,
        NORM: tl.constexpr,
    ):  # fmt: skip
        """The new token's rotated K and its V for one kv head, [1, HEAD_DIM] each, as the pool
        holds them; with `write` (the split that owns the token's position) stored at `slot`."""
        one = tl.arange(0, 1)
        rows = seq * k_row + kvh * k_head + one
        k = rotated_rows(K, rows, d, cos, sin, one == 0, NormK, eps, HEAD_DIM // 2, NORM)
        k = cache_value(k, TO_FP8)
        v = cache_value(tl.load(V + seq * v_row + kvh * v_head + d)[None, :], TO_FP8)
        if write:
            dst = slot * kc_stride_slot + kvh * kc_stride_h + d[None, :]
            tl.store(KC + dst, k)
            tl.store(VC + dst, v)
        return k.to(KC.dtype.element_ty), v.to(VC.dtype.element_ty)

    @triton.jit
    def _kv_tile(
        q, KC, VC, BlockTable, seq, kvh, d, tile, end, bt_stride, kc_stride_slot, kc_stride_h,
        BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        """Context positions [tile, tile + BLOCK_N) of one sequence and kv head, read in place
        through its block table: (valid [BLOCK_N], K and V [BLOCK_N, HEAD_DIM] in q's dtype)."""
        pos = tile + tl.arange(0, BLOCK_N)
        valid = pos < end
        block = tl.load(BlockTable + seq * bt_stride + pos // BLOCK_SIZE, mask=valid, other=0)
        slot = block * BLOCK_SIZE + pos % BLOCK_SIZE
        kv_off = slot[:, None] * kc_stride_slot + kvh * kc_stride_h + d[None, :]
        k = tl.load(KC + kv_off, mask=valid[:, None], other=0.0).to(q.dtype)  # an FP8 cache widens
        v = tl.load(VC + kv_off, mask=valid[:, None], other=0.0).to(q.dtype)
        return valid, k, v

    @triton.jit
    def _attend_tiles(
        q, KC, VC, BlockTable, seq, kvh, d, start, end, bt_stride, kc_stride_slot, kc_stride_h, scale,
        softcap, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
    ):  # fmt: skip
        """The online softmax of a query group over context positions [start, end) of one
        sequence: (running max, denominator, output). Logits soft-capped under SOFTCAP."""
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        denom = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        for tile in range(start, end, BLOCK_N):
            valid, k, v = _kv_tile(
                q, KC, VC, BlockTable, seq, kvh, d, tile, end, bt_stride, kc_stride_slot, kc_stride_h,
                BLOCK_SIZE, BLOCK_N,
            )  # fmt: skip
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [GROUP_PAD, BLOCK_N]
            s = tl.where(valid[None, :], soft_capped(s, softcap, SOFTCAP), float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            denom = denom * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        return m, denom, acc

    @triton.jit
    def _attend_one_more(q, k, v, m, denom, acc, scale, attend, softcap, SOFTCAP: tl.constexpr):
        """The online softmax's step for one more key when `attend` (k, v: [1, HEAD_DIM]), with
        the rounding of the tile loop: its probabilities meet V in V's dtype."""
        if attend:
            s = soft_capped(tl.sum(q.to(tl.float32) * k.to(tl.float32), 1) * scale, softcap, SOFTCAP)
            m_new = tl.maximum(m, s)
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new)
            denom = denom * alpha + p
            acc = acc * alpha[:, None] + p.to(v.dtype).to(tl.float32)[:, None] * v.to(tl.float32)
            m = m_new
        return m, denom, acc

    @triton.jit(do_not_specialize=["bt_stride"])  # the block table's width changes every eager step
    def _decode_split_kernel(
        Q, KC, VC, BlockTable, SeqLens, PartOut, PartLse, Out, K, V, Cos, Sin, Slots, NormQ, NormK, eps,
        Sinks, q_stride_s, q_stride_h, kc_stride_slot, kc_stride_h, bt_stride, po_stride_s, po_stride_h,
        po_stride_split, pl_stride_s, pl_stride_h, k_row, k_head, v_row, v_head, scale, window, softcap,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr, ROPE: tl.constexpr,
        TO_FP8: tl.constexpr, NORM: tl.constexpr, F16: tl.constexpr, SOFTCAP: tl.constexpr,
        SINKS: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """With ROPE, q, k and v come straight from the projection: each program rotates its
        query heads in registers (normalized first under NORM), and the token's K/V (position
        seq_len - 1) are written to the pool by the split whose share holds it, which attends to
        them from registers after its loop (a select inside the loop cost 8% at batch 64).
        SOFTCAP: logits soft-capped (Gemma 2). SINKS: each head's sink (gpt-oss) joins split 0's
        softmax, so the merge, which weighs the splits by their log-sum-exps, counts it once."""
        wait_for_producers(PDL)
        seq, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        seq_len = tl.load(SeqLens + seq)
        lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
        per_split = tl.cdiv(tl.cdiv(seq_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = lo + split * per_split
        end = tl.minimum(start + per_split, seq_len)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_DIM)
        heads = kvh * GROUP + g
        if ROPE:
            cos, sin = tl.load(Cos + seq * HEAD_DIM + d), tl.load(Sin + seq * HEAD_DIM + d)
            rows = seq * q_stride_s + heads * q_stride_h
            q = rotated_rows(Q, rows, d, cos, sin, g < GROUP, NormQ, eps, HEAD_DIM // 2, NORM)
            q = q.to(Q.dtype.element_ty)
            new_slot = tl.load(Slots + seq)
            new_pos = tl.where(new_slot >= 0, seq_len - 1, -1)  # a padding row (slot -1) writes nothing
            owner = (start <= new_pos) & (new_pos < end)
            k_new, v_new = _new_token_kv(
                K, V, KC, VC, cos, sin, seq, kvh, d, new_slot, owner, k_row, k_head, v_row, v_head,
                kc_stride_slot, kc_stride_h, NormK, eps, HEAD_DIM, TO_FP8, NORM,
            )  # fmt: skip
            end = tl.where(owner, new_pos, end)  # the new token joins after the loop, from registers
        else:
            q_off = seq * q_stride_s + heads[:, None] * q_stride_h + d[None, :]
            q = tl.load(Q + q_off, mask=g[:, None] < GROUP, other=0.0)
        q_tiles = q
        if F16:
            q_tiles = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
        m, denom, acc = _attend_tiles(
            q_tiles, KC, VC, BlockTable, seq, kvh, d, start, end, bt_stride, kc_stride_slot, kc_stride_h,
            scale, softcap, GROUP_PAD, HEAD_DIM, BLOCK_SIZE, BLOCK_N, PRECISION, SOFTCAP,
        )  # fmt: skip
        admit_dependents(PDL)
        if ROPE:
            m, denom, acc = _attend_one_more(
                q, k_new.to(q.dtype), v_new.to(q.dtype), m, denom, acc, scale, owner, softcap, SOFTCAP
            )
        gm = g < GROUP
        if SINKS:  # noqa: SIM102 (apart: the constexpr prunes it all at compile time)
            if split == 0:
                sink = tl.load(Sinks + heads, mask=gm, other=0.0).to(tl.float32)
                m, denom, acc = join_sink(m, denom, acc, sink)
        lse = tl.where(denom > 0, m + tl.log(denom), float("-inf"))
        out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
        if NUM_SPLITS == 1:  # nothing to merge: the output itself, [S, H, D] contiguous
            out_off = (seq * tl.num_programs(1) * GROUP + heads[:, None]) * HEAD_DIM + d[None, :]
            tl.store(Out + out_off, out.to(Out.dtype.element_ty), mask=gm[:, None])
            return
        tl.store(
            PartOut + seq * po_stride_s + heads[:, None] * po_stride_h + split * po_stride_split + d[None, :],
            out,
            mask=gm[:, None],
        )
        tl.store(PartLse + seq * pl_stride_s + heads * pl_stride_h + split, lse, mask=gm)


if triton is not None:

    @triton.jit
    def _merge_splits_kernel(
        PartOut, PartLse, Out, num_splits, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr, PDL: tl.constexpr
    ):  # fmt: skip
        """One (sequence, head): weight each split's output by exp(lse - max); empty splits
        (lse = -inf) weigh nothing, and a padding row (every split empty) gets zeros."""
        wait_for_producers(PDL)
        row = tl.program_id(0)  # sequence * heads + head
        s = tl.arange(0, SPLITS)
        d = tl.arange(0, HEAD_DIM)
        lse = tl.load(PartLse + row * num_splits + s, mask=s < num_splits, other=float("-inf"))
        top = tl.maximum(tl.max(lse, 0), -1e30)
        w = tl.exp(lse - top)
        total = tl.maximum(tl.sum(w, 0), 1e-30)
        parts = tl.load(
            PartOut + (row * num_splits + s[:, None]) * HEAD_DIM + d[None, :],
            mask=s[:, None] < num_splits,
            other=0.0,
        )
        out = tl.sum(parts * w[:, None], 0) / total
        tl.store(Out + row * HEAD_DIM + d, out.to(Out.dtype.element_ty))


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """k, v: [T, KVH, D] contiguous; caches: [slots, KVH, D]; slots: [T] (negative = skip)."""
    if triton is None or not k.is_cuda:
        return store_kv_reference(k, v, k_cache, v_cache, slots)
    return store_kv_triton(k, v, k_cache, v_cache, slots)


def store_kv_triton(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """`store_kv`'s kernel, wherever Triton runs (its interpreter included: the CPU tests)."""
    width = k.shape[1] * k.shape[2]
    block = triton.next_power_of_2(width)
    _store_kv_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, slots, k.stride(0), k_cache.stride(0), width, block, k_cache.dtype == FP8,
        **pdl_args(k.device),
    )  # fmt: skip


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    scale: float,
    window: int | None = None,
    num_splits: int = 1,
    out: torch.Tensor | None = None,
    rope_kv: RopeKV | None = None,
    norms: HeadNorms | None = None,
    tiling: DecodeTiling | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Triton kernel on CUDA (the reference elsewhere); same contract as the reference.
    `out` ([S, H, D] contiguous, new if None): where to write, e.g. the decode rows of a mixed step.
    `rope_kv`: q and this step's K/V as the projection left them, rotated and written by the
    kernel itself (CUDA only: `fused.rotary_decode_attention` decides when it applies); `norms`
    (with `rope_kv` only): q's and k's heads RMS-normalized before they are rotated. `tiling`:
    the launch, `decode_tiling`'s for the cache if None. `softcap` (Gemma 2) and `sinks` [H]
    (gpt-oss): `attention_probs`'; each is a compile-time switch of the kernel, so other models'
    kernels are as they were."""
    num_seqs, heads, dim = q.shape
    out = torch.empty(num_seqs, heads, dim, dtype=q.dtype, device=q.device) if out is None else out
    if triton is None or not q.is_cuda:
        assert rope_kv is None, "the reference attends over a pool that already holds the step's K/V"
        want = paged_decode_attention_reference(
            q, k_cache, v_cache, block_table, seq_lens, block_size, scale, window, softcap, sinks
        )
        return out.copy_(want)
    return decode_attention_triton(
        q, k_cache, v_cache, block_table, seq_lens, block_size, scale, window, num_splits, out, rope_kv,
        norms, tiling, softcap, sinks,
    )  # fmt: skip


def decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    scale: float,
    window: int | None,
    num_splits: int,
    out: torch.Tensor,
    rope_kv: RopeKV | None = None,
    norms: HeadNorms | None = None,
    tiling: DecodeTiling | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_decode_attention`'s launches, wherever Triton runs (its interpreter included: the
    tests)."""
    num_seqs, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    tiling = tiling or decode_tiling(k_cache.dtype)
    f16 = tiling.f16 and k_cache.dtype == FP8 and q.dtype == torch.bfloat16
    # One split (a batch that fills the GPU by itself) writes `out` directly: no merge launch.
    part_out = torch.empty(num_seqs, heads, num_splits, dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(num_seqs, heads, num_splits, dtype=torch.float32, device=q.device)
    k, v, cos, sin, slots = rope_kv if rope_kv is not None else (q, q, q, q, seq_lens)
    assert norms is None or rope_kv is not None, "the heads are normalized where they are rotated"
    norm_q, norm_k, eps = norms if norms is not None else (q, q, 0.0)
    _decode_split_kernel[(num_seqs, kv_heads, num_splits)](
        q, k_cache, v_cache, block_table, seq_lens, part_out, part_lse, out, k, v, cos, sin, slots, norm_q,
        norm_k, eps, sinks if sinks is not None else q, q.stride(0), q.stride(1), k_cache.stride(0),
        k_cache.stride(1), block_table.stride(0), part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), scale,
        window or 0, softcap or 0.0,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=dim,
        BLOCK_SIZE=block_size, BLOCK_N=tiling.block_n, NUM_SPLITS=num_splits,
        PRECISION=dot_precision(q.dtype), ROPE=rope_kv is not None, TO_FP8=k_cache.dtype == FP8,
        NORM=norms is not None, F16=f16, SOFTCAP=softcap is not None, SINKS=sinks is not None,
        num_warps=tiling.warps, num_stages=tiling.stages,
        **pdl_args(q.device),
    )  # fmt: skip
    if num_splits > 1:
        _merge_splits_kernel[(num_seqs * heads,)](
            part_out, part_lse, out, num_splits, HEAD_DIM=dim, SPLITS=triton.next_power_of_2(num_splits),
            **pdl_args(q.device),
        )  # fmt: skip
    return out


def num_splits_for(num_seqs: int, kv_heads: int, num_sms: int = 132) -> int:
    """Splits per (sequence, kv head) so one launch has about two waves of programs: many at
    batch 1 (long contexts would otherwise run on 8 SMs), one once the batch fills the GPU. A
    power of two: the split count is a compile-time constant of the kernel, and the decode
    graphs' batch ladder compiles these few at start-up, where any count would make a mixed step
    with an unseen number of decode rows compile a new kernel under traffic."""
    splits = max(1, min(16, 2 * num_sms // max(num_seqs * kv_heads, 1)))
    return 1 << (splits.bit_length() - 1)
