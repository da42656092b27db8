"""The proxy's `Stats`: every member worker's own snapshot, and their sums.

A slow worker, or one dropped while the proxy gathers (its channel closed), leaves its entry
without stats rather than the whole answer missing the caller's deadline: each worker's call
gets a share of the time the caller has left. A channel closed while its call runs cancels the
call (gRPC raises CancelledError for it, not an RpcError): that too is "no stats", unless it is
the gathering task itself that is being cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from kvservice.server.proxy.worker_pool import WorkerHandle, WorkerPool
from kvservice.v1 import kvservice_pb2 as pb

WORKER_STATS_TIMEOUT_S = 2.0  # at most, for each worker's Stats
_TRANSFER_FIELDS = tuple(
    field.name for field in pb.KVTransferStats.DESCRIPTOR.fields
)  # all counters and gauges: summed


async def cluster_stats(prefill: WorkerPool, decode: WorkerPool, time_remaining: float | None) -> pb.StatsResponse:
    """Each member's entry (the proxy's view of it, and its own Stats when it answers in time),
    and the sums; `time_remaining`: the caller's seconds left (None: no deadline)."""
    timeout = (
        WORKER_STATS_TIMEOUT_S if time_remaining is None else max(0.1, min(WORKER_STATS_TIMEOUT_S, time_remaining / 2))
    )

    async def one(worker: WorkerHandle, role: str) -> pb.WorkerStats:
        entry = pb.WorkerStats(
            address=worker.address,
            num_outstanding=worker.num_outstanding,
            is_healthy=worker.is_healthy,
            num_indexed_blocks=len(worker.kv_index.block_hashes),
            num_indexed_offload_blocks=len(worker.kv_index.offload_hashes),
            state=worker.state,
            role=role,
        )
        with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.TimeoutError):
            call = worker.stub.Stats(pb.StatsRequest(), timeout=timeout, metadata=worker.metadata)
            try:
                entry.stats.CopyFrom(await asyncio.wait_for(call, timeout))
            except asyncio.CancelledError:
                if not call.cancelled() or _is_cancelling():
                    raise
        return entry

    members = [(w, "prefill") for w in prefill.workers] + [(w, "decode") for w in decode.workers]
    entries = await asyncio.gather(*(one(w, role) for w, role in members))
    stats = pb.StatsResponse(role="proxy")
    stats.workers.extend(entries)
    for entry in entries:
        s = entry.stats
        stats.num_blocks_total += s.num_blocks_total
        stats.num_blocks_free += s.num_blocks_free
        stats.num_running_requests += s.num_running_requests
        stats.num_waiting_requests += s.num_waiting_requests
        stats.num_waiting_for_remote_kv += s.num_waiting_for_remote_kv
        stats.num_finished_requests += s.num_finished_requests if s.role != "prefill" else 0
        stats.num_aborted_requests += s.num_aborted_requests
        stats.prefix_cache.queries += s.prefix_cache.queries
        stats.prefix_cache.hits += s.prefix_cache.hits
        for total, part in ((stats.kv_sending, s.kv_sending), (stats.kv_receiving, s.kv_receiving)):
            for name in _TRANSFER_FIELDS:
                setattr(total, name, getattr(total, name) + getattr(part, name))
    return stats


def _is_cancelling() -> bool:
    """Whether the running task itself has been asked to stop."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
