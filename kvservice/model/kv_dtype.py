"""The KV cache's element type (`--kv-cache-dtype`), and its rows as PyTorch code reads and writes them.

A cache row is one token's values of one KV head. `auto` stores them in the model's compute dtype
(exact); `bfloat16` rounds them to bfloat16 (round to nearest even) as they are written, half of
float32's bytes, and attention widens them back to float32 as it reads them. The C++ kernels do
the same (`csrc/kv_row.h`); these functions are the PyTorch path's, and the tests' reference.
"""

from __future__ import annotations

import torch

from kvservice.config import KV_CACHE_DTYPES

_STORAGE: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16}


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensors' dtype: the model's for "auto", else the one named."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return _STORAGE.get(kv_cache_dtype, model_dtype)


def row_width(dtype: torch.dtype, head_dim: int) -> int:
    """Elements of one cache row of `dtype` holding `head_dim` values."""
    return head_dim


def encode_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., head_dim] as cache rows of `dtype` (bfloat16: rounded to nearest even)."""
    return x.to(dtype)


def decode_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows [..., row_width] as values [..., head_dim] of the compute dtype `dtype`."""
    return rows.to(dtype)
