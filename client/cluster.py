"""`LocalCluster`: N prefill + M decode workers and a proxy (or one colocated worker) as local child processes.

`kvservice launch`, the demo, the benchmarks and the tests all start servers through it: every child
listens on a port the OS picks and prints it on its ready line; prefill and decode workers start
together, and the decode workers read the prefill workers' addresses from stdin once those are
ready (`--kv-peers -`: the only workers they may dial), so their start-ups overlap, and then each
other's (a second line: the decode workers a prefix may be pulled from);
prefill and decode workers that may run on the same cores take turns on them through a
`--core-lease` file (`kvservice.worker.core_lease`); the cluster is ready when the proxy's health
check says SERVING; stopping sends SIGTERM (graceful drain), then SIGKILL to anything still alive
after the grace period. No process outlives it: on Linux each child gets SIGTERM from the kernel
when its parent dies, even by SIGKILL (`PR_SET_PDEATHSIG`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import re
import signal
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from kvservice.client.client import KVServiceClient
from kvservice.runtime.process_env import WORKER_ENV

_PR_SET_PDEATHSIG = 1
_READY = re.compile(r"listening on (\S+:\d+)")
_HTTP = re.compile(r"http on (\S+:\d+)")
_METRICS = re.compile(r"metrics on (\S+:\d+)")


class LaunchError(RuntimeError):
    """A child did not become ready: `child` names it (`proxy`, `prefill-0`, ...); `returncode` is its exit
    code where it exited (argparse exits with 2 on a flag it does not know), None where it hung."""

    def __init__(self, message: str, child: str, returncode: int | None = None) -> None:
        super().__init__(message)
        self.child = child
        self.returncode = returncode


@dataclass(eq=False)
class ChildProcess:
    name: str
    process: asyncio.subprocess.Process
    cmd: list[str]
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
    # Prefill and decode workers whose cores overlap take turns on them (unless worker_args name a --core-lease).
    core_lease: bool = True
    proxy_args: Sequence[str] = ()
    # The readiness probe's channel: set it when the children serve TLS (their flags go in worker_args/proxy_args).
    client_credentials: grpc.ChannelCredentials | None = None
    startup_timeout: float = 120.0
    grace_period: float = 10.0
    # Each worker's KV offload tier in DIR/<its name> (prefill-0, decode-1, both): stable across launches.
    kv_offload_dir: str | None = None
    kv_offload_gib: float = 4.0
    children: list[ChildProcess] = field(default_factory=list)
    address: str = ""  # where clients connect: the proxy, or the colocated worker
    core_lease_path: str | None = None  # the lease file this cluster made (removed once its workers hold it open)

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
            child = await self.start_child(
                "both", [*worker, "--role", "both", "--port", str(self.port)], self.colocated_cores
            )
            self.address = child.address
        else:
            worker += self._core_lease_args()
            prefills = [
                await self._spawn(f"prefill-{i}", [*worker, "--role", "prefill"], self.prefill_cores)
                for i in range(self.num_prefill)
            ]
            kv_peers = self._kv_peers_args()
            decode = [*worker, "--role", "decode", *kv_peers]
            decodes = [
                await self._spawn(f"decode-{i}", decode, self.decode_cores, stdin=bool(kv_peers))
                for i in range(self.num_decode)
            ]
            await asyncio.gather(*(self._ready(child) for child in prefills))
            if kv_peers:
                _tell(decodes, self.prefill_addresses)
            await asyncio.gather(*(self._ready(child) for child in decodes))
            if kv_peers:
                # Then each other: a decode worker may pull a prefix another one caches.
                _tell(decodes, self.decode_addresses, last=True)
            # Every worker opened the lease file before it reported ready, and the locks live on
            # those open files: the name can go now, so that even a SIGKILLed launcher leaves
            # nothing in /dev/shm.
            self._remove_core_lease()
            proxy_cmd = [sys.executable, "-m", "kvservice", "proxy", "--port", str(self.port), *self.proxy_args, *grace]
            if self.prefill_addresses:
                proxy_cmd += ["--prefill", *self.prefill_addresses]
            proxy_cmd += ["--decode", *self.decode_addresses]
            self.address = (await self.start_child("proxy", proxy_cmd, None)).address
        async with KVServiceClient(self.address, self.client_credentials) as client:
            await client.wait_until_serving(self.startup_timeout)

    def _core_lease_args(self) -> list[str]:
        """A lease file for prefill and decode workers that may compute on the same cores (no
        cores given means all of them), unless the caller turned it off or named one."""
        if not self.core_lease or "--core-lease" in self.worker_args or not self.num_prefill or not self.num_decode:
            return []
        if (
            self.prefill_cores is not None
            and self.decode_cores is not None
            and not set(self.prefill_cores) & set(self.decode_cores)
        ):
            return []
        fd, self.core_lease_path = tempfile.mkstemp(
            prefix="kvservice-cores-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
        )
        os.close(fd)
        return ["--core-lease", self.core_lease_path]

    def _kv_peers_args(self) -> list[str]:
        """Decode workers may pull KV only from this cluster's prefill workers, whose addresses
        they read from stdin once those are ready, unless the caller's worker flags name other peers."""
        if not self.num_prefill or "--kv-peers" in self.worker_args:
            return []
        return ["--kv-peers", "-"]

    async def start_child(self, name: str, cmd: list[str], cores: Sequence[int] | None) -> ChildProcess:
        """Start a child of this cluster and wait until it is ready (its addresses set)."""
        return await self._ready(await self._spawn(name, cmd, cores))

    def _offload_args(self, name: str) -> list[str]:
        """A worker's --kv-offload-dir (its own subdirectory) and bound; none for the proxy."""
        if self.kv_offload_dir is None or name == "proxy":
            return []
        directory = os.path.join(self.kv_offload_dir, name)
        return ["--kv-offload-dir", directory, "--kv-offload-gib", f"{self.kv_offload_gib:g}"]

    async def _spawn(self, name: str, cmd: list[str], cores: Sequence[int] | None, stdin: bool = False) -> ChildProcess:
        """Start a child (`stdin`: with a pipe to its stdin); `_ready` waits for its ready line."""
        cmd = [*cmd, *self._offload_args(name)]
        env = {**os.environ, **WORKER_ENV}
        core_set = set(cores) if cores is not None else None
        parent = os.getpid()

        def preexec() -> None:  # in the child, between fork and exec
            die_with_parent(parent)
            if core_set is not None:
                os.sched_setaffinity(0, core_set)

        process = await asyncio.create_subprocess_exec(
            *cmd,
            stdin=asyncio.subprocess.PIPE if stdin else None,
            stdout=asyncio.subprocess.PIPE,
            env=env,
            preexec_fn=preexec,
            start_new_session=True,
        )
        child = ChildProcess(name, process, cmd)
        self.children.append(child)
        return child

    async def _ready(self, child: ChildProcess) -> ChildProcess:
        """Wait for the child's ready line and take its addresses from it."""
        name, process, cmd = child.name, child.process, child.cmd
        assert process.stdout is not None
        try:
            line = await asyncio.wait_for(process.stdout.readline(), self.startup_timeout)
        except TimeoutError:
            raise LaunchError(f"{name} did not report ready within {self.startup_timeout:.0f} s", name) from None
        match = _READY.search(line.decode(errors="replace"))
        if match is None:
            code = await process.wait()
            raise LaunchError(f"{name} exited with code {code} before it was ready ({' '.join(cmd)})", name, code)
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
            if child.process.stdin is not None and not child.process.stdin.is_closing():
                child.process.stdin.close()  # a decode worker still waiting for its --kv-peers line
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
        self._remove_core_lease()

    def _remove_core_lease(self) -> None:
        if self.core_lease_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.core_lease_path)
            self.core_lease_path = None

    def child(self, name: str) -> ChildProcess:
        return next(c for c in self.children if c.name == name)


def die_with_parent(parent: int) -> None:
    """Ask the kernel for SIGTERM when the parent dies (Linux); exit now if it already has."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return  # best effort: the launcher's own stop() still applies
    if os.getppid() != parent:  # it died before the request took effect
        os._exit(1)


async def _drain(stream: asyncio.StreamReader) -> None:
    while await stream.readline():
        pass


def _tell(children: Sequence[ChildProcess], addresses: Sequence[str], last: bool = False) -> None:
    """Write one line of `addresses` to each child's stdin (`--kv-peers -`); `last`: then close it."""
    line = (" ".join(addresses) + "\n").encode()
    for child in children:
        stdin = child.process.stdin
        assert stdin is not None
        if stdin.is_closing():
            continue
        stdin.write(line)
        if last:
            stdin.close()
