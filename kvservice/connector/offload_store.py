"""KV offload tiers: where full blocks the prefix cache evicts go instead of vanishing.

A tier maps a block's prefix-cache hash (`kvservice.core.block_hash`, an int) to the bytes
of that block's KV, every layer's K and V (`pack_block`). Its contract (`KVTier`):

- `write(block_hash, payload)` stores a block or returns False (full, off, refused); it
  never raises for disk trouble. Equal hashes mean equal prefixes, so a block already
  stored is not written again.
- `contains(block_hash)` answers a prefix lookup from memory, without touching the disk.
- `read(block_hash)` returns the payload, or None when it is absent or failed validation.
  A True `contains` is a hint, not a promise: the block may be evicted or dropped before
  the read.
- `stats` is a snapshot, safe to take from any thread.

`DiskKVStore` keeps one file per block in `DIR/blocks/<hash as 16 hex digits>.kv`:

    header (48 bytes, little-endian)              payload
    magic "KVOB" | format version u32 |           the block's KV bytes
    fingerprint digest 16 B | block hash u64 |
    payload length u64 | CRC-32 of payload u32 | 4 zero bytes

`DIR/store.json` names the format version, the `StoreFingerprint` (model, KV dtype, block
size, layers, KV heads, head dim) and its digest; a store written for another fingerprint is
reset, never served. `DIR/lock` is held with `flock` by the one store using the directory.
Files are written to a temporary name and renamed, so a crash never leaves a partial block
under a real name. The block files never total more than `capacity_bytes` (least recently
used evicted first), and any OSError turns the store off (one warning) instead of raising.

`HostMemoryKVStore` is the same contract in memory. `kvservice.connector.offload_io` runs a
tier's reads and writes on a thread of its own and packs a block's layers into one payload.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import pathlib
import socket
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvservice.connector.wire import checksum, dtype_from_name, dtype_name
from kvservice.model.kv_cache import KVCacheLayout

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
STORE_FILE = "store.json"
LOCK_FILE = "lock"
BLOCKS_DIR = "blocks"
_BLOCK_SUFFIX = ".kv"
_TMP_SUFFIX = ".tmp"
_MAGIC = b"KVOB"
# magic, format version, fingerprint digest, block hash, payload length, CRC-32, padding to 48
_HEADER = struct.Struct("<4sI16sQQI4x")
HEADER_SIZE = _HEADER.size
_DIGEST_BYTES = 16
_MAX_HASH = (1 << 64) - 1


class OffloadStoreLockedError(RuntimeError):
    """Another store (in this process or another) already uses the directory."""


@dataclass(frozen=True, slots=True)
class StoreFingerprint:
    """What decides a block's bytes besides its tokens: blocks are served only to an equal fingerprint."""

    model_id: str
    dtype: str  # a KV dtype's wire name: "float32", "bfloat16", "float16", "int8"
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id:
            raise ValueError(f"StoreFingerprint.model_id must be a non-empty string, got {self.model_id!r}")
        dtype_from_name(self.dtype)
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"StoreFingerprint.{name} must be a positive int, got {value!r}")

    @classmethod
    def from_layout(cls, model_id: str, layout: KVCacheLayout) -> StoreFingerprint:
        return cls(
            model_id,
            dtype_name(layout.dtype),
            layout.block_size,
            layout.num_layers,
            layout.num_kv_heads,
            layout.head_dim,
        )

    @property
    def digest(self) -> str:
        """32 hex digits, stable across processes and Python versions."""
        fields = json.dumps(dataclasses.asdict(self), sort_keys=True).encode()
        return hashlib.blake2b(fields, digest_size=_DIGEST_BYTES, person=b"kvs-offload").hexdigest()


@dataclass(frozen=True, slots=True)
class KVTierStats:
    """A snapshot of one tier's counters (since it was opened)."""

    num_blocks: int
    bytes_used: int  # what counts against the capacity: on disk, the block files' sizes, headers included
    capacity_bytes: int
    num_blocks_written: int
    num_bytes_written: int  # payload bytes
    num_blocks_read: int  # reads that returned a block
    num_bytes_read: int  # payload bytes
    num_hits: int  # `contains` lookups that found the block
    num_misses: int  # `contains` lookups that did not
    num_blocks_evicted: int  # least recently used, to make room (or because the capacity shrank)
    num_blocks_dropped: int  # failed validation on read, deleted
    is_enabled: bool


@dataclass(slots=True)
class _Counts:
    num_blocks_written: int = 0
    num_bytes_written: int = 0
    num_blocks_read: int = 0
    num_bytes_read: int = 0
    num_hits: int = 0
    num_misses: int = 0
    num_blocks_evicted: int = 0
    num_blocks_dropped: int = 0

    def count_lookup(self, found: bool) -> bool:
        """Count one `contains` lookup as a hit or a miss; returns `found`."""
        if found:
            self.num_hits += 1
        else:
            self.num_misses += 1
        return found

    def snapshot(self, num_blocks: int, bytes_used: int, capacity_bytes: int, is_enabled: bool) -> KVTierStats:
        return KVTierStats(num_blocks, bytes_used, capacity_bytes, **dataclasses.asdict(self), is_enabled=is_enabled)


class _Changes:
    """The blocks that entered and left a store, in order, since the last `take`: what its
    worker's KV events say of it. Recorded only once someone takes them (a worker that
    publishes no events keeps no list)."""

    def __init__(self) -> None:
        self._changes: list[tuple[bool, int]] = []  # (stored?, block hash)
        self._is_recording = False

    def stored(self, block_hash: int) -> None:
        if self._is_recording:
            self._changes.append((True, block_hash))

    def removed(self, block_hashes: Iterable[int]) -> None:
        if self._is_recording:
            self._changes.extend((False, block_hash) for block_hash in block_hashes)

    def take(self) -> list[tuple[bool, int]]:
        self._is_recording = True
        changes, self._changes = self._changes, []
        return changes


@runtime_checkable
class KVTier(Protocol):
    """One level of KV storage below the device cache, keyed by prefix-cache block hash.

    Reads and writes may come from an I/O thread while another thread takes `stats`:
    implementations guard their state. Nothing raises for storage trouble.
    """

    def contains(self, block_hash: int) -> bool:
        """Whether the block is held (a hint: a later `read` may still return None)."""
        ...

    def read(self, block_hash: int) -> bytes | None:
        """The block's payload; None when absent or dropped by validation."""
        ...

    def write(self, block_hash: int, payload: bytes | memoryview) -> bool:
        """Store a block, evicting least recently used ones to make room; False when not stored."""
        ...

    @property
    def stats(self) -> KVTierStats: ...

    def block_hashes(self) -> list[int]:
        """Every block held now (empty when the tier is off)."""
        ...

    def take_changes(self) -> list[tuple[bool, int]]:
        """(stored?, block hash) for each block written or removed since the last call, in order;
        recording starts with the first call."""
        ...


def _check_hash(block_hash: int) -> None:
    if not 0 < block_hash <= _MAX_HASH:
        raise ValueError(f"a block hash is an unsigned 64-bit int other than 0, got {block_hash}")


class HostMemoryKVStore:
    """A bounded LRU of payloads in memory: the tier a GPU worker puts between its device and the disk."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._blocks: OrderedDict[int, bytes] = OrderedDict()  # least recently used first
        self._bytes_used = 0
        self._counts = _Counts()
        self._changes = _Changes()

    def contains(self, block_hash: int) -> bool:
        with self._lock:
            return self._counts.count_lookup(block_hash in self._blocks)

    def block_hashes(self) -> list[int]:
        with self._lock:
            return list(self._blocks)

    def take_changes(self) -> list[tuple[bool, int]]:
        with self._lock:
            return self._changes.take()

    def read(self, block_hash: int) -> bytes | None:
        with self._lock:
            payload = self._blocks.get(block_hash)
            if payload is not None:
                self._blocks.move_to_end(block_hash)
                self._counts.num_blocks_read += 1
                self._counts.num_bytes_read += len(payload)
            return payload

    def write(self, block_hash: int, payload: bytes | memoryview) -> bool:
        _check_hash(block_hash)
        data = bytes(payload)
        with self._lock:
            if len(data) > self.capacity_bytes:
                return False
            if block_hash in self._blocks:
                self._blocks.move_to_end(block_hash)
                return True
            while self._bytes_used + len(data) > self.capacity_bytes:
                evicted_hash, evicted = self._blocks.popitem(last=False)
                self._bytes_used -= len(evicted)
                self._counts.num_blocks_evicted += 1
                self._changes.removed((evicted_hash,))
            self._blocks[block_hash] = data
            self._changes.stored(block_hash)
            self._bytes_used += len(data)
            self._counts.num_blocks_written += 1
            self._counts.num_bytes_written += len(data)
            return True

    @property
    def stats(self) -> KVTierStats:
        with self._lock:
            return self._counts.snapshot(len(self._blocks), self._bytes_used, self.capacity_bytes, True)


def _block_problem(header: bytes, payload: bytes, block_hash: int, digest: bytes) -> str | None:
    """Why a block file cannot be served, or None when it is sound."""
    if len(header) < HEADER_SIZE:
        return f"truncated header ({len(header)} of {HEADER_SIZE} bytes)"
    magic, version, file_digest, file_hash, length, crc = _HEADER.unpack(header)
    if magic != _MAGIC:
        return f"bad magic {magic!r}"
    if version != FORMAT_VERSION:
        return f"format version {version}, expected {FORMAT_VERSION}"
    if file_digest != digest:
        return f"written for fingerprint {file_digest.hex()}, not this store's {digest.hex()}"
    if file_hash != block_hash:
        return f"holds block {file_hash:016x}"
    if len(payload) != length:
        shape = "truncated" if len(payload) < length else "too long"
        return f"payload {shape} ({len(payload)} bytes read, its header says {length})"
    if checksum(payload) != crc:
        return "CRC-32 mismatch (corrupted payload)"
    return None


def _manifest_problem(stored_bytes: bytes, expected: dict[str, object]) -> str | None:
    """Why a store.json is not this store's, or None when it is."""
    try:
        stored = json.loads(stored_bytes)
    except ValueError as e:
        return f"{STORE_FILE} is unreadable ({e})"
    if not isinstance(stored, dict):
        return f"{STORE_FILE} is not a JSON object"
    if stored.get("format_version") != FORMAT_VERSION:
        return f"format version {stored.get('format_version')!r}, this worker writes {FORMAT_VERSION}"
    theirs, ours = stored.get("fingerprint"), expected["fingerprint"]
    assert isinstance(ours, dict)
    if not isinstance(theirs, dict):
        return f"{STORE_FILE} has no fingerprint"
    changed = [
        f"{name} {theirs.get(name)!r} (this worker: {value!r})"
        for name, value in ours.items()
        if theirs.get(name) != value
    ]
    if changed:
        return "written for another model or layout: " + ", ".join(changed)
    if stored.get("digest") != expected["digest"]:
        return f"its digest {stored.get('digest')!r} does not match its fingerprint"
    return None


def _write_file_atomically(
    path: pathlib.Path, parts: Sequence[bytes | memoryview], mtime_ns: int | None, fsync: bool
) -> None:
    """Write `parts` to a temporary name and rename it to `path`: `path` is whole or absent."""
    tmp = path.with_name(path.name + _TMP_SUFFIX)
    try:
        with open(tmp, "wb") as f:
            for part in parts:
                f.write(part)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        if mtime_ns is not None:
            os.utime(tmp, ns=(mtime_ns, mtime_ns))
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if fsync:
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _describe_holder(fd: int) -> str:
    try:
        holder = json.loads(os.pread(fd, 4096, 0))
        return f"{holder['label']!r} (pid {holder['pid']} on {holder['hostname']})"
    except (OSError, ValueError, TypeError, KeyError):
        return "a holder that has not written its name yet"


class DiskKVStore:
    """The disk tier: one file per block, at most `capacity_bytes` on disk, least recently used evicted first.

    Opening takes the directory's lock (OffloadStoreLockedError if another store holds it),
    resets a store written for another fingerprint, and rebuilds the LRU order from the
    files' modification times (reads and writes set them). Any OSError turns the store
    off for good, with one warning: every later call is a no-op. `label` names this owner
    (e.g. "decode-0") in the lock file; `fsync` makes every write durable before it counts.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        capacity_bytes: int,
        fingerprint: StoreFingerprint,
        *,
        label: str = "",
        fsync: bool = False,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.directory = pathlib.Path(directory)
        self.capacity_bytes = capacity_bytes
        self.fingerprint = fingerprint
        self.label = label
        self._fsync = fsync
        self._digest = bytes.fromhex(fingerprint.digest)
        self._blocks_dir = self.directory / BLOCKS_DIR
        self._lock = threading.Lock()
        self._entries: OrderedDict[int, int] = OrderedDict()  # block hash -> bytes on disk, least recently used first
        self._bytes_used = 0
        self._last_mtime_ns = 0
        self._lock_fd: int | None = None
        self._is_enabled = True
        self._counts = _Counts()
        self._changes = _Changes()
        try:
            self._open()
        except OSError as e:
            self._disable(f"cannot open the store: {e}")

    # ------------------------------------------------------------ the KVTier contract

    def contains(self, block_hash: int) -> bool:
        with self._lock:
            if not self._is_enabled:
                return False
            return self._counts.count_lookup(block_hash in self._entries)

    def block_hashes(self) -> list[int]:
        with self._lock:
            return list(self._entries) if self._is_enabled else []

    def take_changes(self) -> list[tuple[bool, int]]:
        with self._lock:
            return self._changes.take()

    def read(self, block_hash: int) -> bytes | None:
        with self._lock:
            if not self._is_enabled or block_hash not in self._entries:
                return None
            try:
                with open(self._path(block_hash), "rb") as f:
                    # One byte past the size it was written with: a file grown since is caught, not read whole.
                    header, payload = f.read(HEADER_SIZE), f.read(max(self._entries[block_hash] - HEADER_SIZE + 1, 0))
                problem = _block_problem(header, payload, block_hash, self._digest)
                if problem is not None:
                    self._drop(block_hash, problem)
                    return None
                self._touch(block_hash)
            except FileNotFoundError:
                self._bytes_used -= self._entries.pop(block_hash)  # removed behind our back
                self._changes.removed((block_hash,))
                return None
            except OSError as e:
                self._disable(f"reading block {block_hash:016x}: {e}")
                return None
            self._counts.num_blocks_read += 1
            self._counts.num_bytes_read += len(payload)
            return payload

    def write(self, block_hash: int, payload: bytes | memoryview) -> bool:
        _check_hash(block_hash)
        data = memoryview(payload).cast("B")
        size = HEADER_SIZE + data.nbytes
        with self._lock:
            if not self._is_enabled or size > self.capacity_bytes:
                return False
            try:
                if block_hash in self._entries:
                    self._touch(block_hash)  # equal hash, equal KV: nothing to rewrite
                    return True
                self._evict_until_fits(size)
                header = _HEADER.pack(_MAGIC, FORMAT_VERSION, self._digest, block_hash, data.nbytes, checksum(data))
                _write_file_atomically(self._path(block_hash), (header, data), self._next_mtime_ns(), self._fsync)
            except OSError as e:
                self._disable(f"writing block {block_hash:016x}: {e}")
                return False
            self._entries[block_hash] = size
            self._bytes_used += size
            self._changes.stored(block_hash)
            self._counts.num_blocks_written += 1
            self._counts.num_bytes_written += data.nbytes
            return True

    @property
    def stats(self) -> KVTierStats:
        with self._lock:
            return self._counts.snapshot(len(self._entries), self._bytes_used, self.capacity_bytes, self._is_enabled)

    @property
    def is_enabled(self) -> bool:
        with self._lock:
            return self._is_enabled

    def close(self) -> None:
        """Release the directory's lock; the store is off afterwards. Idempotent."""
        with self._lock:
            self._is_enabled = False
            if self._lock_fd is not None:
                os.close(self._lock_fd)  # closing the descriptor releases its flock
                self._lock_fd = None

    def __enter__(self) -> DiskKVStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------ opening

    def _open(self) -> None:
        self._blocks_dir.mkdir(parents=True, exist_ok=True)
        self._take_lock()
        self._adopt_or_reset()
        self._load_entries()
        self._evict_until_fits(0)  # the capacity may have shrunk since the last run

    def _take_lock(self) -> None:
        path = self.directory / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe_holder(fd)
            os.close(fd)
            raise OffloadStoreLockedError(
                f"KV offload store {self.directory} is in use: {path} is held by {holder}"
            ) from None
        except OSError:
            os.close(fd)
            raise
        self._lock_fd = fd
        owner = {"pid": os.getpid(), "hostname": socket.gethostname(), "label": self.label}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(owner).encode(), 0)

    def _adopt_or_reset(self) -> None:
        """Keep the blocks of a store with this fingerprint; remove any other's. Then (re)write
        store.json, which also proves the directory writable."""
        manifest: dict[str, object] = {
            "format_version": FORMAT_VERSION,
            "digest": self.fingerprint.digest,
            "fingerprint": dataclasses.asdict(self.fingerprint),
        }
        path = self.directory / STORE_FILE
        if path.exists():
            problem = _manifest_problem(path.read_bytes(), manifest)
        else:
            problem = f"blocks without a {STORE_FILE}" if any(self._blocks_dir.iterdir()) else None
        if problem is not None:
            logger.warning("KV offload store %s: reset, its blocks are not served: %s", self.directory, problem)
            with os.scandir(self._blocks_dir) as entries:
                for entry in entries:
                    os.unlink(entry.path)
        _write_file_atomically(path, (json.dumps(manifest, indent=2).encode(),), None, self._fsync)

    def _load_entries(self) -> None:
        found: list[tuple[int, str, int, int]] = []  # (mtime, name, block hash, size)
        with os.scandir(self._blocks_dir) as entries:
            for entry in entries:
                if entry.name.endswith(_TMP_SUFFIX):
                    os.unlink(entry.path)  # a write cut short
                    continue
                block_hash = _hash_of_name(entry.name)
                if block_hash is not None:
                    stat = entry.stat()
                    found.append((stat.st_mtime_ns, entry.name, block_hash, stat.st_size))
        for _, _, block_hash, size in sorted(found):
            self._entries[block_hash] = size
            self._bytes_used += size
        self._last_mtime_ns = max((mtime for mtime, *_ in found), default=0)

    # ------------------------------------------------------------ with the lock held

    def _path(self, block_hash: int) -> pathlib.Path:
        return self._blocks_dir / f"{block_hash:016x}{_BLOCK_SUFFIX}"

    def _next_mtime_ns(self) -> int:
        # Strictly increasing, so the LRU order survives a reopen even within one clock tick.
        self._last_mtime_ns = max(time.time_ns(), self._last_mtime_ns + 1)
        return self._last_mtime_ns

    def _touch(self, block_hash: int) -> None:
        mtime_ns = self._next_mtime_ns()
        os.utime(self._path(block_hash), ns=(mtime_ns, mtime_ns))
        self._entries.move_to_end(block_hash)

    def _evict_until_fits(self, num_bytes: int) -> None:
        while self._entries and self._bytes_used + num_bytes > self.capacity_bytes:
            block_hash, size = self._entries.popitem(last=False)
            self._bytes_used -= size
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path(block_hash))
            self._counts.num_blocks_evicted += 1
            self._changes.removed((block_hash,))

    def _drop(self, block_hash: int, problem: str) -> None:
        path = self._path(block_hash)
        logger.warning("KV offload store: dropped %s: %s", path, problem)
        self._bytes_used -= self._entries.pop(block_hash)
        self._counts.num_blocks_dropped += 1
        self._changes.removed((block_hash,))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def _disable(self, reason: str) -> None:
        if self._is_enabled:
            self._is_enabled = False
            self._changes.removed(self._entries)  # off: none of them is served any more
            logger.warning("KV offload store %s turned itself off (no reads or writes): %s", self.directory, reason)


def _hash_of_name(name: str) -> int | None:
    stem, suffix = name[: -len(_BLOCK_SUFFIX)], name[-len(_BLOCK_SUFFIX) :]
    if suffix != _BLOCK_SUFFIX or len(stem) != 16:
        return None
    try:
        block_hash = int(stem, 16)
    except ValueError:
        return None
    return block_hash if f"{block_hash:016x}" == stem and block_hash != 0 else None
