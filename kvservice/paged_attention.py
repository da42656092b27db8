"""The C++ decode attention kernel (`csrc/paged_attention.cpp`), built on first use.

`load_decode_kernel()` compiles the extension once per machine (torch's extension cache,
~/.cache/torch_extensions or $TORCH_EXTENSIONS_DIR) and returns the op, or None when
the build fails or `KVSERVICE_ATTENTION=torch` asks for the pure-PyTorch path; callers
then fall back to gathering the context and attending with matmuls.
"""

from __future__ import annotations

import logging
import os
import pathlib
import time
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

_SOURCE = pathlib.Path(__file__).parent / "csrc" / "paged_attention.cpp"
# Bump with every change to the source's interface: torch caches builds by name and hash.
_EXTENSION_NAME = "kvservice_paged_attention_v1"

DecodeKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]

_kernel: DecodeKernel | None = None
_tried = False


def loaded_decode_kernel() -> DecodeKernel | None:
    """The op if `load_decode_kernel` has loaded it in this process; never builds."""
    return _kernel


def load_decode_kernel() -> DecodeKernel | None:
    """The compiled op (building it on the first call of the process), or None."""
    global _kernel, _tried
    if _tried:
        return _kernel
    _tried = True
    if os.environ.get("KVSERVICE_ATTENTION", "") == "torch":
        return None
    if hasattr(torch.ops.kvservice, "paged_decode_attention"):  # already loaded in this process
        _kernel = torch.ops.kvservice.paged_decode_attention
        return _kernel
    from torch.utils import cpp_extension

    start = time.perf_counter()
    log.info("building the C++ decode attention kernel (once per machine; cached by torch)")
    try:
        cpp_extension.load(
            name=_EXTENSION_NAME,
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-fopenmp-simd"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, a read-only cache...: the fallback still works
        log.warning("C++ decode attention unavailable, using the PyTorch path: %s", str(e).splitlines()[0] if str(e) else e)
        return None
    log.info("C++ decode attention ready in %.1f s", time.perf_counter() - start)
    _kernel = torch.ops.kvservice.paged_decode_attention
    return _kernel
