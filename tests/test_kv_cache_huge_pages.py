"""The CPU KV cache lies in memory advised for transparent huge pages, zeroed, and behaves as
any tensor (the decode step streams it: 4 KiB pages cost a TLB miss each)."""

from __future__ import annotations

import pathlib

import pytest
import torch

from kvservice.model.kv_cache import HUGE_PAGE_BYTES, KVCacheLayout, allocate_kv_caches, huge_page_zeros

LAYOUT = KVCacheLayout(num_layers=2, block_size=16, num_kv_heads=3, head_dim=64, dtype=torch.float32)


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address`."""
    flags: list[str] | None = None
    holds = False
    for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
        first = line.split()[0]
        if "-" in first and not first.endswith(":"):
            start, end = (int(x, 16) for x in first.split("-"))
            holds = start <= address < end
        elif holds and first == "VmFlags:":
            flags = line.split()[1:]
    assert flags is not None, "no mapping holds the tensor"
    return flags


def test_cpu_caches_are_zeroed_aligned_and_advised_for_huge_pages() -> None:
    num_blocks = 2 * HUGE_PAGE_BYTES // LAYOUT.bytes_per_block_per_layer  # 4 MiB a layer
    caches = allocate_kv_caches(LAYOUT, num_blocks, torch.device("cpu"))
    assert [tuple(c.shape) for c in caches] == [LAYOUT.blocks_shape(num_blocks)] * 2
    for cache in caches:
        assert cache.dtype == torch.float32 and cache.is_contiguous() and not cache.any()
        assert cache.data_ptr() % HUGE_PAGE_BYTES == 0
        cache.fill_(1.5)
        assert cache.view(torch.uint8).numpy().reshape(2, num_blocks, -1).shape[2] * 2 == LAYOUT.bytes_per_block_per_layer
    assert caches[0].sum().item() == 1.5 * caches[0].numel()
    if not pathlib.Path("/sys/kernel/mm/transparent_hugepage").exists():
        pytest.skip("this kernel has no transparent huge pages: the advice is not kept")
    assert "hg" in _vm_flags(caches[0].data_ptr())


def test_small_tensors_and_devices_other_than_the_cpu_are_plain_zeros() -> None:
    small = huge_page_zeros((4, 8), torch.bfloat16)
    assert small.dtype == torch.bfloat16 and not small.any()
    assert "hg" not in _vm_flags(small.data_ptr())
    caches = allocate_kv_caches(LAYOUT, 4, torch.device("meta"))
    assert all(c.device.type == "meta" for c in caches)
