"""The Gated DeltaNet recurrence (Qwen3-Next's linear attention) in torch, over a step's padded grid.

Per value head, the state S is a [key_dim, value_dim] matrix. Each token decays it by
exp(g) (g <= 0, from the softplus'd `a` projection), reads what it currently stores under the
token's key (k^T S), moves that toward the token's value with strength beta (the delta rule:
S += k (beta (v - k^T S))), and emits q^T S. Keys and queries are L2-normalized and q is scaled
by key_dim^-0.5. Before the recurrence, q/k/v pass through a causal depthwise conv whose state
is the last conv_kernel - 1 inputs.

This is the token-by-token form (what HF calls the recurrent kernel): exact, and linear in the
tokens of a step. Padding cells of the grid get g = 0 and beta = 0, which leave the state as is.
The state is float32 whatever the model's dtype (as the reference keeps it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model_service.models.recurrent import RecurrentPlan


def causal_conv(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, plan: RecurrentPlan
) -> torch.Tensor:
    """SiLU(depthwise causal conv) of flat rows x [T, C], continuing each sequence's conv state
    ([slots, K - 1, C]) and leaving in it the last K - 1 inputs of each run; weight [C, 1, K]."""
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


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    plan: RecurrentPlan,
) -> torch.Tensor:
    """Outputs [T, Hv, Dv] (in v's dtype) for flat rows q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta
    [T, Hv]; continues each sequence's state in ssm_state [slots, Hv, Dk, Dv] and checkpoints it
    where the plan says."""
    dtype, group = v.dtype, v.shape[1] // k.shape[1]  # each q/k head serves `group` consecutive value heads
    q = l2norm(q.repeat_interleave(group, dim=1).float()) * q.shape[-1] ** -0.5
    k = l2norm(k.repeat_interleave(group, dim=1).float())
    q, k, v, g, beta = (plan.to_grid(t.float()) for t in (q, k, v, g, beta))
    state = plan.read(ssm_state)  # [S, Hv, Dk, Dv]
    out = torch.empty_like(v)
    for t in range(plan.max_len):
        state = state * g[:, t].exp()[..., None, None]
        k_t = k[:, t, :, :, None]
        delta = (v[:, t] - (state * k_t).sum(dim=-2)) * beta[:, t, :, None]
        state = state + k_t * delta[:, :, None, :]
        out[:, t] = (state * q[:, t, :, :, None]).sum(dim=-2)
        if t in plan.checkpoints:
            seqs, slots = plan.checkpoints[t]
            ssm_state[slots] = state[seqs]
    ssm_state[plan.slots] = state
    return plan.to_flat(out).to(dtype)
