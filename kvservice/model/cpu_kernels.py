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
then keep their PyTorch formulas, which the tests compare the kernels against. That path
is ~7x slower, so it is never silent: `compute_path()` names the path a worker runs (its
`Stats` and `/metrics` carry it), and the tests and `make test` fail when the kernels do
not build, unless `KVSERVICE_ALLOW_TORCH_FALLBACK=1` says that is expected on this machine
(`KVSERVICE_KERNELS=torch` counts as asking for it too).

The build is keyed by what it is built from (`build_key`: the sources' and headers' content,
the compile flags, the ISA, the torch version), never by where the sources lie: checkouts
with the same sources share one build, and none rebuilds another's. A build compiles copies
of the sources in its own directory, and a later start loads the built library directly.

`python -m kvservice.model.cpu_kernels` builds, prints the compute path, and exits 1 when
the kernels are unavailable without an opt-out (`make test` runs it first).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import pathlib
import sys
import time
from collections.abc import Iterator, Sequence

import torch

log = logging.getLogger(__name__)

ALLOW_FALLBACK_ENV = "KVSERVICE_ALLOW_TORCH_FALLBACK"
KERNELS_ENV = "KVSERVICE_KERNELS"

CSRC = pathlib.Path(__file__).parent / "csrc"
# In link order; every `*.h` beside them is part of the build too.
_SOURCE_NAMES = (
    "paged_attention.cpp",
    "prompt_attention.cpp",
    "norm_rotary.cpp",
    "block_quant_linear.cpp",
    "decode_layer.cpp",
    "greedy_head.cpp",
    "swiglu.cpp",
)
# Vector ISA flags per torch's own CPU capability check; any other capability builds the
# plain C++ loops ("generic"). The ISA is part of the build key and the extension's name, so
# a cache shared by different CPUs never loads the wrong build.
_ISA_FLAGS = {
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
}
# No FMA contraction: rotary then rounds exactly like the PyTorch formula. -fopenmp:
# at::parallel_for is an OpenMP pragma in ATen's headers; without it every kernel ran on one
# thread. The build links libgomp.so.1, which resolves to the one torch already loaded (same
# soname): one OpenMP pool, torch's.
_BASE_CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]
_LDFLAGS = ["-fopenmp"]

_is_loaded = False
_tried = False
_isa = ""  # the ISA of the loaded build
_build_error: str | None = None  # why the build or load failed, when it did


def kernels_loaded() -> bool:
    """Whether `load_cpu_kernels` has loaded the ops in this process; never builds."""
    return _is_loaded


def prompt_attention_is_faster() -> bool:
    """Whether `prompt_attention` beats torch's SDPA here: its loaded AVX-512 or AVX2 build
    (SmolLM2's 256-token prompt, a layer: ~0.8 vs ~1.3 ms on 2 Zen 4 cores, ~0.9 vs ~1.5 ms on 2
    Zen 3 cores with AVX2). Elsewhere it runs its plain C++ loops, which are correct but slower
    than SDPA."""
    return _is_loaded and torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX2")


def machine_isa() -> str:
    """The vector ISA a build here targets: AVX512, AVX2, or generic (plain C++ loops)."""
    capability = torch.backends.cpu.get_cpu_capability()
    return capability if capability in _ISA_FLAGS else "generic"


def compile_flags(isa: str) -> list[str]:
    """The compiler flags of a build for `isa`."""
    return [*_BASE_CFLAGS, *_ISA_FLAGS.get(isa, [])]


def kernel_files(csrc: pathlib.Path = CSRC) -> list[pathlib.Path]:
    """What a build compiles: the sources in `csrc` in link order, then its headers by name."""
    return [csrc / name for name in _SOURCE_NAMES] + sorted(csrc.glob("*.h"))


def build_key(files: Sequence[pathlib.Path], cflags: Sequence[str], isa: str) -> str:
    """A hash of what a build is made from: each file's name and content, the compile and link
    flags, the ISA and this torch. Where the files lie is left out, so two checkouts with the same
    sources share one build and different sources never share one."""
    digest = hashlib.sha256()

    def add(part: bytes) -> None:
        digest.update(len(part).to_bytes(8, "little"))  # length-prefixed: no two inputs concatenate alike
        digest.update(part)

    for path in files:
        add(path.name.encode())
        add(path.read_bytes())
    for flag in (*cflags, "--ldflags", *_LDFLAGS, "--isa", isa):
        add(flag.encode())
    add(f"torch {torch.__version__} {torch.version.git_version}".encode())
    return digest.hexdigest()


def extension_name(isa: str, key: str) -> str:
    """The extension (and its build directory's) name in torch's cache."""
    return f"kvservice_cpu_kernels_{isa.lower()}_{key[:16]}"


def torch_fallback_opt_out() -> str | None:
    """The setting that makes running without the kernels expected here, or None: then a failed
    build is an error (in the tests and `make test`), not a quiet ~7x slowdown."""
    if os.environ.get(ALLOW_FALLBACK_ENV, "") == "1":
        return f"{ALLOW_FALLBACK_ENV}=1"
    if os.environ.get(KERNELS_ENV, "") == "torch":
        return f"{KERNELS_ENV}=torch"
    return None


def compute_path(device: torch.device | str = "cpu") -> str:
    """Which code computes a model on `device` in this process, for stats and metrics: the C++
    kernels and the ISA of their build, or PyTorch and why."""
    device_type = torch.device(device).type
    if device_type != "cpu":
        return f"pytorch (device {device_type}: the C++ kernels are CPU only)"
    if _is_loaded:
        return f"cpu-kernels ({_isa})"
    if os.environ.get(KERNELS_ENV, "") == "torch":
        return f"pytorch ({KERNELS_ENV}=torch)"
    if _build_error is not None:
        return f"pytorch fallback (kernel build failed: {_build_error})"
    return "pytorch (the C++ kernels were not loaded)"


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
    global _is_loaded, _tried, _isa, _build_error
    if _tried:
        return _is_loaded
    _tried = True
    if os.environ.get(KERNELS_ENV, "") == "torch":
        return False
    isa = machine_isa()
    if not hasattr(torch.ops.kvservice, "block_quant_linear"):
        start = time.perf_counter()
        log.info("loading the C++ CPU kernels (built once per machine, then cached by torch)")
        try:
            _build_and_load(isa)
        except Exception as e:  # no compiler, no ninja, a read-only cache...: the fallback still works
            first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            _build_error = first_line[:200]
            log.warning("C++ CPU kernels unavailable, using the ~7x slower PyTorch path: %s", _build_error)
            return False
        log.info("C++ CPU kernels (%s) ready in %.1f s", isa, time.perf_counter() - start)
    _isa = isa
    _is_loaded = True
    return True


def _build_and_load(isa: str) -> None:
    """Load the build keyed by this machine's ISA and these sources, building it first if it is
    not in torch's cache. The build compiles copies of the sources under its own directory, so its
    ninja file names no checkout: a checkout that resumes another's half-done build (same key, same
    sources) does not rebuild what that one compiled."""
    from torch.utils import cpp_extension

    files = kernel_files()
    cflags = compile_flags(isa)
    name = extension_name(isa, build_key(files, cflags, isa))
    build_dir = pathlib.Path(cpp_extension._get_build_directory(name, False))
    library = build_dir / f"{name}.so"
    with one_builder(build_dir):
        if library.exists():
            try:
                torch.ops.load_library(str(library))
                return
            except OSError as e:  # a link killed midway leaves a truncated library: build it again
                log.warning("rebuilding %s, which does not load: %s", library, e)
                library.unlink(missing_ok=True)
        sources = build_dir / "src"
        sources.mkdir(exist_ok=True)
        for path in files:
            data = path.read_bytes()
            copy = sources / path.name
            if not copy.exists() or copy.read_bytes() != data:  # an unchanged copy keeps its mtime
                copy.write_bytes(data)
        cpp_extension.load(
            name=name,
            sources=[str(sources / source) for source in _SOURCE_NAMES],
            extra_cflags=cflags,
            extra_ldflags=_LDFLAGS,
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )


def main() -> int:
    """Build and load the kernels, print the compute path; 1 when they are unavailable and no
    opt-out (`torch_fallback_opt_out`) says that is expected."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    is_loaded = load_cpu_kernels()
    path = compute_path("cpu")
    print(f"CPU compute path: {path}")
    if is_loaded:
        return 0
    opt_out = torch_fallback_opt_out()
    if opt_out is not None:
        print(f"running on the PyTorch path, as {opt_out} allows")
        return 0
    print(
        f"error: the C++ CPU kernels are unavailable here and servers would run ~7x slower ({path}).\n"
        "Install a C++ compiler and ninja, or set "
        f"{ALLOW_FALLBACK_ENV}=1 where the PyTorch path is expected.",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
