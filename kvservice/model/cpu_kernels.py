"""The C++ CPU kernels (`csrc/*.cpp`), built on first use; PyTorch code is the fallback.

- `paged_decode_attention`: decode attention reading K/V in place through the block table.
- `add_rms_norm_`, `rotary_`: the residual add + RMSNorm, and rotary in place, one call each.
- `prompt_attention`, `prompt_attention_out`: causal attention of a fresh prompt over its own keys
  (AVX-512 fast), as a new tensor or into rows of a given one.
- `block_quant_linear`: a linear layer for a few rows over GGUF block-quantized weights.
- `silu_mul`: SwiGLU's activation, silu(gate) * up, in one pass over the gate/up projection.
- `decode_layer_`: a whole decoder layer of a decode step, those kernels in one call.
- `greedy_head`: the LM head's argmax per row, exactly, mostly in 8-bit integer dot products
  (AVX-512 VNNI, or AVX2's vpmaddubsw; `greedy_head_supported()`).

`load_cpu_kernels()` compiles the extension once per machine (torch's extension cache,
~/.cache/torch_extensions or $TORCH_EXTENSIONS_DIR) and loads it. It returns False when
the build fails or `KVSERVICE_KERNELS=torch` asks for the pure-PyTorch path; callers
then keep their PyTorch formulas, which the tests compare the kernels against.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import pathlib
import time
from collections.abc import Iterator

import torch

log = logging.getLogger(__name__)

_SOURCES = [
    pathlib.Path(__file__).parent / "csrc" / name
    for name in (
        "paged_attention.cpp",
        "prompt_attention.cpp",
        "norm_rotary.cpp",
        "block_quant_linear.cpp",
        "decode_layer.cpp",
        "greedy_head.cpp",
        "swiglu.cpp",
    )
]
_HEADERS = sorted((pathlib.Path(__file__).parent / "csrc").glob("*.h"))
# torch caches builds by name and the sources' hash (not the headers': their hash joins the
# name); bump the version when an op's schema changes.
_EXTENSION_VERSION = "v10"
# Vector ISA flags per torch's own CPU capability check. The capability is part of the
# extension's name, so a cache shared by different CPUs never loads the wrong build.
_ISA_FLAGS = {
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
}

_is_loaded = False
_tried = False


def kernels_loaded() -> bool:
    """Whether `load_cpu_kernels` has loaded the ops in this process; never builds."""
    return _is_loaded


def prompt_attention_is_faster() -> bool:
    """Whether `prompt_attention` beats torch's SDPA here: its loaded AVX-512 or AVX2 build
    (SmolLM2's 256-token prompt, a layer: ~0.8 vs ~1.3 ms on 2 Zen 4 cores, ~0.9 vs ~1.5 ms on 2
    Zen 3 cores with AVX2). Elsewhere it runs its plain C++ loops, which are correct but slower
    than SDPA."""
    return _is_loaded and torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX2")


@contextlib.contextmanager
def one_builder(build_dir: pathlib.Path) -> Iterator[None]:
    """Hold the build of `build_dir` against other kvservice processes, and clear torch's lock
    file there if a killed build left it. torch marks a build in progress with a `lock` file that
    only its builder removes; one killed mid-build (Ctrl-C during a first start) left every later
    start waiting on it forever. Every kvservice build holds this record lock while it builds, and
    the OS drops it when its holder dies: whoever holds it and still finds `lock` knows that
    lock's builder is gone."""
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        held = open(build_dir / "kvservice-build.lock", "a")  # noqa: SIM115 (closed below, after the yield)
    except OSError:  # a read-only cache: nothing is built there, a finished build still loads
        yield
        return
    with held:
        fcntl.flock(held, fcntl.LOCK_EX)  # a concurrent start waits here, then finds the build done
        baton = build_dir / "lock"
        if baton.exists():
            log.warning("removing %s, left by a kernel build that was killed", baton)
            baton.unlink(missing_ok=True)
        yield


def load_cpu_kernels() -> bool:
    """Build (first call on a machine) and load the ops; False means: use the PyTorch path."""
    global _is_loaded, _tried
    if _tried:
        return _is_loaded
    _tried = True
    if os.environ.get("KVSERVICE_KERNELS", "") == "torch":
        return False
    if not hasattr(torch.ops.kvservice, "block_quant_linear"):
        from torch.utils import cpp_extension

        capability = torch.backends.cpu.get_cpu_capability()
        isa_flags = _ISA_FLAGS.get(capability, [])
        headers = hashlib.sha256(b"".join(h.read_bytes() for h in _HEADERS)).hexdigest()[:8]
        name = f"kvservice_cpu_kernels_{_EXTENSION_VERSION}_{capability.lower() if isa_flags else 'generic'}_{headers}"
        start = time.perf_counter()
        log.info("loading the C++ CPU kernels (built once per machine, then cached by torch)")
        try:
            build_dir = pathlib.Path(cpp_extension._get_build_directory(name, False))
            with one_builder(build_dir):
                cpp_extension.load(
                    name=name,
                    sources=[str(s) for s in _SOURCES],
                    # No FMA contraction: rotary then rounds exactly like the PyTorch formula.
                    # -fopenmp: at::parallel_for is an OpenMP pragma in ATen's headers; without it
                    # every kernel ran on one thread. The build links libgomp.so.1, which resolves
                    # to the one torch already loaded (same soname): one OpenMP pool, torch's.
                    extra_cflags=["-O3", "-fopenmp", "-ffp-contract=off", *isa_flags],
                    extra_ldflags=["-fopenmp"],
                    build_directory=str(build_dir),
                    is_python_module=False,
                    verbose=False,
                )
        except Exception as e:  # no compiler, no ninja, a read-only cache...: the fallback still works
            first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
            log.warning("C++ CPU kernels unavailable, using the PyTorch path: %s", first_line)
            return False
        log.info("C++ CPU kernels ready in %.1f s", time.perf_counter() - start)
    _is_loaded = True
    return True
