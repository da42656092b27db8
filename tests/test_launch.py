"""`kvservice launch`: the engine flags it takes reach every worker, and a bad one fails before any starts."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import pathlib
import signal
import sys

import aiohttp
import grpc
import pytest
import torch
from conftest import kill_all

from kvservice.client import launch
from kvservice.client.client import KVServiceClient
from kvservice.config import LAUNCH_STEP_TARGET_MS, SERVING_STEP_TARGET_MS
from kvservice.loading.model_files import load_model_config
from kvservice.model.kv_cache import KVCacheLayout
from kvservice.runtime.engine_args import engine_config
from kvservice.server import worker_server
from kvservice.server.proxy import server as proxy_server

KVSERVICE = str(pathlib.Path(sys.executable).with_name("kvservice"))


def _parse(add_arguments: object, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)  # type: ignore[operator]
    return parser.parse_args(list(argv))


def test_engine_flags_given_to_launch_are_every_workers_engine_config() -> None:
    args = _parse(
        launch.add_arguments,
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--block-size",
        "32",
        "--kv-cache-mib",
        "64",
        "--max-num-seqs",
        "8",
        "--max-num-batched-tokens",
        "512",
        "--seed",
        "7",
        "--num-blocks",
        "100",
        "--device",
        "cpu",
        "--kv-load-failure-policy",
        "fail",
        "--draft-model",
        "tiny",
        "--num-speculative-tokens",
        "2",
        "--",
        "--num-threads",
        "1",
    )
    argv = launch.worker_argv(args)
    assert argv[:4] == ["--dtype", "float32", "--max-model-len", "256"]
    assert argv[-2:] == ["--num-threads", "1"]  # the flags after '--' come last: they win
    worker = _parse(worker_server.add_arguments, "--role", "decode", *argv)
    assert worker.num_threads == 1
    # The prompt lane is a colocated worker's: a decode worker's config turns it off.
    assert worker_server.engine_config(worker) == dataclasses.replace(engine_config(args), prompt_lane=False)
    assert engine_config(args).max_model_len == 256 and engine_config(args).dtype == "float32"


def test_launch_passes_no_engine_flag_left_at_serves_default() -> None:
    """Only its own step target (the lease's cycle aims lower than `serve`'s steps)."""
    args = _parse(launch.add_arguments, "--num-decode", "2", "--no-kv-transfer-shm", "--", "--kv-staging-mib", "8")
    # (the shared-memory switch is launch's own)
    assert launch.worker_argv(args) == ["--step-target-ms", f"{LAUNCH_STEP_TARGET_MS}", "--kv-staging-mib", "8"]


@pytest.mark.parametrize(
    ("flags", "target_ms"),
    [([], LAUNCH_STEP_TARGET_MS), (["--step-target-ms", "80"], 80.0), (["--step-target-ms", "95"], 95.0)],
)
def test_launchs_step_target_reaches_every_worker(flags: list[str], target_ms: float) -> None:
    assert LAUNCH_STEP_TARGET_MS < SERVING_STEP_TARGET_MS
    args = _parse(launch.add_arguments, *flags)
    for role in ("prefill", "decode"):
        worker = _parse(worker_server.add_arguments, "--role", role, *launch.worker_argv(args))
        assert worker_server.engine_config(worker).step_target_ms == target_ms


def test_routing_flags_given_to_launch_reach_the_proxy() -> None:
    args = _parse(
        launch.add_arguments, "--model", "smollm2", "--routing", "round-robin", "--max-local-prefill-tokens", "64"
    )
    proxy = _parse(proxy_server.add_arguments, "--decode", "127.0.0.1:1", *launch.proxy_argv(args))
    assert (proxy.routing, proxy.max_local_prefill_tokens, proxy.model) == ("round-robin", 64, "smollm2")
    defaults = _parse(
        proxy_server.add_arguments, "--decode", "127.0.0.1:1", *launch.proxy_argv(_parse(launch.add_arguments))
    )
    assert (defaults.routing, defaults.max_local_prefill_tokens) == ("kv-aware", 0)
    with pytest.raises(SystemExit):
        _parse(launch.add_arguments, "--max-local-prefill-tokens", "-1")


def test_launch_rejects_a_bad_engine_flag_before_starting_workers(capsys: pytest.CaptureFixture[str]) -> None:
    assert launch.main(_parse(launch.add_arguments, "--block-size", "24")) == 2
    assert "block_size must be a power of two, got 24" in capsys.readouterr().err


def test_worker_peer_names_given_to_launch_reach_every_worker() -> None:
    args = _parse(
        launch.add_arguments, "--worker-peer-names", "kvservice", "proxy.internal", "--", "--num-threads", "1"
    )
    worker = _parse(worker_server.add_arguments, "--role", "prefill", *launch.worker_argv(args))
    assert worker.worker_peer_names == ["kvservice", "proxy.internal"]


@pytest.mark.parametrize(
    ("flags", "is_on"), [([], True), (["--kv-transfer-shm"], True), (["--no-kv-transfer-shm"], False)]
)
def test_kv_transfer_shm_is_launchs_default_and_reaches_the_workers(flags: list[str], is_on: bool) -> None:
    """Every launched worker runs on this host: KV through shared memory unless turned off."""
    args = _parse(launch.add_arguments, *flags)
    worker = _parse(worker_server.add_arguments, "--role", "decode", *launch.worker_argv(args))
    assert worker.kv_transfer_shm is is_on


def test_launch_refuses_worker_peer_names_without_mutual_tls(capsys: pytest.CaptureFixture[str]) -> None:
    assert launch.main(_parse(launch.add_arguments, "--worker-peer-names", "kvservice")) == 2
    assert "--worker-peer-names needs mutual TLS" in capsys.readouterr().err


def test_launch_refuses_an_unknown_dtype() -> None:
    with pytest.raises(SystemExit):
        _parse(launch.add_arguments, "--dtype", "float8")


@pytest.mark.slow
async def test_launched_workers_run_with_the_engine_flags_given_to_launch() -> None:
    block_size, kv_cache_mib, max_model_len = 32, 1, 64
    process = await asyncio.create_subprocess_exec(
        KVSERVICE,
        "launch",
        "--port",
        "0",
        "--http-port",
        "0",
        "--dtype",
        "float16",
        "--block-size",
        str(block_size),
        "--kv-cache-mib",
        str(kv_cache_mib),
        "--max-model-len",
        str(max_model_len),
        "--",
        "--num-threads",
        "1",
        stdout=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert process.stdout is not None
        lines = []
        while not lines or not lines[-1].startswith("Ctrl-C"):  # the last line of launch's banner
            line = (await asyncio.wait_for(process.stdout.readline(), 180)).decode()
            assert line, f"launch exited: {lines}"
            lines.append(line.strip())
        address = lines[0].split("proxy listening on ")[1]
        http_address = next(line.split("http ")[1].rstrip(")") for line in lines if line.startswith("proxy"))
        async with KVServiceClient(address) as client:
            stats = await client.stats()
            # float16 KV, 32-token blocks and 1 MiB: the block count only these flags give.
            layout = KVCacheLayout.for_model(load_model_config("tiny"), block_size, torch.float16)
            expected = (kv_cache_mib << 20) // layout.bytes_per_block
            assert [w.stats.num_blocks_total for w in stats.workers] == [expected, expected]
            with pytest.raises(grpc.aio.AioRpcError) as error:
                async for _ in client.generate(list(range(1, max_model_len + 1)), max_tokens=1):
                    pass
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"maximum length is {max_model_len}" in (error.value.details() or "")
        async with aiohttp.ClientSession() as session, session.get(f"http://{http_address}/v1/models") as response:
            assert (await response.json())["data"][0]["max_model_len"] == max_model_len
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 60) == 0
    finally:
        if process.returncode is None:  # a failed check: launch still stops its workers on SIGTERM
            process.send_signal(signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(process.wait(), 60)
        await kill_all([process])
