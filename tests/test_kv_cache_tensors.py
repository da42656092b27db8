"""The KV cache tensors: zeroed, writable, one per layer."""

from __future__ import annotations

import pytest
import torch

from kvservice.model.kv_cache import KVCacheLayout, allocate_kv_caches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_caches_are_zeroed_writable_tensors_one_per_layer(dtype: torch.dtype) -> None:
    layout = KVCacheLayout(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype)
    caches = allocate_kv_caches(layout, num_blocks=5, device=torch.device("cpu"))
    assert len(caches) == 3
    for i, cache in enumerate(caches):
        assert cache.shape == (2, 5, 4, 2, 8) and cache.dtype == dtype and cache.is_contiguous()
        assert not cache.any()
        cache[1, 4, 3] = i + 1  # the last V row of the last block
    for i, cache in enumerate(caches):
        assert cache[1, 4, 3].eq(i + 1).all() and int(cache.ne(0).sum()) == 2 * 8
    assert caches[0].data_ptr() != caches[1].data_ptr()
