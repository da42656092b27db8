"""Rotary position embeddings: the frequencies (with `rope_scaling`), the per-position
cos/sin tables, and one step's rotation of q and k (in place, by the C++ kernel when loaded)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from kvservice.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], with `rope_scaling` applied (default, linear, llama3, freq_factors)."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        old_context_len = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    if rope_type == "freq_factors":
        # One divisor per frequency, precomputed: a GGUF's `rope_freqs` tensor (Llama 3's scaling).
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    raise ValueError(
        f"rope_scaling: unsupported rope_type {rope_type!r} (supported: default, linear, llama3, freq_factors)"
    )


@dataclass(slots=True)
class StepRope:
    """One step's rotary angles: the positions [T], and per-token cos/sin [T, 1, D] unless fused."""

    positions: torch.Tensor
    cos_table: torch.Tensor  # float32 [max_positions, head_dim]
    sin_table: torch.Tensor
    cos: torch.Tensor | None  # [T, 1, head_dim] in the model's dtype; None with the kernel
    sin: torch.Tensor | None

    def apply_(self, qkv: torch.Tensor, num_heads: int, head_dim: int) -> None:
        """Rotate the first `num_heads` heads of qkv [T, (Hq + 2 Hkv) * D] (q's, then k's) in place."""
        if self.cos is None or self.sin is None:
            torch.ops.kvservice.rotary_(qkv, self.positions, self.cos_table, self.sin_table, num_heads, head_dim)
            return
        x = qkv[:, : num_heads * head_dim].view(qkv.shape[0], num_heads, head_dim)
        x.copy_(x * self.cos + _rotate_half(x) * self.sin)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to `max_positions`, looked up per token."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        # Computed, never loaded: on the CPU even while the model is built on the meta device
        # (where these ops would pull in torch's meta registrations, about a second).
        with torch.device("cpu"):
            inv_freq = rope_inv_freq(cfg)
            freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype, fused: bool) -> StepRope:
        if fused:
            return StepRope(positions, self.cos, self.sin, None, None)
        # [T, 1, head_dim]: broadcast over heads.
        cos, sin = self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)
        return StepRope(positions, self.cos, self.sin, cos, sin)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
