"""Channels from a decode worker to the prefill workers it pulls from, bounded in number.

A channel is opened on first use and kept for the next pull to the same address; past
`capacity` channels the least recently used idle one is closed. A channel in use is
never closed under its pull.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc


@dataclass(slots=True, eq=False)
class _Entry:
    channel: grpc.aio.Channel
    num_users: int = 0


class ChannelCache:
    def __init__(
        self, capacity: int, credentials: grpc.ChannelCredentials | None = None, options: Sequence[tuple[str, Any]] = ()
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._credentials = credentials
        self._options = list(options)
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._entries)

    @contextlib.asynccontextmanager
    async def use(self, address: str) -> AsyncIterator[grpc.aio.Channel]:
        """The channel to `address`, held open for the duration of the block."""
        entry = self._entries.get(address)
        if entry is None:
            entry = _Entry(self._open(address))
            self._entries[address] = entry
        self._entries.move_to_end(address)
        entry.num_users += 1
        try:
            yield entry.channel
        finally:
            entry.num_users -= 1
            await self._evict()

    async def close(self) -> None:
        entries, self._entries = list(self._entries.values()), OrderedDict()
        for entry in entries:
            await entry.channel.close()

    def _open(self, address: str) -> grpc.aio.Channel:
        if self._credentials is not None:
            return grpc.aio.secure_channel(address, self._credentials, options=self._options)
        return grpc.aio.insecure_channel(address, options=self._options)

    async def _evict(self) -> None:
        while len(self._entries) > self.capacity:
            idle = next((address for address, entry in self._entries.items() if entry.num_users == 0), None)
            if idle is None:
                return  # every channel is in use: the extra ones go once their pulls end
            await self._entries.pop(idle).channel.close()
