"""The Gated DeltaNet recurrence (Qwen3-Next's linear attention) in torch, over a step's padded grid.

Per value head, the state S is a [key_dim, value_dim] matrix. Each token decays it by
exp(g) (g <= 0, from the softplus'd `a` projection), reads what it currently stores under the
token's key (k^T S), moves that toward the token's value with strength beta (the delta rule:
S += k (beta (v - k^T S))), and emits q^T S. Keys and queries are L2-normalized and q is scaled
by key_dim^-0.5. Before the recurrence, q/k/v pass through a causal depthwise conv whose state
is the last conv_kernel - 1 inputs.

Two forms of the same recurrence: token by token (decode and verify rows, short runs), and
chunked (long prefill runs; `chunked_scan`). Padding cells of the grid get g = 0 and beta = 0,
which leave the state as is.
The state is float32 whatever the model's dtype (as the reference keeps it).
Both functions take either the grid plan, and run the torch code here, or a step's `StateRuns`,
and run the step kernels (kernels/gated_delta.py), for which this torch code is the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from model_service.kernels.gated_delta import StateRuns, causal_conv_step, gated_delta_step
from model_service.models.recurrent import RecurrentPlan

CHUNK = 64  # tokens per chunk of the chunked form
MIN_CHUNKED_RUN = 32  # shorter segments (decode, verify rows) run token by token
ScanResult = tuple[Tensor, Tensor]  # (outputs, the state after the last step)


def causal_conv(
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    plan: RecurrentPlan | StateRuns,
) -> torch.Tensor:
    """SiLU(depthwise causal conv) [T, C] of the flat rows of q, k and v ([T, Hk, width] each, as
    in_proj_qkvz lays them out), whose channels are all of q's, then k's, then v's; continues each
    sequence's conv state ([slots, K - 1, C]), leaving in it the last K - 1 inputs of each run;
    weight [C, 1, K]."""
    if isinstance(plan, StateRuns):
        return causal_conv_step(qkv, conv_state, weight, plan)
    x = torch.cat([t.reshape(t.shape[0], -1) for t in qkv], dim=-1)
    past = plan.read(conv_state).to(weight.dtype)  # [S, K - 1, C]
    full = torch.cat([past, plan.to_grid(x).to(weight.dtype)], dim=1)  # [S, K - 1 + L, C]
    out = F.silu(F.conv1d(full.transpose(1, 2), weight, groups=weight.shape[0])).transpose(1, 2)
    keep = past.shape[1]
    for step, (seqs, slots) in plan.checkpoints.items():
        conv_state[slots] = full[seqs, step + 1 : step + 1 + keep].float()
    tail = plan.lengths[:, None] + torch.arange(keep, device=x.device)[None, :]  # [S, K - 1]
    conv_state[plan.slots] = full.gather(1, tail[..., None].expand(-1, -1, full.shape[-1])).float()
    return plan.to_flat(out).to(x.dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gates(
    ba: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, num_key_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta) [T, Hv] from in_proj_ba's rows [T, 2 Hv] (per key head, its value heads' b, then
    their a): the log decay g = -exp(A_log) softplus(a + dt_bias), float32, and the write strength
    beta = sigmoid(b)."""
    n = ba.shape[0]
    b, a = ba.view(n, num_key_heads, -1).chunk(2, dim=-1)
    g = -a_log.float().exp() * F.softplus(a.reshape(n, -1).float() + dt_bias)
    return g, b.reshape(n, -1).sigmoid()


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ba: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_state: torch.Tensor,
    plan: RecurrentPlan | StateRuns,
) -> torch.Tensor:
    """Outputs [T, Hv, Dv] (in v's dtype) for flat rows q, k [T, Hk, Dk], v [T, Hv, Dv] and the
    gates' inputs (`gates`); continues each sequence's state in ssm_state [slots, Hv, Dk, Dv] and
    checkpoints it where the plan says. The grid's steps are scanned in segments that end at
    checkpoints."""
    if isinstance(plan, StateRuns):
        return gated_delta_step(q, k, v, ba, a_log, dt_bias, ssm_state, plan)
    g, beta = gates(ba, a_log, dt_bias, k.shape[1])
    dtype, group = v.dtype, v.shape[1] // k.shape[1]  # each q/k head serves `group` consecutive value heads
    q = l2norm(q.repeat_interleave(group, dim=1).float()) * q.shape[-1] ** -0.5
    k = l2norm(k.repeat_interleave(group, dim=1).float())
    q, k, v, g, beta = (plan.to_grid(t.float()) for t in (q, k, v, g, beta))
    state = plan.read(ssm_state)  # [S, Hv, Dk, Dv]
    out = torch.empty_like(v)
    start = 0
    for end in sorted({t + 1 for t in plan.checkpoints} | {plan.max_len}):
        scan = chunked_scan if end - start >= MIN_CHUNKED_RUN else recurrent_scan
        part = slice(start, end)
        out[:, part], state = scan(q[:, part], k[:, part], v[:, part], g[:, part], beta[:, part], state)
        if end - 1 in plan.checkpoints:
            seqs, slots = plan.checkpoints[end - 1]
            ssm_state[slots] = state[seqs]
        start = end
    ssm_state[plan.slots] = state
    return plan.to_flat(out).to(dtype)


def recurrent_scan(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> ScanResult:
    """Token by token. q, k [S, L, H, Dk], v [S, L, H, Dv], g, beta [S, L, H], state [S, H, Dk, Dv],
    all float32; returns (outputs [S, L, H, Dv], the state after the last step)."""
    out = torch.empty_like(v)
    for t in range(v.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        k_t = k[:, t, :, :, None]
        delta = (v[:, t] - (state * k_t).sum(dim=-2)) * beta[:, t, :, None]
        state = state + k_t * delta[:, :, None, :]
        out[:, t] = (state * q[:, t, :, :, None]).sum(dim=-2)
    return out, state


def chunked_scan(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> ScanResult:
    """The same as `recurrent_scan`, CHUNK tokens at a time (the DeltaNet paper's UT / WY form):
    within a chunk, the delta-rule updates are one unit-lower-triangular solve and a few matmuls,
    so a long prefill takes L / CHUNK sequential steps instead of L. Zero padding (g = beta = 0,
    k = v = 0) leaves the state and the real tokens' outputs unchanged."""
    num_seqs, length, heads = v.shape[:3]
    pad = (-length) % CHUNK
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(1, 2) for x in (q, k, v))  # [S, H, L', D]
    g, beta = (F.pad(x, (0, 0, 0, pad)).transpose(1, 2) for x in (g, beta))  # [S, H, L']
    q, k, v = (x.reshape(num_seqs, heads, -1, CHUNK, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.reshape(num_seqs, heads, -1, CHUNK) for x in (g, beta))
    cum = g.cumsum(dim=-1)  # log of the decay from the chunk's start through each position
    future = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=v.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(future, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # its strictly lower part; the diagonal is taken as 1
    intra = (q @ k.transpose(-1, -2)) * decay
    new_values, k_read = (
        torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        for rhs in (v * beta[..., None], k_beta * cum.exp()[..., None])
    )
    q = q * cum.exp()[..., None]
    k_write = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    out = torch.empty_like(v)
    for i in range(v.shape[2]):
        v_new = new_values[:, :, i] - k_read[:, :, i] @ state
        out[:, :, i] = q[:, :, i] @ state + intra[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + k_write[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(num_seqs, heads, -1, v.shape[-1])[:, :, :length].transpose(1, 2)
    return out, state
