"""DNS discovery: every A/AAAA record of a name is one worker, re-resolved on an interval.

The same mechanism serves a Kubernetes headless Service, docker compose `--scale` and
Swarm's `tasks.NAME`. A new address joins the pool (`joining` until it is SERVING and
synced); an address gone from every name's answer is retired (`leaving`). A failed lookup
changes nothing: a DNS blip must not empty the pool.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kvservice.server.proxy.worker_pool import WorkerPool

logger = logging.getLogger(__name__)

DEFAULT_DISCOVERY_INTERVAL_S = 5.0


@dataclass(frozen=True, slots=True)
class DNSName:
    """`NAME:PORT`: the workers are every address NAME resolves to, each on PORT."""

    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> DNSName:
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"expected NAME:PORT with a port in 1-65535, got {text!r}")
        return cls(host, int(port))

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


Resolver = Callable[[DNSName], Awaitable[set[str]]]


async def resolve(name: DNSName) -> set[str]:
    """The worker addresses (`IP:PORT`, `[IPv6]:PORT`) behind `name`: one per A/AAAA record."""
    infos = await asyncio.get_running_loop().getaddrinfo(name.host, name.port, type=socket.SOCK_STREAM)
    return {_address(info[4][0], name.port) for info in infos}


def _address(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ipaddress.ip_address(ip.split("%")[0]).version == 6 else f"{ip}:{port}"


class Discovery:
    """Keeps `pool`'s discovered members equal to what `names` resolve to (static members stay)."""

    def __init__(
        self,
        pool: WorkerPool,
        names: list[DNSName],
        interval: float = DEFAULT_DISCOVERY_INTERVAL_S,
        resolver: Resolver = resolve,
    ) -> None:
        if not interval > 0:
            raise ValueError(f"--discovery-interval must be > 0, got {interval}")
        self.pool = pool
        self.names = names
        self.interval = interval
        self.resolver = resolver
        self._static = {w.address for w in pool.workers}
        self._last: dict[DNSName, set[str]] = {}  # each name's last good answer

    async def refresh(self) -> None:
        """One round: resolve every name, add what is new, retire what is gone."""
        for name in self.names:
            try:
                self._last[name] = await self.resolver(name)
            except OSError as e:
                logger.warning(
                    "discovery: %s did not resolve (%s); keeping its %d workers", name, e, len(self._last.get(name, ()))
                )
        found = set().union(*self._last.values()) - self._static
        current = {w.address: w for w in self.pool.workers}
        for address in sorted(found - current.keys()):
            self.pool.add(address)
        for address, worker in current.items():
            if address in self._static:
                continue
            if address in found:
                self.pool.readmit(worker)
            else:
                self.pool.retire(worker)

    async def run(self) -> None:
        """Refresh forever, every `interval` seconds (the first round at once); the proxy's
        health monitor applies joins and drops (`WorkerPool.update_membership`)."""
        while True:
            await self.refresh()
            await asyncio.sleep(self.interval)  # the re-resolution period, not synchronisation
