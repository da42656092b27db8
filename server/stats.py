"""A worker's `Stats` snapshot: the engine's own stats objects translated into the proto.

Taken on the engine thread between steps, so the queues, the cache and the counters
agree with each other. It names the worker's compute path too (`compute_path`: the C++ kernels
and their ISA, or PyTorch and why), so a ~7x slower fallback shows in `kvservice stats` and
`/metrics`.
"""

from __future__ import annotations

from kvservice.connector.offload_tier import OffloadTier
from kvservice.core.outputs import KVTransferCounters
from kvservice.engine.engine import LLMEngine
from kvservice.model.cpu_kernels import compute_path
from kvservice.v1 import kvservice_pb2 as pb


def engine_stats(engine: LLMEngine, role: str) -> pb.StatsResponse:
    scheduler = engine.core.scheduler.make_stats()
    stats = pb.StatsResponse(
        role=role,
        num_blocks_total=scheduler.num_blocks_total,
        num_blocks_free=scheduler.num_blocks_free,
        num_running_requests=scheduler.num_running_requests,
        num_waiting_requests=scheduler.num_waiting_requests,
        num_waiting_for_remote_kv=scheduler.num_waiting_for_remote_kv,
        num_finished_requests=scheduler.num_finished_requests,
        num_aborted_requests=scheduler.num_aborted_requests,
        num_preemptions=scheduler.num_preemptions,
        compute_path=compute_path(engine.core.loaded.device),
    )
    stats.prefix_cache.queries = scheduler.prefix_cache.queries
    stats.prefix_cache.hits = scheduler.prefix_cache.hits
    spec = scheduler.spec_decoding
    stats.spec_decode.num_draft_tokens = spec.num_draft_tokens
    stats.spec_decode.num_accepted_tokens = spec.num_accepted_tokens
    stats.spec_decode.num_verify_steps = spec.num_verify_steps
    stats.spec_decode.acceptance_rate = spec.acceptance_rate
    stats.spec_decode.mean_accepted_length = spec.mean_accepted_length
    stats.spec_decode.num_draft_prompt_tokens_computed = spec.num_draft_prompt_tokens_computed
    stats.spec_decode.num_draft_prompt_tokens_received = spec.num_draft_prompt_tokens_received
    stats.spec_decode.num_draft_prompt_tokens_recomputed = spec.num_draft_prompt_tokens_recomputed
    tier = engine.core.kv_tier
    if isinstance(tier, OffloadTier):
        kv_offload_to_proto(tier, stats.kv_offload)
    connector = engine.connector.make_stats() if engine.connector is not None else None
    if connector is not None:
        if connector.receiving is not None:
            transfer_counters_to_proto(connector.receiving, stats.kv_receiving)
        if connector.sending is not None:
            transfer_counters_to_proto(connector.sending, stats.kv_sending)
        if connector.peer_pulls is not None:
            stats.kv_offload.num_peer_blocks_from_prefill = connector.peer_pulls.num_blocks_from_prefill
            stats.kv_offload.num_peer_blocks_from_decode = connector.peer_pulls.num_blocks_from_decode
            stats.kv_offload.num_peer_pulls_failed = connector.peer_pulls.num_failed
        if connector.staging is not None:
            stats.kv_sending.staging_bytes_in_use = connector.staging.bytes_in_use
            stats.kv_sending.staging_bytes_capacity = connector.staging.bytes_capacity
            stats.kv_sending.num_staged_transfers = connector.staging.num_staged_transfers
    return stats


def transfer_counters_to_proto(counters: KVTransferCounters, into: pb.KVTransferStats) -> None:
    into.num_transfers = counters.num_transfers
    into.num_failed_transfers = counters.num_failed_transfers
    into.num_chunks = counters.num_chunks
    into.num_bytes = counters.num_bytes
    into.num_shared_memory_bytes = counters.num_shared_memory_bytes
    into.total_seconds = counters.total_seconds


def kv_offload_to_proto(tier: OffloadTier, into: pb.KVOffloadStats) -> None:
    store = tier.stats
    into.enabled = store.is_enabled
    into.num_blocks = store.num_blocks
    into.bytes_used = store.bytes_used
    into.capacity_bytes = store.capacity_bytes
    into.num_blocks_written = store.num_blocks_written
    into.num_bytes_written = store.num_bytes_written
    into.num_blocks_read = tier.num_blocks_loaded
    into.num_bytes_read = store.num_bytes_read
    into.num_hit_blocks = tier.num_hit_blocks
    into.num_blocks_dropped = store.num_blocks_dropped
    into.num_blocks_evicted = store.num_blocks_evicted
