"""What one engine step hands from phase to phase: a leaf module, no torch, no grpc.

`Scheduler.schedule()` -> `SchedulerOutput` (with the connector's `KVConnectorMetadata`)
-> the runner's forward -> `KVConnectorOutput` from the connector's worker half
-> `Scheduler.update_from_output()` -> one `EngineCoreOutput` per request that advanced.
`SchedulerStats` and `KVConnectorStats` are the only way counters leave the engine.
Every module of the step imports these types from here, so the scheduler and the
connector contract need not import each other.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from kvservice.core.logprobs import TokenLogprobs
from kvservice.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from kvservice.core.block_pool import KVCacheEvent


class KVConnectorMetadata:
    """What a connector's scheduler half tells its worker half for one step.

    Each connector subclasses it with its own fields (loads to start, saves to make);
    the scheduler and the runner only carry it.
    """


@dataclass(frozen=True, slots=True)
class LanePrompt:
    """The tokens whose KV a colocated worker's prompt lane computes for one request, into its blocks."""

    request_id: str
    token_ids: list[int]
    start: int  # position of token_ids[0] (past the request's cached prefix)
    block_ids: list[int]


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # including the speculative tokens
    block_ids: list[int]
    # Draft tokens to verify this step; they follow the request's own tokens.
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def is_sampling(self) -> bool:
        """Whether this step reaches the end of the request's tokens, so it samples."""
        request = self.request
        return request.num_computed_tokens + self.num_new_tokens == request.num_tokens + len(self.spec_token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_scheduled_tokens: int
    num_prompt_tokens: int = 0  # of num_scheduled_tokens, those of prompt chunks (the rest decode)
    # Requests finished (or aborted) since the previous step: the connector's worker
    # half learns of them through `get_finished(finished_req_ids)`.
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    kv_connector_metadata: KVConnectorMetadata | None = None

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class KVConnectorWorkerMeta:
    """What the worker half tells the scheduler half beyond the finished sets."""

    # Decode side: the first token the remote prefill sampled, per completed load.
    first_token_ids: dict[str, int] = field(default_factory=dict)
    # Decode side: the completed loads that brought the speculative draft's prompt KV too.
    draft_kv_request_ids: set[str] = field(default_factory=set)


@dataclass(slots=True)
class KVConnectorOutput:
    """What the worker half reports after a step; the scheduler half consumes it."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)
    kv_connector_stats: dict[str, Any] | None = None
    kv_cache_events: list[KVCacheEvent] = field(default_factory=list)
    kv_connector_worker_meta: KVConnectorWorkerMeta | None = None

    @property
    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.invalid_block_ids)


@dataclass(frozen=True, slots=True)
class EngineCoreOutput:
    """New tokens of one request after a step; `finish_reason` set on its last output.

    `logprobs` (when asked for) has one entry per new token. The first output with tokens
    carries `num_cached_tokens` (prompt tokens found in the prefix cache) and, when asked
    for, `prompt_logprobs` (one per prompt position from 1 on)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int | None = None


def request_output(
    request: Request,
    token_ids: list[int],
    status: RequestStatus | None,
    logprobs: list[TokenLogprobs] | None,
    is_first: bool,
) -> EngineCoreOutput:
    """A request's output for this step; its first one also carries the prompt's cache hit
    and, where asked for and gathered, its prompt logprobs (sent once)."""
    prompt_logprobs = None
    if is_first and request.sampling_params.prompt_logprobs is not None and not request.needs_prompt_logprobs:
        prompt_logprobs = list(request.prompt_logprobs)
    return EngineCoreOutput(
        request.request_id,
        token_ids,
        status.finish_reason if status else None,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        num_cached_tokens=request.num_cached_tokens if is_first else None,
    )


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """Automatic prefix caching, in tokens: looked up at admission, and found cached."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass(frozen=True, slots=True)
class SpecDecodingStats:
    """Speculative decoding counters since the engine started."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0
    # Prompt tokens the draft model ran over on this worker; of a decode worker's pulled prompt
    # tokens, those whose draft KV came with the pull, and those it had to compute itself.
    num_draft_prompt_tokens_computed: int = 0
    num_draft_prompt_tokens_received: int = 0
    num_draft_prompt_tokens_recomputed: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens per proposed draft token (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify step: the accepted drafts plus the target's own token."""
        return (
            (self.num_accepted_tokens + self.num_verify_steps) / self.num_verify_steps if self.num_verify_steps else 0.0
        )


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """A consistent snapshot of the scheduler's queues, cache and counters."""

    num_running_requests: int
    num_waiting_requests: int
    num_waiting_for_remote_kv: int
    num_finished_requests: int
    num_aborted_requests: int
    num_preemptions: int
    num_blocks_total: int
    num_blocks_free: int
    spec_decoding: SpecDecodingStats = SpecDecodingStats()
    prefix_cache: PrefixCacheStats = PrefixCacheStats()

    @property
    def num_unfinished_requests(self) -> int:
        return self.num_running_requests + self.num_waiting_requests + self.num_waiting_for_remote_kv


@dataclass(slots=True)
class KVTransferCounters:
    """One direction of KV traffic since the worker started (sending on prefill workers,
    receiving on decode workers). Updated in place from one event loop only; anything
    that leaves that loop is a `snapshot()`."""

    num_transfers: int = 0
    num_failed_transfers: int = 0
    num_chunks: int = 0
    num_bytes: int = 0
    num_shared_memory_bytes: int = 0  # of num_bytes, those through a same-host segment
    total_seconds: float = 0.0  # summed over transfers

    def snapshot(self) -> KVTransferCounters:
        return replace(self)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class PeerPullCounters:
    """Prompt prefixes pulled from other workers instead of computed, by the source's role (the
    engine thread's; `snapshot()` for anyone else)."""

    num_blocks_from_prefill: int = 0
    num_blocks_from_decode: int = 0
    num_failed: int = 0

    def count(self, source_role: str, num_blocks: int) -> None:
        if source_role == "prefill":
            self.num_blocks_from_prefill += num_blocks
        else:
            self.num_blocks_from_decode += num_blocks

    def snapshot(self) -> PeerPullCounters:
        return replace(self)


@dataclass(frozen=True, slots=True)
class StagingStats:
    """A prefill worker's staging pool: KV copied out of the cache, waiting to be pulled."""

    bytes_in_use: int
    bytes_capacity: int
    num_staged_transfers: int


@dataclass(frozen=True, slots=True)
class KVConnectorStats:
    """What a connector reports about its transfers: `receiving` on decode workers,
    `sending` (with the staging pool) on prefill workers."""

    receiving: KVTransferCounters | None = None
    sending: KVTransferCounters | None = None
    staging: StagingStats | None = None
    peer_pulls: PeerPullCounters | None = None
