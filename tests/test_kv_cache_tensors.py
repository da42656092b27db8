"""The KV cache tensors: zeroed, writable, one per layer, their memory taken only as it is written."""

from __future__ import annotations

import gc
import resource

import pytest
import torch

from kvservice.model.kv_cache import KVCacheLayout, allocate_kv_caches, zero_pages


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_caches_are_zeroed_writable_tensors_one_per_layer(dtype: torch.dtype) -> None:
    layout = KVCacheLayout(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype)
    caches = allocate_kv_caches(layout, num_blocks=5, device=torch.device("cpu"))
    assert len(caches) == 3
    for i, cache in enumerate(caches):
        assert cache.shape == (2, 5, 4, 2, 8) and cache.dtype == dtype and cache.is_contiguous()
        assert not cache.any()
        cache[1, 4, 3] = i + 1  # the last V row of the last block
    gc.collect()  # the maps live as long as their tensors
    for i, cache in enumerate(caches):
        assert cache[1, 4, 3].eq(i + 1).all() and int(cache.ne(0).sum()) == 2 * 8
    assert caches[0].data_ptr() != caches[1].data_ptr()


def test_zero_pages_take_memory_only_where_written() -> None:
    gc.collect()
    before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    big = zero_pages((256, 1 << 20), torch.float32)  # 1 GiB of zeros
    big[0, :1024] = 1.0  # one page
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before_kib
    assert float(big[0].sum()) == 1024.0 and float(big[255, -1]) == 0.0
    assert grown_kib < 64 << 10, f"1 GiB of zeros took {grown_kib} KiB of resident memory"
    del big


def test_zero_pages_of_nothing_is_an_empty_tensor() -> None:
    empty = zero_pages((2, 0, 4), torch.float32)
    assert empty.shape == (2, 0, 4) and empty.numel() == 0
