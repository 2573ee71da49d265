"""The torch reference attention backend: correct everywhere, fast nowhere; CI runs it.

From the backend-neutral batch (query offsets, sequence lengths, block table) `prepare` derives,
with a handful of vectorized ops and no per-sequence Python: a padded [S, max_q] grid of query
rows, each sequence's context slots gathered from the block table, and one boolean mask per
sliding window (causal, within context, within the window). Each layer then writes its K/V into
the pool and runs SDPA over the gathered context. A GPU kernel replaces all of this behind the
same two methods, reading the block table directly instead of gathering.

MLA layers (`forward_latent`) attend over cached latents in two ways. The step's leading
one-token sequences (decode rows) use the absorbed weights: each head's non-rotary query goes
through its W_UK into latent space, scores are q_latent . c + q_rope . k_rope against the cached
rows as they are (one shared "KV head"), and the output c-weighted sum goes through W_UV; no
per-head K or V is ever made. The rest (prefill chunks, verify runs) decompress each context row
with `kv_b_proj` into per-head keys and values and attend as usual: cheaper when many queries
share a context. Both read the whole cached context, so a prefix-cache hit is attended to like
tokens this step wrote.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from model_service.attention.paged import PagedAttention
from model_service.kernels.fused import apply_rotary, head_rms_norm
from model_service.kernels.paged_attention import HeadNorms, cache_rows, write_cache_rows
from model_service.models.step import StepBatch


class TorchReferenceBackend(PagedAttention):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """`PagedAttention`'s arguments."""
        super().__init__(*args, **kwargs)
        self._batch: StepBatch | None = None
        self._num_decode = 0
        self._query_index = self._token_rows = self._key_slots = torch.empty(0, dtype=torch.long)
        self._masks: dict[int | None, torch.Tensor] = {}

    def prepare(self, batch: StepBatch) -> None:
        device, bs = batch.input_ids.device, self.kv_cache.block_size
        q_lens = batch.query_start[1:] - batch.query_start[:-1]  # [S]
        max_q, max_k, total = batch.max_query_len, batch.max_seq_len, batch.num_tokens
        j = torch.arange(max_q, device=device)
        k = torch.arange(max_k, device=device)
        valid_q = j[None, :] < q_lens[:, None]  # [S, Q]
        self._query_index = torch.where(valid_q, batch.query_start[:-1, None] + j, total)
        seq_of_token = torch.repeat_interleave(
            torch.arange(batch.num_seqs, device=device), q_lens, output_size=total
        )
        within = torch.arange(total, device=device) - batch.query_start[seq_of_token]
        self._token_rows = seq_of_token * max_q + within
        blocks = batch.block_table[:, (k // bs).clamp(max=batch.block_table.shape[1] - 1)]
        in_context = k[None, :] < batch.seq_lens[:, None]
        self._key_slots = torch.where(in_context, blocks * bs + k % bs, 0)  # [S, K]
        query_pos = torch.where(valid_q, (batch.seq_lens - q_lens)[:, None] + j, -1)  # [S, Q]
        self._masks = {w: _mask(query_pos, max_k, w) for w in set(self.windows)}
        self._num_decode = batch.num_leading_decodes
        self._batch = batch

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        norms: HeadNorms | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert self._batch is not None, "prepare() must run before the first layer"
        if norms is not None:
            q, k = head_rms_norm(q, k, norms)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        k_cache, v_cache = self.kv_cache.layer(layer)
        write_cache_rows(k_cache, self._batch.slot_mapping, k)
        write_cache_rows(v_cache, self._batch.slot_mapping, v)
        _, heads, dim = q.shape
        q_padded = torch.cat((q, q.new_zeros(1, heads, dim)))[self._query_index]  # [S, Q, H, D]
        keys = cache_rows(k_cache, self._key_slots).to(q.dtype)  # [S, K, KVH, D]
        values = cache_rows(v_cache, self._key_slots).to(q.dtype)
        qkv = (q_padded.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2))
        mask = self._masks[self.windows[layer]]
        if self.softcap is not None or sinks is not None:
            out = explicit_attention(*qkv, mask, self.scale, self.softcap, sinks)
        else:
            out = F.scaled_dot_product_attention(
                *qkv, attn_mask=mask, scale=self.scale, enable_gqa=heads != k.shape[1]
            )  # [S, H, Q, D]
        return out.transpose(1, 2).reshape(-1, heads, dim)[self._token_rows]

    def forward_latent(
        self,
        layer: int,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        cache_row: torch.Tensor,
        kv_up: torch.Tensor,
    ) -> torch.Tensor:
        cache = self.kv_cache.latent(layer)
        self._write_rows(cache, cache_row[:, None, :])
        d, nope = self._num_decode, q_nope.shape[-1]
        parts = []
        if d > 0:  # absorbed: W_UK into the query, attention in latent space, then W_UV
            q = torch.cat((torch.einsum("thn,hnl->thl", q_nope[:d], kv_up[:, :nope]), q_rope[:d]), dim=-1)
            out = self._latent_attention(cache, q, kv_up.shape[-1])
            parts.append(torch.einsum("thl,hvl->thv", out, kv_up[:, nope:]))
        if d < q_nope.shape[0]:
            parts.append(self._decompressed(cache, q_nope, q_rope, kv_up, d))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _write_rows(self, cache: torch.Tensor, rows: torch.Tensor) -> None:
        """This step's MLA rows [T, 1, latent + rope] into their slots."""
        assert self._batch is not None, "prepare() must run before the first layer"
        write_cache_rows(cache, self._batch.slot_mapping, rows)

    def _latent_attention(self, cache: torch.Tensor, q: torch.Tensor, latent: int) -> torch.Tensor:
        """The step's leading decode rows (sequence i's query is row i), absorbed queries q
        [d, H, latent + rope] against their contexts' cached rows as one shared KV head whose
        value is the latent: [d, H, latent]."""
        d = q.shape[0]
        rows = cache_rows(cache, self._key_slots[:d]).to(q.dtype)  # [d, K, 1, latent + rope]
        return F.scaled_dot_product_attention(
            q[:, :, None],  # [d, H, 1, latent + rope]
            rows.transpose(1, 2),  # [d, 1, K, latent + rope]
            rows.transpose(1, 2)[..., :latent],
            attn_mask=self._masks[None][:d, :, :1],
            scale=self.scale,
            enable_gqa=True,
        )[:, :, 0]

    def _decompressed(
        self, cache: torch.Tensor, q_nope: torch.Tensor, q_rope: torch.Tensor, kv_up: torch.Tensor, first: int
    ) -> torch.Tensor:
        """The sequences from `first` on (their tokens too start at row `first`): per-head K/V
        made from every cached row of their contexts."""
        heads, per_head, latent = kv_up.shape
        nope = q_nope.shape[-1]
        rows = cache_rows(cache, self._key_slots[first:]).to(q_nope.dtype)[:, :, 0]  # [S', K, latent + rope]
        kv = F.linear(rows[..., :latent], kv_up.reshape(heads * per_head, latent))
        k_nope, values = kv.view(*rows.shape[:2], heads, per_head).split([nope, per_head - nope], dim=-1)
        k_rope = rows[:, :, None, latent:].expand(-1, -1, heads, -1)
        keys = torch.cat((k_nope, k_rope), dim=-1)  # [S', K, H, Dn + R]
        q = torch.cat((q_nope, q_rope), dim=-1)
        q_padded = torch.cat((q, q.new_zeros(1, *q.shape[1:])))[self._query_index[first:]]  # [S', Q, H, D]
        out = F.scaled_dot_product_attention(
            q_padded.transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=self._masks[None][first:],
            scale=self.scale,
        )  # [S', H, Q, Dv]
        grid_rows = self._token_rows[first:] - first * self._query_index.shape[1]
        return out.transpose(1, 2).reshape(-1, heads, per_head - nope)[grid_rows]


def explicit_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """SDPA written out, for the terms SDPA has no place for: q [S, H, Q, D], k and v
    [S, KVH, K, D], mask [S, 1, Q, K]. `cap`: the scaled logits soft-capped before the mask, as
    HF's eager Gemma 2 attention computes them. `sinks` [H]: gpt-oss's per-head logit that joins
    each row's softmax (taking its share of the probability) but has no value, as HF's eager
    gpt-oss attention."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    logits = q @ k.transpose(-1, -2) * scale
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    logits = logits.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return logits.softmax(-1, dtype=torch.float32).to(q.dtype) @ v
    sink = sinks.to(logits.dtype).view(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
    probs = torch.cat((logits, sink), dim=-1).softmax(-1, dtype=torch.float32)[..., :-1]
    return probs.to(q.dtype) @ v


def _mask(query_pos: torch.Tensor, max_k: int, window: int | None) -> torch.Tensor:
    """[S, 1, Q, K]: causal, within context, optionally within a sliding window."""
    key_pos = torch.arange(max_k, device=query_pos.device)
    q = query_pos[:, :, None]
    allowed = key_pos[None, None, :] <= q
    if window is not None:
        allowed &= key_pos[None, None, :] > q - window
    # Padding query rows attend to position 0 so SDPA never sees an all-masked row (NaN).
    allowed[:, :, 0] |= query_pos < 0
    return allowed[:, None]
