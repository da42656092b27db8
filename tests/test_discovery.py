"""Workers come and go: DNS discovery and the proxy's membership (server/proxy/discovery.py).

Unit tests drive `Discovery` over a `WorkerPool` with a resolver the test controls. The
end-to-end test runs workers and the proxy in a network namespace of its own, whose
`/etc/hosts` (`/etc/netns/NS/hosts`, which `ip netns exec` mounts) is the DNS the proxy
resolves: decode workers are added to and removed from the name while requests stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable

import pytest
from conftest import is_idle, tiny_greedy, wait_for, worker_stats
from hf_models import random_prompts

from kvservice.client.client import KVServiceClient
from kvservice.server.proxy.discovery import Discovery, DNSName, resolve
from kvservice.server.proxy.worker_pool import WorkerPool


def test_dns_names_are_name_and_port() -> None:
    assert DNSName.parse("decode.default.svc:8000") == DNSName("decode.default.svc", 8000)
    for bad in ("decode", "decode:", ":8000", "decode:http", "decode:0", "decode:70000"):
        with pytest.raises(ValueError, match="NAME:PORT"):
            DNSName.parse(bad)


async def test_resolve_gives_one_address_per_record() -> None:
    assert "127.0.0.1:9000" in await resolve(DNSName("localhost", 9000))


async def test_discovery_adds_joins_retires_and_drops_workers() -> None:
    answers: dict[str, set[str] | OSError] = {"pool": {"10.0.0.1:1", "10.0.0.2:1"}}

    async def resolver(name: DNSName) -> set[str]:
        answer = answers[name.host]
        if isinstance(answer, OSError):
            raise answer
        return set(answer)

    pool = WorkerPool(["10.0.0.9:1"], role="decode")  # a static member: stays whatever DNS says
    discovery = Discovery(pool, [DNSName("pool", 1)], interval=1.0, resolver=resolver)
    try:
        await discovery.refresh()
        states = {w.address: w.state for w in pool.workers}
        assert states == {"10.0.0.9:1": "not_serving", "10.0.0.1:1": "joining", "10.0.0.2:1": "joining"}
        for worker in pool.workers:
            worker.is_healthy = True  # what the health watch sets on SERVING
        pool.needs_snapshot = True
        await pool.update_membership()
        assert {w.address for w in pool.healthy} == {"10.0.0.9:1"}, "joined before the KV snapshot"
        for worker in pool.workers:
            worker.kv_index.is_synced = True
        await pool.update_membership()
        assert {w.address for w in pool.healthy} == {"10.0.0.9:1", "10.0.0.1:1", "10.0.0.2:1"}
        assert pool.num_joins == 2

        answers["pool"] = OSError("temporary failure in name resolution")
        await discovery.refresh()
        assert len(pool.healthy) == 3, "a failed lookup must not empty the pool"

        answers["pool"] = {"10.0.0.2:1"}
        busy = next(w for w in pool.workers if w.address == "10.0.0.1:1")
        with pool.using(busy):
            await discovery.refresh()
            await pool.update_membership()
            assert busy.state == "leaving" and busy not in pool.healthy and busy in pool.workers
        await pool.update_membership()
        assert busy not in pool.workers and pool.num_leaves == 1
        assert pool.num_in_state() == {"serving": 2}
    finally:
        await pool.close()


# ---------------------------------------------------------------- end to end, in a namespace


PORT = 9000  # every worker's port: each has an address of its own in the namespace
NUM_REQUESTS = 200
CONCURRENCY = 8
MAX_TOKENS = 24
DISCOVERY_INTERVAL_S = 1.0


class Namespace:
    """A network namespace joined to this one by a veth pair, with addresses .2-.9 of a /24
    inside and its own /etc/hosts; `close` deletes it (the veth pair goes with it)."""

    def __init__(self) -> None:
        n = os.getpid() % 100000
        self.name = f"kvm{n}"
        self.subnet = f"10.201.{n % 250}"
        self.hosts = pathlib.Path("/etc/netns") / self.name / "hosts"

    def ip(self, host: int) -> str:
        return f"{self.subnet}.{host}"

    def create(self) -> None:
        outside, inside = f"{self.name}h", f"{self.name}c"
        self._run("ip", "netns", "add", self.name)
        self._run("ip", "link", "add", outside, "type", "veth", "peer", "name", inside, "netns", self.name)
        self._run("ip", "addr", "add", f"{self.ip(1)}/24", "dev", outside)
        self._run("ip", "link", "set", outside, "up")
        for host in range(2, 10):
            self._run(*self.prefix(), "ip", "addr", "add", f"{self.ip(host)}/24", "dev", inside)
        self._run(*self.prefix(), "ip", "link", "set", inside, "up")
        self._run(*self.prefix(), "ip", "link", "set", "lo", "up")
        self.hosts.parent.mkdir(parents=True, exist_ok=True)
        self.set_names({})

    def set_names(self, names: dict[str, list[str]]) -> None:
        """The namespace's DNS: each name -> its addresses (rewritten in place: the mount follows the inode)."""
        lines = ["127.0.0.1 localhost"] + [f"{ip} {name}" for name, ips in names.items() for ip in ips]
        with open(self.hosts, "w") as f:
            f.write("\n".join(lines) + "\n")

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def close(self) -> None:
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
        shutil.rmtree(self.hosts.parent, ignore_errors=True)

    @staticmethod
    def _run(*cmd: str) -> None:
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {result.stderr.strip()}")


@contextlib.asynccontextmanager
async def namespace() -> AsyncIterator[tuple[Namespace, list[asyncio.subprocess.Process]]]:
    from netns import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    ns = Namespace()
    processes: list[asyncio.subprocess.Process] = []
    try:
        ns.create()
        yield ns, processes
    finally:
        for process in processes:
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                await process.wait()
        ns.close()


async def spawn(ns: Namespace, processes: list[asyncio.subprocess.Process], *args: str) -> str:
    """Start `python -m kvservice ARGS` inside the namespace; its address once it listens."""
    from kvservice.runtime.process_env import WORKER_ENV

    process = await asyncio.create_subprocess_exec(
        *ns.prefix(),
        sys.executable,
        "-m",
        "kvservice",
        *args,
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, **WORKER_ENV},
        start_new_session=True,
    )
    processes.append(process)
    assert process.stdout is not None
    line = (await asyncio.wait_for(process.stdout.readline(), 90)).decode()
    match = re.search(r"listening on (\S+:\d+)", line)
    assert match is not None, f"did not start: {line!r}"
    return match.group(1)


def worker(ns: Namespace, processes: list[asyncio.subprocess.Process], role: str, host: int) -> asyncio.Task[str]:
    args = (
        "serve",
        "--role",
        role,
        "--model",
        "tiny",
        "--num-blocks",
        "256",
        "--num-threads",
        "1",
        "--grace-period",
        "10",
        "--host",
        ns.ip(host),
        "--port",
        str(PORT),
    )
    return asyncio.create_task(spawn(ns, processes, *args))


async def membership(client: KVServiceClient) -> dict[str, str]:
    """Proxy's decode members -> their state."""
    stats = await client.stats()
    return {w.address: w.state for w in stats.workers if w.role == "decode"}


async def follows(client: KVServiceClient, want: dict[str, str], since: float) -> float:
    """Seconds from `since` until the proxy's decode membership is `want`."""

    async def matches() -> bool:
        return await membership(client) == want

    await wait_for(matches, f"decode membership {want}", 30)
    return time.monotonic() - since


def dns_proxy(ns: Namespace, processes: list[asyncio.subprocess.Process], host: int) -> Awaitable[str]:
    """A proxy at `host` that finds its workers by the names `prefill-pool` and `decode-pool`."""
    return spawn(
        ns,
        processes,
        "proxy",
        "--prefill-dns",
        f"prefill-pool:{PORT}",
        "--decode-dns",
        f"decode-pool:{PORT}",
        "--discovery-interval",
        str(DISCOVERY_INTERVAL_S),
        "--health-interval",
        "0.2",
        "--model",
        "tiny",
        "--host",
        ns.ip(host),
        "--port",
        "0",
    )


class StreamingLoad:
    """Clients that stream the prompts in turn, each output checked against its expected tokens."""

    def __init__(self, client: KVServiceClient, prompts: list[list[int]], expected: list[list[int]]) -> None:
        self.client, self.prompts, self.expected = client, prompts, expected
        self.num_done = self.num_started = 0
        self.mismatches: list[int] = []  # the prompts whose output differed
        self.is_finishing = asyncio.Event()  # set: stop once every prompt has been sent once

    async def client_loop(self) -> None:
        while not (self.is_finishing.is_set() and self.num_started >= len(self.prompts)):
            i = self.num_started % len(self.prompts)
            self.num_started += 1
            tokens: list[int] = []
            async for chunk in self.client.generate(
                self.prompts[i], max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True
            ):
                tokens.extend(chunk.token_ids)
            if tokens != self.expected[i]:
                self.mismatches.append(i)
            self.num_done += 1


@contextlib.asynccontextmanager
async def streaming_load(
    client: KVServiceClient, prompts: list[list[int]], expected: list[list[int]]
) -> AsyncIterator[StreamingLoad]:
    """CONCURRENCY clients streaming while the body runs; on leaving it, they go on until every
    prompt has been sent, and are awaited (cancelled when the body failed)."""
    load = StreamingLoad(client, prompts, expected)
    running = asyncio.gather(*(load.client_loop() for _ in range(CONCURRENCY)))
    try:
        yield load
        load.is_finishing.set()
        await running
    finally:
        if not running.done():
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running


@pytest.mark.slow
async def test_decode_workers_join_and_leave_by_dns_while_requests_stream() -> None:
    prompts = random_prompts([24] * NUM_REQUESTS, seed=21, vocab_size=256)
    expected = tiny_greedy(prompts, MAX_TOKENS)
    async with namespace() as (ns, processes):
        p1, d1, d2 = ns.ip(3), ns.ip(4), ns.ip(5)
        ns.set_names({"prefill-pool": [p1], "decode-pool": [d1]})
        # d2 starts now but is not in DNS yet: it joins when the name gains its address.
        prefill_address, d1_address, d2_address = await asyncio.gather(
            worker(ns, processes, "prefill", 3), worker(ns, processes, "decode", 4), worker(ns, processes, "decode", 5)
        )
        proxy = await dns_proxy(ns, processes, 2)
        async with KVServiceClient(proxy) as client:
            await follows(client, {d1_address: "serving"}, time.monotonic())
            # The load runs until both membership changes are done and NUM_REQUESTS have completed.
            async with streaming_load(client, prompts, expected) as load:
                await wait_for(lambda: asyncio.sleep(0, load.num_done >= 20), "20 requests done", 60)
                # A decode worker scales up: it gets traffic once SERVING with its snapshot.
                added = time.monotonic()
                ns.set_names({"prefill-pool": [p1], "decode-pool": [d1, d2]})
                join_s = await follows(client, {d1_address: "serving", d2_address: "serving"}, added)

                async def d2_served() -> bool:
                    return (await worker_stats(d2_address)).num_finished_requests > 0

                await wait_for(d2_served, "the new decode worker serving a request", 30)
                # The first one scales down: no new requests, its in-flight ones finish, then it is dropped.
                removed = time.monotonic()
                ns.set_names({"prefill-pool": [p1], "decode-pool": [d2]})
                leave_s = await follows(client, {d2_address: "serving"}, removed)
                finished_on_d1 = (await worker_stats(d1_address)).num_finished_requests
        print(f"membership: join {join_s:.2f} s, leave {leave_s:.2f} s after the DNS change")
        done = load.num_done
        assert done >= NUM_REQUESTS and not load.mismatches, load.mismatches  # every request completed, token for token
        limit = DISCOVERY_INTERVAL_S + 1.0
        assert join_s <= limit and leave_s <= limit, (join_s, leave_s)
        d1_stats = await worker_stats(d1_address)
        assert is_idle(d1_stats), d1_stats  # the removed worker ends with every block free
        assert d1_stats.num_finished_requests == finished_on_d1, "a request went to the removed worker after it left"
        d2_stats, prefill_stats = await worker_stats(d2_address), await worker_stats(prefill_address)
        assert d1_stats.num_finished_requests + d2_stats.num_finished_requests == done
        assert d2_stats.num_finished_requests > 0
        assert is_idle(d2_stats) and prefill_stats.kv_sending.num_transfers >= NUM_REQUESTS - 2 * CONCURRENCY


@pytest.mark.slow
async def test_two_proxies_route_the_same_workers_independently() -> None:
    """No proxy-to-proxy state: each has its own subscriptions and index, and both serve exactly."""
    prompts = random_prompts([40] * 16, seed=22, vocab_size=256)
    expected = tiny_greedy(prompts, 8)
    async with namespace() as (ns, processes):
        ns.set_names({"prefill-pool": [ns.ip(3)], "decode-pool": [ns.ip(4), ns.ip(5)]})
        await asyncio.gather(
            worker(ns, processes, "prefill", 3), worker(ns, processes, "decode", 4), worker(ns, processes, "decode", 5)
        )
        proxies = [await dns_proxy(ns, processes, host) for host in (2, 6)]
        for proxy in proxies:
            async with KVServiceClient(proxy) as client:
                await follows(
                    client, {f"{ns.ip(4)}:{PORT}": "serving", f"{ns.ip(5)}:{PORT}": "serving"}, time.monotonic()
                )

        async def one(proxy: str, prompt: list[int]) -> list[int]:
            async with KVServiceClient(proxy) as client:
                return (await client.complete(prompt, max_tokens=8, temperature=0.0, ignore_eos=True)).token_ids

        outputs = await asyncio.gather(*(one(proxies[i % 2], p) for i, p in enumerate(prompts)))
        assert outputs == expected
        for proxy in proxies:
            async with KVServiceClient(proxy) as client:
                stats = await client.stats()
            assert {w.role for w in stats.workers} == {"prefill", "decode"}
            # Each proxy indexes what the workers cache, whichever proxy sent the request.
            assert sum(w.num_indexed_blocks for w in stats.workers if w.role == "decode") >= len(prompts) * 2

        # Drain: SIGTERM makes a decode worker report NOT_SERVING at once; both proxies see it
        # within a second (their health watch), route around it, and it exits 0 after draining.
        draining = processes[1]
        address = f"{ns.ip(4)}:{PORT}"
        os.killpg(draining.pid, signal.SIGTERM)
        signalled = time.monotonic()
        for proxy in proxies:
            async with KVServiceClient(proxy) as client:
                assert (
                    await follows(client, {address: "not_serving", f"{ns.ip(5)}:{PORT}": "serving"}, signalled) <= 1.0
                )
        assert await asyncio.gather(*(one(proxies[i % 2], p) for i, p in enumerate(prompts[:4]))) == expected[:4]
        assert await asyncio.wait_for(draining.wait(), 30) == 0
