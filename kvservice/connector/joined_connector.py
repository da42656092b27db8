"""Two connectors as one: a saving half and a loading half (a prefill worker that stages its
prompts' KV for decode workers and pulls prompt prefixes that other workers hold).

Every call goes to the half it concerns, or to both where both take part (finished requests,
metadata, stats, shutdown): the saving half decides what a finished request's blocks wait for
and which `kv_transfer_params` it hands back, the loading half what a waiting request loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvservice.connector.base import KVConnectorBase
from kvservice.core.outputs import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorStats,
    KVConnectorWorkerMeta,
    SchedulerOutput,
)

if TYPE_CHECKING:
    import torch

    from kvservice.core.block_pool import KVCacheEvent
    from kvservice.core.request import Request
    from kvservice.model.attention import AttentionMetadata
    from kvservice.model.kv_cache import KVCacheLayout


@dataclass(slots=True)
class JoinedMetadata(KVConnectorMetadata):
    saving: KVConnectorMetadata
    loading: KVConnectorMetadata


class JoinedKVConnector(KVConnectorBase):
    def __init__(self, saving: KVConnectorBase, loading: KVConnectorBase) -> None:
        super().__init__()
        self.saving = saving
        self.loading = loading

    @property
    def moves_draft_kv(self) -> bool:
        return self.saving.moves_draft_kv

    # ------------------------------------------------------------ scheduler side

    def supplies_first_token(self, request: Request) -> bool:
        return self.loading.supplies_first_token(request)

    def loads_prefix_only(self, request: Request) -> bool:
        return self.loading.loads_prefix_only(request)

    def has_kv_source(self, request: Request) -> bool:
        return self.loading.has_kv_source(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return self.loading.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        self.loading.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> JoinedMetadata:
        return JoinedMetadata(
            self.saving.build_connector_meta(scheduler_output), self.loading.build_connector_meta(scheduler_output)
        )

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        delay_loading, _ = self.loading.request_finished(request, block_ids)
        delay_saving, params = self.saving.request_finished(request, block_ids)
        return delay_saving or delay_loading, params

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.saving.update_connector_output(output)
        self.loading.update_connector_output(output)

    # ------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: list[torch.Tensor], layout: KVCacheLayout) -> None:
        self.saving.register_kv_caches(kv_caches, layout)
        self.loading.register_kv_caches(kv_caches, layout)

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        assert isinstance(metadata, JoinedMetadata)
        super().bind_connector_metadata(metadata)
        self.saving.bind_connector_metadata(metadata.saving)
        self.loading.bind_connector_metadata(metadata.loading)

    def clear_connector_metadata(self) -> None:
        self.saving.clear_connector_metadata()
        self.loading.clear_connector_metadata()
        super().clear_connector_metadata()

    def start_load_kv(self, forward_context: Any) -> None:
        self.loading.start_load_kv(forward_context)

    def wait_for_layer_load(self, layer: int) -> None:
        self.loading.wait_for_layer_load(layer)

    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata) -> None:
        self.saving.save_kv_layer(layer, kv_layer, attn_metadata)

    def wait_for_save(self) -> None:
        self.saving.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        sending, _ = self.saving.get_finished(finished_req_ids)
        _, recving = self.loading.get_finished(finished_req_ids)
        return sending, recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.loading.get_block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        stats = {**(self.saving.get_kv_connector_stats() or {}), **(self.loading.get_kv_connector_stats() or {})}
        return stats or None

    def make_stats(self) -> KVConnectorStats | None:
        saving, loading = self.saving.make_stats(), self.loading.make_stats()
        if saving is None or loading is None:
            return saving or loading
        return KVConnectorStats(
            receiving=loading.receiving or saving.receiving,
            sending=saving.sending or loading.sending,
            staging=saving.staging or loading.staging,
            peer_pulls=loading.peer_pulls or saving.peer_pulls,
        )

    def get_kv_connector_kv_cache_events(self) -> list[KVCacheEvent]:
        return self.saving.get_kv_connector_kv_cache_events() + self.loading.get_kv_connector_kv_cache_events()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMeta | None:
        return self.loading.build_connector_worker_meta()

    def shutdown(self) -> None:
        self.saving.shutdown()
        self.loading.shutdown()
