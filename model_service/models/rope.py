"""Rotary position embeddings, including the context-extension schemes checkpoints ask for.

The inverse frequencies follow the published formulas (linear interpolation, Llama 3's
wavelength-banded scaling, YaRN, dynamic NTK within max_position_embeddings, LongRoPE's short
factors within original_max_position_embeddings); tests compare them to
HF's on the same config.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """Return (inv_freq [head_dim/2], attention_factor) for a RoPE scaling dict."""
    # In float32, as Meta's, Qwen's and HF's code compute them: a float64 computation rounds a third
    # of them one ulp away, which moves position p's angle by ~p * 6e-8 radians (cos off by 7e-3 at
    # 128k), and llama3's band blend cancels digits (up to ~1e-5 relative in the medium band).
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = scaling.get("rope_type", "default")
    # Dynamic NTK keeps the default frequencies within max_position_embeddings, and the engine's
    # context stops there (ModelConfig.context_length).
    if kind in ("default", "dynamic"):
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling)
    if kind == "longrope":
        return _longrope(head_dim, theta, scaling)
    raise ValueError(f"unsupported rope_type {kind!r}")


def _llama3(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn(dim: int, base: float, s: dict[str, Any]) -> tuple[torch.Tensor, float]:
    factor = float(s["factor"])
    orig = float(s["original_max_position_embeddings"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention_factor = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1 / (factor * pos_freqs)) * (1 - extrapolation) + (1 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def _longrope(dim: int, base: float, s: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """LongRoPE's (Phi-3's) short factors, which HF uses while the sequence is within
    original_max_position_embeddings, where the engine's context stops
    (`ModelConfig._check_longrope_context`); and HF's attention factor, applied at every length:
    `attention_factor`, else sqrt(1 + ln(factor) / ln(original)) for a factor above 1 (config.py
    sets `factor` to max_position_embeddings / original where config.json leaves it out)."""
    factor, original = float(s["factor"]), float(s["original_max_position_embeddings"])
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext_factors = torch.tensor(s["short_factor"], dtype=torch.float32)
    inv_freq = 1.0 / (ext_factors * base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return inv_freq, float(attention_factor)


class RotaryEmbedding(torch.nn.Module):
    """Computes cos/sin for a flat vector of positions once per forward; every layer shares them."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any]) -> None:
        super().__init__()
        inv_freq, self.attention_factor = inverse_frequencies(head_dim, theta, scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_factor).to(dtype), (emb.sin() * self.attention_factor).to(dtype)
