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
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest
import pytest_asyncio
from conftest import local_cluster
from grpc_reflection.v1alpha import reflection_pb2_grpc

from kvservice.client.client import KVServiceClient
from kvservice.client.cluster import LocalCluster
from kvservice.connector.kv_transfer_service import PULL_KV_METHOD
from kvservice.process_env import WORKER_ENV
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


async def _drain(call: AsyncIterator[object]) -> None:
    async for _ in call:
        pass


def worker_calls(channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...] | None) -> dict[str, Callable[[], Awaitable[object]]]:
    """Every RPC a worker serves besides health, each with harmless arguments."""
    worker = pb_grpc.WorkerStub(channel)
    request = pb.GenerateRequest(request_id="hostile-1", token_ids=pb.TokenIds(ids=[1, 2, 3]), sampling_params=pb.SamplingParams(max_tokens=2))
    pull = channel.unary_stream(PULL_KV_METHOD, request_serializer=pb.PullKVRequest.SerializeToString, response_deserializer=bytes)
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    return {
        "Prefill": lambda: worker.Prefill(pb.PrefillRequest(request=request, transfer_token=b"t" * 32), timeout=10, metadata=metadata),
        "Decode": lambda: _drain(worker.Decode(
            pb.DecodeRequest(request=request, kv_transfer_params=pb.KVTransferParams(remote_address="unix:/tmp/x", transfer_token=b"t")),
            timeout=10, metadata=metadata,
        )),
        "ReleaseKV": lambda: worker.ReleaseKV(pb.ReleaseKVRequest(request_id="victim", transfer_token=b"t"), timeout=10, metadata=metadata),
        "Stats": lambda: worker.Stats(pb.StatsRequest(), timeout=10, metadata=metadata),
        "PullKV": lambda: _drain(pull(pb.PullKVRequest(request_id="victim", transfer_token=b"t"), timeout=10, metadata=metadata)),
        # No request message: the server may refuse before the client could write one, and a
        # write racing the refusal fails on the client as INTERNAL. Served, this call ends OK.
        "Reflection": lambda: _drain(reflection.ServerReflectionInfo(iter([]), timeout=10, metadata=metadata)),
    }


@pytest.mark.parametrize("token", [None, "wrong", TOKEN + "x"], ids=["none", "wrong", "longer"])
async def test_every_worker_rpc_but_health_needs_the_token(cluster: LocalCluster, token: str | None) -> None:
    served = {"prefill": {"Prefill", "ReleaseKV", "Stats", "PullKV", "Reflection"}, "decode": {"Decode", "Stats", "Reflection"}}
    for role, address in [("prefill", cluster.prefill_addresses[0]), ("decode", cluster.decode_addresses[0])]:
        async with grpc.aio.insecure_channel(address) as channel:
            calls = worker_calls(channel, _metadata(token))
            for name in served[role]:
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


async def _decode_worker(*args: str) -> tuple[str, asyncio.subprocess.Process]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvservice", "serve", "--role", "decode", "--model", "tiny", "--port", "0",
        "--num-blocks", "32", "--num-threads", "1", "--grace-period", "1", *args,
        stdout=asyncio.subprocess.PIPE, env={**os.environ, **WORKER_ENV},
    )
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
async def test_decode_dials_only_its_kv_peers(remote_address: str, code: grpc.StatusCode) -> None:
    address, process = await _decode_worker("--kv-peers", "127.0.0.1:1")
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            request = pb.DecodeRequest(
                request=pb.GenerateRequest(request_id="r1", token_ids=pb.TokenIds(ids=[1, 2, 3]), sampling_params=pb.SamplingParams(max_tokens=2)),
                kv_transfer_params=pb.KVTransferParams(remote_address=remote_address, transfer_token=b"t" * 32),
            )
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await _drain(pb_grpc.WorkerStub(channel).Decode(request, timeout=30))
            assert refused.value.code() is code
            assert "remote_address" in (refused.value.details() or "")
    finally:
        process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(process.wait(), 30)
