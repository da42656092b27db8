"""The same-host KV path (`--kv-transfer-shm`): the segment, its ring, and pulls through it,
including the ones where it cannot be used or a peer misuses it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import stat
from collections.abc import AsyncIterator, Callable, Iterator

import grpc
import numpy as np
import pytest
import torch
from corrupting_prefill import corrupting_every

from kvservice.connector import shared_memory, wire
from kvservice.connector.kv_puller import LoadSpec, pull_kv
from kvservice.connector.kv_transfer_service import KVTransferService
from kvservice.connector.prefill_connector import PrefillConnectorMetadata, PrefillKVConnector, SaveSpec
from kvservice.connector.shared_memory import (
    CONTROL_BYTES,
    OpenSegments,
    RingWriter,
    SegmentPool,
    SharedMemoryUnavailable,
    SharedSegment,
)
from kvservice.connector.staging import StagingPool
from kvservice.connector.transfer_registry import TransferRegistry
from kvservice.core.outputs import KVTransferCounters
from kvservice.model.attention import AttentionMetadata
from kvservice.model.kv_cache import KVCacheLayout, allocate_kv_caches
from kvservice.v1 import kvservice_pb2 as pb

pytestmark = pytest.mark.timeout(60)

LAYOUT = KVCacheLayout(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
BLOCK = LAYOUT.bytes_per_block_per_layer
FIRST_TOKEN = 17
WAIT = 20.0


def _segments() -> set[str]:
    """This process's segments (a name carries its creator's pid)."""
    return {n for n in os.listdir(shared_memory.SHM_DIR) if n.startswith(f"kvservice-kv-{os.getpid()}-")}


@pytest.fixture(autouse=True)
def no_segment_left_behind() -> Iterator[None]:
    """Every test, passing or refused, leaves /dev/shm as it found it."""
    before = _segments()
    yield
    assert _segments() == before


# ---------------------------------------------------------------- the segment


def test_the_prefill_side_keeps_at_most_its_capacity_mapped_and_unmaps_them_on_close() -> None:
    created = [SharedSegment.create(CONTROL_BYTES + 100) for _ in range(3)]
    opened = OpenSegments(capacity=2)
    try:
        first, second = opened.open(created[0].name), opened.open(created[1].name)
        assert opened.open(created[0].name) is first  # mapped once, by name
        third = opened.open(created[2].name)  # past the capacity: the least recently used goes
        assert second._mmap is None and first._mmap is not None and third._mmap is not None
        opened.close()
        assert first._mmap is None and third._mmap is None
    finally:
        for segment in created:
            segment.unlink()
            segment.close()


def test_a_segment_is_private_to_its_user_and_gone_from_the_namespace_once_unlinked() -> None:
    segment = SharedSegment.create(CONTROL_BYTES + 1000)
    try:
        info = os.stat(os.path.join(shared_memory.SHM_DIR, segment.name))
        assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_size == CONTROL_BYTES + 1000
        peer = SharedSegment.open(segment.name)  # what the prefill worker does
        peer.ring_region(0, 3)[:] = [1, 2, 3]
        assert list(segment.ring_region(0, 3)) == [1, 2, 3]  # one memory, two mappings
        segment.unlink()
        with pytest.raises(SharedMemoryUnavailable):
            SharedSegment.open(segment.name)
        peer.close()
    finally:
        segment.unlink()
        segment.close()


@pytest.mark.parametrize(
    "name",
    [
        "../../etc/passwd",
        "kvservice-kv-1-" + "z" * 32,
        "kvservice-kv-1-" + "a" * 31,
        "other",
        "kvservice-kv-1-" + "a" * 32 + "/x",
    ],
)
def test_open_refuses_any_name_but_a_segments(name: str) -> None:
    with pytest.raises(SharedMemoryUnavailable):
        SharedSegment.open(name)


def test_open_refuses_a_symlink_with_a_segment_name() -> None:
    name = f"kvservice-kv-{os.getpid()}-{secrets.token_hex(16)}"
    path = os.path.join(shared_memory.SHM_DIR, name)
    os.symlink("/etc/hostname", path)
    try:
        with pytest.raises(SharedMemoryUnavailable):
            SharedSegment.open(name)
    finally:
        os.unlink(path)


def test_ring_regions_never_wrap_and_never_leave_the_ring() -> None:
    segment = SharedSegment.create(CONTROL_BYTES + 100)
    try:
        assert segment.ring_region(250, 50).nbytes == 50  # positions 250-299 are ring bytes 50-99
        for position, num_bytes in ((60, 41), (0, 101), (-1, 1), (99, 2)):
            with pytest.raises(ValueError):
                segment.ring_region(position, num_bytes)
    finally:
        segment.unlink()
        segment.close()


async def test_the_writer_reuses_ring_space_only_once_the_reader_has_read_it() -> None:
    segment = SharedSegment.create(CONTROL_BYTES + 100)
    try:
        writer = RingWriter(segment)
        chunk = np.full(40, 7, dtype=np.uint8)
        assert [await writer.write(chunk) for _ in range(2)] == [0, 40]
        # The third does not fit before the ring's end: it starts at the next lap, at 100,
        # and overwrites [0, 40), so it waits until the reader has read past 40.
        third = asyncio.create_task(writer.write(np.full(40, 9, dtype=np.uint8)))
        await asyncio.sleep(0.01)
        assert not third.done()
        segment.mark_read(39)
        await asyncio.sleep(0.01)
        assert not third.done()
        segment.mark_read(40)
        assert await asyncio.wait_for(third, WAIT) == 100
        assert list(segment.ring_region(100, 40)) == [9] * 40 and list(segment.ring_region(40, 40)) == [7] * 40
        assert not writer.fits(101) and writer.fits(100)
    finally:
        segment.unlink()
        segment.close()


# ---------------------------------------------------------------- pulls through it


class _Prefill:
    """A real prefill side in this process: random KV staged through the connector, served by
    `KVTransferService` (or by `frames`, a fake server, when given)."""

    def __init__(
        self,
        num_tokens: int,
        frames: Callable[[pb.PullKVRequest], list[bytes]] | None = None,
        num_staged: int = 1,
        service: Callable[[TransferRegistry], KVTransferService] = KVTransferService,
    ) -> None:
        """`num_staged`: transfers its staging holds at once; `service`: builds the PullKV service."""
        self.num_tokens = num_tokens
        self.num_blocks = LAYOUT.num_blocks_for(num_tokens)
        self.kv_caches = allocate_kv_caches(LAYOUT, self.num_blocks, torch.device("cpu"))
        gen = torch.Generator().manual_seed(3)
        for kv_layer in self.kv_caches:
            kv_layer.normal_(generator=gen)
        self.registry = TransferRegistry(StagingPool(num_staged * self.num_blocks * LAYOUT.bytes_per_block), LAYOUT)
        self.service = service(self.registry)
        self.frames = frames
        self.requests: list[pb.PullKVRequest] = []

    def stage(self, request_id: str, token: bytes, chunk_blocks: int) -> None:
        connector = PrefillKVConnector(self.registry, chunk_bytes=chunk_blocks * BLOCK)
        self.registry.register(request_id, token, self.num_tokens)
        connector.bind_connector_metadata(
            PrefillConnectorMetadata([SaveSpec(request_id, 0, list(range(self.num_blocks)))])
        )
        no_attention = AttentionMetadata(torch.empty(0, dtype=torch.long), 0, None, None, [])
        for layer, kv_layer in enumerate(self.kv_caches):
            connector.save_kv_layer(layer, kv_layer, no_attention)
        connector.clear_connector_metadata()
        self.registry.complete(request_id, FIRST_TOKEN)

    async def pull_kv(self, request: pb.PullKVRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        self.requests.append(request)
        if self.frames is None:
            async for frame in self.service.pull_kv(request, context):
                yield frame
        else:
            for frame in self.frames(request):
                yield frame


@contextlib.asynccontextmanager
async def _serving(prefill: _Prefill) -> AsyncIterator[str]:
    """`prefill`'s PullKV on 127.0.0.1; its address."""
    handler = grpc.method_handlers_generic_handler(
        "kvservice.v1.KVTransfer",
        {
            "PullKV": grpc.unary_stream_rpc_method_handler(
                prefill.pull_kv, request_deserializer=pb.PullKVRequest.FromString
            )
        },
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    try:
        yield address
    finally:
        await server.stop(None)


async def _pull(
    prefill: _Prefill, request_id: str, token: bytes, address: str | None = None, segments: SegmentPool | None = None
) -> tuple[str | None, KVTransferCounters, list[torch.Tensor]]:
    """One pull from `prefill` (served at `address`, or for this pull alone), offering a segment
    of `segments` (a pool of its own if None); checks every byte of a pull that succeeds."""
    async with contextlib.AsyncExitStack() as stack:
        if address is None:
            address = await stack.enter_async_context(_serving(prefill))
        if segments is None:
            segments = SegmentPool()
            stack.callback(segments.close)
        block_ids = list(range(prefill.num_blocks, 0, -1))  # block 0 stays untouched
        caches = allocate_kv_caches(LAYOUT, prefill.num_blocks + 1, torch.device("cpu"))
        counters = KVTransferCounters()
        spec = LoadSpec(request_id, address, token, block_ids, prefill.num_tokens)
        async with grpc.aio.insecure_channel(address) as channel:
            result = await pull_kv(channel, spec, caches, LAYOUT, WAIT, counters, segments=segments)
        if result.error is None:
            assert result.first_token_id == FIRST_TOKEN
            for layer, cache in enumerate(caches):
                assert torch.equal(cache[:, block_ids].view(torch.int16), prefill.kv_caches[layer].view(torch.int16))
                assert not cache[:, 0].any()
        return result.error, counters, caches
    raise AssertionError("unreachable")


@pytest.mark.parametrize("chunk_blocks", [1, 3, 64], ids=["ring-laps", "uneven-chunks", "one-chunk-per-layer"])
async def test_a_pull_through_the_segment_is_bit_identical_and_leaves_nothing_behind(
    chunk_blocks: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A ring of 5 blocks' bytes for 3 layers x 7 blocks: small chunks lap it several times;
    # a whole layer (7 blocks) does not fit it and goes over the stream as bytes.
    monkeypatch.setattr(shared_memory, "DEFAULT_RING_BYTES", 5 * BLOCK)
    prefill = _Prefill(num_tokens=27)  # 7 blocks, the last one partial
    token = secrets.token_bytes(16)
    prefill.stage("r", token, chunk_blocks)
    error, counters, _ = await _pull(prefill, "r", token)
    assert error is None
    assert prefill.requests[0].shared_memory  # it was offered
    total = 3 * 7 * BLOCK
    assert counters.num_bytes == total
    assert counters.num_shared_memory_bytes == (0 if chunk_blocks == 64 else total)
    assert prefill.service.stats.num_shared_memory_bytes == counters.num_shared_memory_bytes
    assert prefill.registry.pool.bytes_in_use == 0


async def test_a_segment_serves_the_next_pull_from_the_same_prefill_worker_once_its_pull_completed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Fresh shared memory costs as much as the copies: the second pull reuses the first's
    segment (no longer in /dev/shm: the prefill worker keeps it mapped), bit for bit right."""
    monkeypatch.setattr(shared_memory, "DEFAULT_RING_BYTES", 5 * BLOCK)
    opened: list[str] = []
    real_open = SharedSegment.open
    monkeypatch.setattr(SharedSegment, "open", staticmethod(lambda name: (opened.append(name), real_open(name))[1]))
    prefill = _Prefill(num_tokens=27)
    segments = SegmentPool()
    try:
        async with _serving(prefill) as address:
            for request_id in ("r1", "r2", "r3"):
                token = secrets.token_bytes(16)
                prefill.stage(request_id, token, 2)
                error, counters, _ = await _pull(prefill, request_id, token, address, segments)  # checks every byte
                assert error is None and counters.num_shared_memory_bytes == counters.num_bytes == 3 * 7 * BLOCK
        offered = {request.shared_memory for request in prefill.requests}
        assert len(offered) == 1 and segments.num_created == 1
        assert opened == [*offered]  # opened once, by name; then reused from the prefill worker's mapping
        assert not os.path.exists(os.path.join(shared_memory.SHM_DIR, *offered))
    finally:
        segments.close()


async def test_a_segment_whose_pull_failed_or_was_not_used_is_never_offered_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    segments = SegmentPool()
    prefill = _Prefill(num_tokens=9, num_staged=3, service=corrupting_every(2))  # corrupts every second chunk
    try:
        async with _serving(prefill) as address:
            prefill.stage("bad", token := secrets.token_bytes(16), 1)
            error, _, _ = await _pull(prefill, "bad", token, address, segments)
            assert error is not None  # the prefill worker may still write into that ring: not reused
            prefill.service = KVTransferService(prefill.registry)  # a sound service; nothing open

            def elsewhere(name: str) -> SharedSegment:
                raise SharedMemoryUnavailable(f"cannot open {name}")

            with monkeypatch.context() as patched:
                patched.setattr(SharedSegment, "open", staticmethod(elsewhere))
                prefill.stage("streamed", token := secrets.token_bytes(16), 1)
                error, counters, _ = await _pull(prefill, "streamed", token, address, segments)
            assert error is None and counters.num_shared_memory_bytes == 0  # streamed: that prefill holds no segment
            prefill.stage("next", token := secrets.token_bytes(16), 1)
            error, counters, _ = await _pull(prefill, "next", token, address, segments)
            assert error is None and counters.num_shared_memory_bytes == counters.num_bytes
            assert segments.num_created == 3  # one per pull: neither earlier segment came back
    finally:
        segments.close()


async def test_a_prefill_that_cannot_open_the_segment_streams_the_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another host (or /dev/shm, or user): the name does not open there; the pull still works."""
    prefill = _Prefill(num_tokens=9)
    token = secrets.token_bytes(16)
    prefill.stage("r", token, 2)

    def elsewhere(name: str) -> SharedSegment:
        raise SharedMemoryUnavailable(f"cannot open {name}: No such file or directory")

    monkeypatch.setattr(SharedSegment, "open", staticmethod(elsewhere))
    error, counters, _ = await _pull(prefill, "r", token)
    assert error is None and counters.num_bytes == 3 * 3 * BLOCK and counters.num_shared_memory_bytes == 0


async def test_a_corrupted_byte_in_the_segment_fails_the_pull() -> None:
    prefill = _Prefill(num_tokens=9, service=corrupting_every(2))
    token = secrets.token_bytes(16)
    prefill.stage("r", token, 1)
    error, _, _ = await _pull(prefill, "r", token)
    assert error is not None and "header.crc32" in error


def _header_only(request_id: str, position: int, num_blocks: int = 1, layer: int = 0) -> bytes:
    payload = np.zeros(num_blocks * BLOCK, dtype=np.uint8)
    return wire.encode_chunk(
        request_id=request_id,
        layer=layer,
        first_block=0,
        num_blocks=num_blocks,
        dtype="bfloat16",
        shape=LAYOUT.blocks_shape(num_blocks),
        payload=memoryview(payload),
        shared_memory_position=position,
    )


@pytest.mark.parametrize(
    ("frames", "message"),
    [
        # A header-only chunk on a pull that offered nothing (the fake drops the offer below).
        (lambda rid: [_header_only(rid, 0)], "this pull offered no shared memory"),
        # Positions must move forward: a chunk may not point back at ring space already read.
        (lambda rid: [_header_only(rid, 0), _header_only(rid, 0, layer=1)], "before the previous chunk's end"),
        # Bytes running past the ring's end (the ring holds 9 blocks here).
        (lambda rid: [_header_only(rid, 9 * BLOCK - 10)], "do not fit"),
    ],
    ids=["not-offered", "backwards", "wraps"],
)
async def test_the_puller_refuses_header_only_chunks_it_cannot_trust(
    frames: Callable[[str], list[bytes]], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shared_memory, "DEFAULT_RING_BYTES", 9 * BLOCK)
    prefill = _Prefill(num_tokens=9, frames=lambda request: frames(request.request_id))
    if message == "this pull offered no shared memory":

        def refuse(size: int) -> SharedSegment:
            raise OSError("no /dev/shm here")

        monkeypatch.setattr(SharedSegment, "create", staticmethod(refuse))
    error, _, caches = await _pull(prefill, "r", b"t" * 16)
    assert error is not None and "rejected a chunk" in error and message in error, error
    assert not any(cache.any() for cache in caches), "a refused chunk was written"


# ---------------------------------------------------------------- across processes


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_a_cluster_with_kv_transfer_shm_moves_every_kv_byte_through_segments_and_leaves_none() -> None:
    """`kvservice serve --role decode --kv-transfer-shm` with a prefill worker on this host:
    the output is the colocated engine's, every pulled byte went through a segment (both
    workers' stats say so), and no segment outlives the cluster."""
    from conftest import local_cluster, tiny_greedy

    from kvservice.client.client import KVServiceClient

    every_segment = set(os.listdir(shared_memory.SHM_DIR))
    prompts = [list(range(3, 3 + n)) for n in (5, 40, 130)]  # 1 to 9 blocks of 16 tokens
    async with local_cluster("tiny", worker_args=["--num-threads", "1", "--kv-transfer-shm"]) as cluster:
        async with KVServiceClient(cluster.address) as client:
            outputs = [
                list((await client.complete(p, timeout=60, max_tokens=6, temperature=0, ignore_eos=True)).token_ids)
                for p in prompts
            ]
        async with (
            KVServiceClient(cluster.decode_addresses[0]) as decode,
            KVServiceClient(cluster.prefill_addresses[0]) as prefill,
        ):
            received, sent = (await decode.stats()).kv_receiving, (await prefill.stats()).kv_sending
    assert outputs == tiny_greedy(prompts, 6)
    assert (received.num_transfers, received.num_failed_transfers) == (len(prompts), 0)
    assert received.num_bytes > 0 and received.num_shared_memory_bytes == received.num_bytes
    assert sent.num_shared_memory_bytes == sent.num_bytes == received.num_bytes
    assert {n for n in os.listdir(shared_memory.SHM_DIR) if n.startswith("kvservice-kv-")} <= every_segment


def test_the_sweep_removes_old_names_of_dead_pullers_only() -> None:
    import subprocess
    import sys
    import time

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    dead_pid = int(dead.stdout)
    old = time.time() - 2 * shared_memory.ORPHAN_AGE_SECONDS
    names = {
        "orphan": f"kvservice-kv-{dead_pid}-{secrets.token_hex(16)}",
        "fresh": f"kvservice-kv-{dead_pid}-{secrets.token_hex(16)}",  # its pull may be starting right now
        "alive": f"kvservice-kv-{os.getpid()}-{secrets.token_hex(16)}",
        "not-ours": f"other-{dead_pid}-{secrets.token_hex(16)}",
    }
    paths = {kind: os.path.join(shared_memory.SHM_DIR, name) for kind, name in names.items()}
    try:
        for kind, path in paths.items():
            with open(path, "wb"):
                pass
            if kind != "fresh":
                os.utime(path, (old, old))
        assert shared_memory.sweep_orphaned_segments() >= 1
        assert {kind for kind, path in paths.items() if os.path.exists(path)} == {"fresh", "alive", "not-ours"}
    finally:
        for path in paths.values():
            if os.path.exists(path):
                os.unlink(path)
