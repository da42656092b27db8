"""A worker's `Stats` snapshot, taken on the engine thread between steps (consistent)."""

from __future__ import annotations

from kvservice.connector.decode_connector import DecodeKVConnector
from kvservice.connector.prefill_connector import PrefillKVConnector
from kvservice.engine import LLMEngine
from kvservice.v1 import kvservice_pb2 as pb


def engine_stats(engine: LLMEngine, role: str) -> pb.StatsResponse:
    scheduler = engine.scheduler
    stats = pb.StatsResponse(
        role=role,
        num_blocks_total=engine.num_blocks,
        num_blocks_free=engine.num_free_blocks,
        num_running_requests=len(scheduler.running),
        num_waiting_requests=len(scheduler.waiting),
        num_waiting_for_remote_kv=len(scheduler.waiting_for_remote_kv),
        num_finished_requests=scheduler.num_finished,
        num_aborted_requests=scheduler.num_aborted,
        num_preemptions=scheduler.num_preemptions,
    )
    spec = stats.spec_decode
    spec.num_draft_tokens = scheduler.num_draft_tokens
    spec.num_accepted_tokens = scheduler.num_accepted_tokens
    spec.num_verify_steps = scheduler.num_verify_steps
    if scheduler.num_draft_tokens:
        spec.acceptance_rate = scheduler.num_accepted_tokens / scheduler.num_draft_tokens
    if scheduler.num_verify_steps:
        spec.mean_accepted_length = (scheduler.num_accepted_tokens + scheduler.num_verify_steps) / scheduler.num_verify_steps
    connector = engine.connector
    if isinstance(connector, DecodeKVConnector):
        connector.stats.to_proto(stats.kv_receiving)
    elif isinstance(connector, PrefillKVConnector):
        pool = connector.registry.pool
        stats.kv_sending.staging_bytes_in_use = pool.bytes_in_use
        stats.kv_sending.staging_bytes_capacity = pool.capacity_bytes
        stats.kv_sending.num_staged_transfers = connector.registry.num_transfers
    return stats
