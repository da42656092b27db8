"""The bearer token on every RPC but health, workers included, across processes.

A 1P1D cluster on the tiny model where every process has `--auth-token`: a caller that
reaches a worker without the token gets UNAUTHENTICATED from everything but health,
while the proxy (to both workers) and the decode worker (to the prefill worker, for
its KV pull) send it and the request takes the disaggregated path.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio
from conftest import WORKER_RPCS, drain, local_cluster, worker_calls

from kvservice.client.client import KVServiceClient
from kvservice.client.cluster import LocalCluster
from kvservice.runtime.process_env import WORKER_ENV
from kvservice.v1 import kvservice_pb2 as pb
from kvservice.v1 import kvservice_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]

TOKEN = "worker-s3cret"
WORKER_ARGS = ["--num-blocks", "64", "--num-threads", "1", "--grace-period", "2", "--auth-token", TOKEN]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster() -> AsyncIterator[LocalCluster]:
    async with local_cluster("tiny", worker_args=WORKER_ARGS, proxy_args=["--auth-token", TOKEN], grace_period=2) as c:
        yield c


def _metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {token}"),) if token is not None else None


@pytest.mark.parametrize("token", [None, "wrong", TOKEN + "x"], ids=["none", "wrong", "longer"])
async def test_every_worker_rpc_but_health_needs_the_token(cluster: LocalCluster, token: str | None) -> None:
    for role, address in [("prefill", cluster.prefill_addresses[0]), ("decode", cluster.decode_addresses[0])]:
        async with grpc.aio.insecure_channel(address) as channel:
            calls = worker_calls(channel, _metadata(token))
            for name in WORKER_RPCS[role]:
                call = calls[name]
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call()
                assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED, (address, name, refused.value)
        async with KVServiceClient(address) as client:
            assert await client.health() == "SERVING"  # probes carry no token


async def test_with_the_token_the_request_is_disaggregated(cluster: LocalCluster) -> None:
    async with KVServiceClient(cluster.address, bearer_token=TOKEN) as client:
        completion = await client.complete([5, 6, 7, 8, 9], timeout=60, max_tokens=4, temperature=0, ignore_eos=True)
    assert len(completion.token_ids) == 4
    async with KVServiceClient(cluster.decode_addresses[0], bearer_token=TOKEN) as decode:
        stats = await decode.stats()
    # The KV came over the pull (which carries the token), not from a silent recompute.
    assert stats.kv_receiving.num_transfers >= 1
    assert stats.kv_receiving.num_failed_transfers == 0


async def test_a_launched_decode_worker_dials_only_the_clusters_prefill_workers(cluster: LocalCluster) -> None:
    """LocalCluster (and so `kvservice launch`) gives decode workers the prefill addresses as --kv-peers."""
    request = pb.DecodeRequest(
        request=pb.GenerateRequest(
            request_id="r-peer", token_ids=pb.TokenIds(ids=[1, 2, 3]), sampling_params=pb.SamplingParams(max_tokens=2)
        ),
        kv_transfer_params=pb.KVTransferParams(remote_address="127.0.0.1:1", transfer_token=b"t" * 32),
    )
    async with grpc.aio.insecure_channel(cluster.decode_addresses[0]) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await drain(pb_grpc.WorkerStub(channel).Decode(request, timeout=30, metadata=_metadata(TOKEN)))
    assert refused.value.code() is grpc.StatusCode.PERMISSION_DENIED
    assert "--kv-peers" in (refused.value.details() or "")


async def _start_decode_worker(*args: str, stdin: bytes | None = None) -> asyncio.subprocess.Process:
    """A decode worker on the tiny model; `stdin`: written to its stdin, which is then closed."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvservice",
        "serve",
        "--role",
        "decode",
        "--model",
        "tiny",
        "--port",
        "0",
        "--num-blocks",
        "32",
        "--num-threads",
        "1",
        "--grace-period",
        "1",
        *args,
        stdin=asyncio.subprocess.PIPE if stdin is not None else None,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE if stdin is not None else None,
        env={**os.environ, **WORKER_ENV},
    )
    if stdin is not None:
        assert process.stdin is not None
        process.stdin.write(stdin)
        process.stdin.close()
    return process


async def _decode_worker(*args: str, stdin: bytes | None = None) -> tuple[str, asyncio.subprocess.Process]:
    process = await _start_decode_worker(*args, stdin=stdin)
    assert process.stdout is not None
    line = (await asyncio.wait_for(process.stdout.readline(), 60)).decode()
    match = re.search(r"listening on (\S+:\d+)", line)
    if match is None:
        process.kill()
        await process.wait()
        raise AssertionError(f"decode worker did not start: {line!r}")
    return match.group(1), process


@pytest.mark.parametrize(
    ("remote_address", "code"),
    [
        ("unix:/tmp/kvservice.sock", grpc.StatusCode.INVALID_ARGUMENT),
        ("unix:1234", grpc.StatusCode.INVALID_ARGUMENT),
        ("dns:///evil.example:443", grpc.StatusCode.INVALID_ARGUMENT),
        ("127.0.0.1:2", grpc.StatusCode.PERMISSION_DENIED),
    ],
)
@pytest.mark.parametrize("given", ["argv", "stdin"])
async def test_decode_dials_only_its_kv_peers(remote_address: str, code: grpc.StatusCode, given: str) -> None:
    if given == "argv":
        address, process = await _decode_worker("--kv-peers", "127.0.0.1:1")
    else:  # as `kvservice launch` starts it: the line comes once the prefill workers are ready
        address, process = await _decode_worker("--kv-peers", "-", stdin=b"127.0.0.1:1 127.0.0.1:3\n")
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            request = pb.DecodeRequest(
                request=pb.GenerateRequest(
                    request_id="r1",
                    token_ids=pb.TokenIds(ids=[1, 2, 3]),
                    sampling_params=pb.SamplingParams(max_tokens=2),
                ),
                kv_transfer_params=pb.KVTransferParams(remote_address=remote_address, transfer_token=b"t" * 32),
            )
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await drain(pb_grpc.WorkerStub(channel).Decode(request, timeout=30))
            assert refused.value.code() is code
            assert "remote_address" in (refused.value.details() or "")
    finally:
        process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(process.wait(), 30)


async def test_a_decode_worker_whose_stdin_ends_before_its_kv_peers_exits_with_the_reason() -> None:
    process = await _start_decode_worker("--kv-peers", "-", stdin=b"")
    _, stderr = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 2
    assert b"--kv-peers -: stdin ended before a line of prefill addresses" in stderr
