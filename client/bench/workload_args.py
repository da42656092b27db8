"""The workload and load-shape flags of the serving benchmarks, shared by `bench serve` and
`bench compare` (vLLM's flag names accepted too)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from kvservice.client.bench.metrics import GOODPUT_METRICS

# Byte ids only: valid for the `tiny` model (vocabulary 320) and any real tokenizer.
DEFAULT_VOCAB_SIZE = 256

RANDOM, SHAREGPT, PREFIX_REPETITION, MULTI_TURN = "random", "sharegpt", "prefix_repetition", "multi_turn"
DATASETS = (RANDOM, SHAREGPT, PREFIX_REPETITION, MULTI_TURN)


def _slo(value: str) -> tuple[str, float]:
    name, sep, limit = value.partition(":")
    if not sep or name not in GOODPUT_METRICS:
        raise argparse.ArgumentTypeError(
            f"expected METRIC:MS with METRIC in {', '.join(GOODPUT_METRICS)}; got {value!r}"
        )
    try:
        limit_ms = float(limit)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: {limit!r} is not a number of milliseconds") from None
    if not (math.isfinite(limit_ms) and limit_ms >= 0):
        raise argparse.ArgumentTypeError(f"{value!r}: the limit must be a finite value >= 0 ms")
    return name, limit_ms


def add_workload_arguments(
    parser: argparse.ArgumentParser,
    *,
    input_len: int,
    output_len: int | None,
    num_prompts: int,
    request_rate: float,
    num_warmups: int = 0,
    tokenizer_default: str,
) -> None:
    """The workload and load-shape flags shared by `bench serve` and `bench compare` (vLLM's names accepted too)."""
    parser.add_argument(
        "--dataset",
        "--dataset-name",
        dest="dataset",
        choices=DATASETS,
        default=RANDOM,
        help="prompt source: random token ids, ShareGPT conversations' first turns, "
        "prefix_repetition (shared prefixes + own suffixes), "
        "multi_turn (chats resending their history, gRPC only) (default: random)",
    )
    parser.add_argument("--dataset-path", type=Path, help="the ShareGPT JSON file (with --dataset sharegpt)")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="counts ShareGPT prompt tokens and turns random token ids into text for openai-chat: "
        f"'tiny', 'smollm2', a model directory, a GGUF file or a tokenizer.json (default: {tokenizer_default})",
    )
    parser.add_argument(
        "--input-len",
        "--random-input-len",
        dest="input_len",
        type=int,
        default=input_len,
        help=f"random: prompt tokens (default: {input_len})",
    )
    out_default = "ShareGPT: the reply's length; random: 128" if output_len is None else str(output_len)
    parser.add_argument(
        "--output-len",
        "--random-output-len",
        dest="output_len",
        type=int,
        default=output_len,
        help=f"tokens to generate per request (default: {out_default})",
    )
    parser.add_argument(
        "--range-ratio",
        "--random-range-ratio",
        dest="range_ratio",
        type=float,
        default=0.0,
        help="random: lengths uniform in [len*(1-r), len*(1+r)] (default: 0)",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=DEFAULT_VOCAB_SIZE,
        help=f"random: token ids are drawn from [0, N) "
        f"(default: {DEFAULT_VOCAB_SIZE}, valid for the tiny model and any real one)",
    )
    parser.add_argument(
        "--num-prompts",
        type=int,
        default=num_prompts,
        help=f"requests to send, but for multi_turn (default: {num_prompts})",
    )
    _add_dataset_arguments(parser)
    rate = "inf: all at once" if math.isinf(request_rate) else f"{request_rate:g}"
    parser.add_argument(
        "--request-rate",
        type=float,
        default=request_rate,
        help=f"requests/s, gamma arrivals (Poisson at burstiness 1); inf sends all at once (default: {rate})",
    )
    parser.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of arrival gaps: 1 Poisson, <1 burstier, >1 more regular (default: 1)",
    )
    parser.add_argument(
        "--max-concurrency", type=int, default=None, help="most requests in flight at once (default: no limit)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals (default: 0)")
    parser.add_argument(
        "--num-warmups",
        type=int,
        default=num_warmups,
        help=f"requests sent and discarded before measuring (default: {num_warmups})",
    )
    parser.add_argument(
        "--goodput",
        type=_slo,
        nargs="+",
        metavar="METRIC:MS",
        help=f"SLOs for goodput, METRIC in {', '.join(GOODPUT_METRICS)} (e.g. ttft:500 tpot:50)",
    )
    parser.add_argument(
        "--request-timeout", type=float, default=300.0, help="deadline of one request in seconds (default: 300)"
    )
    parser.add_argument(
        "--save-result",
        nargs="?",
        const="",
        default=None,
        metavar="FILE",
        help="write the result JSON, named by --result-filename in --result-dir "
        "(a FILE given here is the older spelling of --result-filename)",
    )
    parser.add_argument(
        "--result-dir",
        type=Path,
        default=None,
        help="directory of the result file (default: the current one); implies --save-result",
    )
    parser.add_argument(
        "--result-filename",
        default=None,
        help="the result file's name or path (default: BACKEND-RATEqps[-concurrencyN]-MODEL-DATE.json, as vLLM); "
        "implies --save-result",
    )
    parser.add_argument("--plot", type=Path, metavar="DIR", help="write PNG charts into DIR (needs matplotlib)")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def _add_dataset_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of the prefix_repetition (vLLM's names and defaults) and multi_turn datasets;
    token ids in [0, --vocab-size)."""
    group = parser.add_argument_group("prefix_repetition: each request is one of N shared prefixes + its own suffix")
    group.add_argument(
        "--prefix-repetition-prefix-len",
        type=int,
        default=256,
        metavar="N",
        help="tokens of each shared prefix (default: 256)",
    )
    group.add_argument(
        "--prefix-repetition-suffix-len",
        type=int,
        default=256,
        metavar="N",
        help="tokens of each request's own suffix (default: 256)",
    )
    group.add_argument(
        "--prefix-repetition-num-prefixes",
        type=int,
        default=10,
        metavar="N",
        help="distinct prefixes; --num-prompts must be a multiple (default: 10)",
    )
    group.add_argument(
        "--prefix-repetition-output-len",
        type=int,
        default=128,
        metavar="N",
        help="tokens to generate per request (default: 128)",
    )
    group = parser.add_argument_group(
        "multi_turn: turn k's prompt is turn k-1's prompt + its answer + a new user message"
    )
    group.add_argument(
        "--multi-turn-num-conversations",
        type=int,
        default=16,
        metavar="N",
        help="conversations; each arrives as a request would (default: 16)",
    )
    group.add_argument(
        "--multi-turn-turns", type=int, default=4, metavar="N", help="turns per conversation (default: 4)"
    )
    group.add_argument(
        "--multi-turn-input-len", type=int, default=128, metavar="N", help="tokens of each user message (default: 128)"
    )
    group.add_argument(
        "--multi-turn-output-len", type=int, default=32, metavar="N", help="tokens of each answer (default: 32)"
    )
