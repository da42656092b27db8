"""The KV connector contract: how KV moves between engines, around every model step.

A connector has two halves in one object (both live in the engine's process):

Scheduler side, called by the `Scheduler` while it plans a step:
  0. `supplies_first_token(request)` - whether a remote prefill samples the request's
     first token (then its whole prompt may come from the local prefix cache).
  1. `get_num_new_matched_tokens(request, num_computed_tokens)` - how many prompt tokens
     past the local prefix-cache hit a remote source will supply, and whether they
     arrive asynchronously.
  2. `update_state_after_alloc(request, block_ids, num_external_tokens)` - blocks are
     allocated for them; remember where to load.
  3. `build_connector_meta(scheduler_output)` - what the worker half must do this step.
  4. `request_finished(request, block_ids)` - a request ended; returns whether freeing
     its blocks must wait (a save or load still touches them) and its `kv_transfer_params`.
  5. `update_connector_output(output)` - what the worker half reported after the step.

Worker side, called once per step by the model runner, in this order (the
`kv_connector_lifecycle` context manager in `kvservice.connector.lifecycle` enforces it):
  `bind_connector_metadata(meta)` -> `start_load_kv(ctx)` -> forward, which calls
  `wait_for_layer_load(layer)` before and `save_kv_layer(layer, ...)` after each layer's
  attention -> `wait_for_save()` (unless finalization is deferred) ->
  `get_finished(finished_req_ids)` -> `get_block_ids_with_load_errors()` ->
  `get_kv_connector_stats()` -> `get_kv_connector_kv_cache_events()` ->
  `build_connector_worker_meta()` -> `clear_connector_metadata()` (unless deferred).

Optional hooks are concrete no-ops, so a connector implements only what it moves.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any

from kvservice.core.outputs import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorStats,
    KVConnectorWorkerMeta,
    SchedulerOutput,
)

# The keys of `Request.kv_transfer_params` that the router sets and the connectors read.
TRANSFER_TOKEN = "transfer_token"  # the random secret that authorises pulling one transfer's KV
REMOTE_ADDRESS = "remote_address"  # decode side: the prefill worker that holds the KV
# A prefix source: another worker staged the prompt's leading blocks (ExportKV) for a pull.
PREFIX_ADDRESS = "prefix_address"  # the worker to pull them from
PREFIX_TOKEN = "prefix_token"  # the token they are staged under
PREFIX_NUM_TOKENS = "prefix_num_tokens"  # how many leading prompt tokens (whole blocks)
PREFIX_LAST_HASH = "prefix_last_hash"  # the chained hash of the last of those blocks
PREFIX_ROLE = "prefix_role"  # the source's role, for the puller's stats
PREFIX_KEYS = (PREFIX_ADDRESS, PREFIX_TOKEN, PREFIX_NUM_TOKENS, PREFIX_LAST_HASH, PREFIX_ROLE)


def drop_prefix_source(request: Request) -> None:
    """Forget a request's prefix source (pulled, failed, or of no use): it is tried once."""
    params = request.kv_transfer_params
    if params is not None:
        for key in PREFIX_KEYS:
            params.pop(key, None)


if TYPE_CHECKING:
    import torch

    from kvservice.core.block_pool import KVCacheEvent
    from kvservice.core.request import Request
    from kvservice.model.attention import AttentionMetadata
    from kvservice.model.kv_cache import KVCacheLayout


class KVConnectorBase(abc.ABC):
    """Both halves of a connector. Subclasses implement the abstract methods."""

    def __init__(self) -> None:
        self._connector_metadata: KVConnectorMetadata | None = None

    # ------------------------------------------------------------ scheduler side

    def supplies_first_token(self, request: Request) -> bool:
        """Called by the scheduler before it looks up a waiting request's cached prefix:
        True when an external source sends the first sampled token with the KV, so no
        prompt token has to be computed here. Default: False."""
        return False

    def loads_prefix_only(self, request: Request) -> bool:
        """Whether the load `get_num_new_matched_tokens` matches for this waiting request brings only
        leading blocks of its prompt and no first token (a prefix source): the request then computes
        its prompt from the end of what arrived. Default: False (a load brings the whole prompt)."""
        return False

    def has_kv_source(self, request: Request) -> bool:
        """Whether this connector may bring some of a waiting request's prompt KV (the scheduler
        then gives it the chance after an offload tier's load). Default: `supplies_first_token`."""
        return self.supplies_first_token(request)

    @abc.abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Called by the scheduler for a waiting request before it allocates blocks;
        `num_computed_tokens` is its local prefix-cache hit.

        Returns (number of tokens past `num_computed_tokens` whose KV an external
        source supplies, whether that load is asynchronous, i.e. the request must wait
        in WAITING_FOR_REMOTE_KV until `get_finished` reports it in `finished_recving`;
        (0, True) waits for a load that brings only the first token).
        """

    @abc.abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """Called by the scheduler after allocating blocks for a request that
        `get_num_new_matched_tokens` matched: where the external KV must land."""

    @abc.abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Called by the scheduler at the end of `schedule()`: the worker half's
        instructions for this step (loads to start, saves to make). Resets the
        scheduler half's per-step state."""

    @abc.abstractmethod
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Called by the scheduler when a request finishes or is aborted, before its
        blocks are freed. Returns (delay_free, kv_transfer_params): with delay_free the
        scheduler frees the blocks only once the request appears in
        `finished_sending` or `finished_recving`."""

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Called by the scheduler with each step's worker output. Default: nothing."""

    # ------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: list[torch.Tensor], layout: KVCacheLayout) -> None:
        """Called once by the engine after it allocates its KV cache (one tensor per layer,
        [2, num_blocks, block_size, kv_heads, head_dim]). Default: nothing."""

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        """Called by the runner at the start of every step with `build_connector_meta`'s result."""
        self._connector_metadata = metadata

    def clear_connector_metadata(self) -> None:
        """Called by the runner at the end of the step (or by `finalize_kv_connector`)."""
        self._connector_metadata = None

    @property
    def connector_metadata(self) -> KVConnectorMetadata:
        assert self._connector_metadata is not None, "no connector metadata bound for this step"
        return self._connector_metadata

    @abc.abstractmethod
    def start_load_kv(self, forward_context: Any) -> None:
        """Called by the runner right after binding: start this step's loads. Must not
        block on the network; asynchronous loads run in the background."""

    @property
    def moves_draft_kv(self) -> bool:
        """Whether this connector moves a speculative draft model's KV too: then the engine
        registers the draft's caches after the target's (`KVCacheLayout.num_draft_layers`) and
        the draft's forward calls the per-layer hooks with the layers numbered after the
        target's. Default: False (the target's caches alone)."""
        return False

    @property
    def has_layer_hooks(self) -> bool:
        """Whether this connector's class does anything in the two per-layer hooks (a decode
        step without them runs all its layers in one C++ call)."""
        cls = type(self)
        return (
            cls.wait_for_layer_load is not KVConnectorBase.wait_for_layer_load
            or cls.save_kv_layer is not KVConnectorBase.save_kv_layer
        )

    def wait_for_layer_load(self, layer: int) -> None:
        """Called inside the forward before layer `layer`'s attention reads the cache.
        Default: nothing (loads are whole-request and asynchronous)."""

    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata) -> None:
        """Called inside the forward after layer `layer` wrote its KV. `kv_layer` is that
        layer's cache, [2, num_blocks, block_size, num_kv_heads, head_dim]. Default: nothing."""

    def wait_for_save(self) -> None:
        """Called by the runner after the forward (or by `finalize_kv_connector`):
        block until this step's saves no longer need the device blocks. Default: nothing."""

    @abc.abstractmethod
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """Called by the runner after every step. `finished_req_ids` are the requests
        the scheduler finished since the last step. Returns (finished_sending: requests
        whose blocks the saves no longer need, finished_recving: requests whose
        asynchronous load completed, failed or was cancelled)."""

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Called by the runner after `get_finished`: block ids whose load failed since the
        last call (their requests are in `finished_recving` too). Default: none."""
        return set()

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        """Called by the runner every step: transfer counters, or None."""
        return None

    def make_stats(self) -> KVConnectorStats | None:
        """Called from the engine thread between steps (stats endpoints): this connector's
        transfer counters, as a consistent snapshot. Default: None."""
        return None

    def get_kv_connector_kv_cache_events(self) -> list[KVCacheEvent]:
        """Called by the runner every step: KV cache events since the last call."""
        return []

    def build_connector_worker_meta(self) -> KVConnectorWorkerMeta | None:
        """Called by the runner every step: what the worker half tells the scheduler
        half beyond the finished sets (e.g. the first token a remote prefill sampled)."""
        return None

    def shutdown(self) -> None:
        """Stop background work and release buffers. Default: nothing."""
