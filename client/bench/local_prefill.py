"""`kvservice bench local-prefill`: where a decode worker should stop prefilling by itself.

Conditional disaggregation (`kvservice proxy --max-local-prefill-tokens N`) lets the decode
worker prefill a prompt's uncached part itself when it is at most N tokens. Local prefill
saves the hop to the prefill worker and the transfer, but the decode worker then computes
the prompt between the decode steps of the requests it is serving. This benchmark
measures both sides of that trade on one 1 prefill + 1 decode deployment per mode (the
prefill worker pinned to one core, the decode worker to the other):

- `local`: the proxy with `--max-local-prefill-tokens` above every probe (all local);
- `remote`: the proxy with `--max-local-prefill-tokens 0` (all disaggregated).

In each, `--background-streams` requests decode without end on the decode worker while
probes of each length (fresh random tokens: nothing cached) are sent one at a time. A
probe's TTFT is one figure; the background streams' largest gap between tokens while the
probe runs shows what local prefill costs the requests already running (both are
medians over the probes, so one stray hiccup does not decide). Local prefill pays
off while the delay it causes in all (the probe's TTFT plus, for every running stream,
its stall beyond what it sees with remote prefill) is at most the remote probe's TTFT:
the crossover is the longest probe length up to which that holds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from kvservice.client.bench.record import record_grpc_request
from kvservice.client.bench.table import cell, ratio, render
from kvservice.client.bench.workload_args import DEFAULT_VOCAB_SIZE
from kvservice.client.client import KVServiceClient
from kvservice.client.cluster import LocalCluster

MODES = {"local": 1 << 30, "remote": 0}  # mode -> the proxy's --max-local-prefill-tokens
DEFAULT_LENGTHS = (16, 32, 64, 128, 256, 512, 1024)


@dataclass
class ModeResult:
    """One mode's probes, per prompt length: each probe's TTFT, and the background
    streams' largest gap between tokens while it ran (seconds)."""

    ttft_s: dict[int, list[float]] = field(default_factory=dict)
    max_background_gap_s: dict[int, list[float]] = field(default_factory=dict)

    def median_ms(self, length: int) -> float:
        return 1000 * statistics.median(self.ttft_s[length])

    def gap_ms(self, length: int) -> float:
        return 1000 * statistics.median(self.max_background_gap_s[length])


def local_delay_ms(local: ModeResult, remote: ModeResult, length: int, num_streams: int) -> float:
    """What prefilling `length` tokens locally costs in all: the request's TTFT plus the
    extra stall of each of the `num_streams` requests decoding meanwhile."""
    return local.median_ms(length) + num_streams * max(0.0, local.gap_ms(length) - remote.gap_ms(length))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="tiny",
        help="'tiny', 'smollm2', a Hugging Face model directory or a GGUF file (default: tiny)",
    )
    parser.add_argument(
        "--lengths",
        default=",".join(map(str, DEFAULT_LENGTHS)),
        metavar="N,...",
        help=f"uncached prompt lengths to probe, in tokens (default: {','.join(map(str, DEFAULT_LENGTHS))})",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="probes per length and mode; the median counts (default: 3)"
    )
    parser.add_argument(
        "--background-streams",
        type=int,
        default=4,
        help="requests decoding on the decode worker meanwhile (default: 4)",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=DEFAULT_VOCAB_SIZE,
        help=f"probe token ids are drawn from [0, N) (default: {DEFAULT_VOCAB_SIZE})",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the probes' tokens (default: 0)")
    parser.add_argument(
        "--request-timeout", type=float, default=300.0, help="deadline of one probe in seconds (default: 300)"
    )
    parser.add_argument(
        "--json", action="store_true", help="end with one line of JSON: every probe's TTFT and the crossover"
    )
    parser.add_argument(
        "worker_args", nargs=argparse.REMAINDER, help="after '--': extra `kvservice serve` flags for both workers"
    )


def crossover(local: ModeResult, remote: ModeResult, lengths: Sequence[int], num_streams: int) -> int:
    """The longest length up to which local prefill's whole delay is at most the remote
    TTFT (0: never)."""
    best = 0
    for length in sorted(lengths):
        if local_delay_ms(local, remote, length, num_streams) > remote.median_ms(length):
            break
        best = length
    return best


async def _background(
    client: KVServiceClient,
    prompt: list[int],
    gaps: list[tuple[float, float]],
    decoding: asyncio.Event,
    stop: asyncio.Event,
) -> None:
    """Decode without end (restarting when a request reaches its length), noting each gap
    between tokens as (arrival time, gap); `decoding` is set at the first gap."""
    while not stop.is_set():
        last = None
        async for chunk in client.generate(prompt, max_tokens=512, temperature=0.0, ignore_eos=True, timeout=600):
            now = time.perf_counter()
            if last is not None and chunk.token_ids:
                gaps.append((now, now - last))
                decoding.set()
            last = now
            if stop.is_set():
                break


async def _until_decoding(decoding: Sequence[asyncio.Event], background: Sequence[asyncio.Task[None]]) -> None:
    """Until every background stream decodes; raises if one ends before it does."""
    for started, task in zip(decoding, background):
        waiter = asyncio.ensure_future(started.wait())
        await asyncio.wait({waiter, task}, return_when=asyncio.FIRST_COMPLETED)
        if not started.is_set():
            waiter.cancel()
            task.result()  # raises what ended the stream
            raise RuntimeError("a background stream ended before it decoded")


async def measure_mode(args: argparse.Namespace, mode: str, lengths: Sequence[int]) -> ModeResult:
    cluster = LocalCluster(
        args.model,
        worker_args=tuple(w for w in args.worker_args if w != "--"),
        prefill_cores=[0],
        decode_cores=[1],
        proxy_args=("--max-local-prefill-tokens", str(MODES[mode])),
    )
    rng = random.Random(args.seed)
    result = ModeResult()
    async with cluster, KVServiceClient(cluster.address) as client:
        # One warm-up probe per mode: the first forward pays one-time costs.
        await record_grpc_request(
            client, [rng.randrange(args.vocab_size) for _ in range(16)], f"{mode}-warmup", max_tokens=2
        )
        stop = asyncio.Event()
        gaps: list[tuple[float, float]] = []
        decoding = [asyncio.Event() for _ in range(args.background_streams)]
        background = [
            asyncio.create_task(
                _background(client, [rng.randrange(args.vocab_size) for _ in range(32)], gaps, started, stop)
            )
            for started in decoding
        ]
        try:
            await asyncio.wait_for(_until_decoding(decoding, background), args.request_timeout)
            for length in lengths:
                result.ttft_s[length], result.max_background_gap_s[length] = [], []
                for i in range(args.repeats):
                    prompt = [rng.randrange(args.vocab_size) for _ in range(length)]
                    record = await record_grpc_request(
                        client, prompt, f"{mode}-{length}-{i}", max_tokens=2, timeout=args.request_timeout
                    )
                    if not record.success or record.ttft is None:
                        raise RuntimeError(f"{mode}: a probe of {length} tokens failed: {record.error}")
                    result.ttft_s[length].append(record.ttft)
                    # The step that computed the probe's prompt ended the gap it caused by the probe's end.
                    during = [gap for at, gap in gaps if record.start <= at <= record.end]
                    result.max_background_gap_s[length].append(max(during, default=0.0))
                print(f"{mode}: {length} tokens, median TTFT {result.median_ms(length):.1f} ms", file=sys.stderr)
        finally:
            stop.set()
            for task in background:
                task.cancel()
            for task in background:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
    return result


def report(local: ModeResult, remote: ModeResult, lengths: Sequence[int], num_streams: int) -> str:
    header = (
        "Uncached tokens",
        "local TTFT (ms)",
        "remote TTFT (ms)",
        "local max gap (ms)",
        "remote max gap (ms)",
        "local delay (ms)",
        "local delay/remote TTFT",
    )
    rows = []
    for length in lengths:
        delay = local_delay_ms(local, remote, length, num_streams)
        rows.append(
            (
                str(length),
                cell(local.median_ms(length)),
                cell(remote.median_ms(length)),
                cell(local.gap_ms(length)),
                cell(remote.gap_ms(length)),
                cell(delay),
                ratio(delay, remote.median_ms(length)),
            )
        )
    return render(header, rows)


def main(args: argparse.Namespace) -> int:
    try:
        lengths = sorted({int(n) for n in args.lengths.split(",")})
    except ValueError:
        print(f"kvservice bench local-prefill: --lengths: not a list of integers: {args.lengths!r}", file=sys.stderr)
        return 2
    if not lengths or lengths[0] <= 0 or args.repeats <= 0 or args.background_streams < 0:
        print(
            "kvservice bench local-prefill: --lengths, --repeats must be positive, --background-streams >= 0",
            file=sys.stderr,
        )
        return 2
    local = asyncio.run(measure_mode(args, "local", lengths))
    remote = asyncio.run(measure_mode(args, "remote", lengths))
    best = crossover(local, remote, lengths, args.background_streams)
    print(report(local, remote, lengths, args.background_streams))
    print(
        f"local delay = local TTFT + {args.background_streams} streams x their extra stall "
        "(local max gap - remote max gap)"
    )
    print(f"crossover: local prefill costs no more up to {best} uncached tokens (--max-local-prefill-tokens {best})")
    if args.json:
        print(
            json.dumps(
                {
                    "model": args.model,
                    "lengths": lengths,
                    "crossover": best,
                    "local": asdict(local),
                    "remote": asdict(remote),
                }
            )
        )
    return 0
