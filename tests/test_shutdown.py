"""Graceful shutdown across processes: what a stopping server still serves, and what it refuses.

- A prefill worker given SIGTERM still serves pulls of the transfers it staged (else the
  decode side recomputes), refuses new prefills, and exits once they are pulled.
- A proxy given SIGTERM turns its HTTP /health to 503 and refuses new requests at once,
  while in-flight ones finish, within one grace period shared with its gRPC drain.
- `LocalCluster` (`kvservice launch`) gives every child the grace period it waits for.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import signal
import sys
import time

import aiohttp
import grpc
import pytest
from conftest import local_cluster, tiny_pull_request
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvservice.connector import wire
from kvservice.connector.kv_transfer_service import PULL_KV_METHOD
from kvservice.runtime.grpc_options import GRPC_OPTIONS
from kvservice.runtime.process_env import WORKER_ENV
from kvservice.v1 import kvservice_pb2 as pb
from kvservice.v1 import kvservice_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.slow, pytest.mark.asyncio, pytest.mark.timeout(180)]

GRACE_S = 30.0  # long: every wait below must end well before it
BLOCK_SIZE = 16


async def _not_serving(channel: grpc.aio.Channel, watch: grpc.aio.UnaryStreamCall) -> None:
    while (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING:
        pass


async def test_a_stopping_prefill_worker_serves_pulls_of_what_it_staged() -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvservice",
        "serve",
        "--role",
        "prefill",
        "--model",
        "tiny",
        "--port",
        "0",
        "--num-blocks",
        "64",
        "--block-size",
        str(BLOCK_SIZE),
        "--num-threads",
        "1",
        "--grace-period",
        str(GRACE_S),
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, **WORKER_ENV},
    )
    assert process.stdout is not None
    try:
        line = (await asyncio.wait_for(process.stdout.readline(), 60)).decode()
        address = re.search(r"listening on (\S+:\d+)", line).group(1)  # type: ignore[union-attr]
        async with grpc.aio.insecure_channel(address, options=GRPC_OPTIONS) as channel:
            worker = pb_grpc.WorkerStub(channel)
            token = secrets.token_bytes(32)
            staged = pb.GenerateRequest(
                request_id="staged",
                token_ids=pb.TokenIds(ids=list(range(1, 40))),
                sampling_params=pb.SamplingParams(max_tokens=4),
            )
            await worker.Prefill(pb.PrefillRequest(request=staged, transfer_token=token), timeout=60)

            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            process.send_signal(signal.SIGTERM)
            await asyncio.wait_for(_not_serving(channel, watch), 30)
            watch.cancel()

            late = pb.GenerateRequest(
                request_id="late", token_ids=pb.TokenIds(ids=[1, 2, 3]), sampling_params=pb.SamplingParams(max_tokens=4)
            )
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await worker.Prefill(pb.PrefillRequest(request=late, transfer_token=token), timeout=30)
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE

            pull = channel.unary_stream(
                PULL_KV_METHOD, request_serializer=pb.PullKVRequest.SerializeToString, response_deserializer=None
            )
            frames = [frame async for frame in pull(tiny_pull_request(BLOCK_SIZE, "staged", token), timeout=30)]
        assert wire.decode_frame(frames[-1]).done is not None, "the pull ended without its done frame"
        started = time.monotonic()
        assert await asyncio.wait_for(process.wait(), GRACE_S) == 0
        assert time.monotonic() - started < GRACE_S / 2, "it waited out its grace period though nothing was left"
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_a_stopping_proxy_refuses_new_http_requests_and_finishes_in_flight_ones() -> None:
    async with local_cluster(
        "tiny",
        worker_args=["--num-blocks", "512", "--num-threads", "1"],
        proxy_args=["--http-port", "0"],
        grace_period=GRACE_S,
    ) as cluster:
        proxy = cluster.child("proxy")
        for child in cluster.children:  # the launcher gives each child the grace it waits for
            cmdline = open(f"/proc/{child.process.pid}/cmdline", "rb").read().split(b"\0")
            assert cmdline[len(cmdline) - 1 - cmdline[::-1].index(b"--grace-period") + 1] == f"{GRACE_S:g}".encode(), (
                child.name
            )
        base = f"http://{proxy.http_address}"
        # A long gRPC stream keeps the gRPC side draining for a while.
        grpc_request = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[4, 5, 6]),
            sampling_params=pb.SamplingParams(temperature=0, max_tokens=1200, ignore_eos=True),
        )
        async with grpc.aio.insecure_channel(cluster.address) as channel:
            grpc_stream = pb_grpc.GenerationStub(channel).Generate(grpc_request, timeout=120)
            await grpc_stream.read()  # it has started
            async with aiohttp.ClientSession() as session:
                body = {
                    "model": "kvservice",
                    "prompt": [1, 2, 3],
                    "max_tokens": 200,
                    "ignore_eos": True,
                    "temperature": 0,
                    "stream": True,
                }
                async with session.post(f"{base}/v1/completions", json=body) as in_flight:
                    assert in_flight.status == 200
                    await in_flight.content.readline()  # the stream has started
                    proxy.process.send_signal(signal.SIGTERM)
                    signalled = time.monotonic()
                    while True:  # a readiness wait on another connection, with a deadline
                        try:
                            async with aiohttp.ClientSession() as probe:
                                async with probe.get(f"{base}/health") as health:
                                    if health.status != 200:
                                        break
                        except aiohttp.ClientConnectionError:
                            break  # no longer accepting at all
                        assert time.monotonic() - signalled < 3, "/health still said ok while the proxy drained"
                        await asyncio.sleep(0.05)
                    events = [json.loads(line[6:]) async for line in in_flight.content if line.startswith(b"data: {")]
            assert events[-1]["choices"][0]["finish_reason"] == "length"
            last = response = await grpc_stream.read()
            while response is not grpc.aio.EOF:
                last, response = response, await grpc_stream.read()
            assert last.finish_reason == pb.FINISH_REASON_LENGTH  # drained, not cut
        assert await asyncio.wait_for(proxy.process.wait(), GRACE_S) == 0
