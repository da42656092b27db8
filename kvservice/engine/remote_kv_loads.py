"""Asynchronous KV loads, the scheduler's collaborator: a waiting request whose prompt KV a
connector supplies parks here with its blocks until the connector reports the load done. No torch.

A decode worker's loads bring the prompt's KV and the first token its prefill worker sampled;
a prefix source's (any role) bring leading blocks alone, and the request computes the rest.
`RemoteKVLoads` decides; the `Scheduler` owns the queues and acts on what `take_finished`
reports (resume, recompute or fail), so the two never reach into each other's state.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field

from kvservice.connector.base import KVConnectorBase, drop_prefix_source
from kvservice.core.kv_cache_manager import KVCacheManager
from kvservice.core.outputs import KVConnectorOutput
from kvservice.core.request import Request, RequestStatus
from kvservice.engine.prefix_reuse import start_after_prefix


@dataclass(slots=True)
class FinishedLoads:
    """What one connector report means for the scheduler's queues."""

    # Finished requests whose transfer no longer touches their blocks: free them now.
    released_ids: list[str] = field(default_factory=list)
    # Loads done: the prompt's KV is in place, with the first token the prefill sampled, or None
    # from a source that sends none (the request then computes its last token here).
    resumed: list[tuple[Request, int | None]] = field(default_factory=list)
    # Of the resumed, those whose load brought the speculative draft's prompt KV too.
    with_draft_kv: set[str] = field(default_factory=set)
    # Loads that failed (invalid blocks, no or a bad first token): recompute or fail them.
    failed: list[Request] = field(default_factory=list)
    # Prefix loads done: the request computes its prompt from the given token on.
    prefixes: list[tuple[Request, int]] = field(default_factory=list)
    # Prefix loads that failed: recomputed, whatever the failure policy (a prefix was an offer).
    prefixes_failed: list[Request] = field(default_factory=list)


class RemoteKVLoads:
    """The requests in WAITING_FOR_REMOTE_KV, and the connector calls that park and release them."""

    def __init__(self, kv: KVCacheManager, connector: KVConnectorBase, vocab_size: int | None) -> None:
        self.kv = kv
        self.connector = connector
        self.vocab_size = vocab_size  # bounds a first token that a remote prefill sends
        self.parked: dict[str, Request] = {}
        # Of the parked, those loading a prefix alone: where their load ends (in tokens).
        self.prefix_ends: dict[str, int] = {}

    def has_source(self, request: Request) -> bool:
        """Whether the connector may bring some of this request's prompt KV."""
        return self.connector.has_kv_source(request)

    def try_park(self, request: Request, cached: list[int]) -> bool | None:
        """Park a waiting request whose prompt KV (past its cached prefix) arrives asynchronously.
        True if it was parked, None if it must but its blocks are not free, else False."""
        num_cached = len(cached) * self.kv.block_size
        num_external, is_async = self.connector.get_num_new_matched_tokens(request, num_cached)
        if not is_async:
            return False
        block_ids = self.kv.allocate_slots(request, num_external, cached)
        if block_ids is None:
            return None
        start_after_prefix(request, self.kv, num_cached)
        self.connector.update_state_after_alloc(request, block_ids, num_external)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.parked[request.request_id] = request
        if self.connector.loads_prefix_only(request):
            self.prefix_ends[request.request_id] = num_cached + num_external
        return True

    def take_finished(self, output: KVConnectorOutput, pending_free: Container[str]) -> FinishedLoads:
        """Sort a step's connector report: releases among `pending_free`, loads done, loads failed."""
        self.connector.update_connector_output(output)
        result = FinishedLoads()
        failed_ids = self.kv.requests_holding(output.invalid_block_ids, self.parked)
        meta = output.kv_connector_worker_meta
        first_token_ids = meta.first_token_ids if meta is not None else {}
        result.with_draft_kv = set(meta.draft_kv_request_ids) if meta is not None else set()
        result.released_ids = [r for r in output.finished_sending | output.finished_recving if r in pending_free]
        for request_id in output.finished_recving:
            request = self.parked.pop(request_id, None)
            if request is None:
                continue
            prefix_end = self.prefix_ends.pop(request_id, None)
            if prefix_end is not None:
                drop_prefix_source(request)  # a prefill worker's request keeps its transfer token
                if request_id in failed_ids:
                    result.prefixes_failed.append(request)
                else:
                    result.prefixes.append((request, prefix_end))
                continue
            first_token = first_token_ids.get(request_id)
            if request_id in failed_ids or not self._is_valid_first_token(request, first_token):
                result.failed.append(request)
            else:
                result.resumed.append((request, first_token))
            request.kv_transfer_params = None
        return result

    def _is_valid_first_token(self, request: Request, token_id: int | None) -> bool:
        """A source that samples the first token must send one inside the vocabulary."""
        if token_id is None:
            return not self.connector.supplies_first_token(request)
        return 0 <= token_id < (self.vocab_size or 1 << 62)
