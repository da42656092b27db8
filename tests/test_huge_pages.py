"""Huge pages for the KV cache: the advice covers exactly the whole 2 MiB pages inside a tensor."""

from __future__ import annotations

import pathlib

import pytest
import torch

from kvservice.model.huge_pages import HUGE_PAGE_BYTES, advise_huge_pages, zeros_on_huge_pages

THP = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")


def whole_pages(tensor: torch.Tensor) -> int:
    start = tensor.data_ptr()
    end = start + tensor.untyped_storage().nbytes()
    first = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    return max(0, end // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES - first)


@pytest.mark.skipif(not THP.exists(), reason="this kernel has no transparent huge pages")
def test_the_advice_covers_every_whole_huge_page_of_a_large_tensor() -> None:
    tensor = torch.empty(3 * HUGE_PAGE_BYTES + 12345, dtype=torch.uint8)
    advised = advise_huge_pages(tensor)
    assert advised == whole_pages(tensor) and advised >= 2 * HUGE_PAGE_BYTES


def test_a_tensor_without_a_whole_huge_page_is_not_advised() -> None:
    assert advise_huge_pages(torch.empty(1000, dtype=torch.float32)) == 0
    assert advise_huge_pages(torch.empty(HUGE_PAGE_BYTES // 4, dtype=torch.float32, device="meta")) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zeros_on_huge_pages_are_zeros_of_the_shape_asked(dtype: torch.dtype) -> None:
    shape = (2, 40, 16, 3, 64)  # a 960 KiB or 480 KiB layer: spans a huge page or not, zeroed either way
    big = zeros_on_huge_pages((5, *shape), dtype, torch.device("cpu"))
    assert big.shape == (5, *shape) and big.dtype == dtype and big.is_contiguous() and not big.any()
    big[4, 1, 39] = 1
    assert int(big.ne(0).sum()) == 16 * 3 * 64
