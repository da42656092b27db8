"""The run of a serving benchmark: send a workload through a `Backend` at its arrival times and
measure it (the reusable core of `bench serve`, `bench compare`, `bench prefix` and the tests).

A workload is a list of single requests or of conversations; a single request runs as a
conversation of one turn (`conversation.py`), so every dataset is driven the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import secrets
import sys
import time
from collections.abc import Sequence
from datetime import datetime
from typing import Any, Protocol

from kvservice.client.bench.backend import Backend
from kvservice.client.bench.conversation import Conversation, run_conversation
from kvservice.client.bench.metrics import BenchmarkMetrics, RequestRecord, compute_metrics, metrics_to_result_json
from kvservice.client.bench.workload import SampledRequest, request_arrivals, warm_up_requests

KV_NOT_MEASURED = "not measured (HTTP has no Stats; --stats-target HOST:PORT reads a kvservice proxy's)"

Workload = Sequence[SampledRequest] | Sequence[Conversation]


class _Progress(Protocol):
    def update(self, n: int = 1) -> object: ...
    def close(self) -> None: ...


class _TextProgress:
    """A one-line `done/total` counter on stderr, for when tqdm is not installed."""

    def __init__(self, total: int, disable: bool) -> None:
        self.total, self.done, self.disable = total, 0, disable

    def update(self, n: int = 1) -> None:
        self.done += n
        if not self.disable:
            sys.stderr.write(f"\r{self.done}/{self.total} requests")
            sys.stderr.flush()

    def close(self) -> None:
        if not self.disable:
            sys.stderr.write("\n")


def _progress(total: int, disable: bool) -> _Progress:
    try:
        from tqdm import tqdm
    except ImportError:
        return _TextProgress(total, disable)
    return tqdm(total=total, unit="req", file=sys.stderr, disable=disable)


async def _warm_up(
    backend: Backend, requests: Sequence[SampledRequest], num_warmups: int, seed: int, timeout: float | None
) -> None:
    tag = secrets.token_hex(4)
    warm_ups = warm_up_requests(requests, num_warmups, seed)
    records = await asyncio.gather(
        *(backend.send(request, f"warmup-{tag}-{i}", timeout) for i, request in enumerate(warm_ups))
    )
    failed = [r for r in records if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} of {num_warmups} warm-up requests failed; first: {failed[0].error}")


async def run_benchmark(
    backend: Backend,
    workload: Workload,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    *,
    seed: int = 0,
    num_warmups: int = 0,
    goodput_slos: dict[str, float] | None = None,
    request_timeout: float | None = None,
    disable_tqdm: bool = True,
) -> tuple[BenchmarkMetrics, list[RequestRecord], dict[str, Any]]:
    """Send `workload` through `backend` (entered, ready) at the given arrival process and measure it.

    Requests (or conversations: their first turns) arrive by the arrival process; a
    conversation's later turns follow its answers. `max_concurrency` bounds the
    conversations in flight, each with one request in flight, so it bounds requests too.
    Warm-ups are shaped as the first requests but share no tokens' order with them (no
    prefix-cache hits carried into the run).

    Returns the metrics, one record per request (conversation by conversation, turn by
    turn), and the extra result fields: the run's settings and the servers' counters
    over the measured requests only (`kv_transfer_*`, `prefix_cache_*`), or
    `kv_transfer_note` where the backend cannot read them. Request failures are
    recorded, not raised; a failed warm-up raises RuntimeError.
    """
    if not workload:
        raise ValueError("the workload must not be empty")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    conversations = [c if isinstance(c, Conversation) else Conversation((c,)) for c in workload]
    if num_warmups > 0:
        await _warm_up(backend, [c.turns[0] for c in conversations], num_warmups, seed, request_timeout)
    counters_before = await backend.server_counters()
    limit: contextlib.AbstractAsyncContextManager[object] = (
        asyncio.Semaphore(max_concurrency) if max_concurrency is not None else contextlib.nullcontext()
    )
    num_requests = sum(len(c.turns) for c in conversations)
    progress = _progress(num_requests, disable_tqdm)
    tag = secrets.token_hex(4)

    async def send(request: SampledRequest, request_id: str) -> RequestRecord:
        record = await backend.send(request, request_id, request_timeout)
        progress.update(1)
        return record

    async def converse(index: int, conversation: Conversation) -> list[RequestRecord]:
        # As vLLM: the arrival schedule is fixed; the concurrency cap delays sending.
        async with limit:
            return await run_conversation(conversation, f"bench-{tag}-{index}", send)

    benchmark_start = time.perf_counter()
    try:
        async with asyncio.TaskGroup() as group:
            tasks = []
            async for conversation in request_arrivals(conversations, request_rate, burstiness, seed):
                tasks.append(group.create_task(converse(len(tasks), conversation)))
    finally:
        progress.close()
    duration = time.perf_counter() - benchmark_start
    counters_after = await backend.server_counters() if counters_before is not None else None
    records = [record for task in tasks for record in task.result()]
    metrics = compute_metrics(records, duration, goodput_slos)
    extra: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": backend.name,
        "target": backend.address,
        "num_prompts": num_requests,
        "num_conversations": len(conversations),
        "request_rate": request_rate if math.isfinite(request_rate) else "inf",
        "burstiness": burstiness,
        "max_concurrency": max_concurrency,
        "num_warmups": num_warmups,
        "goodput_slos": goodput_slos,
    }
    if counters_before is not None and counters_after is not None:
        extra.update(counters_after.since(counters_before).to_result_json(metrics.completed))
    else:
        extra["kv_transfer_note"] = KV_NOT_MEASURED
    return metrics, records, extra


def result_json(metrics: BenchmarkMetrics, records: Sequence[RequestRecord], extra: dict[str, Any]) -> dict[str, Any]:
    """`metrics_to_result_json` plus `requests`: each record, times in s since the first send."""
    t0 = min((r.start for r in records), default=0.0)
    per_request = [
        {
            "request_id": r.request_id,
            "prompt_len": r.prompt_len,
            "output_len": r.output_len,
            "start": r.start - t0,
            "token_times": [t - t0 for t in r.token_times],
            "end": r.end - t0,
            "turn": r.turn,
            "success": r.success,
            "error": r.error,
        }
        for r in records
    ]
    # Wall-clock time of t0, so a run can be lined up with events outside it (a scale command).
    start_unix = t0 + time.time() - time.perf_counter()
    return {**metrics_to_result_json(metrics, records, extra), "start_unix": start_unix, "requests": per_request}
