from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]

class KVTier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_TIER_CACHE: _ClassVar[KVTier]
    KV_TIER_OFFLOAD: _ClassVar[KVTier]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
KV_TIER_CACHE: KVTier
KV_TIER_OFFLOAD: KVTier

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_tokens", "seed", "stop_token_ids", "ignore_eos", "stop", "logprobs", "prompt_logprobs", "structured_output", "n")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    stop: _containers.RepeatedScalarFieldContainer[str]
    logprobs: int
    prompt_logprobs: int
    structured_output: StructuredOutput
    n: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., stop: _Optional[_Iterable[str]] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ..., n: _Optional[int] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: Choices
    grammar: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., grammar: _Optional[str] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class Logprobs(_message.Message):
    __slots__ = ("token_id", "logprob", "rank", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatPrompt(_message.Message):
    __slots__ = ("messages", "add_generation_prompt")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "chat", "sampling_params", "resume_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    chat: ChatPrompt
    sampling_params: SamplingParams
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatPrompt, _Mapping]] = ..., sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ..., resume_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "num_prompt_tokens", "logprobs", "prompt_logprobs", "num_cached_tokens", "prompt_token_ids", "index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    num_prompt_tokens: int
    logprobs: _containers.RepeatedCompositeFieldContainer[Logprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[Logprobs]
    num_cached_tokens: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    index: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., num_prompt_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[Logprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[Logprobs, _Mapping]]] = ..., num_cached_tokens: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., index: _Optional[int] = ...) -> None: ...

class CompleteResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "num_prompt_tokens", "logprobs", "prompt_logprobs", "num_cached_tokens", "prompt_token_ids", "index", "sequences")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    num_prompt_tokens: int
    logprobs: _containers.RepeatedCompositeFieldContainer[Logprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[Logprobs]
    num_cached_tokens: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    index: int
    sequences: _containers.RepeatedCompositeFieldContainer[CompleteResponse]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., num_prompt_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[Logprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[Logprobs, _Mapping]]] = ..., num_cached_tokens: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., index: _Optional[int] = ..., sequences: _Optional[_Iterable[_Union[CompleteResponse, _Mapping]]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVTransferStats(_message.Message):
    __slots__ = ("num_transfers", "num_failed_transfers", "num_chunks", "num_bytes", "total_seconds", "staging_bytes_in_use", "staging_bytes_capacity", "num_staged_transfers", "num_shared_memory_bytes")
    NUM_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    NUM_FAILED_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STAGING_BYTES_IN_USE_FIELD_NUMBER: _ClassVar[int]
    STAGING_BYTES_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    NUM_STAGED_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARED_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_transfers: int
    num_failed_transfers: int
    num_chunks: int
    num_bytes: int
    total_seconds: float
    staging_bytes_in_use: int
    staging_bytes_capacity: int
    num_staged_transfers: int
    num_shared_memory_bytes: int
    def __init__(self, num_transfers: _Optional[int] = ..., num_failed_transfers: _Optional[int] = ..., num_chunks: _Optional[int] = ..., num_bytes: _Optional[int] = ..., total_seconds: _Optional[float] = ..., staging_bytes_in_use: _Optional[int] = ..., staging_bytes_capacity: _Optional[int] = ..., num_staged_transfers: _Optional[int] = ..., num_shared_memory_bytes: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("role", "num_blocks_total", "num_blocks_free", "num_running_requests", "num_waiting_requests", "kv_sending", "kv_receiving", "num_finished_requests", "num_aborted_requests", "num_waiting_for_remote_kv", "workers", "spec_decode", "num_preemptions", "prefix_cache", "compute_path", "kv_offload")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_SENDING_FIELD_NUMBER: _ClassVar[int]
    KV_RECEIVING_FIELD_NUMBER: _ClassVar[int]
    NUM_FINISHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_ABORTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FOR_REMOTE_KV_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_PATH_FIELD_NUMBER: _ClassVar[int]
    KV_OFFLOAD_FIELD_NUMBER: _ClassVar[int]
    role: str
    num_blocks_total: int
    num_blocks_free: int
    num_running_requests: int
    num_waiting_requests: int
    kv_sending: KVTransferStats
    kv_receiving: KVTransferStats
    num_finished_requests: int
    num_aborted_requests: int
    num_waiting_for_remote_kv: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStats]
    spec_decode: SpecDecodeStats
    num_preemptions: int
    prefix_cache: PrefixCacheStats
    compute_path: str
    kv_offload: KVOffloadStats
    def __init__(self, role: _Optional[str] = ..., num_blocks_total: _Optional[int] = ..., num_blocks_free: _Optional[int] = ..., num_running_requests: _Optional[int] = ..., num_waiting_requests: _Optional[int] = ..., kv_sending: _Optional[_Union[KVTransferStats, _Mapping]] = ..., kv_receiving: _Optional[_Union[KVTransferStats, _Mapping]] = ..., num_finished_requests: _Optional[int] = ..., num_aborted_requests: _Optional[int] = ..., num_waiting_for_remote_kv: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerStats, _Mapping]]] = ..., spec_decode: _Optional[_Union[SpecDecodeStats, _Mapping]] = ..., num_preemptions: _Optional[int] = ..., prefix_cache: _Optional[_Union[PrefixCacheStats, _Mapping]] = ..., compute_path: _Optional[str] = ..., kv_offload: _Optional[_Union[KVOffloadStats, _Mapping]] = ...) -> None: ...

class KVOffloadStats(_message.Message):
    __slots__ = ("enabled", "num_blocks", "bytes_used", "capacity_bytes", "num_blocks_written", "num_bytes_written", "num_blocks_read", "num_bytes_read", "num_hit_blocks", "num_blocks_dropped", "num_blocks_evicted", "num_peer_blocks_from_prefill", "num_peer_blocks_from_decode", "num_peer_pulls_failed", "num_blocks_exported")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_READ_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    NUM_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_EVICTED_FIELD_NUMBER: _ClassVar[int]
    NUM_PEER_BLOCKS_FROM_PREFILL_FIELD_NUMBER: _ClassVar[int]
    NUM_PEER_BLOCKS_FROM_DECODE_FIELD_NUMBER: _ClassVar[int]
    NUM_PEER_PULLS_FAILED_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_EXPORTED_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    num_blocks: int
    bytes_used: int
    capacity_bytes: int
    num_blocks_written: int
    num_bytes_written: int
    num_blocks_read: int
    num_bytes_read: int
    num_hit_blocks: int
    num_blocks_dropped: int
    num_blocks_evicted: int
    num_peer_blocks_from_prefill: int
    num_peer_blocks_from_decode: int
    num_peer_pulls_failed: int
    num_blocks_exported: int
    def __init__(self, enabled: _Optional[bool] = ..., num_blocks: _Optional[int] = ..., bytes_used: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., num_blocks_written: _Optional[int] = ..., num_bytes_written: _Optional[int] = ..., num_blocks_read: _Optional[int] = ..., num_bytes_read: _Optional[int] = ..., num_hit_blocks: _Optional[int] = ..., num_blocks_dropped: _Optional[int] = ..., num_blocks_evicted: _Optional[int] = ..., num_peer_blocks_from_prefill: _Optional[int] = ..., num_peer_blocks_from_decode: _Optional[int] = ..., num_peer_pulls_failed: _Optional[int] = ..., num_blocks_exported: _Optional[int] = ...) -> None: ...

class PrefixCacheStats(_message.Message):
    __slots__ = ("queries", "hits")
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    queries: int
    hits: int
    def __init__(self, queries: _Optional[int] = ..., hits: _Optional[int] = ...) -> None: ...

class SpecDecodeStats(_message.Message):
    __slots__ = ("num_draft_tokens", "num_accepted_tokens", "num_verify_steps", "acceptance_rate", "mean_accepted_length", "num_draft_prompt_tokens_computed", "num_draft_prompt_tokens_received", "num_draft_prompt_tokens_recomputed")
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_VERIFY_STEPS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_PROMPT_TOKENS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_PROMPT_TOKENS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_PROMPT_TOKENS_RECOMPUTED_FIELD_NUMBER: _ClassVar[int]
    num_draft_tokens: int
    num_accepted_tokens: int
    num_verify_steps: int
    acceptance_rate: float
    mean_accepted_length: float
    num_draft_prompt_tokens_computed: int
    num_draft_prompt_tokens_received: int
    num_draft_prompt_tokens_recomputed: int
    def __init__(self, num_draft_tokens: _Optional[int] = ..., num_accepted_tokens: _Optional[int] = ..., num_verify_steps: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., mean_accepted_length: _Optional[float] = ..., num_draft_prompt_tokens_computed: _Optional[int] = ..., num_draft_prompt_tokens_received: _Optional[int] = ..., num_draft_prompt_tokens_recomputed: _Optional[int] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("address", "stats", "num_outstanding", "is_healthy", "num_indexed_blocks", "state", "role", "num_indexed_offload_blocks")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTSTANDING_FIELD_NUMBER: _ClassVar[int]
    IS_HEALTHY_FIELD_NUMBER: _ClassVar[int]
    NUM_INDEXED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_INDEXED_OFFLOAD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    address: str
    stats: StatsResponse
    num_outstanding: int
    is_healthy: bool
    num_indexed_blocks: int
    state: str
    role: str
    num_indexed_offload_blocks: int
    def __init__(self, address: _Optional[str] = ..., stats: _Optional[_Union[StatsResponse, _Mapping]] = ..., num_outstanding: _Optional[int] = ..., is_healthy: _Optional[bool] = ..., num_indexed_blocks: _Optional[int] = ..., state: _Optional[str] = ..., role: _Optional[str] = ..., num_indexed_offload_blocks: _Optional[int] = ...) -> None: ...

class KVTransferParams(_message.Message):
    __slots__ = ("remote_address", "transfer_token")
    REMOTE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    remote_address: str
    transfer_token: bytes
    def __init__(self, remote_address: _Optional[str] = ..., transfer_token: _Optional[bytes] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request", "transfer_token", "prefix_source")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SOURCE_FIELD_NUMBER: _ClassVar[int]
    request: GenerateRequest
    transfer_token: bytes
    prefix_source: PrefixSource
    def __init__(self, request: _Optional[_Union[GenerateRequest, _Mapping]] = ..., transfer_token: _Optional[bytes] = ..., prefix_source: _Optional[_Union[PrefixSource, _Mapping]] = ...) -> None: ...

class PrefixSource(_message.Message):
    __slots__ = ("remote_address", "transfer_token", "num_tokens", "last_block_hash", "source_role")
    REMOTE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAST_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ROLE_FIELD_NUMBER: _ClassVar[int]
    remote_address: str
    transfer_token: bytes
    num_tokens: int
    last_block_hash: int
    source_role: str
    def __init__(self, remote_address: _Optional[str] = ..., transfer_token: _Optional[bytes] = ..., num_tokens: _Optional[int] = ..., last_block_hash: _Optional[int] = ..., source_role: _Optional[str] = ...) -> None: ...

class ExportKVRequest(_message.Message):
    __slots__ = ("request_id", "transfer_token", "prompt_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transfer_token: bytes
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., transfer_token: _Optional[bytes] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ExportKVResponse(_message.Message):
    __slots__ = ("num_tokens", "last_block_hash")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAST_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    last_block_hash: int
    def __init__(self, num_tokens: _Optional[int] = ..., last_block_hash: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "first_token_id", "text", "finish_reason", "num_prompt_tokens", "first_token_logprobs", "prompt_logprobs", "num_cached_tokens", "prompt_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_id: int
    text: str
    finish_reason: FinishReason
    num_prompt_tokens: int
    first_token_logprobs: Logprobs
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[Logprobs]
    num_cached_tokens: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., num_prompt_tokens: _Optional[int] = ..., first_token_logprobs: _Optional[_Union[Logprobs, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[Logprobs, _Mapping]]] = ..., num_cached_tokens: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request", "kv_transfer_params", "prefix_source")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SOURCE_FIELD_NUMBER: _ClassVar[int]
    request: GenerateRequest
    kv_transfer_params: KVTransferParams
    prefix_source: PrefixSource
    def __init__(self, request: _Optional[_Union[GenerateRequest, _Mapping]] = ..., kv_transfer_params: _Optional[_Union[KVTransferParams, _Mapping]] = ..., prefix_source: _Optional[_Union[PrefixSource, _Mapping]] = ...) -> None: ...

class DecodeStreamRequest(_message.Message):
    __slots__ = ("start", "cancel")
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    start: DecodeRequest
    cancel: str
    def __init__(self, start: _Optional[_Union[DecodeRequest, _Mapping]] = ..., cancel: _Optional[str] = ...) -> None: ...

class DecodeStreamEvent(_message.Message):
    __slots__ = ("request_id", "response", "error", "done")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    response: GenerateResponse
    error: DecodeStreamError
    done: bool
    def __init__(self, request_id: _Optional[str] = ..., response: _Optional[_Union[GenerateResponse, _Mapping]] = ..., error: _Optional[_Union[DecodeStreamError, _Mapping]] = ..., done: _Optional[bool] = ...) -> None: ...

class DecodeStreamError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class DecodeStreamBatch(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[DecodeStreamEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[DecodeStreamEvent, _Mapping]]] = ...) -> None: ...

class ReleaseKVRequest(_message.Message):
    __slots__ = ("request_id", "transfer_token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transfer_token: bytes
    def __init__(self, request_id: _Optional[str] = ..., transfer_token: _Optional[bytes] = ...) -> None: ...

class ReleaseKVResponse(_message.Message):
    __slots__ = ("was_staged",)
    WAS_STAGED_FIELD_NUMBER: _ClassVar[int]
    was_staged: bool
    def __init__(self, was_staged: _Optional[bool] = ...) -> None: ...

class KVEventsRequest(_message.Message):
    __slots__ = ("after_seq",)
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    after_seq: int
    def __init__(self, after_seq: _Optional[int] = ...) -> None: ...

class KVBlocksStored(_message.Message):
    __slots__ = ("block_hashes", "parent_hash")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    parent_hash: int
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., parent_hash: _Optional[int] = ...) -> None: ...

class KVBlocksRemoved(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class KVCacheEvent(_message.Message):
    __slots__ = ("stored", "removed", "tier")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    stored: KVBlocksStored
    removed: KVBlocksRemoved
    tier: KVTier
    def __init__(self, stored: _Optional[_Union[KVBlocksStored, _Mapping]] = ..., removed: _Optional[_Union[KVBlocksRemoved, _Mapping]] = ..., tier: _Optional[_Union[KVTier, str]] = ...) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("seq", "is_snapshot", "events", "block_size", "hash_seed")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    IS_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASH_SEED_FIELD_NUMBER: _ClassVar[int]
    seq: int
    is_snapshot: bool
    events: _containers.RepeatedCompositeFieldContainer[KVCacheEvent]
    block_size: int
    hash_seed: int
    def __init__(self, seq: _Optional[int] = ..., is_snapshot: _Optional[bool] = ..., events: _Optional[_Iterable[_Union[KVCacheEvent, _Mapping]]] = ..., block_size: _Optional[int] = ..., hash_seed: _Optional[int] = ...) -> None: ...

class PullKVRequest(_message.Message):
    __slots__ = ("request_id", "transfer_token", "num_layers", "block_size", "num_kv_heads", "head_dim", "dtype", "first_block", "shared_memory", "num_draft_layers", "draft_fingerprint")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_LAYERS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transfer_token: bytes
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    first_block: int
    shared_memory: str
    num_draft_layers: int
    draft_fingerprint: str
    def __init__(self, request_id: _Optional[str] = ..., transfer_token: _Optional[bytes] = ..., num_layers: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., first_block: _Optional[int] = ..., shared_memory: _Optional[str] = ..., num_draft_layers: _Optional[int] = ..., draft_fingerprint: _Optional[str] = ...) -> None: ...

class KVChunkHeader(_message.Message):
    __slots__ = ("request_id", "layer", "first_block", "num_blocks", "dtype", "shape", "num_bytes", "crc32", "in_shared_memory", "shared_memory_position")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    IN_SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_POSITION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    layer: int
    first_block: int
    num_blocks: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    num_bytes: int
    crc32: int
    in_shared_memory: bool
    shared_memory_position: int
    def __init__(self, request_id: _Optional[str] = ..., layer: _Optional[int] = ..., first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., num_bytes: _Optional[int] = ..., crc32: _Optional[int] = ..., in_shared_memory: _Optional[bool] = ..., shared_memory_position: _Optional[int] = ...) -> None: ...

class KVTransferDone(_message.Message):
    __slots__ = ("request_id", "first_token_id", "num_chunks", "num_bytes", "num_tokens", "has_draft_kv")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HAS_DRAFT_KV_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_id: int
    num_chunks: int
    num_bytes: int
    num_tokens: int
    has_draft_kv: bool
    def __init__(self, request_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., num_chunks: _Optional[int] = ..., num_bytes: _Optional[int] = ..., num_tokens: _Optional[int] = ..., has_draft_kv: _Optional[bool] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("header", "done", "payload")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    header: KVChunkHeader
    done: KVTransferDone
    payload: bytes
    def __init__(self, header: _Optional[_Union[KVChunkHeader, _Mapping]] = ..., done: _Optional[_Union[KVTransferDone, _Mapping]] = ..., payload: _Optional[bytes] = ...) -> None: ...
