"""`kvservice bench serve`: load a server with a workload and report vLLM `bench serve` metrics.

Names and semantics follow vLLM's `bench serve`: requests are sent with
`ignore_eos=True`, `max_tokens` = the sampled output length and temperature 0, so
every request generates exactly the tokens the workload asks for; arrivals are
gamma-distributed (`--request-rate`, `--burstiness`), optionally capped by
`--max-concurrency`. On top of vLLM's figures it reports time to second token and
the KV transfer the run caused, from the decode side's `Stats` before and after.

`run_benchmark` is the reusable core (`bench compare` and the tests call it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import secrets
import sys
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import grpc

from kvservice.client.bench.metrics import (
    GOODPUT_METRICS,
    BenchmarkMetrics,
    KVTransferTotals,
    RequestRecord,
    compute_metrics,
    format_report,
    kv_transfer_report_lines,
    metrics_to_result_json,
)
from kvservice.client.bench.record import record_grpc_request
from kvservice.client.bench.workload import (
    SampledRequest,
    random_requests,
    request_arrivals,
    sharegpt_requests,
)
from kvservice.client.client import KVServiceClient
from kvservice.tls import TLSFiles, add_tls_arguments

# Byte ids only: valid for the `tiny` model (vocabulary 320) and any real tokenizer.
DEFAULT_VOCAB_SIZE = 256
DEFAULT_NUM_PROMPTS = 100


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


# ---------------------------------------------------------------- the run


async def _send(
    client: KVServiceClient, request: SampledRequest, request_id: str, timeout: float | None
) -> RequestRecord:
    prompt = request.prompt_token_ids if request.prompt_token_ids is not None else request.prompt
    assert prompt is not None
    return await record_grpc_request(
        client, prompt, request_id, max_tokens=request.expected_output_len, prompt_len=request.prompt_len, timeout=timeout
    )


async def _warm_up(client: KVServiceClient, requests: Sequence[SampledRequest], num_warmups: int, timeout: float | None) -> None:
    tag = secrets.token_hex(4)
    records = await asyncio.gather(
        *(_send(client, requests[i % len(requests)], f"warmup-{tag}-{i}", timeout) for i in range(num_warmups))
    )
    failed = [r for r in records if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} of {num_warmups} warm-up requests failed; first: {failed[0].error}")


async def run_benchmark(
    target: str,
    requests: Sequence[SampledRequest],
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    *,
    seed: int = 0,
    num_warmups: int = 0,
    goodput_slos: dict[str, float] | None = None,
    request_timeout: float | None = None,
    disable_tqdm: bool = True,
    credentials: grpc.ChannelCredentials | None = None,
    bearer_token: str | None = None,
) -> tuple[BenchmarkMetrics, list[RequestRecord], dict[str, Any]]:
    """Send `requests` to `target` at the given arrival process and measure them.

    Returns the metrics, one record per request in send order, and the extra result
    fields: the run's settings and the KV transfer figures (`kv_transfer_*`) of the
    measured requests only (warm-ups excluded). Request failures are recorded, not
    raised; a failed warm-up raises RuntimeError.
    """
    if not requests:
        raise ValueError("requests must not be empty")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    async with KVServiceClient(target, credentials, bearer_token) as client:
        if num_warmups > 0:
            await _warm_up(client, requests, num_warmups, request_timeout)
        kv_before = KVTransferTotals.from_stats(await client.stats())
        limit: contextlib.AbstractAsyncContextManager[object] = (
            asyncio.Semaphore(max_concurrency) if max_concurrency is not None else contextlib.nullcontext()
        )
        progress = _progress(len(requests), disable_tqdm)
        tag = secrets.token_hex(4)

        async def send(index: int, request: SampledRequest) -> RequestRecord:
            # As vLLM: the arrival schedule is fixed; the concurrency cap delays sending.
            async with limit:
                record = await _send(client, request, f"bench-{tag}-{index}", request_timeout)
            progress.update(1)
            return record

        benchmark_start = time.perf_counter()
        try:
            async with asyncio.TaskGroup() as group:
                tasks = []
                async for request in request_arrivals(requests, request_rate, burstiness, seed):
                    tasks.append(group.create_task(send(len(tasks), request)))
        finally:
            progress.close()
        duration = time.perf_counter() - benchmark_start
        kv_delta = KVTransferTotals.from_stats(await client.stats()).since(kv_before)
    records = [task.result() for task in tasks]
    metrics = compute_metrics(records, duration, goodput_slos)
    extra: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "target": target,
        "num_prompts": len(requests),
        "request_rate": request_rate if math.isfinite(request_rate) else "inf",
        "burstiness": burstiness,
        "max_concurrency": max_concurrency,
        "num_warmups": num_warmups,
        "goodput_slos": goodput_slos,
        **kv_delta.to_result_json(),
    }
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
            "success": r.success,
            "error": r.error,
        }
        for r in records
    ]
    return {**metrics_to_result_json(metrics, records, extra), "requests": per_request}


# ---------------------------------------------------------------- the command


def _slo(value: str) -> tuple[str, float]:
    name, sep, limit = value.partition(":")
    if not sep or name not in GOODPUT_METRICS:
        raise argparse.ArgumentTypeError(f"expected METRIC:MS with METRIC in {', '.join(GOODPUT_METRICS)}; got {value!r}")
    try:
        limit_ms = float(limit)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: {limit!r} is not a number of milliseconds") from None
    if not (math.isfinite(limit_ms) and limit_ms >= 0):
        raise argparse.ArgumentTypeError(f"{value!r}: the limit must be a finite value >= 0 ms")
    return name, limit_ms


def add_workload_arguments(parser: argparse.ArgumentParser, *, input_len: int, output_len: int | None, num_prompts: int, request_rate: float, num_warmups: int = 0) -> None:
    """The workload and load-shape flags shared by `bench serve` and `bench compare`."""
    parser.add_argument("--dataset", choices=["random", "sharegpt"], default="random", help="prompt source (default: random)")
    parser.add_argument("--dataset-path", type=Path, help="the ShareGPT JSON file (with --dataset sharegpt)")
    parser.add_argument("--tokenizer", default="tiny", help="ShareGPT only: 'tiny' (byte-level) or a tokenizer.json or model directory, to count prompt tokens (default: tiny)")
    parser.add_argument("--input-len", type=int, default=input_len, help=f"random: prompt tokens (default: {input_len})")
    out_default = "ShareGPT: the reply's length; random: 128" if output_len is None else str(output_len)
    parser.add_argument("--output-len", type=int, default=output_len, help=f"tokens to generate per request (default: {out_default})")
    parser.add_argument("--range-ratio", type=float, default=0.0, help="random: lengths uniform in [len*(1-r), len*(1+r)] (default: 0)")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, help=f"random: token ids are drawn from [0, N) (default: {DEFAULT_VOCAB_SIZE}, valid for the tiny model and any real one)")
    parser.add_argument("--num-prompts", type=int, default=num_prompts, help=f"requests to send (default: {num_prompts})")
    rate = "inf: all at once" if math.isinf(request_rate) else f"{request_rate:g}"
    parser.add_argument("--request-rate", type=float, default=request_rate, help=f"requests/s, gamma arrivals (Poisson at burstiness 1); inf sends all at once (default: {rate})")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps: 1 Poisson, <1 burstier, >1 more regular (default: 1)")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once (default: no limit)")
    parser.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals (default: 0)")
    parser.add_argument("--num-warmups", type=int, default=num_warmups, help=f"requests sent and discarded before measuring (default: {num_warmups})")
    parser.add_argument("--goodput", type=_slo, nargs="+", metavar="METRIC:MS", help=f"SLOs for goodput, METRIC in {', '.join(GOODPUT_METRICS)} (e.g. ttft:500 tpot:50)")
    parser.add_argument("--request-timeout", type=float, default=300.0, help="deadline of one request in seconds (default: 300)")
    parser.add_argument("--save-result", type=Path, metavar="FILE", help="write the result JSON here")
    parser.add_argument("--plot", type=Path, metavar="DIR", help="write PNG charts into DIR (needs matplotlib)")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, metavar="HOST:PORT", help="the proxy, or a colocated (--role both) worker")
    parser.add_argument("--ready-timeout", type=float, default=60.0, help="seconds to wait for the target to be SERVING (default: 60)")
    add_tls_arguments(parser)
    add_workload_arguments(parser, input_len=1024, output_len=None, num_prompts=DEFAULT_NUM_PROMPTS, request_rate=math.inf)


def _tokenizer_encode(name: str):  # noqa: ANN202 - Callable[[str], list[int]]
    from kvservice.tokenizer import ByteTokenizer, HFTokenizer

    if name == "tiny":
        return ByteTokenizer().encode
    path = Path(name)
    return HFTokenizer(path / "tokenizer.json" if path.is_dir() else path).encode


def sample_requests(args: argparse.Namespace) -> list[SampledRequest]:
    """The workload the flags describe; raises ValueError / OSError on bad input."""
    if args.dataset == "sharegpt":
        if args.dataset_path is None:
            raise ValueError("--dataset sharegpt needs --dataset-path")
        return sharegpt_requests(args.dataset_path, args.num_prompts, _tokenizer_encode(args.tokenizer), args.seed, args.output_len)
    output_len = 128 if args.output_len is None else args.output_len
    return random_requests(args.num_prompts, args.input_len, output_len, args.range_ratio, args.vocab_size, args.seed)


def workload_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "dataset": args.dataset,
        "dataset_path": str(args.dataset_path) if args.dataset_path else None,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "range_ratio": args.range_ratio,
        "seed": args.seed,
    }


def write_json(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


def main(args: argparse.Namespace) -> int:
    try:
        requests = sample_requests(args)
    except (ValueError, OSError) as e:
        print(f"kvservice bench serve: error: {e}", file=sys.stderr)
        return 2
    try:
        metrics, records, extra = asyncio.run(_run(args, requests))
    except (ValueError, RuntimeError, TimeoutError, grpc.aio.AioRpcError) as e:
        message = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.aio.AioRpcError) else str(e)
        print(f"kvservice bench serve: error: {message}", file=sys.stderr)
        return 1
    extra.update(workload_settings(args))
    print(format_report(metrics, kv_transfer_report_lines(extra)))
    if args.save_result:
        write_json(args.save_result, result_json(metrics, records, extra))
        print(f"result written to {args.save_result}")
    if args.plot:
        from kvservice.client.bench.plots import (
            write_plots,  # matplotlib only when asked
        )

        for path in write_plots(records, args.plot):
            print(f"plot written to {path}")
    errors = sorted({r.error for r in records if not r.success})
    for error in errors[:5]:
        print(f"error: {error}", file=sys.stderr)
    return 0 if metrics.failed == 0 else 1


async def _run(args: argparse.Namespace, requests: list[SampledRequest]) -> tuple[BenchmarkMetrics, list[RequestRecord], dict[str, Any]]:
    async with KVServiceClient(args.target, TLSFiles.from_args(args).channel_credentials()) as client:
        await client.wait_until_serving(args.ready_timeout)
    return await run_benchmark_with_args(args.target, requests, args)


async def run_benchmark_with_args(
    target: str, requests: list[SampledRequest], args: argparse.Namespace
) -> tuple[BenchmarkMetrics, list[RequestRecord], dict[str, Any]]:
    """`run_benchmark` with the workload flags that `bench serve` and `bench compare` share."""
    return await run_benchmark(
        target,
        requests,
        args.request_rate,
        args.burstiness,
        args.max_concurrency,
        seed=args.seed,
        num_warmups=args.num_warmups,
        goodput_slos=dict(args.goodput) if args.goodput else None,
        request_timeout=args.request_timeout,
        disable_tqdm=args.disable_tqdm,
        # `bench compare` shares these flags but launches its own plaintext cluster.
        credentials=TLSFiles.from_args(args).channel_credentials() if hasattr(args, "tls_ca") else None,
        bearer_token=getattr(args, "auth_token", None),
    )
