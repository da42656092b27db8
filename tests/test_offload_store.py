"""Tests for kvservice.connector.offload_store: the disk and host KV tiers, their I/O thread and payloads."""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import pathlib
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest
import torch

from kvservice.connector import offload_store
from kvservice.connector.offload_io import OffloadIO, pack_block, unpack_block
from kvservice.connector.offload_store import (
    BLOCKS_DIR,
    HEADER_SIZE,
    LOCK_FILE,
    STORE_FILE,
    DiskKVStore,
    HostMemoryKVStore,
    KVTier,
    KVTierStats,
    OffloadStoreLockedError,
    StoreFingerprint,
)
from kvservice.model.kv_cache import KVCacheLayout

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
LOGGER = offload_store.logger.name
FINGERPRINT = StoreFingerprint("tiny-llama", "float32", block_size=16, num_layers=2, num_kv_heads=2, head_dim=8)
PAYLOAD_SIZE = 1000
BLOCK_BYTES = HEADER_SIZE + PAYLOAD_SIZE  # one block on disk


def _payload(seed: int, size: int = PAYLOAD_SIZE) -> bytes:
    return random.Random(seed).randbytes(size)


def _store(
    directory: pathlib.Path, num_blocks: int = 8, fingerprint: StoreFingerprint = FINGERPRINT, label: str = ""
) -> DiskKVStore:
    """A store with room for exactly `num_blocks` blocks of PAYLOAD_SIZE."""
    return DiskKVStore(directory, num_blocks * BLOCK_BYTES, fingerprint, label=label)


def _block_file(directory: pathlib.Path, block_hash: int) -> pathlib.Path:
    return directory / BLOCKS_DIR / f"{block_hash:016x}.kv"


def _bytes_on_disk(directory: pathlib.Path) -> int:
    with os.scandir(directory / BLOCKS_DIR) as entries:
        return sum(entry.stat().st_size for entry in entries)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


# ---------------------------------------------------------------- fingerprint


def test_fingerprint_digest_is_pinned_and_covers_every_field() -> None:
    # Pinned: a changed digest scheme would silently reset every store on upgrade.
    assert FINGERPRINT.digest == "31d77da3d62e83e41a40e935d316b013"
    assert StoreFingerprint(**dataclasses.asdict(FINGERPRINT)).digest == FINGERPRINT.digest
    changes = dict(model_id="other", dtype="bfloat16", block_size=32, num_layers=3, num_kv_heads=4, head_dim=16)
    digests = {dataclasses.replace(FINGERPRINT, **{name: value}).digest for name, value in changes.items()}
    assert len(digests) == len(changes) and FINGERPRINT.digest not in digests


def test_fingerprint_from_layout_and_validation() -> None:
    layout = KVCacheLayout(num_layers=2, block_size=16, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    assert StoreFingerprint.from_layout("tiny-llama", layout) == FINGERPRINT
    with pytest.raises(ValueError, match="block_size"):
        StoreFingerprint("m", "float32", 0, 2, 2, 8)
    with pytest.raises(ValueError, match="model_id"):
        StoreFingerprint("", "float32", 16, 2, 2, 8)
    with pytest.raises(ValueError, match="int4"):  # int8 is a KV dtype (--kv-cache-dtype int8)
        StoreFingerprint("m", "int4", 16, 2, 2, 8)


# ---------------------------------------------------------------- the disk tier


def test_round_trip_and_stats(tmp_path: pathlib.Path) -> None:
    with _store(tmp_path) as store:
        assert isinstance(store, KVTier) and store.is_enabled
        assert store.write(1, _payload(1))
        assert store.write(2, memoryview(_payload(2)))
        assert store.contains(1) and store.contains(2) and not store.contains(3)
        assert store.read(1) == _payload(1) and store.read(2) == _payload(2)
        assert store.read(3) is None
        assert store.stats == KVTierStats(
            num_blocks=2,
            bytes_used=2 * BLOCK_BYTES,
            capacity_bytes=8 * BLOCK_BYTES,
            num_blocks_written=2,
            num_bytes_written=2 * PAYLOAD_SIZE,
            num_blocks_read=2,
            num_bytes_read=2 * PAYLOAD_SIZE,
            num_hits=2,
            num_misses=1,
            num_blocks_evicted=0,
            num_blocks_dropped=0,
            is_enabled=True,
        )
        manifest = json.loads((tmp_path / STORE_FILE).read_text())
        assert manifest["digest"] == FINGERPRINT.digest and manifest["fingerprint"]["block_size"] == 16


def test_writing_a_stored_hash_again_keeps_the_first_copy(tmp_path: pathlib.Path) -> None:
    with _store(tmp_path) as store:
        assert store.write(1, _payload(1))
        assert store.write(1, _payload(99))  # equal hash means equal KV: not rewritten
        assert store.read(1) == _payload(1)
        assert store.stats.num_blocks_written == 1


def test_the_bound_holds_under_many_writes(tmp_path: pathlib.Path) -> None:
    capacity = 5 * BLOCK_BYTES + BLOCK_BYTES // 2  # room for 5 blocks, not 6
    with DiskKVStore(tmp_path, capacity, FINGERPRINT) as store:
        for block_hash in range(1, 51):
            assert store.write(block_hash, _payload(block_hash))
            on_disk = _bytes_on_disk(tmp_path)
            assert on_disk == store.stats.bytes_used <= capacity
        stats = store.stats
        assert stats.num_blocks == 5 and stats.num_blocks_evicted == 45
        assert [h for h in range(1, 51) if store.contains(h)] == [46, 47, 48, 49, 50]
        assert not store.write(99, _payload(99, size=capacity))  # bigger than the whole store
        assert store.is_enabled and store.stats.num_blocks == 5


def test_eviction_is_least_recently_used_and_a_read_block_survives(tmp_path: pathlib.Path) -> None:
    with _store(tmp_path, num_blocks=3) as store:
        for block_hash in (1, 2, 3):
            store.write(block_hash, _payload(block_hash))
        assert store.read(1) == _payload(1)
        assert store.write(4, _payload(4))
        assert [store.contains(h) for h in (1, 2, 3, 4)] == [True, False, True, True]
        assert not _block_file(tmp_path, 2).exists()


@pytest.mark.parametrize("is_clock_frozen", [False, True], ids=["clock", "frozen-clock"])
def test_warm_reopen_serves_the_blocks_in_their_lru_order(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, is_clock_frozen: bool
) -> None:
    if is_clock_frozen:  # timestamps that do not move between writes: coarse clocks, a clock set back
        monkeypatch.setattr(time, "time_ns", lambda: 1_700_000_000_000_000_000)
    with _store(tmp_path, num_blocks=3, label="decode-0") as store:
        for block_hash in (1, 2, 3):
            store.write(block_hash, _payload(block_hash))
        store.read(1)  # order now 2, 3, 1
    with _store(tmp_path, num_blocks=3, label="decode-0") as store:
        assert store.stats.num_blocks == 3 and store.stats.bytes_used == 3 * BLOCK_BYTES
        assert store.write(4, _payload(4))  # evicts 2, the least recently used before the restart
        assert [store.contains(h) for h in (1, 2, 3, 4)] == [True, False, True, True]
        assert store.read(3) == _payload(3)  # order now 1, 4, 3
    with _store(tmp_path, num_blocks=3) as store:  # a second restart orders the two runs' touches together
        assert store.write(5, _payload(5))
        assert [store.contains(h) for h in (1, 3, 4, 5)] == [False, True, True, True]
        assert store.read(1) is None and store.read(3) == _payload(3) and store.read(4) == _payload(4)


def test_reopening_with_a_smaller_capacity_evicts_down_to_it(tmp_path: pathlib.Path) -> None:
    with _store(tmp_path, num_blocks=4) as store:
        for block_hash in (1, 2, 3, 4):
            store.write(block_hash, _payload(block_hash))
    with _store(tmp_path, num_blocks=2) as store:
        assert [store.contains(h) for h in (1, 2, 3, 4)] == [False, False, True, True]
        assert store.stats.num_blocks_evicted == 2
        assert _bytes_on_disk(tmp_path) == 2 * BLOCK_BYTES


def test_a_write_cut_short_is_removed_on_reopen(tmp_path: pathlib.Path) -> None:
    with _store(tmp_path) as store:
        store.write(1, _payload(1))
    leftover = tmp_path / BLOCKS_DIR / f"{2:016x}.kv.tmp"
    leftover.write_bytes(b"half a block")
    with _store(tmp_path) as store:
        assert not leftover.exists() and store.stats.num_blocks == 1 and not store.contains(2)


def _truncate(path: pathlib.Path, other: pathlib.Path) -> None:
    path.write_bytes(path.read_bytes()[: HEADER_SIZE + PAYLOAD_SIZE // 2])


def _truncate_header(path: pathlib.Path, other: pathlib.Path) -> None:
    path.write_bytes(path.read_bytes()[: HEADER_SIZE // 2])


def _append_bytes(path: pathlib.Path, other: pathlib.Path) -> None:
    path.write_bytes(path.read_bytes() + bytes(10_000))


def _flip_a_payload_bit(path: pathlib.Path, other: pathlib.Path) -> None:
    data = bytearray(path.read_bytes())
    data[HEADER_SIZE + 123] ^= 0x10
    path.write_bytes(bytes(data))


def _bad_magic(path: pathlib.Path, other: pathlib.Path) -> None:
    path.write_bytes(b"XXXX" + path.read_bytes()[4:])


def _another_blocks_file(path: pathlib.Path, other: pathlib.Path) -> None:
    path.write_bytes(_block_file(path.parent.parent, 2).read_bytes())


def _another_fingerprints_file(path: pathlib.Path, other: pathlib.Path) -> None:
    fingerprint = StoreFingerprint("tiny-llama", "float32", 32, 2, 2, 8)
    with DiskKVStore(other, 8 * BLOCK_BYTES, fingerprint) as store:
        store.write(1, _payload(1))
    path.write_bytes(_block_file(other, 1).read_bytes())


@pytest.mark.parametrize(
    ("corrupt", "reason"),
    [
        (_truncate, "truncated"),
        (_truncate_header, "truncated header"),
        (_append_bytes, "too long"),
        (_flip_a_payload_bit, "CRC-32"),
        (_bad_magic, "magic"),
        (_another_blocks_file, "holds block"),
        (_another_fingerprints_file, "fingerprint"),
    ],
)
def test_a_block_failing_validation_is_dropped_never_served(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture, corrupt: object, reason: str
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    directory = tmp_path / "store"
    with _store(directory) as store:
        store.write(1, _payload(1))
        store.write(2, _payload(2))
        path = _block_file(directory, 1)
        corrupt(path, tmp_path / "other")  # type: ignore[operator]
        assert store.read(1) is None
        assert not path.exists() and not store.contains(1)
        assert store.read(2) == _payload(2)  # its neighbour is untouched
        stats = store.stats
        assert stats.num_blocks_dropped == 1 and stats.num_blocks == 1 and stats.bytes_used == BLOCK_BYTES
        assert store.is_enabled
    [line] = _warnings(caplog)
    assert str(path) in line and reason in line


def test_a_store_of_another_block_size_is_reset_not_served(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with _store(tmp_path) as store:
        store.write(1, _payload(1))
    other = StoreFingerprint("tiny-llama", "float32", 32, 2, 2, 8)
    with _store(tmp_path, fingerprint=other) as store:
        assert not store.contains(1) and store.read(1) is None and store.stats.num_blocks == 0
        assert not _block_file(tmp_path, 1).exists()
        assert json.loads((tmp_path / STORE_FILE).read_text())["digest"] == other.digest
    [line] = _warnings(caplog)
    assert "reset" in line and "block_size 16 (this worker: 32)" in line


def _remove(path: pathlib.Path) -> None:
    path.unlink()


def _rewrite(**changes: object) -> Callable[[pathlib.Path], None]:
    def rewrite(path: pathlib.Path) -> None:
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))

    return rewrite


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (_remove, f"blocks without a {STORE_FILE}"),
        (lambda path: path.write_text("{not json"), "unreadable"),
        (lambda path: path.write_text("[1, 2]"), "not a JSON object"),
        (_rewrite(format_version=2), "format version 2"),
        (_rewrite(fingerprint=None), "no fingerprint"),
        (_rewrite(digest="0" * 32), "does not match its fingerprint"),
    ],
    ids=["missing", "unreadable", "not-an-object", "format-version", "no-fingerprint", "digest"],
)
def test_a_store_json_not_of_this_store_resets_it(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture, change: Callable[[pathlib.Path], None], reason: str
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with _store(tmp_path) as store:
        store.write(1, _payload(1))
    change(tmp_path / STORE_FILE)
    with _store(tmp_path) as store:
        assert not store.contains(1) and store.read(1) is None and store.stats.num_blocks == 0
        assert store.is_enabled and store.write(2, _payload(2))
    assert not _block_file(tmp_path, 1).exists()
    [line] = _warnings(caplog)
    assert "reset" in line and reason in line
    with _store(tmp_path) as store:  # the store.json it wrote is its own: nothing more is reset
        assert store.read(2) == _payload(2)


# ---------------------------------------------------------------- faults


def _assert_off(store: DiskKVStore) -> None:
    assert not store.is_enabled and not store.stats.is_enabled
    assert not store.write(7, _payload(7))
    assert not store.contains(7) and store.read(7) is None


def test_a_directory_under_a_regular_file_turns_the_store_off(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    (tmp_path / "file").write_text("not a directory")
    with _store(tmp_path / "file" / "kv") as store:
        _assert_off(store)
    [line] = _warnings(caplog)
    assert "turned itself off" in line and "file" in line


def test_a_disk_full_at_start_turns_the_store_off(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)

    def full(src: object, dst: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "replace", full)
    with _store(tmp_path) as store:
        _assert_off(store)
    [line] = _warnings(caplog)
    assert os.strerror(errno.ENOSPC) in line
    assert not list((tmp_path / BLOCKS_DIR).iterdir())  # no temporary file left behind


def test_a_disk_full_mid_run_turns_the_store_off_and_keeps_earlier_blocks(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    store = _store(tmp_path, label="decode-0")
    assert store.write(1, _payload(1)) and store.write(2, _payload(2))
    before = {h: _block_file(tmp_path, h).read_bytes() for h in (1, 2)}
    real_replace, calls = os.replace, []

    def full(src: str, dst: str) -> None:
        calls.append(dst)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "replace", full)
    assert not store.write(3, _payload(3))
    _assert_off(store)
    assert len(calls) == 1  # off means off: no more disk I/O
    assert not store.contains(1) and store.read(1) is None  # not even for the blocks written before
    assert {h: _block_file(tmp_path, h).read_bytes() for h in (1, 2)} == before
    assert sorted(os.listdir(tmp_path / BLOCKS_DIR)) == [f"{h:016x}.kv" for h in (1, 2)]
    [line] = _warnings(caplog)
    assert "turned itself off" in line and os.strerror(errno.ENOSPC) in line and f"{3:016x}" in line
    store.close()
    monkeypatch.setattr(os, "replace", real_replace)
    with _store(tmp_path) as reopened:  # the disk has room again: the earlier blocks are served
        assert reopened.read(1) == _payload(1) and reopened.read(2) == _payload(2)


def test_a_read_error_turns_the_store_off(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with _store(tmp_path) as store:
        store.write(1, _payload(1))

        def broken_open(*args: object, **kwargs: object) -> None:
            raise OSError(errno.EIO, os.strerror(errno.EIO))

        monkeypatch.setattr(offload_store, "open", broken_open, raising=False)
        assert store.read(1) is None
        _assert_off(store)
    [line] = _warnings(caplog)
    assert os.strerror(errno.EIO) in line


# ---------------------------------------------------------------- the lock


def test_a_second_store_on_the_same_directory_is_refused(tmp_path: pathlib.Path) -> None:
    with _store(tmp_path, label="decode-0"):
        with pytest.raises(OffloadStoreLockedError) as refused:
            _store(tmp_path, label="decode-1")
        message = str(refused.value)
        assert str(tmp_path / LOCK_FILE) in message and "'decode-0'" in message and f"pid {os.getpid()}" in message
    with _store(tmp_path, label="decode-1") as store:  # released by close
        assert store.is_enabled


def test_a_store_held_by_another_process_is_refused(tmp_path: pathlib.Path) -> None:
    holder = (
        "import sys\n"
        "from kvservice.connector.offload_store import DiskKVStore, StoreFingerprint\n"
        "fingerprint = StoreFingerprint('tiny-llama', 'float32', 16, 2, 2, 8)\n"
        "with DiskKVStore(sys.argv[1], 1 << 20, fingerprint, label='prefill-7'):\n"
        "    print('opened', flush=True)\n"
        "    sys.stdin.read()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", holder, str(tmp_path)],
        cwd=REPO_ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "opened\n"
        with pytest.raises(OffloadStoreLockedError, match=rf"'prefill-7' \(pid {child.pid} on "):
            _store(tmp_path)
    finally:
        assert child.stdin is not None
        child.stdin.close()
        assert child.wait(timeout=60) == 0
    with _store(tmp_path) as store:  # the holder exited: the lock went with it
        assert store.is_enabled


# ---------------------------------------------------------------- threads


def test_stats_stay_consistent_while_another_thread_writes(tmp_path: pathlib.Path) -> None:
    with _store(tmp_path, num_blocks=4) as store:
        writer = threading.Thread(target=lambda: [store.write(h, _payload(h)) for h in range(1, 101)])
        writer.start()
        while writer.is_alive():
            stats = store.stats
            assert stats.bytes_used == stats.num_blocks * BLOCK_BYTES <= stats.capacity_bytes
        writer.join()
        assert store.stats.num_blocks_written == 100 and store.stats.num_blocks == 4


class _RecordingTier:
    """A host tier that records which thread called it."""

    def __init__(self) -> None:
        self.inner = HostMemoryKVStore(1 << 20)
        self.threads: set[str] = set()

    def contains(self, block_hash: int) -> bool:
        return self.inner.contains(block_hash)

    def read(self, block_hash: int) -> bytes | None:
        self.threads.add(threading.current_thread().name)
        return self.inner.read(block_hash)

    def write(self, block_hash: int, payload: bytes | memoryview) -> bool:
        self.threads.add(threading.current_thread().name)
        return self.inner.write(block_hash, payload)

    @property
    def stats(self) -> KVTierStats:
        return self.inner.stats


def test_offload_io_reads_and_writes_on_its_own_thread(tmp_path: pathlib.Path) -> None:
    tier = _RecordingTier()
    io = OffloadIO(tier, name="kv-offload-test")
    try:
        for block_hash in (1, 2, 3):
            assert io.submit_write(block_hash, _payload(block_hash))
        future = io.submit_read([3, 4, 1])
        assert future.result(timeout=30) == [_payload(3), None, _payload(1)]
    finally:
        io.close()
    assert tier.threads == {"kv-offload-test"}
    with pytest.raises(RuntimeError, match="closed"):
        io.submit_write(5, _payload(5))


def test_offload_io_over_a_disk_store(tmp_path: pathlib.Path) -> None:
    with _store(tmp_path) as store:
        io = OffloadIO(store)
        try:
            io.submit_write(1, _payload(1))
            assert io.submit_read([1, 2]).result(timeout=30) == [_payload(1), None]
        finally:
            io.close()


def test_closing_offload_io_runs_every_queued_write() -> None:
    tier = HostMemoryKVStore(1 << 20)
    io = OffloadIO(tier, max_pending=64)
    for block_hash in range(1, 41):
        assert io.submit_write(block_hash, _payload(block_hash, size=10))
    io.close()
    assert tier.stats.num_blocks_written == 40


class _BlockedTier(_RecordingTier):
    """Holds its first write until released; reads raise."""

    def __init__(self) -> None:
        super().__init__()
        self.is_writing = threading.Event()
        self.release = threading.Event()
        self.written: list[int] = []

    def write(self, block_hash: int, payload: bytes | memoryview) -> bool:
        self.is_writing.set()
        assert self.release.wait(timeout=60)
        self.written.append(block_hash)
        return True

    def read(self, block_hash: int) -> bytes | None:
        raise RuntimeError(f"tier bug reading {block_hash}")


def test_a_full_offload_io_queue_drops_and_counts() -> None:
    tier = _BlockedTier()
    io = OffloadIO(tier, max_pending=2)
    try:
        assert io.submit_write(1, b"a")
        assert tier.is_writing.wait(timeout=30)  # the thread holds write 1; the queue is empty
        assert io.submit_write(2, b"b") and io.submit_write(3, b"c")
        assert not io.submit_write(4, b"d")
        dropped_read = io.submit_read([5, 6])
        assert dropped_read.done() and dropped_read.result() == [None, None]
        assert (io.num_writes_dropped, io.num_reads_dropped) == (1, 1)
    finally:
        tier.release.set()
        io.close()
    assert tier.written == [1, 2, 3]


def test_a_failing_tier_read_reaches_the_future() -> None:
    tier = _BlockedTier()
    tier.release.set()
    io = OffloadIO(tier)
    try:
        with pytest.raises(RuntimeError, match="tier bug reading 9"):
            io.submit_read([9]).result(timeout=30)
    finally:
        io.close()


# ---------------------------------------------------------------- the host tier


def test_host_memory_store_bound_and_lru() -> None:
    store = HostMemoryKVStore(300)
    assert isinstance(store, KVTier)
    for block_hash in (1, 2, 3):
        assert store.write(block_hash, _payload(block_hash, size=100))
    assert store.read(1) == _payload(1, size=100)
    assert store.write(4, memoryview(_payload(4, size=100)))
    assert [store.contains(h) for h in (1, 2, 3, 4)] == [True, False, True, True]
    assert not store.write(5, _payload(5, size=301))
    stats = store.stats
    assert stats.bytes_used == 300 == stats.capacity_bytes and stats.num_blocks == 3
    assert stats.num_blocks_evicted == 1 and stats.num_blocks_written == 4
    assert (stats.num_hits, stats.num_misses) == (3, 1)


# ---------------------------------------------------------------- payloads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pack_unpack_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    layout = KVCacheLayout(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    # Blocks cut from real cache tensors ([2, num_blocks, ...] per layer): non-contiguous views.
    caches = [torch.randn(layout.blocks_shape(5), generator=gen).to(dtype) for _ in range(layout.num_layers)]
    layers = [cache[:, 3] for cache in caches]
    payload = pack_block(layers)
    assert len(payload) == layout.bytes_per_block
    unpacked = unpack_block(payload, layout)
    assert len(unpacked) == layout.num_layers
    int_view = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[dtype]
    for got, want in zip(unpacked, layers):
        assert got.dtype == dtype and got.shape == (2, 4, 2, 8)
        assert torch.equal(got.view(int_view), want.contiguous().view(int_view))


def test_pack_and_unpack_refuse_what_does_not_fit() -> None:
    layout = KVCacheLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    layer = torch.zeros(2, 4, 2, 8)
    with pytest.raises(ValueError, match="bytes"):
        unpack_block(pack_block([layer]), layout)  # one layer of two
    with pytest.raises(ValueError, match="bytes"):
        unpack_block(pack_block([layer, layer])[:-1], layout)
    with pytest.raises(ValueError, match="layer 1"):
        pack_block([layer, layer.to(torch.bfloat16)])
    with pytest.raises(ValueError, match="layer 1"):
        pack_block([layer, torch.zeros(2, 4, 2, 4)])
    with pytest.raises(ValueError, match=r"\[2, block_size"):
        pack_block([torch.zeros(4, 2, 8)])
    with pytest.raises(ValueError, match="at least one"):
        pack_block([])


# ---------------------------------------------------------------- what the KV events say of a store


def test_a_disk_store_reports_what_entered_and_left_it_in_order(tmp_path: pathlib.Path) -> None:
    with _store(tmp_path, num_blocks=2) as store:
        store.write(1, _payload(1))  # before anyone asked: not recorded
        assert store.take_changes() == []  # the first take starts the record
        store.write(2, _payload(2))
        store.write(3, _payload(3))  # evicts 1, the least recently used
        store.write(3, _payload(3))  # already held: no change
        _block_file(tmp_path, 2).write_bytes(b"corrupt")
        assert store.read(2) is None  # dropped by validation
        assert store.take_changes() == [(True, 2), (False, 1), (True, 3), (False, 2)]
        assert store.take_changes() == []
        assert store.block_hashes() == [3]


def test_a_disk_store_that_turns_itself_off_reports_every_block_gone(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _store(tmp_path) as store:
        store.take_changes()
        store.write(1, _payload(1))
        store.write(2, _payload(2))

        def full(src: str, dst: str) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "replace", full)
        assert not store.write(3, _payload(3))
        assert store.take_changes() == [(True, 1), (True, 2), (False, 1), (False, 2)]
        assert store.block_hashes() == []


def test_a_host_memory_store_reports_its_writes_and_evictions() -> None:
    store = HostMemoryKVStore(2 * PAYLOAD_SIZE)
    store.take_changes()
    for block_hash in (1, 2, 3):
        store.write(block_hash, _payload(block_hash))
    assert store.take_changes() == [(True, 1), (True, 2), (False, 1), (True, 3)]
    assert sorted(store.block_hashes()) == [2, 3]
