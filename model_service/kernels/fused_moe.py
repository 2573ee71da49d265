"""The experts of a sparse MoE layer in Triton for decode-sized batches: each selected expert's
weights read once a step, every shape fixed by (tokens, top_k, experts), so a decode step with
MoE layers is one CUDA graph replay like a dense one.

Why not `grouped_mm` (kernels/experts.py): at a few rows an expert its CUTLASS tiles are built for
prefill, it needs the rows gathered and sorted by torch ops first (~10 launches), and it runs only
for bf16 on sm90/sm100. A decode step of Qwen3-30B-A3B reads ~75 MB of experts a layer and does
almost no arithmetic, so what matters is streaming the selected experts' bytes at full bandwidth in
as few launches as possible. The layout is the field's (vLLM's and SGLang's fused_moe), written for
this engine:

1. `align` (two launches, a program a chunk of pairs): the (token, slot) pairs sorted by expert,
   each expert's run padded to a multiple of BLOCK_M rows: `sorted_pairs[i]` a pair index
   (t * top_k + slot) or the sentinel P = T * top_k for padding, `block_expert[b]` the expert of
   rows [b * BLOCK_M, (b+1) * BLOCK_M) or -1 past the end. The buffers have a fixed upper bound
   of blocks, ceil((P + min(E, P) * (BLOCK_M - 1)) / BLOCK_M), so no count ever reaches the
   host. Pairs of experts outside [0, E) (remote, under expert parallelism) are left out. At one
   token the pairs are distinct experts already: the GEMMs take `ids` as the block list directly
   (`direct`), no alignment.
2. `_gate_up_kernel`: program (block, column block) computes the gate and the up columns of its
   rows against its expert's [2I, H] rows, then SiLU(gate) * up in float32, stored per pair in the
   model's dtype (as the reference rounds h). Weights are read where `StackedExperts` keeps them
   ([E, 2I, H], rows contiguous along H), by strides: nothing is copied per call. Where the
   launch has fewer programs than SMs (one token: 8 experts x 12 column blocks, each 16 K tiles
   long) and its e4m3 tiles leave room for two programs an SM, H is split in slices whose
   partial sums the last program to arrive adds in order before the activation, so every SM
   streams weights.
3. `_down_kernel`: the same over down [E, H, I], the routing weight multiplied into the float32
   sums, one float32 row per pair; then each token's top_k rows summed in slot order (remote
   slots skipped) and rounded once, by the token's last program to arrive in each column block
   (an arrival counter, kernels/arrivals.py): deterministic, unlike atomic adds, as accurate as
   the float32 sum can be, and no launch of its own (a `_combine_kernel` was ~2.6 us of a ~30 us
   batch-1 layer).

gpt-oss's experts (`ExpertBiases`, `ClampedSwiGLU`): gate_up's biases added to the float32 sums
before the clamped SwiGLU, down's to each pair's sums before its routing weight, as HF computes
them; constexpr switches (HAS_BIAS, CLAMPED) that compile every other family's kernels as before.

FP8 experts (`ExpertScales`: e4m3 weights, float32 scales per expert, output row and, for
block-quantized checkpoints, 128 input columns): each weight tile is widened to the activations'
type as it is loaded (exactly: every e4m3 value is a bf16 value) and the sums are scaled per
column, after the K loop (one scale a row) or per K tile (a tile lies in one group), so a step
reads one byte a weight, the bytes that bound decode. Activations stay in the compute dtype
(W8A16), whatever a checkpoint calibrated them for.

Tiles: 16 rows (BLOCK_M, `tl.dot`'s smallest; rows past an expert's tokens are masked, and the
wasted arithmetic is free in a memory-bound kernel), and the column block narrowed towards two
programs an SM, as the skinny dense kernel does (kernels/skinny_gemm.py), but no narrower than 64
(measured: `fused_moe_config`): at one token the 8 experts' gate_up is 8 x 768 / 64 = 96
programs. Larger batches take wider row blocks (vLLM's tuned H200 tables for E=128, N=768 switch
to BLOCK_M 32 at 256 tokens).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from model_service.kernels.expert_gemv import expert_gemv, expert_gemv_applies, glu_args
from model_service.kernels.fp8_gemm import E4M3, has_fp8_conversions
from model_service.kernels.paged_attention import dot_precision, triton
from model_service.kernels.pdl import pdl_args
from model_service.models.config import PLAIN_TOP_K, ClampedSwiGLU, Routing

if triton is not None:
    import triton.language as tl

    from model_service.kernels.arrivals import last_to_arrive
    from model_service.kernels.expert_gemv import glu
    from model_service.kernels.pdl import admit_dependents, wait_for_producers


def align_tiles(pairs: int, e_p2: int) -> tuple[int, int]:
    """(pairs an alignment program takes, its warps). Each program reads every program's counts
    ([chunks, E_P2]) and holds [CHUNK, E_P2] tiles in registers, so the best CHUNK grows with the
    pairs and shrinks with the experts: about sqrt(pairs x 128 / E_P2), within [16, 64]. Measured
    over CHUNK 16-64 x 4-16 warps for 60-513 experts at 1-256 tokens (H100, 2026-12-07 ak), this
    picks the fastest or within 0.5 us of it; the fixed 64 x 4 it replaces spilled at E_P2 1,024
    (Qwen3-Next's 512 experts + its fused shared slot: 26.4 -> 6.9 us at 16 tokens) and at 16
    tokens of 128 experts took 6.9 us where 16 pairs take 4.1."""
    root = max(1, math.isqrt(pairs * 128 // e_p2))
    chunk = min(64, max(16, 1 << (root - 1).bit_length()))  # root's next power of two
    warps = 4 if (chunk == 16 and e_p2 <= 512) or (chunk == 32 and e_p2 <= 128) else 8
    return chunk, warps


@dataclass(frozen=True)
class ExpertScales:
    """FP8 experts' float32 scales: gate_up's [E, 2I, G] and down's [E, H, G'], one per expert,
    output row and `group` input columns (`group` 0: one per row, G = G' = 1)."""

    gate_up: torch.Tensor
    down: torch.Tensor
    group: int = 0


@dataclass(frozen=True)
class ExpertBiases:
    """Per-expert output biases (gpt-oss's experts): gate_up's [E, 2I] (gate's columns first, as
    the weights' rows) and down's [E, H], in any float type (read as float32)."""

    gate_up: torch.Tensor
    down: torch.Tensor


@dataclass(frozen=True)
class FusedMoeConfig:
    block_m: int
    gate_up_block_n: int
    down_block_n: int
    block_k: int
    num_stages: int
    num_warps: int = 4
    gate_up_split: int = 1  # K slices of gate_up, summed by the last to arrive (few-program launches)
    gemv: bool = False  # one token: GEMVs (kernels/expert_gemv.py) instead of these tiles


def fused_moe_config(
    tokens: int, top_k: int, experts: int, hidden: int, inter: int, sms: int = 132, item_bytes: int = 2
) -> FusedMoeConfig:
    """The tiling for `tokens` rows over `experts` local experts on a GPU of `sms` SMs: BLOCK_M by
    rows an expert (16 up to 16 of them, then 32, then 64), column blocks halved from 128 down to
    64 while a launch has fewer than two programs an SM. Sixteen-row blocks read K in 128-long
    runs (a weight column's 256 contiguous bytes in bf16). An H200 sweep at Qwen3-30B-A3B's
    shapes (`bench/moe.py --tokens 1 64 --sweep`, 2026-12-02 v): at 1 token the 32-wide columns
    and 64-long K this took before 42.1 us, 64 x 64 columns with K 128 37.8; at 64 tokens K 128
    gained 3-5% at every width. The run is 256 bytes whatever the weights' type (`item_bytes`):
    float32 tiles of K 128 and 128 columns outgrow the shared memory of four stages. One-byte
    (e4m3) weights take bf16's K and 8 warps: their sweep (2026-12-02 x: K 128 / 256, 4 / 8
    warps) found them bound by widening the tiles in registers, not by bytes (8 warps: 42.7 ->
    39.1 us at 1 token, 287 -> 267 at 64). Wider row blocks (not swept) keep K 64 and 32.
    gate_up's K split (`gate_up_split`, the same sweep at 1 token): e4m3 tiles, two programs an
    SM, 40.0 us unsplit, 37.2 / 36.4 / 36.8 / 38.7 / 41.2 in 2 / 3 / 4 / 6 / 8 slices, so ~2
    programs an SM (3 slices at one token); bf16 tiles (one program an SM in shared memory)
    38.2 unsplit, 40.6-43.2 split: their extra programs wait for a second wave, so none.
    64-row blocks (prefill chunks) of 16-bit weights read K in runs of 64 over 4 stages: at
    2,048 tokens (`--tokens 2048 --sweep`, 2026-12-02 y) 0.815 ms at K 32 / 3 stages, 0.700 at
    K 64 / 4 (128-row blocks 0.687 at 8 warps, 1.4-1.8 ms at 4); e4m3 and float32 keep K 32 / 3.
    One token runs as GEMVs (`gemv`, kernels/expert_gemv.py). First for e4m3 only (H100, 2026-12-07
    ah: 31.3 us a layer against the best tiles' 36.5; the engine at batch 1, 24 layers, 570.2 /
    575.8 -> 609.0 / 614.0 / 620.7 tok/s; bf16 no faster). Then with every slot's rows in one
    tile (2026-12-07 ai, another H100, ABAB one process each, `bench/moe.py --engine --batches 1
    --layers 24`): e4m3 590.8 / 621.3 / 621.3 -> 675.6 / 674.9 tok/s, and bf16 too, tiles 486.7 /
    489.7 / 482.7 -> GEMVs 491.6 / 500.5 / 501.9 (+2.5%)."""
    pairs = tokens * top_k
    per_expert = pairs / max(1, min(experts, pairs))
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64
    blocks = max_blocks(tokens, top_k, experts, block_m)

    def block_n(n: int) -> int:
        width = 128
        while width > 64 and blocks * triton_cdiv(n, width) < 2 * sms:
            width //= 2
        return width

    block_k = 256 // max(item_bytes, 2) if block_m == 16 else 64 if block_m == 32 or item_bytes == 2 else 32
    gate_up_n = block_n(inter)
    programs = blocks * triton_cdiv(inter, gate_up_n)
    split = 1
    if item_bytes == 1 and programs < sms:  # one token: 8 experts x 12 column blocks, 16 K steps each
        split = max(1, min(GATE_UP_MAX_SPLIT, triton_cdiv(2 * sms, programs), hidden // (2 * block_k)))
    return FusedMoeConfig(
        block_m,
        gate_up_n,
        block_n(hidden),
        block_k,
        num_stages=4 if block_m <= 32 or item_bytes == 2 else 3,
        num_warps=8 if item_bytes == 1 else 4,
        gate_up_split=split,
        gemv=tokens == 1,
    )


GATE_UP_MAX_SPLIT = 8
GATE_UP_COUNTERS = 1024  # a split gate_up's counters, one a program of the unsplit launch (< SMs)


def fused_counters(tokens: int, hidden: int) -> int:
    """The most arrival counters `fused_moe` needs for `tokens` rows: a split gate_up's first
    (`GATE_UP_COUNTERS`), then one a token and column block of down, whose blocks are 32
    columns or wider."""
    return GATE_UP_COUNTERS + tokens * triton_cdiv(hidden, 32)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def max_blocks(tokens: int, top_k: int, experts: int, block_m: int) -> int:
    """The most BLOCK_M-row blocks the pairs can need: every expert with pairs pads at most
    BLOCK_M - 1 rows, and at most min(E, P) experts have pairs."""
    pairs = tokens * top_k
    return triton_cdiv(pairs + min(experts, pairs) * (block_m - 1), block_m)


@functools.cache
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def fused_moe_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `fused_moe` runs for weights of `dtype` on `device`: CUDA with Triton, Ampere or
    later (bf16 `tl.dot`), half or single precision, or e4m3 where the device converts it (sm89+).
    On the CPU it runs only under Triton's interpreter (the tests)."""
    if triton is None or dtype not in (torch.bfloat16, torch.float16, torch.float32, E4M3):
        return False
    if device.type != "cuda":
        return False
    if dtype == E4M3:
        return has_fp8_conversions(device)
    return torch.cuda.get_device_capability(device)[0] >= 8


def align_reference(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs, block_expert) as `align` builds them, in plain torch (the tests' reference):
    experts in order, pairs in order within an expert, runs padded with the sentinel P."""
    pairs = ids.numel()
    nb = max_blocks(ids.shape[0], ids.shape[1], num_experts, block_m)
    flat = ids.flatten().long()
    sorted_pairs = torch.full((nb * block_m,), pairs, dtype=torch.int32)
    block_expert = torch.full((nb,), -1, dtype=torch.int32)
    row = 0
    for e in range(num_experts):
        mine = (flat == e).nonzero().flatten()
        if mine.numel() == 0:
            continue
        sorted_pairs[row : row + mine.numel()] = mine.to(torch.int32)
        n_blocks = triton_cdiv(mine.numel(), block_m)
        block_expert[row // block_m : row // block_m + n_blocks] = e
        row += n_blocks * block_m
    return sorted_pairs, block_expert


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs [max_blocks * BLOCK_M] int32, block_expert [max_blocks] int32) on the device,
    two launches of one program a chunk of pairs, no host sync: see the module's docstring."""
    tokens, top_k = ids.shape
    pairs = tokens * top_k
    nb = max_blocks(tokens, top_k, num_experts, block_m)
    e_p2 = triton.next_power_of_2(num_experts)
    chunk, warps = align_tiles(pairs, e_p2)
    chunks = triton.cdiv(pairs, chunk)
    ids = ids.contiguous()
    counts = torch.empty(chunks, e_p2, dtype=torch.int32, device=ids.device)
    sorted_pairs = torch.empty(nb * block_m, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(nb, dtype=torch.int32, device=ids.device)
    _count_kernel[(chunks,)](
        ids, counts, pairs, num_experts, E_P2=e_p2, CHUNK=chunk, num_warps=warps, **pdl_args(ids.device)
    )
    _align_kernel[(chunks,)](
        ids, counts, sorted_pairs, block_expert, pairs, num_experts, nb, triton.cdiv(nb, chunks),
        BLOCK_M=block_m, E_P2=e_p2, CHUNK=chunk, num_warps=warps, **pdl_args(ids.device),
    )  # fmt: skip
    return sorted_pairs, block_expert


GROUP_SCORES = {None: 0, "max": 1, "top2_sum": 2}  # Routing.group_score as the kernels take it


def route_topk(
    logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    routing: Routing = PLAIN_TOP_K,
    bias: torch.Tensor | None = None,
    first_expert: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`models.moe.route` in one launch instead of ~8 (~20 with DeepSeek's groups): (weights
    [T, k] float32, ids [T, k] int32 minus `first_expert`, the block's local ids). Same
    arithmetic: float32 softmax or sigmoid scores, `bias` added for the choice only, experts
    outside the best groups masked as `route` masks them, the k best in descending order (ties to
    the lower id), renormalized with DeepSeek's 1e-20 guard, then scaled."""
    tokens, experts = logits.shape
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=logits.device)
    _route_kernel[(tokens,)](
        logits, weights, ids, logits.stride(0), experts, top_k, first_expert,
        **_routing_args(routing, experts, top_k, renormalize, bias, weights), num_warps=4,
        **pdl_args(logits.device),
    )  # fmt: skip
    return weights, ids


def _routing_args(
    routing: Routing,
    experts: int,
    top_k: int,
    renormalize: bool,
    bias: torch.Tensor | None,
    unused: torch.Tensor,
) -> dict[str, object]:
    """The routing kernels' arguments for `routing` (`unused`: a pointer standing in for no bias)."""
    groups = routing.num_groups if routing.group_score is not None else 1
    return {
        "Bias": bias if bias is not None else unused, "SCALING": routing.scaling_factor,
        "PER_GROUP": experts // groups, "TOPK_GROUPS": routing.topk_groups,
        "SIGMOID": routing.scoring == "sigmoid", "HAS_BIAS": bias is not None,
        "GROUP_SCORE": GROUP_SCORES[routing.group_score], "RENORMALIZE": renormalize,
        "E_P2": triton.next_power_of_2(experts), "K_P2": triton.next_power_of_2(top_k),
        "G_P2": triton.next_power_of_2(groups),
    }  # fmt: skip


ROUTER_MAX_ROWS = 16  # rows the router's logits are computed in `route_hidden`; more go to cuBLAS
ROUTER_TILE = 8192  # elements of a [BLOCK_K, E] weight tile: 64 rows of K at Qwen3-30B's 128 experts


@dataclass(frozen=True)
class RouterLaunch:
    """How `route_hidden` cuts the router's weight: tiles of ROUTER_TILE elements but no fewer than
    `min_rows` rows of K, at most `max_slices` K slices a token (a program each, looping over its
    tiles), `warps` a program. The last program to arrive sums every slice's logits, so at
    Qwen3-Next's 512 experts 128 slices of 16 rows (~21 us, an H200, 2026-12-02 z) left it most
    of the work; 32 slices of 2 x 32 rows take ~13 us. The engine's launch: `router_launch`."""

    max_slices: int = 32
    min_rows: int = 32
    warps: int = 4


@functools.cache  # called per MoE layer on eager steps: a handful of shapes a process
def router_launch(tokens: int, experts: int, sms: int) -> RouterLaunch:
    """The engine's launch for `tokens` rows of `experts` logits on a device of `sms` SMs: about
    one wave of programs (sms / tokens slices a token, a power of two), no more slices than keep
    the last program's sum within two tiles of partial logits (slices x experts <= 2 x
    ROUTER_TILE), no fewer than min(32, ROUTER_TILE / experts). Fit to `bench/router.py` on an H100
    (2026-12-07 am, six shapes x 1-16 tokens), then within 0.4 us of the best launch in every cell
    of a second run, where one constant launch was up to 11.1 us behind (Qwen3-Next at 16 tokens:
    27.7 -> 16.6 us; DeepSeek-V3 at 1-2 tokens 22-23 -> 19; Qwen3-235B at one 8.8 -> 7.9). Eight
    warps and 16-row tiles won nowhere by more than the runs' noise."""
    e_p2 = 1 << (experts - 1).bit_length()  # triton.next_power_of_2, which a CPU install lacks
    wave = 1 << ((sms // tokens).bit_length() - 1) if sms >= tokens else 1
    most = max(1, 2 * ROUTER_TILE // e_p2)
    fewest = min(32, max(1, ROUTER_TILE // e_p2))
    return RouterLaunch(max_slices=max(fewest, min(most, wave)))


def route_hidden(
    x: torch.Tensor,
    gate: torch.Tensor,
    top_k: int,
    renormalize: bool,
    arrivals: torch.Tensor,
    routing: Routing = PLAIN_TOP_K,
    bias: torch.Tensor | None = None,
    first_expert: int = 0,
    shared_gate: tuple[torch.Tensor, torch.Tensor] | None = None,
    shared_slots: int = 0,
    shared_id: int = 0,
    launch: RouterLaunch | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`route_topk(x @ gate.T, ...)` in one launch for up to ROUTER_MAX_ROWS rows: at batch 1 the
    router's [H -> E] GEMV was a launch of its own (~5 us of a 48-layer step's 48 x ~65 us).
    `shared_gate` = (Qwen's `shared_expert_gate` weight [1, H], out [T] in x's dtype): out is
    also given `sigmoid(x @ weight.T)` as that linear and sigmoid round it, a dot product the
    same programs add to their slices (in cuBLAS and two elementwise launches it was ~7 us of a
    ~110 us Qwen3-Next layer at batch 1). `shared_slots` pairs more a token (the shared expert
    fused into the experts' stack, `models.moe.shared_expert_slots`): ids `shared_id` on, weights
    that sigmoid in float32 with `shared_gate`, else 1 (DeepSeek's ungated shared experts); the
    results are [T, top_k + shared_slots]. `launch`: how the weight is cut (`RouterLaunch`; the
    results do not depend on it; None: `router_launch`'s).

    Program (token, K slice) sums one [BLOCK_K, E] tile of the weight against x[token] in
    float32 (the weight by its strides: `store_weights_transposed` leaves it contiguous along E,
    so a tile is one run of bytes) and stores the partial logits; the token's last program to
    arrive (a counter in `arrivals`, int32 zeros, >= rows, left zeroed) adds the slices in order,
    so the logits are deterministic, rounds them to x's dtype as `gate(x)` would (unless
    `routing.float32_logits`: DeepSeek's `F.linear(x.float(), gate.float())`), then routes as
    `route_topk`."""
    tokens, hidden = x.shape
    experts = gate.shape[0]
    assert tokens <= arrivals.numel()
    x = x if x.stride(-1) == 1 else x.contiguous()
    e_p2 = triton.next_power_of_2(experts)
    # Off CUDA (Triton's interpreter) an H100's SM count: the tests then run the launch it would.
    launch = launch or router_launch(tokens, experts, _sms(x.device) if x.is_cuda else 132)
    block_k = max(launch.min_rows, ROUTER_TILE // e_p2)
    tiles = triton.cdiv(hidden, block_k)
    loops = triton.cdiv(tiles, min(tiles, launch.max_slices))
    slices = triton.cdiv(tiles, loops)
    parts = torch.empty(tokens, slices, experts + 1, dtype=torch.float32, device=x.device)  # + a shared gate
    weights = torch.empty(tokens, top_k + shared_slots, dtype=torch.float32, device=x.device)
    ids = torch.empty(tokens, top_k + shared_slots, dtype=torch.int32, device=x.device)
    shared, scale = shared_gate if shared_gate is not None else (gate, weights)  # unread stand-ins
    _router_kernel[(tokens, slices)](
        x, gate, parts, arrivals, weights, ids, shared, scale, x.stride(0), gate.stride(0), gate.stride(1),
        shared.stride(-1), hidden, experts, top_k, first_expert, shared_id, SHARED=shared_gate is not None,
        SHARED_SLOTS=shared_slots, S_P2=triton.next_power_of_2(max(shared_slots, 1)),
        ROUND=not routing.float32_logits, BLOCK_K=block_k, LOOPS=loops, SLICES=slices,
        CHUNK_S=min(triton.next_power_of_2(slices), block_k),
        **_routing_args(routing, experts, top_k, renormalize, bias, weights), num_warps=launch.warps,
        **pdl_args(x.device),
    )  # fmt: skip
    return weights, ids


def fused_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    config: FusedMoeConfig | None = None,
    arrivals: torch.Tensor | None = None,
    scales: ExpertScales | None = None,
    biases: ExpertBiases | None = None,
    swiglu: ClampedSwiGLU | None = None,
) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) for the experts held here, as
    `experts.fused_experts` (same arguments: x [T, H]; gate_up [E, 2I, H]; down [E, H, I]; ids
    [T, k] local expert ids, those outside [0, E) adding nothing; weights [T, k] float32;
    `scales` with e4m3 weights; gpt-oss's `biases` and clamped `swiglu`, as
    `experts.experts_reference` takes them). Returns [T, H] in x's dtype. `arrivals`: the
    kernels' counters, int32 zeros, at least `fused_counters(T, H)` of them, owned by the caller
    and left zeroed; None (or too few) allocates zeroed ones, a memset launch more."""
    tokens, top_k = ids.shape
    num_experts, two_inter, hidden = gate_up.shape
    inter = two_inter // 2
    pairs = tokens * top_k
    if (scales is not None) != (gate_up.dtype == E4M3):
        raise ValueError("e4m3 expert weights need their scales, and only they take scales")
    if scales is not None and (biases is not None or swiglu is not None):
        raise ValueError("e4m3 experts run without biases and with SiLU: gpt-oss's experts stay unquantized")
    if pairs == 0:
        return x.new_zeros(tokens, hidden)
    if config is None:
        sms = _sms(x.device) if x.is_cuda else 132
        config = fused_moe_config(tokens, top_k, num_experts, hidden, inter, sms, gate_up.element_size())
    group = scales.group if scales is not None else 0
    if group % config.block_k:
        raise ValueError(f"a K tile of {config.block_k} columns crosses the scales' groups of {group}")
    ids = ids.contiguous()
    weights = weights.contiguous().float()
    x = x if x.stride(-1) == 1 else x.contiguous()
    if config.gemv and expert_gemv_applies(tokens, gate_up, down, group):
        up_scale, down_scale = (scales.gate_up, scales.down) if scales is not None else (None, None)
        pair = (biases.gate_up, biases.down) if biases is not None else None
        return expert_gemv(x, gate_up, down, ids, weights, up_scale, down_scale, group, None, pair, swiglu)
    direct = tokens == 1  # top-k experts are distinct: one block a pair, no alignment
    if direct:
        sorted_pairs, block_expert, blocks = ids, ids, pairs  # unused by the kernels but as pointers
    else:
        sorted_pairs, block_expert = align(ids, num_experts, config.block_m)
        blocks = block_expert.numel()
    gate_up_scale = scales.gate_up.contiguous() if scales is not None else weights  # weights: unread
    precision = dot_precision(x.dtype)
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    col_blocks = triton.cdiv(inter, config.gate_up_block_n)
    counters = fused_counters(tokens, hidden)
    if arrivals is None or arrivals.numel() < counters:
        arrivals = torch.zeros(counters, dtype=torch.int32, device=x.device)
    # The K split: slices of whole K tiles; a split launch needs a counter a program of the unsplit one.
    k_chunk = triton.cdiv(triton.cdiv(hidden, config.gate_up_split), config.block_k) * config.block_k
    split = triton.cdiv(hidden, k_chunk) if blocks * col_blocks <= GATE_UP_COUNTERS else 1
    k_chunk = k_chunk if split > 1 else hidden
    parts = torch.empty(split if split > 1 else 0, pairs, 2 * inter, dtype=torch.float32, device=x.device)
    bias = biases.gate_up.contiguous() if biases is not None else weights  # weights: unread
    _gate_up_kernel[(blocks, col_blocks, split)](
        x, gate_up, gate_up_scale, sorted_pairs, block_expert, h, parts, arrivals, pairs, top_k, num_experts,
        inter, hidden, k_chunk, x.stride(0), gate_up.stride(0), gate_up.stride(1), gate_up.stride(2),
        gate_up_scale.stride(0), gate_up_scale.stride(1), bias, bias.stride(0), *glu_args(biases, swiglu),
        DIRECT=direct, BLOCK_M=config.block_m,
        BLOCK_N=config.gate_up_block_n, BLOCK_K=config.block_k, PRECISION=precision, W8=scales is not None,
        GROUP=group, SPLIT=split, num_warps=config.num_warps, num_stages=config.num_stages,
        **pdl_args(x.device),
    )  # fmt: skip
    down_bias = biases.down if biases is not None else None
    counters = arrivals[GATE_UP_COUNTERS:]
    return _down_and_combine(
        h, down, scales, sorted_pairs, block_expert, ids, weights, blocks, config, counters, down_bias
    )


def _down_and_combine(
    h: torch.Tensor,
    down: torch.Tensor,
    scales: ExpertScales | None,
    sorted_pairs: torch.Tensor,
    block_expert: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    blocks: int,
    config: FusedMoeConfig,
    arrivals: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The down kernel's launch: `blocks` rows of programs over the blocks (pairs under direct),
    then one a BLOCK_M tokens that arrives for their remote slots; returns [T, H] in h's dtype.
    `scales`: e4m3 weights' (down's read here), else None. `arrivals`: zeroed counters, one a
    token and column block (`fused_moe` sized them). `bias`: down's [E, H] (gpt-oss), or None."""
    (tokens, top_k), (num_experts, hidden, inter) = ids.shape, down.shape
    pairs = tokens * top_k
    slots = torch.empty(pairs, hidden, dtype=torch.float32, device=h.device)
    out = torch.empty(tokens, hidden, dtype=h.dtype, device=h.device)
    col_blocks = triton.cdiv(hidden, config.down_block_n)
    scale = scales.down.contiguous() if scales is not None else weights  # weights: unread
    has_bias, bias = bias is not None, bias.contiguous() if bias is not None else weights
    _down_kernel[(blocks + triton.cdiv(tokens, config.block_m), col_blocks)](
        h, down, scale, sorted_pairs, block_expert, ids, weights, slots, out, arrivals, pairs, top_k,
        num_experts, hidden, inter, blocks, down.stride(0), down.stride(1), down.stride(2), scale.stride(0),
        scale.stride(1), bias, bias.stride(0), HAS_BIAS=has_bias, DIRECT=tokens == 1, BLOCK_M=config.block_m,
        BLOCK_N=config.down_block_n,
        BLOCK_K=config.block_k, K_P2=triton.next_power_of_2(top_k), PRECISION=dot_precision(h.dtype),
        W8=scales is not None, GROUP=scales.group if scales is not None else 0,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_args(h.device),
    )  # fmt: skip
    return out


if triton is not None:

    @triton.jit
    def _route_kernel(
        Logits, Weights, Ids, stride, E, TOP_K, FIRST, Bias, SCALING, PER_GROUP, TOPK_GROUPS,
        SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP_SCORE: tl.constexpr, RENORMALIZE: tl.constexpr,
        E_P2: tl.constexpr, K_P2: tl.constexpr, G_P2: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """One token's logits row to its weights and ids (`_route_row`)."""
        wait_for_producers(PDL)
        t = tl.program_id(0)
        experts = tl.arange(0, E_P2)
        logits = tl.load(Logits + t * stride + experts, mask=experts < E, other=float("-inf")).to(tl.float32)
        _route_row(logits, Weights, Ids, t, TOP_K, E, TOP_K, FIRST, Bias, SCALING, PER_GROUP, TOPK_GROUPS,
                   SIGMOID, HAS_BIAS, GROUP_SCORE, RENORMALIZE, E_P2, K_P2, G_P2)  # fmt: skip

    @triton.jit
    def _route_row(
        logits, Weights, Ids, t, ROW, E, TOP_K, FIRST, Bias, SCALING, PER_GROUP, TOPK_GROUPS,
        SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP_SCORE: tl.constexpr, RENORMALIZE: tl.constexpr,
        E_P2: tl.constexpr, K_P2: tl.constexpr, G_P2: tl.constexpr,
    ):  # fmt: skip
        """A token's logits [E_P2] (-inf past E) routed as `models.moe.route`: scores (softmax or
        sigmoid, float32), the choice (scores plus the bias, only within the best groups), the k
        best choices' scores (`_store_top_k`) in the first TOP_K of the token's ROW slots."""
        experts = tl.arange(0, E_P2)
        real = experts < E
        if SIGMOID:
            scores = 1.0 / (1.0 + tl.exp(-logits))
        else:
            z = tl.exp(logits - tl.max(logits, axis=0))
            scores = z / tl.sum(z, axis=0)
        choice = scores
        if HAS_BIAS:
            choice += tl.load(Bias + experts, mask=real, other=0.0).to(tl.float32)
        choice = tl.where(real, choice, float("-inf"))
        if GROUP_SCORE != 0:
            choice = _within_best_groups(choice, experts, PER_GROUP, TOPK_GROUPS, GROUP_SCORE, G_P2)
            choice = tl.where(real, choice, float("-inf"))
        _store_top_k(scores, choice, Weights + t * ROW, Ids + t * ROW, TOP_K, FIRST, SCALING, RENORMALIZE,
                     E_P2, K_P2)  # fmt: skip

    @triton.jit
    def _within_best_groups(
        choice, experts, PER_GROUP, TOPK_GROUPS, GROUP_SCORE: tl.constexpr, G_P2: tl.constexpr
    ):  # fmt: skip
        """`choice` outside the TOPK_GROUPS best groups of PER_GROUP experts masked as
        `models.moe._within_best_groups` masks it: a group's score its best choice (1, V2's; the
        rest set to 0) or its two best summed (2, V3's; the rest -inf). Groups are [G_P2, E_P2]
        masks of the vector, so any number of experts a group works."""
        g = tl.arange(0, G_P2)
        member = (experts[None, :] // PER_GROUP) == g[:, None]
        grouped = tl.where(member, choice[None, :], float("-inf"))
        group_score = tl.max(grouped, axis=1)
        if GROUP_SCORE == 2:  # the best twice when it occurs twice, as torch.topk(2) counts it
            first = tl.argmax(grouped, axis=1, tie_break_left=True)
            rest = tl.where(experts[None, :] == first[:, None], float("-inf"), grouped)
            group_score += tl.max(rest, axis=1)
        keep = tl.zeros([G_P2], tl.int32)
        for _ in range(TOPK_GROUPS):
            best = tl.argmax(group_score, axis=0, tie_break_left=True)
            keep = tl.where(g == best, 1, keep)
            group_score = tl.where(g == best, float("-inf"), group_score)
        allowed = tl.max(tl.where(member, keep[:, None], 0), axis=0) > 0
        return tl.where(allowed, choice, 0.0 if GROUP_SCORE == 1 else float("-inf"))

    @triton.jit
    def _store_top_k(scores, choice, Weights, Ids, TOP_K, FIRST, SCALING, RENORMALIZE: tl.constexpr,
                     E_P2: tl.constexpr, K_P2: tl.constexpr):  # fmt: skip
        """k rounds of one max each over `choice` packed with the expert ids into int64 keys (the
        value's bits ordered as signed ints above the id counted down, so a tie goes to the lower
        id), each chosen key then the smallest; the chosen experts' scores gathered in one
        [K_P2, E_P2] pass. Half the reductions of an argmax and a gather a round: Qwen3-30B's
        routing launch 7.3 -> 6.6 us at one token (H200, 2026-12-02 z)."""
        experts = tl.arange(0, E_P2)
        slot = tl.arange(0, K_P2)
        bits = (choice + 0.0).to(tl.int32, bitcast=True)  # + 0.0: -0.0 keys as 0.0
        ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
        keys = (ordered << 32) | (E_P2 - 1 - experts).to(tl.int64)
        chosen = tl.zeros([K_P2], tl.int32)
        for j in range(TOP_K):
            best = tl.max(keys, axis=0)
            chosen = tl.where(slot == j, E_P2 - 1 - (best & 0xFFFFFFFF).to(tl.int32), chosen)
            keys = tl.where(keys == best, -(2**63), keys)
        live = slot < TOP_K
        hit = (chosen[:, None] == experts[None, :]) & live[:, None]
        picked = tl.sum(tl.where(hit, scores[None, :], 0.0), axis=1)
        if RENORMALIZE:
            picked = picked / (tl.sum(picked, axis=0) + 1e-20)
        tl.store(Weights + slot, picked * SCALING, mask=live)
        tl.store(Ids + slot, chosen - FIRST, mask=live)

    @triton.jit
    def _router_kernel(
        X, Gate, Parts, Arrivals, Weights, Ids, SharedGate, SharedScale, x_stride, g_stride_e, g_stride_k,
        shared_stride, K, E, TOP_K, FIRST, SHARED_ID, Bias, SCALING, PER_GROUP, TOPK_GROUPS,
        SHARED: tl.constexpr, SHARED_SLOTS: tl.constexpr, S_P2: tl.constexpr, SIGMOID: tl.constexpr,
        HAS_BIAS: tl.constexpr, GROUP_SCORE: tl.constexpr, RENORMALIZE: tl.constexpr, ROUND: tl.constexpr,
        E_P2: tl.constexpr, K_P2: tl.constexpr, G_P2: tl.constexpr, BLOCK_K: tl.constexpr,
        LOOPS: tl.constexpr, SLICES: tl.constexpr, CHUNK_S: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """Program (token, K slice): partial logits of every expert (and, under SHARED, of the
        shared expert's gate, stored after them) over LOOPS x BLOCK_K of the hidden size; the
        token's last arrival sums the slices in order (CHUNK_S at a time) and routes; the token's
        SHARED_SLOTS pairs after its TOP_K are the shared expert's (`route_hidden`)."""
        wait_for_producers(PDL)
        t, k_slice = tl.program_id(0), tl.program_id(1)
        experts = tl.arange(0, E_P2)
        e_ok = experts < E
        partial = tl.zeros([E_P2], tl.float32)
        shared = 0.0
        for i in range(LOOPS):
            ks = (k_slice * LOOPS + i) * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            x = tl.load(X + t * x_stride + ks, mask=k_ok, other=0.0).to(tl.float32)
            w = tl.load(Gate + ks[:, None] * g_stride_k + experts[None, :] * g_stride_e,
                        mask=k_ok[:, None] & e_ok[None, :], other=0.0)  # fmt: skip
            partial += tl.sum(w.to(tl.float32) * x[:, None], axis=0)
            if SHARED:
                g = tl.load(SharedGate + ks * shared_stride, mask=k_ok, other=0.0)
                shared += tl.sum(g.to(tl.float32) * x)
        row = Parts + (t * SLICES + k_slice) * (E + 1)
        tl.store(row + experts, partial, mask=e_ok)
        if SHARED:
            tl.store(row + E, shared)
        if last_to_arrive(Arrivals + t, SLICES):
            chunk = tl.arange(0, CHUNK_S)
            logits = tl.zeros([E_P2], tl.float32)
            for s0 in range(0, SLICES, CHUNK_S):  # slices in a fixed order, whichever arrived last
                s = s0 + chunk
                mask = (s[:, None] < SLICES) & e_ok[None, :]
                part = tl.load(Parts + (t * SLICES + s[:, None]) * (E + 1) + experts[None, :], mask=mask,
                               other=0.0, cache_modifier=".cg")  # fmt: skip
                logits += tl.sum(part, axis=0)
            shared_weight = 1.0
            if SHARED:  # the gate's slices in the same order, rounded as its linear and its sigmoid round
                gate = tl.zeros([CHUNK_S], tl.float32)
                for s0 in range(0, SLICES, CHUNK_S):
                    s = s0 + chunk
                    gate += tl.load(Parts + (t * SLICES + s) * (E + 1) + E, mask=s < SLICES, other=0.0,
                                    cache_modifier=".cg")  # fmt: skip
                gate = tl.sum(gate, axis=0).to(X.dtype.element_ty).to(tl.float32)
                scale = (1.0 / (1.0 + tl.exp(-gate))).to(SharedScale.dtype.element_ty)
                tl.store(SharedScale + t, scale)
                shared_weight = scale.to(tl.float32)
            tl.atomic_xchg(Arrivals + t, 0)
            if ROUND:
                logits = logits.to(X.dtype.element_ty).to(tl.float32)
            logits = tl.where(e_ok, logits, float("-inf"))
            pairs = TOP_K + SHARED_SLOTS
            _route_row(logits, Weights, Ids, t, pairs, E, TOP_K, FIRST, Bias, SCALING, PER_GROUP, TOPK_GROUPS,
                       SIGMOID, HAS_BIAS, GROUP_SCORE, RENORMALIZE, E_P2, K_P2, G_P2)  # fmt: skip
            if SHARED_SLOTS > 0:
                j = tl.arange(0, S_P2)
                tl.store(Ids + t * pairs + TOP_K + j, SHARED_ID + j, mask=j < SHARED_SLOTS)
                pair_weight = tl.zeros([S_P2], tl.float32) + shared_weight
                tl.store(Weights + t * pairs + TOP_K + j, pair_weight, mask=j < SHARED_SLOTS)

    @triton.jit
    def _chunk_hits(Ids, chunk, P, E, E_P2: tl.constexpr, CHUNK: tl.constexpr):
        """(the chunk's pair indices, their experts, [CHUNK, E_P2] pair-is-expert): experts
        outside [0, E) match no column."""
        p = chunk * CHUNK + tl.arange(0, CHUNK)
        e = tl.load(Ids + p, mask=p < P, other=-1).to(tl.int32)
        experts = tl.arange(0, E_P2)
        return p, e, (e[:, None] == experts[None, :]) & (experts < E)[None, :]

    @triton.jit(do_not_specialize=["P"])  # the step's pairs: see `_align_kernel`
    def _count_kernel(Ids, Counts, P, E, E_P2: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
        """Program c: how many of chunk c's pairs each expert has (a row of Counts)."""
        wait_for_producers(PDL)
        c = tl.program_id(0)
        _, _, hit = _chunk_hits(Ids, c, P, E, E_P2, CHUNK)
        tl.store(Counts + c * E_P2 + tl.arange(0, E_P2), tl.sum(hit.to(tl.int32), axis=0))

    # Counts that change with every step's tokens are not specialized (divisible by 16 or not,
    # one or not: each combination another compile, under traffic); the expert count is fixed.
    @triton.jit(do_not_specialize=["P", "NUM_BLOCKS", "BLOCKS_EACH"])
    def _align_kernel(
        Ids, Counts, Sorted, BlockExpert, P, E, NUM_BLOCKS, BLOCKS_EACH, BLOCK_M: tl.constexpr,
        E_P2: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """Program c: every chunk's counts summed (and those before c: where c's pairs of an
        expert start within its run), the runs padded and laid out; then c scatters its own
        chunk (stable: a pair's rank in its expert is the earlier chunks' count plus the earlier
        pairs of its chunk with that expert), and writes BLOCKS_EACH blocks' experts and padding
        rows. Pair rows and padding rows are disjoint, so no program waits on another: the one
        program that did this serially spent ~28 us a layer at 64 tokens (2026-12-02 x)."""
        wait_for_producers(PDL)
        c = tl.program_id(0)
        experts = tl.arange(0, E_P2)
        real = experts < E
        counts = tl.zeros([E_P2], tl.int32)
        seen = tl.zeros([E_P2], tl.int32)
        for j in range(tl.num_programs(0)):
            row = tl.load(Counts + j * E_P2 + experts)
            counts += row
            seen += tl.where(j < c, row, 0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = tl.cumsum(padded, axis=0)
        starts = ends - padded
        total = tl.sum(padded, axis=0)
        p, e, hit = _chunk_hits(Ids, c, P, E, E_P2, CHUNK)
        lane = tl.arange(0, CHUNK)
        base = tl.sum(tl.where(hit, (starts + seen)[None, :], 0), axis=1)
        earlier = (e[:, None] == e[None, :]) & (lane[None, :] < lane[:, None])
        dest = base + tl.sum(earlier.to(tl.int32), axis=1)
        tl.store(Sorted + dest, p, mask=(p < P) & (e >= 0) & (e < E))
        rows_in_block = tl.arange(0, BLOCK_M)
        for b0 in range(c * BLOCKS_EACH, tl.minimum((c + 1) * BLOCKS_EACH, NUM_BLOCKS), CHUNK):
            b = b0 + lane
            first = b * BLOCK_M
            # The expert whose padded run holds `first`: the runs (empty ones included) ending
            # at or before it; rows from that run's start + count on are padding.
            owner = tl.sum(((ends[None, :] <= first[:, None]) & real[None, :]).to(tl.int32), axis=1)
            mine = (b < NUM_BLOCKS) & (b < (c + 1) * BLOCKS_EACH)
            tl.store(BlockExpert + b, tl.where(first < total, owner, -1), mask=mine)
            is_owner = experts[None, :] == owner[:, None]
            pad_from = tl.sum(tl.where(is_owner, (starts + counts)[None, :], 0), axis=1)
            rows = first[:, None] + rows_in_block[None, :]
            pad = (rows >= pad_from[:, None]) | (first >= total)[:, None]
            tl.store(Sorted + rows, tl.full([CHUNK, BLOCK_M], 0, tl.int32) + P, mask=mine[:, None] & pad)

    @triton.jit
    def _block_rows(Sorted, BlockExpert, block, P, E, DIRECT: tl.constexpr, BLOCK_M: tl.constexpr):
        """(expert, pair indices [BLOCK_M], live rows) of a block; under DIRECT block b is pair b
        (Sorted and BlockExpert are then the ids) with one live row."""
        lane = tl.arange(0, BLOCK_M)
        if DIRECT:
            expert = tl.load(BlockExpert + block).to(tl.int32)
            expert = tl.where((expert >= 0) & (expert < E), expert, -1)
            pairs = tl.where(lane == 0, block, P)
        else:
            expert = tl.load(BlockExpert + block)
            pairs = tl.load(Sorted + block * BLOCK_M + lane)
        return expert, pairs, pairs < P

    @triton.jit(do_not_specialize=["P"])
    def _gate_up_kernel(
        X, W, Scale, Sorted, BlockExpert, Hout, Parts, Arrivals, P, TOP_K, E, N, K, k_chunk, x_stride,
        w_stride_e, w_stride_n, w_stride_k, s_stride_e, s_stride_n, Bias, b_stride_e, ALPHA, LIMIT,
        HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr, DIRECT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
        W8: tl.constexpr, GROUP: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """h[pair, cols] = silu(x[token] . W[e, cols]) * (x[token] . W[e, N + cols]) for the rows of
        one block and BLOCK_N of the N = I columns (both halves: SiLU needs the whole sum); with
        W8 (e4m3 weights) each sum scaled by its rows' Scale[e, cols] and Scale[e, N + cols]
        (`_tile_product`). Program (block, column block, slice) sums K from slice * k_chunk; with
        SPLIT > 1 each slice stores its partial sums and the last to arrive adds them in slice
        order (kernels/arrivals.py) before the activation. gpt-oss's biases and clamped SwiGLU
        under HAS_BIAS and CLAMPED (`expert_gemv.glu`)."""
        wait_for_producers(PDL)
        expert, pairs, live = _block_rows(Sorted, BlockExpert, tl.program_id(0), P, E, DIRECT, BLOCK_M)
        if expert < 0:
            return
        tokens = pairs // TOP_K
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        ks = tl.arange(0, BLOCK_K)
        w = W + expert.to(tl.int64) * w_stride_e
        sg = Scale + expert.to(tl.int64) * s_stride_e + cols * s_stride_n  # W8: gate rows' scales
        su = sg + N * s_stride_n  # and up rows'
        bias = Bias + expert.to(tl.int64) * b_stride_e
        gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        k_lo = tl.program_id(2) * k_chunk
        k_hi = tl.minimum(k_lo + k_chunk, K)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k_ok = (k0 + ks) < k_hi
            a_mask = live[:, None] & k_ok[None, :]
            a = tl.load(X + tokens[:, None] * x_stride + (k0 + ks)[None, :], mask=a_mask, other=0.0)
            w_mask = k_ok[:, None] & col_ok[None, :]
            w_off = (k0 + ks)[:, None] * w_stride_k + cols[None, :] * w_stride_n
            wg = tl.load(w + w_off, mask=w_mask, other=0.0)
            wu = tl.load(w + N * w_stride_n + w_off, mask=w_mask, other=0.0)
            gate += _tile_product(a, wg, sg, k0, col_ok, W8, GROUP, PRECISION)
            up += _tile_product(a, wu, su, k0, col_ok, W8, GROUP, PRECISION)
        admit_dependents(PDL)
        out = live[:, None] & col_ok[None, :]
        if SPLIT == 1:
            _activate(gate, up, sg, su, Hout, pairs, cols, col_ok, out, N, W8, GROUP, bias, ALPHA, LIMIT,
                      HAS_BIAS, CLAMPED)  # fmt: skip
        else:
            part = Parts + pairs[:, None] * (2 * N) + cols[None, :]  # slice s at s * P * 2N
            tl.store(part + tl.program_id(2) * P * 2 * N, gate, mask=out)
            tl.store(part + tl.program_id(2) * P * 2 * N + N, up, mask=out)
            counter = Arrivals + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
            if last_to_arrive(counter, SPLIT):
                gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for s in range(SPLIT):  # in slice order, whichever arrived last: deterministic
                    gate += tl.load(part + s * P * 2 * N, mask=out, other=0.0, cache_modifier=".cg")
                    up += tl.load(part + s * P * 2 * N + N, mask=out, other=0.0, cache_modifier=".cg")
                tl.atomic_xchg(counter, 0)
                _activate(gate, up, sg, su, Hout, pairs, cols, col_ok, out, N, W8, GROUP, bias, ALPHA, LIMIT,
                          HAS_BIAS, CLAMPED)  # fmt: skip

    @triton.jit
    def _activate(
        gate, up, sg, su, Hout, pairs, cols, col_ok, out, N, W8: tl.constexpr, GROUP: tl.constexpr, Bias,
        ALPHA, LIMIT, HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr,
    ):  # fmt: skip
        """gate_up's epilogue: the per-row scales (`_row_scaled`), the activation in float32
        (`glu`: SiLU(gate) * up, or gpt-oss's biases and clamped SwiGLU), stored in h's dtype."""
        gate = _row_scaled(gate, sg, col_ok, W8, GROUP)
        up = _row_scaled(up, su, col_ok, W8, GROUP)
        h = glu(gate, up, Bias, cols, col_ok, N, ALPHA, LIMIT, HAS_BIAS, CLAMPED)
        tl.store(Hout + pairs[:, None] * N + cols[None, :], h.to(Hout.dtype.element_ty), mask=out)

    @triton.jit(do_not_specialize=["P", "NUM_BLOCKS"])
    def _down_kernel(
        Hin, W, Scale, Sorted, BlockExpert, Ids, Weights, Slots, Out, Arrivals, P, TOP_K, E, N, K,
        NUM_BLOCKS, w_stride_e, w_stride_n, w_stride_k, s_stride_e, s_stride_n, Bias, b_stride_e,
        HAS_BIAS: tl.constexpr, DIRECT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_P2: tl.constexpr,
        PRECISION: tl.constexpr, W8: tl.constexpr, GROUP: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """slots[pair, cols] = weights[pair] * (h[pair] . down[e, cols]) in float32, N = H (scaled
        by Scale[e, cols] with W8, `_tile_product`; plus Bias[e, cols] under HAS_BIAS, before the
        weight), then each token's arrival (`_arrive`). Blocks
        past NUM_BLOCKS (one per BLOCK_M tokens) arrive for their tokens' remote slots, which no
        block holds."""
        wait_for_producers(PDL)
        block = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        if block >= NUM_BLOCKS:
            tokens = (block - NUM_BLOCKS) * BLOCK_M + tl.arange(0, BLOCK_M)
            remote = _remote_slots(Ids, tokens, P // TOP_K, TOP_K, E, K_P2)
            _arrive(Slots, Ids, Out, Arrivals, tokens, remote, remote > 0, cols, col_ok, TOP_K, E, N, BLOCK_M,
                    BLOCK_N)  # fmt: skip
            return
        expert, pairs, live = _block_rows(Sorted, BlockExpert, block, P, E, DIRECT, BLOCK_M)
        if expert < 0:
            return
        ks = tl.arange(0, BLOCK_K)
        w = W + expert.to(tl.int64) * w_stride_e
        scale = Scale + expert.to(tl.int64) * s_stride_e + cols * s_stride_n  # W8: the rows' scales
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + ks) < K
            a = tl.load(Hin + pairs[:, None] * K + (k0 + ks)[None, :], mask=live[:, None] & k_ok[None, :],
                        other=0.0)  # fmt: skip
            b = tl.load(w + (k0 + ks)[:, None] * w_stride_k + cols[None, :] * w_stride_n,
                        mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # fmt: skip
            acc += _tile_product(a, b, scale, k0, col_ok, W8, GROUP, PRECISION)
        admit_dependents(PDL)
        acc = _row_scaled(acc, scale, col_ok, W8, GROUP)
        if HAS_BIAS:
            bias = Bias + expert.to(tl.int64) * b_stride_e + cols
            acc += tl.load(bias, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        acc *= tl.load(Weights + pairs, mask=live, other=0.0)[:, None]
        tl.store(Slots + pairs[:, None] * N + cols[None, :], acc, mask=live[:, None] & col_ok[None, :])
        one = tl.full([BLOCK_M], 1, tl.int32)
        _arrive(Slots, Ids, Out, Arrivals, pairs // TOP_K, one, live, cols, col_ok, TOP_K, E, N, BLOCK_M,
                BLOCK_N)  # fmt: skip

    @triton.jit
    def _tile_product(
        a, w, row_scales, k0, col_ok, W8: tl.constexpr, GROUP: tl.constexpr, PRECISION: tl.constexpr
    ):  # fmt: skip
        """a @ w of one K tile in float32, the operands in one type: e4m3 weights (W8) widened to
        the activations' type, exactly, else the activations in the weights' type. With block
        scales (GROUP > 0) each column times its rows' scale of the group holding k0 (a tile
        never crosses a group: `fused_moe` checks)."""
        if W8:
            product = tl.dot(a, w.to(a.dtype), input_precision=PRECISION)
        else:
            product = tl.dot(a.to(w.dtype), w, input_precision=PRECISION)
        if GROUP > 0:
            product *= tl.load(row_scales + k0 // GROUP, mask=col_ok, other=0.0)[None, :]
        return product

    @triton.jit
    def _row_scaled(acc, row_scales, col_ok, W8: tl.constexpr, GROUP: tl.constexpr):
        """A K loop's sums times their weight rows' scales where e4m3 weights have one scale a row
        (block scales were applied per K tile, `_tile_product`); the sums as they are otherwise."""
        if W8 and GROUP == 0:
            acc *= tl.load(row_scales, mask=col_ok, other=0.0)[None, :]
        return acc

    @triton.jit
    def _remote_slots(Ids, tokens, T, TOP_K, E, K_P2: tl.constexpr):
        """How many of each token's slots name experts outside [0, E) (0 past the T tokens)."""
        slot = tl.arange(0, K_P2)
        held = (tokens[:, None] < T) & (slot[None, :] < TOP_K)
        e = tl.load(Ids + tokens[:, None] * TOP_K + slot[None, :], mask=held, other=0)
        return tl.sum((held & ((e < 0) | (e >= E))).to(tl.int32), axis=1)

    @triton.jit
    def _arrive(Slots, Ids, Out, Arrivals, tokens, count, mask, cols, col_ok, TOP_K, E, N,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
        """Adds `count` arrivals to each masked token's counter of this column block; a token's
        last (its TOP_K-th: every slot, local or not, arrives once) sums its local slots in slot
        order, whichever arrived last, and rounds once: deterministic, unlike atomic adds of the
        rows, and as accurate as the float32 sum can be. Then it zeroes the counter for the next
        call; CUDA graphs replay it as is."""
        tl.debug_barrier()  # every thread's slot rows are written before the arrival releases them
        counter = Arrivals + tokens * tl.num_programs(1) + tl.program_id(1)
        last = mask & (tl.atomic_add(counter, count, mask=mask, sem="acq_rel") + count == TOP_K)
        if tl.max(last.to(tl.int32), axis=0) > 0:  # most programs hold no token's last arrival
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for j in range(TOP_K):
                e = tl.load(Ids + tokens * TOP_K + j, mask=last, other=-1)
                local = last & (e >= 0) & (e < E)
                row = Slots + (tokens * TOP_K + j)[:, None] * N + cols[None, :]
                total += tl.load(row, mask=local[:, None] & col_ok[None, :], other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(counter, 0, mask=last)
            tl.store(Out + tokens[:, None] * N + cols[None, :], total.to(Out.dtype.element_ty),
                     mask=last[:, None] & col_ok[None, :])  # fmt: skip
