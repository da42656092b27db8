"""A connector that records every worker-side call with its arguments, and the call
sequences the lifecycle must produce: the instrument of tests/test_connector_lifecycle.py."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch

from kvservice.connector.base import KVConnectorBase
from kvservice.core.outputs import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorWorkerMeta,
    SchedulerOutput,
)
from kvservice.core.request import Request, RequestStatus
from kvservice.model.kv_cache import KVCacheLayout

NUM_LAYERS = 4  # the tiny model's
REMOTE = "remote"  # kv_transfer_params key: the prompt's KV comes from elsewhere

Call = tuple[Any, ...]


@dataclass(frozen=True)
class StepMeta(KVConnectorMetadata):
    """The recording connector's metadata: which step built it."""

    step: int


class RecordingConnector(KVConnectorBase):
    """Records every worker-side call in order; reports what the test tells it to."""

    def __init__(self, delay_free: bool = False) -> None:
        super().__init__()
        self.calls: list[Call] = []
        self.delay_free = delay_free
        self.kv_caches: list[torch.Tensor] = []
        self.num_metas = 0
        # What the next get_finished / load-error / worker-meta calls report.
        self.report_sending: set[str] = set()
        self.report_recving: set[str] = set()
        self.report_load_errors: set[int] = set()
        self.report_first_tokens: dict[str, int] = {}
        self.stats = {"num_steps": 0}
        # Scheduler side.
        self.finished_requests: list[tuple[str, RequestStatus]] = []
        self.connector_outputs: list[KVConnectorOutput] = []
        # Per layer: whether that layer's cache held any KV when the hook ran.
        self.layer_had_kv_at_load: dict[int, bool] = {}
        self.layer_had_kv_at_save: dict[int, bool] = {}

    def register_kv_caches(self, kv_caches: list[torch.Tensor], layout: KVCacheLayout) -> None:
        self.kv_caches = kv_caches

    # scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if request.kv_transfer_params and REMOTE in request.kv_transfer_params:
            return request.num_prompt_tokens, True
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self.num_metas += 1
        return StepMeta(self.num_metas)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.finished_requests.append((request.request_id, request.status))
        return self.delay_free, None

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.connector_outputs.append(output)

    # worker side

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        self.calls.append(("bind_connector_metadata", metadata))
        super().bind_connector_metadata(metadata)

    def start_load_kv(self, forward_context: Any) -> None:
        self.calls.append(("start_load_kv",))

    def wait_for_layer_load(self, layer: int) -> None:
        self.calls.append(("wait_for_layer_load", layer))
        self.layer_had_kv_at_load[layer] = bool(self.kv_caches[layer].any())

    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        # The metadata of this step is bound while the forward runs.
        self.calls.append(("save_kv_layer", layer, self.connector_metadata))
        assert kv_layer is self.kv_caches[layer]
        self.layer_had_kv_at_save[layer] = bool(kv_layer.any())

    def wait_for_save(self) -> None:
        self.calls.append(("wait_for_save",))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        self.calls.append(("get_finished", frozenset(finished_req_ids)))
        sending, self.report_sending = self.report_sending, set()
        recving, self.report_recving = self.report_recving, set()
        return sending, recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        self.calls.append(("get_block_ids_with_load_errors",))
        errors, self.report_load_errors = self.report_load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        self.calls.append(("get_kv_connector_stats",))
        self.stats["num_steps"] += 1
        return dict(self.stats)

    def get_kv_connector_kv_cache_events(self) -> list[Any]:
        self.calls.append(("get_kv_connector_kv_cache_events",))
        return []

    def build_connector_worker_meta(self) -> KVConnectorWorkerMeta | None:
        self.calls.append(("build_connector_worker_meta",))
        if not self.report_first_tokens:
            return None
        meta = KVConnectorWorkerMeta(first_token_ids=self.report_first_tokens)
        self.report_first_tokens = {}
        return meta

    def clear_connector_metadata(self) -> None:
        self.calls.append(("clear_connector_metadata",))
        super().clear_connector_metadata()

    def take_calls(self) -> list[Call]:
        calls, self.calls = self.calls, []
        return calls


def forward_calls(meta: Any) -> list[Call]:
    calls: list[Call] = []
    for layer in range(NUM_LAYERS):
        calls += [("wait_for_layer_load", layer), ("save_kv_layer", layer, meta)]
    return calls


def after_forward(finished_req_ids: Collection[str] = ()) -> list[Call]:
    return [
        ("get_finished", frozenset(finished_req_ids)),
        ("get_block_ids_with_load_errors",),
        ("get_kv_connector_stats",),
        ("get_kv_connector_kv_cache_events",),
        ("build_connector_worker_meta",),
    ]


def normal_step(meta: Any, finished_req_ids: Collection[str] = ()) -> list[Call]:
    return [
        ("bind_connector_metadata", meta),
        ("start_load_kv",),
        *forward_calls(meta),
        ("wait_for_save",),
        *after_forward(finished_req_ids),
        ("clear_connector_metadata",),
    ]


def no_forward_step(meta: Any, finished_req_ids: Collection[str] = ()) -> list[Call]:
    return [
        ("bind_connector_metadata", meta),
        ("start_load_kv",),
        *after_forward(finished_req_ids),
        ("clear_connector_metadata",),
    ]
