"""The same-host KV path: shared-memory segments the puller creates and reuses across pulls.

This path adds to the gRPC byte stream; it never replaces it.

A decode worker started with `--kv-transfer-shm` offers each pull a segment in /dev/shm,
named in `PullKVRequest.shared_memory`: one of its idle segments for that prefill worker
(`SegmentPool`), or a new one. A segment has mode 0600 and a name with 128 random bits.
The prefill worker checks the transfer token as always, then tries to open the segment.
That works only on the same host, with the same /dev/shm and a user allowed to open it:
- If it opens, chunks' bytes go into the segment and the stream carries only their headers
  (`in_shared_memory`, `shared_memory_position`).
- If it does not open, the bytes stream as usual and nothing else changes.

**Layout.** A control page, then a ring of `DEFAULT_RING_BYTES`.
- Fresh shared memory is costly: mapping new pages costs about as much per byte as the
  copies themselves, here about 0.75 s per GB. So a large pull reuses its ring instead of
  mapping all its bytes.
- A chunk occupies ring positions [p, p + n), which never wrap. The stream's order is the
  ring's order.
- The puller's progress is the control page's first 8 bytes: the ring position up to
  which it has read. The prefill worker writes a chunk only once the position where it
  would land has been read, polling every `POLL_SECONDS` while the ring is full.
- A chunk larger than the ring goes over the stream as bytes.

**Safety.**
- The puller bounds-checks every position against its segment before it reads there, so a
  peer cannot make it read outside its own segment.
- The puller unlinks the name when the first frame arrives, because the prefill worker
  opened the segment before it sent anything. After that, no other process can open it.
- A segment serves one pull at a time. Once a pull through it has completed (every chunk
  came through its ring), it serves the next pull from the same prefill worker, which keeps
  the segments it opened mapped (`OpenSegments`, by name: the name itself is gone). Mapping
  fresh pages for every pull cost as much as the gRPC stream's copies: a decode worker's
  transfer thread used 0.87 CPU-s a run that way, against 0.54 over gRPC. A segment whose
  pull failed, or that the prefill worker no longer holds (it streamed the bytes), is closed.
- A puller killed between creating a segment and the first frame leaves its name behind:
  a decode worker starting with `--kv-transfer-shm` removes such names of dead processes
  (`sweep_orphaned_segments`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import mmap
import os
import re
import secrets
import stat
import time

import numpy as np

SHM_DIR = "/dev/shm"
CONTROL_BYTES = 4096  # the first page: the puller's read position
# Four 2 MiB chunks in flight. Measured here, 256 MiB pulls, median GB/s by ring size:
# 4 MiB 2.2 (the writer waits), 8 MiB 2.6-3.3, 16 MiB 2.3-2.6, 32 MiB 2.1, 64 MiB 1.6 (mapping).
DEFAULT_RING_BYTES = 8 << 20
POLL_SECONDS = 0.0005  # the writer's wait while the ring is full
_NAME_PREFIX = "kvservice-kv-"
_NAME = re.compile(r"kvservice-kv-([0-9]{1,10})-[0-9a-f]{32}")
ORPHAN_AGE_SECONDS = 60.0  # a name this old whose creator is gone is an orphan

logger = logging.getLogger(__name__)
# Fault every page in when mapping: one pass in the kernel instead of a fault per page
# during the copies (Linux only; 0 elsewhere).
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


class SharedMemoryUnavailable(OSError):
    """This segment cannot be used here: the bytes go over the gRPC stream instead."""


class SharedSegment:
    """One pull's segment, mapped read-write: the control page and the ring."""

    def __init__(self, name: str, size: int, fd: int) -> None:
        self.name = name
        self.size = size
        self.ring_bytes = size - CONTROL_BYTES
        try:
            self._mmap: mmap.mmap | None = mmap.mmap(fd, size, mmap.MAP_SHARED | _MAP_POPULATE)
        finally:
            os.close(fd)  # the mapping keeps the segment alive
        self._array = np.frombuffer(self._mmap, dtype=np.uint8)
        self._read_position = self._array[:8].view(np.uint64)
        self._is_linked = True

    @classmethod
    def create(cls, size: int) -> SharedSegment:
        """A fresh segment of `size` bytes that only this user can open (puller side)."""
        if size <= CONTROL_BYTES:
            raise ValueError(f"a segment needs more than its {CONTROL_BYTES}-byte control page, got {size}")
        name = f"{_NAME_PREFIX}{os.getpid()}-{secrets.token_hex(16)}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            # Allocated now, not as pages are first touched: a full /dev/shm (a container's is
            # 64 MiB by default) fails here (the pull goes over gRPC), not with SIGBUS mid-copy.
            os.posix_fallocate(fd, 0, size)
            return cls(name, size, fd)
        except BaseException:
            os.unlink(path)
            raise

    @classmethod
    def open(cls, name: str) -> SharedSegment:
        """The puller's segment (prefill side). Raises SharedMemoryUnavailable unless `name`
        is a puller's segment name and opens here as a regular file larger than the
        control page: a peer cannot point this worker at any other file."""
        if not _NAME.fullmatch(name):
            raise SharedMemoryUnavailable(f"not a kvservice segment name: {name[:64]!r}")
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise SharedMemoryUnavailable(f"cannot open {name}: {e.strerror}") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size <= CONTROL_BYTES:
                raise SharedMemoryUnavailable(f"{name} is not a segment ({info.st_size} bytes)")
        except BaseException:
            os.close(fd)
            raise
        return cls(name, info.st_size, fd)

    # ------------------------------------------------------------ the ring

    def ring_region(self, position: int, num_bytes: int) -> np.ndarray:
        """A uint8 view of ring positions [position, position + num_bytes); ValueError if
        the range wraps or is larger than the ring."""
        start = position % self.ring_bytes
        if position < 0 or num_bytes < 0 or start + num_bytes > self.ring_bytes:
            raise ValueError(
                f"ring positions [{position}, {position + num_bytes}) "
                f"do not fit the {self.ring_bytes}-byte ring unwrapped"
            )
        return self._array[CONTROL_BYTES + start : CONTROL_BYTES + start + num_bytes]

    @property
    def read_position(self) -> int:
        """The ring position up to which the puller has read."""
        return int(self._read_position[0])

    def mark_read(self, position: int) -> None:
        """Puller: everything before `position` is read; the writer may reuse that space."""
        self._read_position[0] = position

    # ------------------------------------------------------------ lifetime

    def unlink(self) -> None:
        """Remove the name (the puller, once the prefill worker holds the segment open)."""
        if self._is_linked:
            self._is_linked = False
            try:
                os.unlink(os.path.join(SHM_DIR, self.name))
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Unmap. Views still alive keep the mapping until they go (it is unmapped then)."""
        if self._mmap is None:
            return
        self._array = self._read_position = np.empty(0, dtype=np.uint8)
        mapping, self._mmap = self._mmap, None
        try:
            mapping.close()
        except BufferError:
            pass  # a view is still alive: the mapping goes with the last one


def sweep_orphaned_segments(now: float | None = None) -> int:
    """Remove segment names left by pullers that died before their pull's first frame:
    those whose creating process is gone and that are older than ORPHAN_AGE_SECONDS. The
    number removed. Harmless if a creator is alive elsewhere (another PID namespace): a
    prefill worker that cannot open a name streams the bytes over gRPC instead."""
    now = time.time() if now is None else now
    removed = 0
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    for name in names:
        match = _NAME.fullmatch(name)
        if match is None or _is_alive(int(match.group(1))):
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            if now - os.lstat(path).st_mtime > ORPHAN_AGE_SECONDS:
                os.unlink(path)
                removed += 1
        except OSError:
            continue  # gone already, or another user's
    if removed:
        logger.info("removed %d orphaned KV segment(s) from %s", removed, SHM_DIR)
    return removed


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


class SegmentPool:
    """The puller's idle segments, by prefill worker: a pull takes one (or a new one) and gives
    it back for the next pull from that worker once it has completed through it."""

    def __init__(self, max_idle_per_peer: int = 8) -> None:
        self.max_idle_per_peer = max_idle_per_peer
        self._idle: dict[str, list[SharedSegment]] = collections.defaultdict(list)
        self.num_created = 0

    def take(self, peer: str) -> SharedSegment:
        """A segment for a pull from `peer`, its ring empty (OSError if none can be created)."""
        idle = self._idle.get(peer)
        if idle:
            segment = idle.pop()
            segment.mark_read(0)  # the ring starts over: the last pull through it has ended
            return segment
        self.num_created += 1
        return SharedSegment.create(CONTROL_BYTES + DEFAULT_RING_BYTES)  # one size: any serves any pull

    def give_back(self, peer: str, segment: SharedSegment, is_reusable: bool) -> None:
        """After the pull: `is_reusable` when it completed with every chunk through the ring
        (so the prefill worker holds the segment and has stopped writing); closed otherwise."""
        segment.unlink()
        idle = self._idle[peer]
        if is_reusable and len(idle) < self.max_idle_per_peer:
            idle.append(segment)
        else:
            segment.close()

    def close(self) -> None:
        for idle in self._idle.values():
            for segment in idle:
                segment.close()
        self._idle.clear()


class OpenSegments:
    """The prefill worker's side: the segments pullers offered, kept mapped by name (at most
    `capacity`, the least recently used closed first), since a puller reuses a segment after
    removing its name."""

    def __init__(self, capacity: int = 32) -> None:
        self.capacity = capacity
        self._segments: collections.OrderedDict[str, SharedSegment] = collections.OrderedDict()

    def open(self, name: str) -> SharedSegment:
        """The segment named `name`: the one already mapped, or opened now (SharedMemoryUnavailable
        if it is not a puller's segment or does not open here)."""
        segment = self._segments.get(name)
        if segment is not None:
            self._segments.move_to_end(name)
            return segment
        segment = SharedSegment.open(name)
        self._segments[name] = segment
        while len(self._segments) > self.capacity:
            self._segments.popitem(last=False)[1].close()
        return segment

    def close(self) -> None:
        for segment in self._segments.values():
            segment.close()
        self._segments.clear()


class RingWriter:
    """The prefill worker's side of a segment: places chunks in the ring in stream order."""

    def __init__(self, segment: SharedSegment) -> None:
        self.segment = segment
        self._position = 0  # where the next chunk may start

    def fits(self, num_bytes: int) -> bool:
        return 0 < num_bytes <= self.segment.ring_bytes

    async def write(self, payload: np.ndarray) -> int:
        """Copy `payload` (uint8) into the ring once the puller has read the space it needs;
        the ring position it starts at (for the chunk's header)."""
        ring = self.segment.ring_bytes
        num_bytes = payload.nbytes
        start = self._position
        if start % ring + num_bytes > ring:
            start += ring - start % ring  # never wrap inside a chunk: skip to the ring's start
        while start + num_bytes - self.segment.read_position > ring:
            await asyncio.sleep(POLL_SECONDS)
        np.copyto(self.segment.ring_region(start, num_bytes), payload)
        self._position = start + num_bytes
        return start
