"""Prometheus metrics of one kvservice process, and the HTTP endpoint that exports them.

Every server (`kvservice serve`, `kvservice proxy`) has a `ServerMetrics` with a registry
of its own; `--metrics-port` serves it at `/metrics`. Names carry the `kvservice_` prefix
and Prometheus' unit suffixes (`_total`, `_seconds`, `_bytes`).

- Request metrics are observed where a request is served: on the proxy for client
  requests, on a worker for what it serves (a prefill worker's request ends with its one
  token, so it has a TTFT and an end-to-end latency but no TTST or TPOT).
- Engine and KV transfer figures (running/waiting requests, KV blocks, transfer bytes,
  seconds and failures, staging pool bytes) come from the worker's `Stats` snapshot,
  taken on the engine thread at scrape time: never stale, never torn.
- `kvservice_compute_path_info{compute_path="..."} 1` names the code a worker computes with:
  "cpu-kernels (AVX512)" or "(AVX2)", or PyTorch and why (alert on `compute_path=~"pytorch.*"`
  where the C++ kernels are expected: that path is ~7x slower).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Iterator
from types import TracebackType

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from kvservice.server.errors import status_for
from kvservice.v1 import kvservice_pb2 as pb

# vLLM's buckets, with finer steps at the low end for the tiny model.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
TPOT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    80.0,
)
E2EL_BUCKETS = (
    0.01,
    0.05,
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
)
SNAPSHOT_TIMEOUT_S = 5.0

StatsSource = Callable[[], Awaitable[pb.StatsResponse]]


class ServerMetrics:
    """The metrics of one server process. `role` is prefill, decode, both or proxy."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvservice_requests",
            "Requests served, by outcome: ok, cancelled, or the gRPC status code in lower case",
            ["outcome"],
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "kvservice_time_to_first_token_seconds",
            "Seconds from a request's arrival to its first token",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.time_to_second_token = Histogram(
            "kvservice_time_to_second_token_seconds",
            "Seconds from a request's arrival to its second token",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.time_per_output_token = Histogram(
            "kvservice_time_per_output_token_seconds",
            "Per finished request with 2+ tokens: (last token - first token) / (tokens - 1)",
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.e2e_request_latency = Histogram(
            "kvservice_e2e_request_latency_seconds",
            "Seconds from a request's arrival to its last token (finished requests)",
            buckets=E2EL_BUCKETS,
            registry=r,
        )
        self.spec_acceptance_rate = Gauge(
            "kvservice_spec_acceptance_rate",
            "Speculative decoding: accepted / proposed draft tokens (0 without speculative decoding)",
            registry=r,
        )
        # The proxy has no engine: its running requests are the client requests in flight.
        self.num_requests_running: Gauge | None = None
        self.workers_healthy: Gauge | None = None
        self.workers: Gauge | None = None  # membership: workers by role and state
        self.worker_joins: Gauge | None = None
        self.worker_leaves: Gauge | None = None
        self.engine: EngineCollector | None = None
        self.requests_prefilled: Counter | None = None
        if role == "proxy":
            self.num_requests_running = Gauge("kvservice_num_requests_running", "Client requests in flight", registry=r)
            self.requests_prefilled = Counter(
                "kvservice_requests_prefilled",
                "Routed requests by where their prompt was prefilled: "
                "prefill_worker (its KV pulled by the decode worker) or decode_worker (locally: a short uncached part, "
                "no prefill worker reachable, or a migrated stream)",
                ["where"],
                registry=r,
            )
            self.workers_healthy = Gauge(
                "kvservice_workers_healthy", "Workers whose health check passes, by role", ["role"], registry=r
            )
            self.workers = Gauge(
                "kvservice_workers",
                "Workers by role and membership state (joining, serving, not_serving, leaving)",
                ["role", "state"],
                registry=r,
            )
            # Counters in meaning, read from the pools when scraped (hence gauges with set_function).
            self.worker_joins = Gauge(
                "kvservice_worker_joins", "Discovered workers that joined, by role", ["role"], registry=r
            )
            self.worker_leaves = Gauge(
                "kvservice_worker_leaves", "Workers dropped after leaving DNS, by role", ["role"], registry=r
            )
        else:
            self.engine = EngineCollector()
            r.register(self.engine)

    def track(self, request_id: str, logger: logging.Logger) -> RequestTracker:
        return RequestTracker(self, request_id, logger)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class RequestTracker:
    """Times, counts and logs one request: `with metrics.track(rid, logger) as t: ... t.on_tokens(n)`.

    Leaving the block records the outcome; an exception passes through unchanged.
    Latency histograms are observed for what happened (TTFT at the first token), the
    end-to-end latency and TPOT only for requests that finished normally.
    """

    __slots__ = ("metrics", "request_id", "logger", "start", "first_token_time", "num_tokens")

    def __init__(self, metrics: ServerMetrics, request_id: str, logger: logging.Logger) -> None:
        self.metrics = metrics
        self.request_id = request_id
        self.logger = logger
        self.start = 0.0
        self.first_token_time = 0.0
        self.num_tokens = 0

    def __enter__(self) -> RequestTracker:
        self.start = time.perf_counter()
        if self.metrics.num_requests_running is not None:
            self.metrics.num_requests_running.inc()
        self.logger.info("request_id=%s started on %s", self.request_id, self.metrics.role)
        return self

    def on_tokens(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        now = time.perf_counter()
        if self.num_tokens == 0:
            self.first_token_time = now
            self.metrics.time_to_first_token.observe(now - self.start)
        if self.num_tokens < 2 <= self.num_tokens + num_tokens:
            self.metrics.time_to_second_token.observe(now - self.start)
        self.num_tokens += num_tokens

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        now = time.perf_counter()
        m = self.metrics
        if m.num_requests_running is not None:
            m.num_requests_running.dec()
        outcome = outcome_of(error)
        m.requests.labels(outcome).inc()
        if outcome == "ok":
            m.e2e_request_latency.observe(now - self.start)
            if self.num_tokens > 1:
                m.time_per_output_token.observe((now - self.first_token_time) / (self.num_tokens - 1))
            self.logger.info(
                "request_id=%s finished: %d tokens in %.3f s", self.request_id, self.num_tokens, now - self.start
            )
        else:
            self.logger.info(
                "request_id=%s ended: %s (%s) after %d tokens", self.request_id, outcome, error, self.num_tokens
            )


def outcome_of(error: BaseException | None) -> str:
    if error is None:
        return "ok"
    if isinstance(error, (asyncio.CancelledError, GeneratorExit)):
        return "cancelled"
    return status_for(error).name.lower()


class EngineCollector(Collector):
    """A worker's engine and KV transfer figures, from the latest `Stats` snapshot."""

    def __init__(self) -> None:
        self.snapshot: pb.StatsResponse | None = None

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot
        if s is None:
            return
        if s.compute_path:
            yield InfoMetricFamily(
                "kvservice_compute_path",
                "The code this worker computes with: the C++ CPU kernels and their ISA, or PyTorch and why",
                value={"compute_path": s.compute_path},
            )
        if s.HasField("kv_offload"):
            yield from _kv_offload_metrics(s.kv_offload)
        yield GaugeMetricFamily(
            "kvservice_num_requests_running", "Requests in the engine's running batch", value=s.num_running_requests
        )
        yield GaugeMetricFamily(
            "kvservice_num_requests_waiting", "Requests queued for admission", value=s.num_waiting_requests
        )
        yield GaugeMetricFamily(
            "kvservice_num_requests_waiting_for_remote_kv",
            "Decode: requests whose prompt KV is being pulled",
            value=s.num_waiting_for_remote_kv,
        )
        yield GaugeMetricFamily(
            "kvservice_kv_blocks_used", "KV cache blocks in use", value=s.num_blocks_total - s.num_blocks_free
        )
        yield GaugeMetricFamily("kvservice_kv_blocks_free", "KV cache blocks free", value=s.num_blocks_free)
        transfers = CounterMetricFamily(
            "kvservice_kv_transfers", "KV transfers, by direction (send: prefill, recv: decode)", labels=["direction"]
        )
        failures = CounterMetricFamily(
            "kvservice_kv_transfer_failures", "KV transfers that failed, by direction", labels=["direction"]
        )
        num_bytes = CounterMetricFamily(
            "kvservice_kv_transfer_bytes", "KV payload bytes transferred, by direction", labels=["direction"]
        )
        shared = CounterMetricFamily(
            "kvservice_kv_transfer_shared_memory_bytes",
            "Of the KV payload bytes, those through a same-host shared-memory segment, by direction",
            labels=["direction"],
        )
        seconds = CounterMetricFamily(
            "kvservice_kv_transfer_seconds",
            "Seconds spent in KV transfers (summed over transfers), by direction",
            labels=["direction"],
        )
        for direction, t in (("send", s.kv_sending), ("recv", s.kv_receiving)):
            transfers.add_metric([direction], t.num_transfers)
            failures.add_metric([direction], t.num_failed_transfers)
            num_bytes.add_metric([direction], t.num_bytes)
            shared.add_metric([direction], t.num_shared_memory_bytes)
            seconds.add_metric([direction], t.total_seconds)
        yield from (transfers, failures, num_bytes, shared, seconds)
        yield CounterMetricFamily(
            "kvservice_prefix_cache_queries", "Prefix cache: prompt tokens looked up", value=s.prefix_cache.queries
        )
        yield CounterMetricFamily(
            "kvservice_prefix_cache_hits", "Prefix cache: prompt tokens found cached", value=s.prefix_cache.hits
        )
        spec = s.spec_decode
        yield CounterMetricFamily(
            "kvservice_spec_draft_tokens", "Speculative decoding: draft tokens proposed", value=spec.num_draft_tokens
        )
        yield CounterMetricFamily(
            "kvservice_spec_accepted_tokens",
            "Speculative decoding: draft tokens accepted",
            value=spec.num_accepted_tokens,
        )
        draft_prompt = CounterMetricFamily(
            "kvservice_spec_draft_prompt_tokens",
            "Speculative decoding: prompt tokens of the draft model, by how their draft KV came about "
            "(computed: the draft ran over them here; received: with a pull; recomputed: a pull lacked it)",
            labels=["source"],
        )
        draft_prompt.add_metric(["computed"], spec.num_draft_prompt_tokens_computed)
        draft_prompt.add_metric(["received"], spec.num_draft_prompt_tokens_received)
        draft_prompt.add_metric(["recomputed"], spec.num_draft_prompt_tokens_recomputed)
        yield draft_prompt
        yield GaugeMetricFamily(
            "kvservice_kv_staging_bytes",
            "Prefill: bytes of the KV staging pool in use",
            value=s.kv_sending.staging_bytes_in_use,
        )
        yield GaugeMetricFamily(
            "kvservice_kv_staging_capacity_bytes",
            "Prefill: the KV staging pool's bound",
            value=s.kv_sending.staging_bytes_capacity,
        )


# ---------------------------------------------------------------- HTTP


def metrics_handler(
    metrics: ServerMetrics, stats: StatsSource | None
) -> Callable[[web.Request], Awaitable[web.Response]]:
    """`GET /metrics`: refresh the engine snapshot (when there is an engine), then export."""

    async def handle(request: web.Request) -> web.Response:
        if stats is not None and metrics.engine is not None:
            try:
                snapshot = await asyncio.wait_for(stats(), SNAPSHOT_TIMEOUT_S)
            except (TimeoutError, RuntimeError):
                metrics.engine.snapshot = None  # a dead or stuck engine exports no engine figures
            else:
                metrics.engine.snapshot = snapshot
                metrics.spec_acceptance_rate.set(snapshot.spec_decode.acceptance_rate)
        return web.Response(body=metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    return handle


def metrics_app(metrics: ServerMetrics, stats: StatsSource | None = None) -> web.Application:
    app = web.Application()
    app.router.add_get("/metrics", metrics_handler(metrics, stats))
    return app


async def start_http(
    app: web.Application,
    host: str,
    port: int,
    shutdown_timeout: float = 5.0,
    ssl_context: ssl.SSLContext | None = None,
    handler_cancellation: bool = False,
) -> tuple[web.AppRunner, int]:
    """Serve `app` on host:port (0: the OS picks; HTTPS with `ssl_context`); returns the
    runner (`await runner.cleanup()`) and the port. With `handler_cancellation`, a client
    that disconnects cancels its handler (and with it the work done for it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, reuse_port=False)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=handler_cancellation)
    try:
        await runner.setup()
        await web.SockSite(runner, sock, shutdown_timeout=shutdown_timeout, ssl_context=ssl_context).start()
    except BaseException:
        sock.close()
        await runner.cleanup()
        raise
    return runner, sock.getsockname()[1]


def _kv_offload_metrics(o: pb.KVOffloadStats) -> Iterator[Metric]:
    """The KV offload tier's gauges and counters (--kv-offload-dir)."""
    yield GaugeMetricFamily(
        "kvservice_kv_offload_enabled",
        "KV offload tier on (0: off, or turned off by a disk fault)",
        value=int(o.enabled),
    )
    yield GaugeMetricFamily("kvservice_kv_offload_blocks", "Blocks in the KV offload store", value=o.num_blocks)
    yield GaugeMetricFamily("kvservice_kv_offload_bytes_used", "Bytes the KV offload store holds", value=o.bytes_used)
    yield GaugeMetricFamily(
        "kvservice_kv_offload_capacity_bytes", "The KV offload store's bound", value=o.capacity_bytes
    )
    counters = (
        ("blocks_written", "Evicted blocks written to the store", o.num_blocks_written),
        ("bytes_written", "Bytes written to the store", o.num_bytes_written),
        ("blocks_read", "Blocks read back into the cache", o.num_blocks_read),
        ("bytes_read", "Bytes read back", o.num_bytes_read),
        ("hit_blocks", "Blocks of prefixes that missed the cache and were found in the store", o.num_hit_blocks),
        (
            "blocks_dropped",
            "Blocks that failed validation (corrupt, truncated, foreign) and were recomputed",
            o.num_blocks_dropped,
        ),
        ("blocks_evicted", "Blocks the store evicted to keep within its bound", o.num_blocks_evicted),
        (
            "peer_blocks_from_prefill",
            "Blocks pulled from prefill workers instead of computed",
            o.num_peer_blocks_from_prefill,
        ),
        (
            "peer_blocks_from_decode",
            "Blocks pulled from decode workers instead of computed",
            o.num_peer_blocks_from_decode,
        ),
        ("peer_pulls_failed", "Peer pulls that failed or were refused, and recomputed", o.num_peer_pulls_failed),
        ("blocks_exported", "Cached blocks staged for other workers to pull (ExportKV)", o.num_blocks_exported),
    )
    for name, documentation, value in counters:
        yield CounterMetricFamily(f"kvservice_kv_offload_{name}", f"KV offload tier: {documentation}", value=value)
