"""The prefill side's book of staged transfers: what is staged, who may pull it, until when.

A transfer is registered (request id, secret token, prompt length) before its prefill
runs, with a staging reservation for all of its KV. The engine thread stages chunks
layer by layer and publishes them; a `PullKV` stream, on the server's event loop,
sends chunks as they are published. The transfer's memory goes back to the pool when
the pull completes, when the transfer fails and no pull holds it, or when its lease
runs out. Thread-safe: one lock, and waiters are woken on their own event loops.
"""

from __future__ import annotations

import asyncio
import enum
import hmac
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvservice.connector.staging import StagingBuffer, StagingPool
from kvservice.connector.transfer_errors import StagingExhausted, TransferDenied, TransferInvalid, TransferNotFound
from kvservice.model.kv_cache import KVCacheLayout

# Refusals remembered at once (each for a lease); past this the oldest are forgotten, so a
# flood of refusals costs bounded memory (request ids are at most 256 bytes).
MAX_REJECTED = 4096


class TransferState(enum.Enum):
    STAGING = enum.auto()  # prefill running; chunks being published
    COMPLETE = enum.auto()  # every chunk published and the first token known
    FAILED = enum.auto()


@dataclass(frozen=True, slots=True)
class StagedChunk:
    """Blocks [first_block, first_block + num_blocks) of one layer, at `offset` in the buffer."""

    layer: int
    first_block: int
    num_blocks: int
    offset: int
    num_bytes: int
    # CRC-32 of the staged bytes when the copy computed it (CPU: while they were hot in
    # cache); None: the sender computes it.
    crc32: int | None = None


@dataclass(eq=False)
class StagedTransfer:
    request_id: str
    token: bytes
    num_tokens: int
    num_blocks: int
    buffer: StagingBuffer
    lease_deadline: float
    state: TransferState = TransferState.STAGING
    # Chunks are laid out in the buffer in staging order, each [2, n, block_size, kv_heads, head_dim].
    next_offset: int = 0
    chunks: list[StagedChunk] = field(default_factory=list)
    first_token_id: int | None = None
    error: str | None = None
    num_pins: int = 0  # pulls and writers using the buffer; it is released only at zero
    is_pulled: bool = False
    is_pull_active: bool = False  # a pull is streaming it: the lease cannot expire under it
    is_released: bool = False
    # The first block the puller needs (it caches the ones before): not staged if not
    # yet staged when the pull starts, and never sent.
    first_block: int = 0
    registered_at: float = field(default_factory=time.monotonic)
    waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = field(default_factory=list)


class TransferRegistry:
    def __init__(self, pool: StagingPool, layout: KVCacheLayout, lease_seconds: float = 30.0) -> None:
        self.pool = pool
        self.layout = layout
        self.lease_seconds = lease_seconds
        self._lock = threading.Lock()
        self._transfers: dict[str, StagedTransfer] = {}
        # Pulls that arrived before their transfer was registered.
        self._registration_waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = {}
        self._space_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        # Requests whose prefill was refused (or released) before registering: early pulls
        # holding the same token fail at once. request_id -> (token, error, forget at).
        self._rejected: dict[str, tuple[bytes, str, float]] = {}
        self.on_release: Callable[[StagedTransfer], None] | None = None

    def transfer_bytes(self, num_tokens: int) -> int:
        num_blocks = self.layout.num_blocks_for(num_tokens)
        return num_blocks * self.layout.bytes_per_block

    # ------------------------------------------------------------ registration (server loop)

    def register(self, request_id: str, token: bytes, num_tokens: int) -> StagedTransfer:
        """Reserve staging for a prompt's KV. Raises StagingExhausted when it does not fit now."""
        num_blocks = self.layout.num_blocks_for(num_tokens)
        num_bytes = num_blocks * self.layout.bytes_per_block
        if not self.pool.fits(num_bytes):
            raise StagingExhausted(
                f"the prompt's KV ({num_bytes} bytes) is larger than the whole staging pool "
                f"({self.pool.capacity_bytes} bytes)"
            )
        with self._lock:
            if request_id in self._transfers:
                raise TransferDenied(f"request_id {request_id!r} already has a staged transfer")
            buffer = self.pool.reserve(num_bytes)
            if buffer is None:
                raise StagingExhausted(
                    f"staging pool full ({self.pool.bytes_in_use}/{self.pool.capacity_bytes} bytes in use)"
                )
            transfer = StagedTransfer(
                request_id, token, num_tokens, num_blocks, buffer, time.monotonic() + self.lease_seconds
            )
            self._transfers[request_id] = transfer
            self._rejected.pop(request_id, None)  # a retry after a refusal
            waiters = self._registration_waiters.pop(request_id, [])
        _wake(waiters)
        return transfer

    async def register_when_space(
        self, request_id: str, token: bytes, num_tokens: int, timeout: float
    ) -> StagedTransfer:
        """`register`, waiting up to `timeout` seconds for staging space to free up."""
        deadline = time.monotonic() + timeout
        while True:
            event = asyncio.Event()
            with self._lock:
                self._space_waiters.append((asyncio.get_running_loop(), event))
            try:
                return self.register(request_id, token, num_tokens)
            except StagingExhausted:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self.pool.fits(self.transfer_bytes(num_tokens)):
                    raise
                try:
                    await asyncio.wait_for(event.wait(), remaining)
                except TimeoutError:
                    pass
            finally:
                with self._lock:
                    self._space_waiters = [w for w in self._space_waiters if w[1] is not event]

    def reject(self, request_id: str, token: bytes, error: str) -> None:
        """The prefill for `request_id` with `token` will never register (refused, invalid,
        released): pulls with that token fail now; pulls with another token keep waiting."""
        with self._lock:
            if request_id in self._transfers:
                return
            self._remember_rejected(request_id, token, error)
            waiters = self._registration_waiters.pop(request_id, [])
        _wake(waiters)

    def _remember_rejected(self, request_id: str, token: bytes, error: str) -> None:
        """Under the lock: a later pull of `request_id` with `token` fails at once, for a lease."""
        self._rejected.pop(request_id, None)
        self._rejected[request_id] = (token, error, time.monotonic() + self.lease_seconds)
        while len(self._rejected) > MAX_REJECTED:
            del self._rejected[next(iter(self._rejected))]

    async def wait_until_empty(self) -> None:
        """Return once nothing is staged (pulled, released or expired): a draining worker
        serves the pulls of what it staged before it stops."""
        while True:
            event = asyncio.Event()
            with self._lock:
                if not self._transfers:
                    return
                self._space_waiters.append((asyncio.get_running_loop(), event))
            try:
                await event.wait()  # every release wakes the space waiters
            finally:
                with self._lock:
                    self._space_waiters = [w for w in self._space_waiters if w[1] is not event]

    # ------------------------------------------------------------ staging (engine thread)

    def get(self, request_id: str) -> StagedTransfer | None:
        with self._lock:
            return self._transfers.get(request_id)

    def pin(self, request_id: str) -> StagedTransfer | None:
        """Hold a live transfer's buffer (a writer or a pull); None if it is gone or failed."""
        with self._lock:
            transfer = self._transfers.get(request_id)
            if transfer is None or transfer.state is TransferState.FAILED:
                return None
            transfer.num_pins += 1
            return transfer

    def unpin(self, transfer: StagedTransfer) -> None:
        with self._lock:
            transfer.num_pins -= 1
            release = self._should_release(transfer)
        if release:
            self._release(transfer)

    def chunk_buffer(
        self, transfer: StagedTransfer, layer: int, first_block: int, num_blocks: int
    ) -> tuple[StagedChunk, torch.Tensor]:
        """Room for one chunk in the transfer's buffer (engine thread, with the transfer pinned):
        the chunk and a [2, n, block_size, kv_heads, head_dim] tensor to copy it into."""
        L = self.layout
        num_bytes = num_blocks * L.bytes_per_block_per_layer
        offset = transfer.next_offset
        assert offset + num_bytes <= transfer.buffer.num_bytes, "staged more than the transfer reserved"
        assert first_block + num_blocks <= transfer.num_blocks and layer < L.num_layers
        transfer.next_offset += num_bytes
        view = transfer.buffer.tensor[offset : offset + num_bytes].view(L.dtype).view(L.blocks_shape(num_blocks))
        return StagedChunk(layer, first_block, num_blocks, offset, num_bytes), view

    def publish(self, transfer: StagedTransfer, chunk: StagedChunk) -> None:
        """A staged chunk's bytes are in place: it may be sent."""
        with self._lock:
            if transfer.state is not TransferState.STAGING:
                return
            transfer.chunks.append(chunk)
            waiters = list(transfer.waiters)
        _wake(waiters)

    def complete(self, request_id: str, first_token_id: int) -> None:
        """Every chunk is published and the prefill sampled `first_token_id`."""
        with self._lock:
            transfer = self._transfers.get(request_id)
            if transfer is None or transfer.state is not TransferState.STAGING:
                return
            transfer.state = TransferState.COMPLETE
            transfer.first_token_id = first_token_id
            waiters = list(transfer.waiters)
        _wake(waiters)

    def release(self, request_id: str, token: bytes) -> bool:
        """The router gave the transfer up (only the token's holder may): fail it and free
        its staging once nothing holds it. Returns whether such a transfer was staged."""
        with self._lock:
            transfer = self._transfers.get(request_id)
            if transfer is not None and not hmac.compare_digest(transfer.token, token):
                return False
        if transfer is None:
            # Not registered (yet, or ever): a pull that is waiting for it with the same token
            # must not wait out its registration deadline. A later registration clears this.
            self.reject(request_id, token, "released by the router before it was registered")
            return False
        self.fail(request_id, "released: the router gave this transfer up")
        return True

    def fail(self, request_id: str, error: str) -> None:
        """The transfer will not complete (aborted, lease expired): pulls end with `error`."""
        with self._lock:
            transfer = self._transfers.get(request_id)
            if transfer is None or transfer.state is TransferState.FAILED:
                return
            transfer.state = TransferState.FAILED
            transfer.error = error
            waiters = list(transfer.waiters)
            release = self._should_release(transfer)
        _wake(waiters)
        if release:
            self._release(transfer)

    # ------------------------------------------------------------ pulling (server loop)

    async def wait_registered(self, request_id: str, token: bytes, timeout: float) -> StagedTransfer:
        """The transfer, waiting up to `timeout` for its prefill request to register it.
        Only a refusal or release made with the pull's own `token` ends the wait early."""
        deadline = time.monotonic() + timeout
        was_woken = False
        while True:
            event = asyncio.Event()
            with self._lock:
                transfer = self._transfers.get(request_id)
                rejected = self._rejected.get(request_id)
                if transfer is None and rejected is not None and hmac.compare_digest(rejected[0], token):
                    raise TransferNotFound(f"the prefill of request_id {request_id!r} was refused: {rejected[1]}")
                if transfer is None and was_woken and rejected is None:
                    raise TransferNotFound(f"transfer for request_id {request_id!r} is gone")
                if transfer is None:
                    self._registration_waiters.setdefault(request_id, []).append((asyncio.get_running_loop(), event))
            if transfer is not None:
                return transfer
            try:
                await asyncio.wait_for(event.wait(), max(0.0, deadline - time.monotonic()))
                was_woken = True  # registered (and maybe gone already), or refused with some token
            except TimeoutError:
                raise TransferNotFound(f"no transfer registered for request_id {request_id!r}") from None
            finally:
                with self._lock:
                    waiters = self._registration_waiters.get(request_id, [])
                    waiters[:] = [w for w in waiters if w[1] is not event]
                    if not waiters:
                        self._registration_waiters.pop(request_id, None)

    def start_pull(self, transfer: StagedTransfer, token: bytes, first_block: int = 0) -> asyncio.Event:
        """Claim the transfer for one pull of blocks [first_block, num_blocks); returns the
        event set whenever the transfer changes."""
        if not hmac.compare_digest(transfer.token, token):
            raise TransferDenied("transfer_token does not match this transfer")
        if first_block > transfer.num_blocks:
            raise TransferInvalid(f"first_block: {first_block}, but the prompt has {transfer.num_blocks} blocks")
        event = asyncio.Event()
        with self._lock:
            if transfer.is_pulled or transfer.is_released:
                raise TransferDenied(f"transfer for request_id {transfer.request_id!r} was already pulled")
            transfer.first_block = first_block
            transfer.is_pulled = True
            transfer.is_pull_active = True
            transfer.num_pins += 1
            transfer.lease_deadline = time.monotonic() + self.lease_seconds
            transfer.waiters.append((asyncio.get_running_loop(), event))
        return event

    def snapshot(self, transfer: StagedTransfer, num_seen: int) -> tuple[list[StagedChunk], TransferState]:
        """Chunks published after the first `num_seen`, and the state; renews the lease."""
        with self._lock:
            transfer.lease_deadline = time.monotonic() + self.lease_seconds
            return transfer.chunks[num_seen:], transfer.state

    def first_block_to_stage(self, request_id: str) -> int:
        """Engine thread: the first block of a transfer worth staging (its pull, if already
        started, said it needs none before)."""
        with self._lock:
            transfer = self._transfers.get(request_id)
            return transfer.first_block if transfer is not None else 0

    def end_pull(self, transfer: StagedTransfer, event: asyncio.Event) -> bool:
        """The pull ended (sent everything, failed or was cancelled): the transfer is done with.
        Returns whether it was complete then (not failed): only then may the done frame go."""
        with self._lock:
            transfer.waiters = [w for w in transfer.waiters if w[1] is not event]
            transfer.is_pull_active = False
            transfer.num_pins -= 1
            if transfer.state is TransferState.STAGING:
                transfer.state = TransferState.FAILED
                transfer.error = "the pull ended before the transfer completed"
            is_complete = transfer.state is TransferState.COMPLETE
            release = self._should_release(transfer)
        if release:
            self._release(transfer)
        return is_complete

    # ------------------------------------------------------------ leases

    def expire(self, now: float | None = None) -> list[str]:
        """Fail transfers whose lease ran out, except those a pull is streaming (the pull
        has a deadline of its own); returns their request ids."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._rejected = {k: v for k, v in self._rejected.items() if v[2] >= now}
            expired = [
                t.request_id
                for t in self._transfers.values()
                if t.lease_deadline < now and not t.is_released and not t.is_pull_active
            ]
        for request_id in expired:
            self.fail(request_id, "lease expired before the decode side pulled the KV")
        return expired

    @property
    def num_transfers(self) -> int:
        with self._lock:
            return len(self._transfers)

    # ------------------------------------------------------------ internals

    def _should_release(self, transfer: StagedTransfer) -> bool:
        """Under the lock: nobody holds the buffer, and it failed or its pull has ended
        (a pull holds a pin while it runs, so pulled and unpinned means finished)."""
        if transfer.is_released or transfer.num_pins > 0:
            return False
        if transfer.state is TransferState.FAILED or transfer.is_pulled:
            transfer.is_released = True
            return True
        return False

    def _release(self, transfer: StagedTransfer) -> None:
        with self._lock:
            self._transfers.pop(transfer.request_id, None)
            # A pull that comes after it (a source that released or expired it) fails at once.
            why = "already pulled" if transfer.error is None else transfer.error
            self._remember_rejected(transfer.request_id, transfer.token, f"the transfer is gone ({why})")
            space_waiters = list(self._space_waiters)
        self.pool.release(transfer.buffer)
        _wake(space_waiters)
        if self.on_release is not None:
            self.on_release(transfer)


def _wake(waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]) -> None:
    for loop, event in waiters:
        try:
            loop.call_soon_threadsafe(event.set)
        except RuntimeError:  # that loop is closed: its waiter is gone
            pass
