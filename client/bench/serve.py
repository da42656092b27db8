"""`kvservice bench serve`: load a server with a workload and report vLLM `bench serve` metrics.

The server is kvservice over gRPC (`--backend grpc --target HOST:PORT`, the default) or
any OpenAI-compatible HTTP server (`--backend openai|openai-chat --base-url URL`:
kvservice's front, vLLM, SGLang); see `backend.py`. vLLM's flag names are accepted
(`--dataset-name`, `--random-input-len`, `--save-result` with `--result-dir` and
`--result-filename`, ...). Names and semantics follow vLLM's `bench serve`: requests are sent with
`ignore_eos=True`, `max_tokens` = the sampled output length and temperature 0, so
every request generates exactly the tokens the workload asks for; arrivals are
gamma-distributed (`--request-rate`, `--burstiness`), optionally capped by
`--max-concurrency`. On top of vLLM's figures it reports time to second token and
the KV transfer and prefix-cache hits the run caused, from the servers' `Stats` before and
after (gRPC only: over HTTP with `--stats-target`, the proxy's gRPC address). Datasets:
random, ShareGPT, prefix_repetition (shared prefixes) and multi_turn (conversations whose
turns resend the history, gRPC only: a turn is built from the answer's token ids).

The run itself is `runner.run_benchmark`; this module turns flags into a workload and a report.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import grpc

from kvservice.client.bench.backend import GRPC, GrpcBackend, OpenAIBackend, add_backend_arguments, backend_from_args
from kvservice.client.bench.conversation import multi_turn_conversations
from kvservice.client.bench.metrics import BenchmarkMetrics, RequestRecord, format_report
from kvservice.client.bench.openai_stream import CHAT
from kvservice.client.bench.runner import Workload, result_json, run_benchmark
from kvservice.client.bench.server_stats import server_report_lines
from kvservice.client.bench.tokenizer import is_local_tokenizer, load_tokenizer
from kvservice.client.bench.workload import (
    SampledRequest,
    prefix_repetition_requests,
    random_requests,
    sharegpt_requests,
)
from kvservice.client.bench.workload_args import MULTI_TURN, PREFIX_REPETITION, RANDOM, SHAREGPT, add_workload_arguments

DEFAULT_NUM_PROMPTS = 100


# ---------------------------------------------------------------- the command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_backend_arguments(parser)
    parser.add_argument(
        "--ready-timeout", type=float, default=60.0, help="seconds to wait for the server to be ready (default: 60)"
    )
    add_workload_arguments(
        parser,
        input_len=1024,
        output_len=None,
        num_prompts=DEFAULT_NUM_PROMPTS,
        request_rate=math.inf,
        tokenizer_default="grpc: tiny; HTTP: the served model's, when it is a preset or a local path",
    )


def sample_workload(args: argparse.Namespace, tokenizer: str) -> Workload:
    """The workload the flags describe (`tokenizer` counts ShareGPT prompts); raises ValueError /
    OSError on bad input."""
    if args.dataset == SHAREGPT:
        if args.dataset_path is None:
            raise ValueError("--dataset sharegpt needs --dataset-path")
        encode = load_tokenizer(tokenizer).encode
        return sharegpt_requests(args.dataset_path, args.num_prompts, encode, args.seed, args.output_len)
    if args.dataset == PREFIX_REPETITION:
        return prefix_repetition_requests(
            args.num_prompts,
            args.prefix_repetition_prefix_len,
            args.prefix_repetition_suffix_len,
            args.prefix_repetition_num_prefixes,
            args.prefix_repetition_output_len,
            args.vocab_size,
            args.seed,
        )
    if args.dataset == MULTI_TURN:
        return multi_turn_conversations(
            args.multi_turn_num_conversations,
            args.multi_turn_turns,
            args.multi_turn_input_len,
            args.multi_turn_output_len,
            args.vocab_size,
            args.seed,
        )
    output_len = 128 if args.output_len is None else args.output_len
    return random_requests(args.num_prompts, args.input_len, output_len, args.range_ratio, args.vocab_size, args.seed)


def as_text_requests(requests: Sequence[SampledRequest], tokenizer: str) -> list[SampledRequest]:
    """Token-id prompts decoded to text (a chat message is text); `prompt_len` stays the ids' count
    until the server's usage reports the rendered prompt's."""
    decode = load_tokenizer(tokenizer).decode
    return [
        r if r.prompt_token_ids is None else replace(r, prompt=decode(r.prompt_token_ids), prompt_token_ids=None)
        for r in requests
    ]


def workload_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The workload flags for the result file; a dataset's own flags only with that dataset."""
    settings = {
        "dataset": args.dataset,
        "dataset_path": str(args.dataset_path) if args.dataset_path else None,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "range_ratio": args.range_ratio,
        "seed": args.seed,
    }
    own = {PREFIX_REPETITION: "prefix_repetition_", MULTI_TURN: "multi_turn_"}.get(args.dataset)
    if own is not None:
        settings.update({name: value for name, value in vars(args).items() if name.startswith(own)})
    return settings


def result_path(args: argparse.Namespace, label: str, model: str) -> Path | None:
    """Where `--save-result` / `--result-dir` / `--result-filename` put the result; None when not asked.

    The default name is vLLM's: `{label}-{rate}qps[-concurrency{N}]-{model's last path part}-{date}.json`.
    """
    name = args.result_filename or args.save_result or None
    if name is None and args.save_result is None and args.result_dir is None:
        return None
    if name is None:
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
        model_name = Path(model.rstrip("/")).name or "model"
        name = f"{label}-{args.request_rate:g}qps{concurrency}-{model_name}-{datetime.now():%Y%m%d-%H%M%S}.json"
    path = Path(name)
    return path if args.result_dir is None or path.is_absolute() else args.result_dir / path


def write_json(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


class UsageError(ValueError):
    """The flags ask for what cannot run: a missing address, no workload (exit code 2, as argparse's errors)."""


def main(args: argparse.Namespace) -> int:
    try:
        _check_backend_flags(args)
        metrics, records, extra = asyncio.run(_run(args))
    except UsageError as e:
        print(f"kvservice bench serve: error: {e}", file=sys.stderr)
        return 2
    except (ValueError, RuntimeError, TimeoutError, grpc.aio.AioRpcError, aiohttp.ClientError) as e:
        message = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.aio.AioRpcError) else str(e)
        print(f"kvservice bench serve: error: {message}", file=sys.stderr)
        return 1
    print(format_report(metrics, server_report_lines(extra)))
    path = result_path(args, args.backend, extra["model_id"])
    if path is not None:
        write_json(path, result_json(metrics, records, extra))
        print(f"result written to {path}")
    if args.plot:
        from kvservice.client.bench.plots import (
            write_plots,  # matplotlib only when asked
        )

        for plot in write_plots(records, args.plot):
            print(f"plot written to {plot}")
    errors = sorted({r.error for r in records if not r.success})
    for error in errors[:5]:
        print(f"error: {error}", file=sys.stderr)
    return 0 if metrics.failed == 0 else 1


def _check_backend_flags(args: argparse.Namespace) -> None:
    if args.backend == GRPC:
        if args.target is None:
            raise UsageError("--backend grpc needs --target HOST:PORT")
        if args.base_url is not None or args.stats_target is not None:
            raise UsageError(
                "--base-url and --stats-target are for the HTTP backends (--backend openai or openai-chat)"
            )
    else:
        if args.base_url is None:
            raise UsageError(f"--backend {args.backend} needs --base-url URL (e.g. http://127.0.0.1:8080)")
        if args.target is not None:
            raise UsageError(
                f"--target is for --backend grpc; with --backend {args.backend}, "
                "--stats-target HOST:PORT reads the KV figures"
            )
        if args.dataset == MULTI_TURN:
            raise UsageError(
                "--dataset multi_turn builds each turn from the answer's token ids, which only --backend grpc streams"
            )


def _tokenizer_name(args: argparse.Namespace, model: str | None) -> str:
    """--tokenizer, else the served model's: 'tiny' over gRPC (no RPC names the model)."""
    if args.tokenizer is not None:
        return args.tokenizer
    if args.backend == GRPC:
        return "tiny"
    assert model is not None
    if not is_local_tokenizer(model):
        raise UsageError(
            f"--tokenizer: the server's model {model!r} is neither a preset (tiny, smollm2) nor a local path, "
            "so its tokenizer is unknown here; give --tokenizer"
        )
    return model


async def _run(args: argparse.Namespace) -> tuple[BenchmarkMetrics, list[RequestRecord], dict[str, Any]]:
    async with backend_from_args(args) as backend:
        await backend.wait_until_ready(args.ready_timeout)
        model = args.model
        if isinstance(backend, OpenAIBackend) and backend.model is None:
            models = await backend.served_models()
            if not models:
                raise ValueError(f"{backend.address}/v1/models lists no model; give --model")
            backend.model = model = models[0]
        # The tokenizer is needed (and so resolved) only where the workload has text.
        needs_text = args.backend == CHAT and args.dataset in (RANDOM, PREFIX_REPETITION)
        tokenizer = _tokenizer_name(args, model) if args.dataset == SHAREGPT or needs_text else None
        try:
            workload = sample_workload(args, tokenizer or "tiny")
            if needs_text:
                assert tokenizer is not None
                workload = as_text_requests(workload, tokenizer)  # random, prefix_repetition: single requests
        except (ValueError, OSError) as e:  # OSError: an unreadable dataset or tokenizer file
            raise UsageError(str(e)) from None
        metrics, records, extra = await run_benchmark(backend, workload, **_run_settings(args))
    extra.update(model_id=model or "kvservice", tokenizer_id=tokenizer, **workload_settings(args))
    return metrics, records, extra


def _run_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "request_rate": args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "seed": args.seed,
        "num_warmups": args.num_warmups,
        "goodput_slos": dict(args.goodput) if args.goodput else None,
        "request_timeout": args.request_timeout,
        "disable_tqdm": args.disable_tqdm,
    }


async def run_benchmark_with_args(
    target: str, workload: Workload, args: argparse.Namespace
) -> tuple[BenchmarkMetrics, list[RequestRecord], dict[str, Any]]:
    """`run_benchmark` over plaintext gRPC at `target` with the workload flags the serving benchmarks share."""
    async with GrpcBackend(target) as backend:
        return await run_benchmark(backend, workload, **_run_settings(args))
