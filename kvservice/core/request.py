"""A request's state as the scheduler sees it: plain Python, no torch."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from kvservice.core.logprobs import TokenLogprobs
from kvservice.core.sampling_params import SamplingParams

# Request ids key state on every server (and are logged): bounded and printable.
MAX_REQUEST_ID_BYTES = 256


def check_request_id(request_id: str, field_name: str = "request_id") -> None:
    """Raise ValueError (naming `field_name`) unless `request_id` is non-empty, printable
    and at most MAX_REQUEST_ID_BYTES bytes of UTF-8."""
    if not request_id:
        raise ValueError(f"{field_name}: empty")
    # Characters first: a huge id is refused before it is encoded.
    if len(request_id) > MAX_REQUEST_ID_BYTES or len(request_id.encode()) > MAX_REQUEST_ID_BYTES:
        raise ValueError(f"{field_name}: longer than {MAX_REQUEST_ID_BYTES} bytes")
    if not request_id.isprintable():
        raise ValueError(f"{field_name}: only printable characters are allowed")


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KV = enum.auto()
    # A colocated worker's prompt lane computes its prompt (all tokens but the last).
    WAITING_FOR_PROMPT_LANE = enum.auto()
    # Its prefix's blocks are being read back from the KV offload tier.
    WAITING_FOR_KV_TIER = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISHED = frozenset(
    {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    }
)
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(slots=True, eq=False)
class Request:
    """One generation: its prompt, the tokens produced so far and how far the KV cache covers.

    Invariant: `num_computed_tokens <= num_tokens`; tokens in [num_computed_tokens, num_tokens)
    still have to run through the model (a prompt chunk, or the last sampled token).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int = 1 << 30
    # Where the KV of the prompt comes from (decode side) or goes to (prefill side).
    kv_transfer_params: dict[str, Any] | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    error: str | None = None
    # Speculative decoding: tokens the draft proposed for the next step, and how many of
    # this request's tokens the draft's own KV cache covers.
    spec_token_ids: list[int] = field(default_factory=list)
    num_draft_computed_tokens: int = 0
    # Prefix caching: the keys of the full blocks so far (extended by the KV cache
    # manager), and how many prompt tokens the last admission found cached.
    block_hashes: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    # Whether the offload tier was asked for this request's prefix (once: a request whose KV
    # comes from elsewhere too is admitted again after the load, and must not ask again).
    has_asked_kv_tier: bool = False
    # Prompt logprobs (`sampling_params.prompt_logprobs`): one per prompt position from 1 on,
    # gathered chunk by chunk (a recomputed prompt skips them) and sent with the first output.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # A sibling of a parallel-sampling request (n > 1): the request whose prompt blocks it
    # shares (see kvservice.engine.prefix_reuse). None for a leader or a lone request.
    leader: Request | None = None
    stop_token_ids: frozenset[int] = field(init=False, default=frozenset())

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.stop_token_ids = frozenset(self.sampling_params.stop_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether prompt logprobs are asked for and not all gathered yet."""
        return (
            self.sampling_params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_num_tokens(self) -> int:
        """The most tokens this request can ever hold (prompt plus all of its output)."""
        return min(self.num_prompt_tokens + self.sampling_params.max_tokens, self.max_model_len)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self) -> RequestStatus | None:
        """The finished status the last appended token implies, or None to keep going."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if not params.ignore_eos and last in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if last in self.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= params.max_tokens or self.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
