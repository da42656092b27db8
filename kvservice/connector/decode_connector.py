"""The pulling connector: a prompt's KV from its prefill worker into a decode worker's blocks, or
a prompt's leading blocks from whichever worker staged them (a prefix source, any role).

Scheduler side: a waiting request whose `kv_transfer_params` name a prefill worker
matches asynchronously the prompt tokens past its local prefix-cache hit (which may
be the whole prompt: the pull then brings only the first token); the scheduler
allocates the blocks and parks it in WAITING_FOR_REMOTE_KV. Worker side: `start_load_kv` starts one pull task
per new load on the connector's own event loop thread; `get_finished` reports loads
that completed, failed or were cancelled, `get_block_ids_with_load_errors` the blocks
of failed ones, and the worker meta carries the first token each prefill sampled.
An aborted load is cancelled and reported only once its task has stopped writing, so
its blocks are never freed under a write. Each prefill worker gets its own
`max_concurrent_pulls` slots (a dead one cannot hold up pulls from a healthy one), and a
pull's deadline counts from when it was started, its wait for a slot included.

A prefix source (`PREFIX_*` in `kv_transfer_params`) brings whole blocks and no first token:
the request runs from the end of what arrived. It is pulled only when the last block's chained
hash is the request's own (same tokens, same model and dtype), only once, and a failed pull is
recomputed whatever the failure policy says (the source was an offer, not a promise).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from kvservice.connector.base import (
    PREFIX_ADDRESS,
    PREFIX_LAST_HASH,
    PREFIX_NUM_TOKENS,
    PREFIX_ROLE,
    PREFIX_TOKEN,
    REMOTE_ADDRESS,
    TRANSFER_TOKEN,
    KVConnectorBase,
    drop_prefix_source,
)
from kvservice.connector.channel_cache import ChannelCache
from kvservice.connector.kv_puller import LoadResult, LoadSpec, pull_kv
from kvservice.connector.shared_memory import SegmentPool, sweep_orphaned_segments
from kvservice.core.outputs import (
    KVConnectorMetadata,
    KVConnectorStats,
    KVConnectorWorkerMeta,
    KVTransferCounters,
    PeerPullCounters,
    SchedulerOutput,
)
from kvservice.core.request import Request, RequestStatus
from kvservice.model.kv_cache import KVCacheLayout
from kvservice.runtime.grpc_options import GRPC_OPTIONS
from kvservice.runtime.native_thread import name_native_thread
from kvservice.runtime.tls import bearer_metadata

# Channels to distinct prefill workers kept open at once (idle ones past it are closed).
MAX_CHANNELS = 64

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class DecodeConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)


class TransferLoop:
    """An asyncio event loop on a thread of its own, for the pull tasks and their channels."""

    def __init__(self, name: str = "kv-transfer") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        name_native_thread()
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Any) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


class DecodeKVConnector(KVConnectorBase):
    def __init__(
        self,
        layout: KVCacheLayout,
        transfer_timeout: float = 120.0,
        max_concurrent_pulls: int = 8,
        channel_credentials: grpc.ChannelCredentials | None = None,
        on_load_done: Callable[[], None] | None = None,
        auth_token: str | None = None,
        max_channels: int = MAX_CHANNELS,
        use_shared_memory: bool = False,
    ) -> None:
        super().__init__()
        self.layout = layout
        # Offer each prefill worker a shared-memory segment for the bytes (same host only);
        # used on the transfer loop only.
        self._segments = SegmentPool() if use_shared_memory else None
        if use_shared_memory:
            sweep_orphaned_segments()
        self.transfer_timeout = transfer_timeout
        self.channel_credentials = channel_credentials
        self.on_load_done = on_load_done
        self.stats = KVTransferCounters()
        self.peer_pulls = PeerPullCounters()  # engine thread
        self._kv_caches: list[torch.Tensor] = []
        self._new_loads: list[LoadSpec] = []  # scheduler side, until the next metadata
        self._loading: dict[str, LoadSpec] = {}  # engine thread: loads started, not yet reported
        self._tasks: dict[str, asyncio.Task[LoadResult]] = {}  # transfer loop: the running pulls
        self._done: collections.deque[tuple[LoadSpec, LoadResult]] = collections.deque()
        self._load_error_blocks: set[int] = set()
        self._first_token_ids: dict[str, int] = {}
        self._draft_kv_request_ids: set[str] = set()  # of those loads, the ones with the draft's KV
        self._transfer_loop = TransferLoop()
        self._channels = ChannelCache(max_channels, channel_credentials, GRPC_OPTIONS)
        self._metadata = bearer_metadata(auth_token)  # prefill workers want the bearer token too
        self._max_concurrent_pulls = max_concurrent_pulls
        # Per prefill worker, while any pull to it is waiting or running (then dropped).
        self._pull_slots: dict[str, asyncio.Semaphore] = {}
        self._num_pulls_per_peer: collections.Counter[str] = collections.Counter()

    @property
    def moves_draft_kv(self) -> bool:
        return self.layout.num_draft_layers > 0

    def register_kv_caches(self, kv_caches: list[torch.Tensor], layout: KVCacheLayout) -> None:
        assert layout == self.layout, f"engine KV layout {layout} differs from the connector's {self.layout}"
        self._kv_caches = kv_caches

    # ------------------------------------------------------------ scheduler side

    def supplies_first_token(self, request: Request) -> bool:
        return self._has_remote_prefill(request)

    def has_kv_source(self, request: Request) -> bool:
        return self._has_remote_prefill(request) or _has_prefix_source(request)

    def loads_prefix_only(self, request: Request) -> bool:
        return not self._has_remote_prefill(request) and _has_prefix_source(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if self._has_remote_prefill(request):
            # Possibly 0 (the whole prompt is cached here): the pull still brings the first token.
            return request.num_prompt_tokens - num_computed_tokens, True
        if not _has_prefix_source(request):
            return 0, False
        num_prefix_tokens = self._usable_prefix_tokens(request)
        if num_prefix_tokens > num_computed_tokens:
            return num_prefix_tokens - num_computed_tokens, True
        drop_prefix_source(request)  # nothing to pull past what is cached here: never asked again
        return 0, False

    @staticmethod
    def _has_remote_prefill(request: Request) -> bool:
        params = request.kv_transfer_params
        return params is not None and REMOTE_ADDRESS in params and not request.output_token_ids

    def _usable_prefix_tokens(self, request: Request) -> int:
        """How many leading prompt tokens the request's prefix source (it has one) brings: 0 unless they are
        whole blocks, short of its last prompt token, and the last block's hash is its own."""
        if request.needs_prompt_logprobs:
            return 0  # every prompt position whose logprobs it reports must be computed here
        params = request.kv_transfer_params
        assert params is not None
        num_tokens = int(params[PREFIX_NUM_TOKENS])
        num_blocks, partial = divmod(num_tokens, self.layout.block_size)
        hashes = request.block_hashes
        if (
            partial
            or not num_blocks
            or num_tokens >= request.num_prompt_tokens
            or len(hashes) < num_blocks
            or hashes[num_blocks - 1] != params[PREFIX_LAST_HASH]
        ):
            logger.warning(
                "request %s: the prefix source %s offers %d tokens that are not this prompt's leading "
                "blocks; computing them",
                request.request_id,
                params[PREFIX_ADDRESS],
                num_tokens,
            )
            return 0
        return num_tokens

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        assert params is not None
        first_block = request.num_computed_tokens // self.layout.block_size
        if self._has_remote_prefill(request):
            spec = LoadSpec(
                request_id=request.request_id,
                remote_address=params[REMOTE_ADDRESS],
                transfer_token=params[TRANSFER_TOKEN],
                block_ids=list(block_ids[: self.layout.num_blocks_for(request.num_prompt_tokens)]),
                num_tokens=request.num_prompt_tokens,
                first_block=first_block,
            )
        else:
            num_tokens = request.num_computed_tokens + num_external_tokens
            spec = LoadSpec(
                request_id=request.request_id,
                remote_address=params[PREFIX_ADDRESS],
                transfer_token=params[PREFIX_TOKEN],
                block_ids=list(block_ids[: num_tokens // self.layout.block_size]),
                num_tokens=num_tokens,
                first_block=first_block,
                sends_first_token=False,
                source_role=str(params.get(PREFIX_ROLE, "decode")),
            )
        self._new_loads.append(spec)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> DecodeConnectorMetadata:
        meta = DecodeConnectorMetadata(self._new_loads)
        self._new_loads = []
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # A load still in flight writes into the blocks: free them once it is reported.
        if request.status is RequestStatus.FINISHED_ABORTED and request.request_id in self._loading:
            return True, None
        if any(spec.request_id == request.request_id for spec in self._new_loads):
            # Aborted in the same step its load was planned: drop the plan, free now.
            self._new_loads = [s for s in self._new_loads if s.request_id != request.request_id]
        return False, None

    # ------------------------------------------------------------ worker side

    def start_load_kv(self, forward_context: Any) -> None:
        meta = self.connector_metadata
        assert isinstance(meta, DecodeConnectorMetadata)
        for spec in meta.loads:
            self._loading[spec.request_id] = spec
            self._transfer_loop.loop.call_soon_threadsafe(self._start_pull, spec)

    # The pull tasks live on the transfer loop; these three run there only.

    def _start_pull(self, spec: LoadSpec) -> None:
        task = asyncio.get_running_loop().create_task(self._pull(spec))
        self._tasks[spec.request_id] = task
        task.add_done_callback(lambda t: self._on_pull_done(spec, t))

    async def _pull(self, spec: LoadSpec) -> LoadResult:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.transfer_timeout
        address = spec.remote_address
        slots = self._pull_slots.setdefault(address, asyncio.Semaphore(self._max_concurrent_pulls))
        self._num_pulls_per_peer[address] += 1
        try:
            try:
                async with asyncio.timeout_at(deadline):
                    await slots.acquire()
            except TimeoutError:
                self.stats.num_failed_transfers += 1
                return LoadResult(
                    spec.request_id, None, f"no pull slot for {address} within {self.transfer_timeout:g} s"
                )
            try:
                async with self._channels.use(address) as channel:
                    return await pull_kv(
                        channel,
                        spec,
                        self._kv_caches,
                        self.layout,
                        max(0.0, deadline - loop.time()),
                        self.stats,
                        self._metadata,
                        self._segments,
                    )
            finally:
                slots.release()
        finally:
            self._num_pulls_per_peer[address] -= 1
            if not self._num_pulls_per_peer[address]:
                del self._num_pulls_per_peer[address]
                del self._pull_slots[address]

    def _on_pull_done(self, spec: LoadSpec, task: asyncio.Task[LoadResult]) -> None:
        """The task has stopped: only now may its blocks be reported (and freed)."""
        self._tasks.pop(spec.request_id, None)
        if task.cancelled():
            result = LoadResult(spec.request_id, None, "cancelled")
        elif task.exception() is not None:
            result = LoadResult(spec.request_id, None, f"pull failed: {task.exception()!r}")
        else:
            result = task.result()
        self._done.append((spec, result))
        self._notify()

    def _cancel_pull(self, request_id: str) -> None:
        task = self._tasks.get(request_id)
        if task is not None:
            task.cancel()

    def _notify(self) -> None:
        if self.on_load_done is not None:
            self.on_load_done()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        for request_id in finished_req_ids & self._loading.keys():
            self._transfer_loop.loop.call_soon_threadsafe(self._cancel_pull, request_id)
        finished_recving: set[str] = set()
        while self._done:
            spec, result = self._done.popleft()
            self._loading.pop(spec.request_id, None)
            finished_recving.add(spec.request_id)
            if not spec.sends_first_token:
                if result.error is None:
                    self.peer_pulls.count(spec.source_role, len(spec.block_ids) - spec.first_block)
                    continue
                self.peer_pulls.num_failed += 1
            if result.error is None and result.first_token_id is not None:
                self._first_token_ids[spec.request_id] = result.first_token_id
                if result.has_draft_kv:
                    self._draft_kv_request_ids.add(spec.request_id)
            else:
                # The scheduler's kv_load_failure_policy decides (recompute, or fail the request).
                logger.warning(
                    "request %s: loading its KV failed: %s", spec.request_id, result.error or "no first token"
                )
                self._load_error_blocks.update(spec.block_ids)
        return set(), finished_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        blocks, self._load_error_blocks = self._load_error_blocks, set()
        return blocks

    def build_connector_worker_meta(self) -> KVConnectorWorkerMeta | None:
        if not self._first_token_ids:
            return None
        meta = KVConnectorWorkerMeta(self._first_token_ids, self._draft_kv_request_ids)
        self._first_token_ids, self._draft_kv_request_ids = {}, set()
        return meta

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        return self.stats.as_dict()

    def make_stats(self) -> KVConnectorStats:
        return KVConnectorStats(receiving=self.stats.snapshot(), peer_pulls=self.peer_pulls.snapshot())

    def shutdown(self) -> None:
        async def close_channels() -> None:
            for task in list(self._tasks.values()):
                task.cancel()
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)
            await self._channels.close()
            if self._segments is not None:
                self._segments.close()

        if not self._transfer_loop.loop.is_closed():
            try:
                self._transfer_loop.submit(close_channels()).result(timeout=5)
            except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
                pass
        self._transfer_loop.close()


def _has_prefix_source(request: Request) -> bool:
    params = request.kv_transfer_params
    return params is not None and PREFIX_ADDRESS in params and not request.output_token_ids
