"""The KV cache's element type (`--kv-cache-dtype`), and its rows as PyTorch code reads and writes them.

A cache row is one token's values of one KV head. `auto` stores them in the model's compute dtype
(exact). `bfloat16` rounds them to bfloat16 (to nearest even) as they are written: half of float32's
bytes. `int8` stores each row as head_dim symmetric 8-bit codes followed by the row's float32 scale
(its 4 bytes as 4 int8 elements, so a row is head_dim + 4 wide): value = code * scale, scale =
max |value| / 127, a quarter of float32's bytes plus 4 a row. Attention reads either back as the
compute dtype. The C++ kernels do the same (`csrc/kv_row.h`), bit for bit on the writes; these
functions are the PyTorch path's, and the tests' reference.
"""

from __future__ import annotations

import torch

from kvservice.config import KV_CACHE_DTYPES

_STORAGE: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "int8": torch.int8}
INT8_SCALE_BYTES = 4  # an int8 row's float32 scale, after its codes
INT8_MAX_CODE = 127


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensors' dtype: the model's for "auto", else the one named."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return _STORAGE.get(kv_cache_dtype, model_dtype)


def row_width(dtype: torch.dtype, head_dim: int) -> int:
    """Elements of one cache row of `dtype` holding `head_dim` values (int8: and the row's scale)."""
    return head_dim + (INT8_SCALE_BYTES if dtype == torch.int8 else 0)


def encode_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., head_dim] as cache rows of `dtype`: rounded to nearest even (bfloat16), or int8 codes
    x * (127 / amax) rounded half to even, then the scale amax / 127, in float32 as kv_row.h does."""
    if dtype != torch.int8:
        return x.to(dtype)
    x32 = x.float()
    amax = x32.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, INT8_MAX_CODE / amax, 0.0)
    codes = (x32 * inv).round_().clamp_(-INT8_MAX_CODE, INT8_MAX_CODE).to(torch.int8)
    return torch.cat([codes, (amax / INT8_MAX_CODE).view(torch.int8)], dim=-1)


def decode_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows [..., row_width] as values [..., head_dim] of the compute dtype `dtype`."""
    if rows.dtype != torch.int8:
        return rows.to(dtype)
    scale = rows[..., -INT8_SCALE_BYTES:].contiguous().view(torch.float32)
    return (rows[..., :-INT8_SCALE_BYTES].float() * scale).to(dtype)
