"""`kvservice serve` as a process: a worker whose engine dies stops serving and exits non-zero."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvservice.client.client import KVServiceClient
from kvservice.runtime.process_env import WORKER_ENV

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]

# A worker whose engine step raises once a request with this id is scheduled: the fault
# is injected in the child process only, the server code runs unchanged.
FAULTY_WORKER = """
import sys
from kvservice.engine.engine import LLMEngine
step = LLMEngine.step
def failing_step(self):
    if "boom" in self.core.scheduler.requests:
        raise RuntimeError("injected step failure")
    return step(self)
LLMEngine.step = failing_step
from kvservice.cli import main
sys.exit(main(sys.argv[1:]))
"""
DEADLINE_S = 30.0


@contextlib.asynccontextmanager
async def faulty_worker() -> AsyncIterator[tuple[str, asyncio.subprocess.Process]]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        FAULTY_WORKER,
        "serve",
        "--role",
        "both",
        "--model",
        "tiny",
        "--port",
        "0",
        "--num-blocks",
        "32",
        "--num-threads",
        "1",
        "--grace-period",
        "2",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **WORKER_ENV},
    )
    assert process.stdout is not None
    try:
        line = (await asyncio.wait_for(process.stdout.readline(), 60)).decode()
        match = re.search(r"listening on (\S+:\d+)", line)
        assert match is not None, f"worker did not start: {line!r}"
        yield match.group(1), process
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGKILL)
        await process.communicate()


async def test_engine_failure_fails_requests_turns_not_serving_and_exits_non_zero() -> None:
    async with faulty_worker() as (address, process):
        async with KVServiceClient(address) as client:
            completion = await client.complete([1, 2, 3], max_tokens=2, timeout=DEADLINE_S)
            assert len(completion.token_ids) == 2
            async with grpc.aio.insecure_channel(address) as channel:
                watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
                assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING

                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await client.complete([1, 2, 3], max_tokens=4, request_id="boom", timeout=DEADLINE_S)
                assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "injected step failure" in (failed.value.details() or "")

                reply = await asyncio.wait_for(watch.read(), DEADLINE_S)
                assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
                watch.cancel()
        assert await asyncio.wait_for(process.wait(), DEADLINE_S) == 1
