"""A prefill side that corrupts the KV it sends: the puller must reject it.

`corrupting_every(n)` is a `KVTransferService` that flips one payload byte of every `n`th chunk
it sends (counted over the service's life) after the chunk's checksum was computed: in the
frame, or in the puller's shared-memory ring when the bytes went there. In-process tests serve
pulls with it directly. Across processes, `CorruptingPrefillCluster` starts its prefill workers
through this file run as a script, `python tests/corrupting_prefill.py N serve ...`: the
`kvservice` command with that service installed in place of the real one.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from kvservice.client.cluster import ChildProcess, LocalCluster
from kvservice.connector import kv_transfer_service
from kvservice.connector.kv_transfer_service import KVTransferService, OutgoingChunk
from kvservice.connector.shared_memory import RingWriter
from kvservice.connector.transfer_registry import StagedChunk, StagedTransfer

LAUNCHER = str(pathlib.Path(__file__).resolve())


class CorruptingKVTransferService(KVTransferService):
    """The real service, but every `corrupt_chunk_every`th chunk it sends has one bad byte."""

    corrupt_chunk_every: ClassVar[int]

    async def encode_chunk(
        self, transfer: StagedTransfer, chunk: StagedChunk, ring: RingWriter | None
    ) -> OutgoingChunk | None:
        outgoing = await super().encode_chunk(transfer, chunk, ring)
        number = self.stats.num_chunks + 1  # the service counts a chunk once it has gone out
        if outgoing is None or number % self.corrupt_chunk_every:
            return outgoing
        position = outgoing.shared_memory_position
        if position is not None:
            assert ring is not None
            ring.segment.ring_region(position + outgoing.num_bytes - 1, 1)[0] ^= 0xFF
            return outgoing
        frame = outgoing.frame  # the payload ends the frame
        return dataclasses.replace(outgoing, frame=frame[:-1] + bytes([frame[-1] ^ 0xFF]))


def corrupting_every(n: int) -> type[CorruptingKVTransferService]:
    """The service class that corrupts every `n`th chunk (n > 0)."""
    assert n > 0
    return type(f"CorruptingEvery{n}", (CorruptingKVTransferService,), {"corrupt_chunk_every": n})


@dataclass
class CorruptingPrefillCluster(LocalCluster):
    """A LocalCluster whose prefill workers run this file: their PullKV corrupts every
    `corrupt_chunk_every`th chunk; the decode workers and the proxy are the real ones."""

    corrupt_chunk_every: int = 1

    async def _spawn(self, name: str, cmd: list[str], cores: Sequence[int] | None, stdin: bool = False) -> ChildProcess:
        if name.startswith("prefill"):
            python, *module = cmd[:3]
            assert module == ["-m", "kvservice"], cmd
            cmd = [python, LAUNCHER, str(self.corrupt_chunk_every), *cmd[3:]]
        return await super()._spawn(name, cmd, cores, stdin)


def main(argv: list[str]) -> int:
    """`N ARGS...`: `kvservice ARGS...` with every KVTransfer service corrupting every Nth chunk.

    Installed where the servers import it from, before any server module is imported."""
    every, *args = argv
    assert not any(name.startswith("kvservice.server") for name in sys.modules), "a server already imported it"
    kv_transfer_service.KVTransferService = corrupting_every(int(every))  # type: ignore[misc]
    from kvservice.cli import main as kvservice_main

    return kvservice_main(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
