"""`kvservice launch`: N prefill + M decode workers and a proxy as local child processes.

`LocalCluster` is also what the demo, the benchmarks and the tests use: every child
listens on a port the OS picks and prints it on its ready line; the cluster is ready
when the proxy's health check says SERVING; stopping sends SIGTERM (graceful drain),
then SIGKILL to anything still alive after the grace period. No process outlives it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from kvservice.client.client import KVServiceClient
from kvservice.process_env import WORKER_ENV
from kvservice.tls import AUTH_TOKEN_ENV, TLSFiles, add_tls_arguments

_READY = re.compile(r"listening on (\S+:\d+)")
_HTTP = re.compile(r"http on (\S+:\d+)")
_METRICS = re.compile(r"metrics on (\S+:\d+)")


class LaunchError(RuntimeError):
    pass


@dataclass(eq=False)
class ChildProcess:
    name: str
    process: asyncio.subprocess.Process
    address: str = ""
    http_address: str = ""  # the OpenAI-compatible front (a proxy with --http-port)
    metrics_address: str = ""  # /metrics (with --metrics-port)
    drain: asyncio.Task[None] | None = None


@dataclass
class LocalCluster:
    """Children of one deployment. Use as `async with LocalCluster(...) as cluster:`."""

    model: str = "tiny"
    num_prefill: int = 1
    num_decode: int = 1
    port: int = 0
    worker_args: Sequence[str] = ()
    prefill_cores: Sequence[int] | None = None
    decode_cores: Sequence[int] | None = None
    colocated: bool = False  # one `--role both` worker instead of the P/D pair and proxy
    colocated_cores: Sequence[int] | None = None
    proxy_args: Sequence[str] = ()
    # The readiness probe's channel: set it when the children serve TLS (their flags go in worker_args/proxy_args).
    client_credentials: grpc.ChannelCredentials | None = None
    startup_timeout: float = 120.0
    grace_period: float = 10.0
    children: list[ChildProcess] = field(default_factory=list)
    address: str = ""  # where clients connect: the proxy, or the colocated worker

    @property
    def prefill_addresses(self) -> list[str]:
        return [c.address for c in self.children if c.name.startswith("prefill")]

    @property
    def decode_addresses(self) -> list[str]:
        return [c.address for c in self.children if c.name.startswith("decode")]

    async def __aenter__(self) -> LocalCluster:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        # Every child drains for as long as `stop` waits for it (after the caller's flags: this wins).
        grace = ["--grace-period", f"{self.grace_period:g}"]
        worker = [sys.executable, "-m", "kvservice", "serve", "--model", self.model, *self.worker_args, *grace]
        if self.colocated:
            child = await self._spawn("both", [*worker, "--role", "both", "--port", str(self.port)], self.colocated_cores)
            self.address = child.address
        else:
            spawns = [self._spawn(f"prefill-{i}", [*worker, "--role", "prefill"], self.prefill_cores) for i in range(self.num_prefill)]
            spawns += [self._spawn(f"decode-{i}", [*worker, "--role", "decode"], self.decode_cores) for i in range(self.num_decode)]
            await asyncio.gather(*spawns)
            proxy_cmd = [sys.executable, "-m", "kvservice", "proxy", "--port", str(self.port), *self.proxy_args, *grace]
            if self.prefill_addresses:
                proxy_cmd += ["--prefill", *self.prefill_addresses]
            proxy_cmd += ["--decode", *self.decode_addresses]
            self.address = (await self._spawn("proxy", proxy_cmd, None)).address
        async with KVServiceClient(self.address, self.client_credentials) as client:
            await client.wait_until_serving(self.startup_timeout)

    async def _spawn(self, name: str, cmd: list[str], cores: Sequence[int] | None) -> ChildProcess:
        env = {**os.environ, **WORKER_ENV}
        preexec = None
        if cores is not None:
            core_set = set(cores)
            preexec = lambda: os.sched_setaffinity(0, core_set)  # noqa: E731
        process = await asyncio.create_subprocess_exec(
            *cmd, stdout=asyncio.subprocess.PIPE, env=env, preexec_fn=preexec, start_new_session=True
        )
        child = ChildProcess(name, process)
        self.children.append(child)
        assert process.stdout is not None
        try:
            line = await asyncio.wait_for(process.stdout.readline(), self.startup_timeout)
        except TimeoutError:
            raise LaunchError(f"{name} did not report ready within {self.startup_timeout:.0f} s") from None
        match = _READY.search(line.decode(errors="replace"))
        if match is None:
            code = await process.wait()
            raise LaunchError(f"{name} exited with code {code} before it was ready ({' '.join(cmd)})")
        child.address = match.group(1)
        for pattern, attribute in ((_HTTP, "http_address"), (_METRICS, "metrics_address")):
            found = pattern.search(line.decode(errors="replace"))
            if found is not None:
                setattr(child, attribute, found.group(1))
        child.drain = asyncio.create_task(_drain(process.stdout))
        return child

    async def stop(self) -> None:
        """SIGTERM everything (the proxy first, so no new work reaches the workers), then wait."""
        for child in reversed(self.children):
            if child.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    child.process.send_signal(signal.SIGTERM)
        for child in reversed(self.children):
            try:
                await asyncio.wait_for(child.process.wait(), self.grace_period + 10)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.process.pid, signal.SIGKILL)
                await child.process.wait()
            if child.drain is not None:
                child.drain.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await child.drain
        self.children.clear()

    def child(self, name: str) -> ChildProcess:
        return next(c for c in self.children if c.name == name)


async def _drain(stream: asyncio.StreamReader) -> None:
    while await stream.readline():
        pass


# ---------------------------------------------------------------- the command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="'tiny' or a Hugging Face model directory (default: tiny)")
    parser.add_argument("--num-prefill", type=int, default=1, help="prefill workers (default: 1)")
    parser.add_argument("--num-decode", type=int, default=1, help="decode workers (default: 1)")
    parser.add_argument("--port", type=int, default=8000, help="the proxy's port (default: 8000; 0 lets the OS pick)")
    parser.add_argument("--http-port", type=int, default=None, help="the proxy's OpenAI-compatible HTTP API on this port (default: off)")
    parser.add_argument("--metrics-port", type=int, default=None, help="the proxy's Prometheus /metrics on this port; every worker gets one the OS picks (default: off)")
    parser.add_argument(
        "--grace-period", type=float, default=30.0,
        help="seconds every child gets to drain on Ctrl-C / SIGTERM before it is killed (default: 30)",
    )
    add_tls_arguments(parser)
    parser.add_argument("worker_args", nargs=argparse.REMAINDER, help="after '--': extra `kvservice serve` flags for every worker")


def main(args: argparse.Namespace) -> int:
    from kvservice.server.grpc_server import run_event_loop

    extra = [a for a in args.worker_args if a != "--"]
    return run_event_loop(_launch(args, extra))


async def _launch(args: argparse.Namespace, worker_args: list[str]) -> int:
    tls = TLSFiles.from_args(args)
    proxy_args: list[str] = [*tls.to_args()]
    worker_args = [*worker_args, *tls.to_args()]
    if args.auth_token:
        # Through the environment, not argv (which `ps` shows): the proxy reads it from there.
        os.environ[AUTH_TOKEN_ENV] = args.auth_token
    if args.http_port is not None:
        proxy_args += ["--http-port", str(args.http_port), "--served-model-name", args.model]
    if args.metrics_port is not None:
        proxy_args += ["--metrics-port", str(args.metrics_port)]
        worker_args = [*worker_args, "--metrics-port", "0"]
    cluster = LocalCluster(
        args.model, args.num_prefill, args.num_decode, args.port, worker_args, proxy_args=proxy_args,
        client_credentials=tls.channel_credentials(), grace_period=args.grace_period,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await cluster.start()
        print(f"kvservice launch: proxy listening on {cluster.address}", flush=True)
        for child in cluster.children:
            extras = "".join(f", {what} {address}" for what, address in (("http", child.http_address), ("metrics", child.metrics_address)) if address)
            print(f"  {child.name:<10} {child.address}  (pid {child.process.pid}{extras})", flush=True)
        print("Ctrl-C or SIGTERM stops everything.", flush=True)
        waits = [asyncio.create_task(c.process.wait()) for c in cluster.children]
        stopper = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait([stopper, *waits], return_when=asyncio.FIRST_COMPLETED)
        for task in [stopper, *waits]:
            task.cancel()
        if stopper not in done:
            dead = [c.name for c in cluster.children if c.process.returncode is not None]
            print(f"kvservice launch: {', '.join(dead)} exited; stopping the rest", file=sys.stderr)
            return 1
        return 0
    except LaunchError as e:
        print(f"kvservice launch: error: {e}", file=sys.stderr)
        return 1
    finally:
        await cluster.stop()
