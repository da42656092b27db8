"""The per-step connector lifecycle around a model forward (the model-runner mixin's semantics).

`kv_connector_output` is the one context manager that orders the worker-side calls:
bind metadata -> start_load_kv -> (forward, in the `with` body) -> wait_for_save
(unless deferred or told not to) -> get_finished -> load errors -> stats -> events ->
worker meta -> clear metadata (unless deferred). Callers cannot get the order wrong.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from kvservice.connector.base import KVConnectorBase
from kvservice.core.outputs import KVConnectorOutput, SchedulerOutput


@contextlib.contextmanager
def kv_connector_output(
    connector: KVConnectorBase,
    scheduler_output: SchedulerOutput,
    wait_for_save: bool = True,
    defer_finalize: bool = False,
    forward_context: Any = None,
) -> Iterator[KVConnectorOutput]:
    """Run one step's connector lifecycle around the `with` body (the forward)."""
    output = KVConnectorOutput()
    assert scheduler_output.kv_connector_metadata is not None, "the scheduler built no connector metadata"
    connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
    # Background transfers start here; they may concern requests not in this batch.
    connector.start_load_kv(forward_context)
    try:
        yield output
    finally:
        if wait_for_save and not defer_finalize:
            connector.wait_for_save()
        output.finished_sending, output.finished_recving = connector.get_finished(scheduler_output.finished_req_ids)
        output.invalid_block_ids = connector.get_block_ids_with_load_errors()
        output.kv_connector_stats = connector.get_kv_connector_stats()
        output.kv_cache_events = connector.get_kv_connector_kv_cache_events()
        output.kv_connector_worker_meta = connector.build_connector_worker_meta()
        if not defer_finalize:
            connector.clear_connector_metadata()


def maybe_get_kv_connector_output(
    connector: KVConnectorBase | None,
    scheduler_output: SchedulerOutput,
    defer_finalize: bool = False,
) -> contextlib.AbstractContextManager[KVConnectorOutput | None]:
    """The lifecycle when a connector is configured; a null context (yielding None) otherwise."""
    if connector is None:
        return contextlib.nullcontext()
    return kv_connector_output(connector, scheduler_output, defer_finalize=defer_finalize)


def kv_connector_no_forward(connector: KVConnectorBase, scheduler_output: SchedulerOutput) -> KVConnectorOutput:
    """A step with nothing to compute still drives transfers (loads finish, saves release)."""
    with kv_connector_output(connector, scheduler_output, wait_for_save=False) as output:
        pass
    return output


def finalize_kv_connector(connector: KVConnectorBase | None) -> None:
    """After a deferred step's draft pass: wait for the saves, then clear the metadata."""
    if connector is not None:
        connector.wait_for_save()
        connector.clear_connector_metadata()
