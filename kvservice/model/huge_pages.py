"""Transparent huge pages for the large tensors decode streams every step.

Decode attention reads every request's K and V rows once a layer, from blocks scattered over the
cache as requests come and go: on 4 KiB pages nearly every few rows cost a page walk (16
requests of 320 tokens read ~47,000 pages a step, far past the TLB). Where the kernel hands out
transparent huge pages only on request (`madvise`, as on this project's machines), the cache
must ask for them before its pages are first touched.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

import torch

HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def advise_huge_pages(tensor: torch.Tensor) -> int:
    """Ask for huge pages under the whole 2 MiB pages inside a CPU tensor's memory; returns the
    bytes advised (0 where there are none, the tensor is not on the CPU, or the OS says no: the
    advice only ever makes memory faster, so a refusal is not an error). Pages already touched
    stay as they are until the kernel's background merging gets to them: advise before filling."""
    madvise = _madvise()
    if madvise is None or tensor.device.type != "cpu":
        return 0
    start = tensor.data_ptr()
    end = start + tensor.untyped_storage().nbytes()
    first = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    last = end // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if last <= first or madvise(first, last - first, _MADV_HUGEPAGE) != 0:
        return 0
    return last - first


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros, on huge pages where the tensor spans any (see advise_huge_pages)."""
    tensor = torch.empty(shape, dtype=dtype, device=device)
    advise_huge_pages(tensor)
    return tensor.zero_()
