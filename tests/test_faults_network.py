"""A network fault between real processes: a prefill worker in one network namespace, the
decode worker and the proxy in another, joined by a veth pair that the test throttles
and then cuts mid-transfer (tests/netns.py). Skipped, with the reason, where network
namespaces cannot be made."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from conftest import kill_all, tiny_greedy
from hf_models import random_prompts
from netns import NetnsPair, unavailable_reason

from kvservice.runtime.process_env import WORKER_ENV

pytestmark = [pytest.mark.slow]

BASE_WORKER_ARGS = ("--num-threads", "1", "--kv-cache-mib", "16")
FAST_PROXY_ARGS = ("--health-interval", "0.2", "--grace-period", "20")
RPC_TIMEOUT = 60.0  # the client deadline: a request that hangs fails the test


# ---------------------------------------------------------------- 6. network cut and throttle

# Runs inside the decode namespace (the test process stays in the root one): sends the
# prompts through the proxy at once, prints "first" at the first token, then one JSON line.
_NETNS_CLIENT = r"""
import asyncio, json, sys
import grpc
from kvservice.client.client import KVServiceClient
job = json.loads(sys.stdin.readline())
async def main():
    async with KVServiceClient(job["address"]) as client:
        await client.wait_until_serving(60)
        print("serving", flush=True)
        sys.stdin.readline()  # go
        announced = False
        async def one(prompt):
            nonlocal announced
            tokens = []
            try:
                async for chunk in client.generate(
                    prompt, timeout=job["timeout"], max_tokens=job["max_tokens"], temperature=0, ignore_eos=True
                ):
                    tokens += chunk.token_ids
                    if tokens and not announced:
                        announced = True
                        print("first", flush=True)
            except grpc.aio.AioRpcError as e:
                return e.code().name
            return tokens
        print(json.dumps(await asyncio.gather(*(one(p) for p in job["prompts"]))), flush=True)
asyncio.run(main())
"""


class NetnsDeployment:
    """A prefill worker in one namespace of `pair`, the decode worker and the proxy in the other;
    `close` kills every process it started."""

    def __init__(self, pair: NetnsPair) -> None:
        self.pair = pair
        self.processes: list[asyncio.subprocess.Process] = []
        self.env = {**os.environ, **WORKER_ENV}
        self.prefill = self.decode = self.proxy = ""  # their addresses, once started

    async def start(self) -> None:
        pair = self.pair
        worker = ["-m", "kvservice", "serve", "--model", "tiny", *BASE_WORKER_ARGS, "--port", "0"]
        self.prefill, self.decode = await asyncio.gather(
            _ready(await self.spawn(pair.prefill_ns, *worker, "--role", "prefill", "--host", pair.prefill_ip)),
            _ready(
                await self.spawn(
                    pair.decode_ns, *worker, "--role", "decode", "--host", pair.decode_ip, "--kv-transfer-timeout", "10"
                )
            ),
        )
        proxy = ["-m", "kvservice", "proxy", "--port", "0", *FAST_PROXY_ARGS]
        self.proxy = await _ready(
            await self.spawn(pair.decode_ns, *proxy, "--prefill", self.prefill, "--decode", self.decode)
        )

    async def spawn(self, ns: str, *args: str, stdin: int | None = None) -> asyncio.subprocess.Process:
        """`python ARGS` in namespace `ns`."""
        process = await asyncio.create_subprocess_exec(
            *self.pair.prefix(ns),
            sys.executable,
            *args,
            stdin=stdin,
            stdout=asyncio.subprocess.PIPE,
            env=self.env,
            start_new_session=True,
        )
        self.processes.append(process)
        return process

    async def run_client(
        self, prompts: list[list[int]], max_tokens: int, on_first: Callable[[], None] | None = None
    ) -> list[object]:
        """The prompts sent at once through the proxy from the decode namespace; each one's
        tokens or status code name. `on_first`: called at the first token."""
        client = await self.spawn(self.pair.decode_ns, "-c", _NETNS_CLIENT, stdin=asyncio.subprocess.PIPE)
        assert client.stdin is not None and client.stdout is not None
        job = {"address": self.proxy, "prompts": prompts, "max_tokens": max_tokens, "timeout": RPC_TIMEOUT}
        client.stdin.write((json.dumps(job) + "\n").encode())
        await client.stdin.drain()
        assert (await asyncio.wait_for(client.stdout.readline(), 60)).strip() == b"serving"
        client.stdin.write(b"go\n")
        await client.stdin.drain()
        line = await asyncio.wait_for(client.stdout.readline(), RPC_TIMEOUT + 10)
        if line.strip() == b"first":
            if on_first is not None:
                on_first()
            line = await asyncio.wait_for(client.stdout.readline(), RPC_TIMEOUT + 10)
        assert await asyncio.wait_for(client.wait(), 10) == 0
        return json.loads(line)

    async def stats_in(self, role: str) -> dict[str, Any]:
        """A worker's Stats, read from inside its own namespace (`kvservice stats --json`)."""
        pair = self.pair
        ns, address = (pair.prefill_ns, self.prefill) if role == "prefill" else (pair.decode_ns, self.decode)
        reader = await self.spawn(ns, "-m", "kvservice", "stats", "--target", address, "--json")
        assert reader.stdout is not None
        out = await asyncio.wait_for(reader.stdout.read(), 60)
        assert await reader.wait() == 0
        return json.loads(out.decode().strip().splitlines()[-1])

    async def close(self) -> None:
        await kill_all(self.processes)
        self.pair.close()


async def _ready(process: asyncio.subprocess.Process) -> str:
    """The address on the process's ready line."""
    assert process.stdout is not None
    line = (await asyncio.wait_for(process.stdout.readline(), 60)).decode()
    match = re.search(r"listening on (\S+:\d+)", line)
    assert match is not None, f"did not start: {line!r}"
    return match.group(1)


@contextlib.asynccontextmanager
async def netns_deployment() -> AsyncIterator[NetnsDeployment]:
    """A started NetnsDeployment (skipped where namespaces cannot be made), closed at the end."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    deployment = NetnsDeployment(NetnsPair.create())
    try:
        await deployment.start()
        yield deployment
    finally:
        await deployment.close()


async def test_network_throttled_then_cut_mid_transfer_loses_no_output() -> None:
    prompts = random_prompts([300] * 6, seed=8, vocab_size=256)  # 300 tokens: ~600 KiB of KV each on the wire
    max_tokens = 8
    expected = tiny_greedy(prompts, max_tokens)
    async with netns_deployment() as deployment:
        pair = deployment.pair
        pair.throttle("10mbit")
        start = time.monotonic()
        assert await deployment.run_client(prompts, max_tokens) == expected
        throttled = time.monotonic() - start
        print(f"netns: 6 x 300-token prompts through a 10 mbit link in {throttled:.1f} s")
        # Cut the link at the first token: the other transfers are still on the (slow) wire.
        results = await deployment.run_client(prompts, max_tokens, lambda: pair.set_link(False))
        for result, want in zip(results, expected):
            assert result == want or result in ("UNAVAILABLE", "DEADLINE_EXCEEDED"), result
        assert sum(r == w for r, w in zip(results, expected)) > 0
        # Link back: every block and staging byte on both sides comes back (broken pulls end
        # by keepalive or the transfer timeout; never-pulled staging by its lease).
        pair.set_link(True)
        deadline = time.monotonic() + 60
        while True:
            prefill_stats, decode_stats = await deployment.stats_in("prefill"), await deployment.stats_in("decode")
            staged = int(prefill_stats["kv_sending"].get("staging_bytes_in_use", 0))
            idle = all(int(s["num_blocks_free"]) == int(s["num_blocks_total"]) for s in (prefill_stats, decode_stats))
            if idle and staged == 0:
                break
            assert time.monotonic() < deadline, (prefill_stats, decode_stats)
            await asyncio.sleep(1.0)  # the lease and the keepalive run on their own clocks
