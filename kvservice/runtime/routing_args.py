"""The proxy's routing flags, defined once: `kvservice proxy` parses them, `kvservice launch` passes them on."""

from __future__ import annotations

import argparse

ROUTING_POLICIES = ("kv-aware", "least-loaded", "round-robin")
DEFAULT_ROUTING = "kv-aware"
# The crossover measured with `kvservice bench local-prefill` (a decode worker serving 4
# streams; local cost = the request's TTFT + each stream's extra stall): on SmolLM2 on a
# 2-core CPU, local prefill of even 8 uncached tokens costs more than remote prefill plus
# transfer (1.15x), so the default keeps every request disaggregated. (The tiny model's
# crossover is 256 tokens; SmolLM2's with one running stream, 16.)
DEFAULT_MAX_LOCAL_PREFILL_TOKENS = 0
# Less than this many more tokens on a peer's cache is not worth the ExportKV round trip and a pull.
DEFAULT_PEER_PULL_MIN_TOKENS = 64


def add_routing_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--routing",
        choices=ROUTING_POLICIES,
        default=DEFAULT_ROUTING,
        help="how the proxy picks workers: kv-aware (by what each worker caches, learned from its KV events: "
        "the prefill worker with the fewest uncached prompt tokens plus load, the decode worker with the fewest "
        "blocks to pull plus load; text and chat prompts need --model's tokenizer, else least-loaded), "
        f"least-loaded (fewest outstanding requests), round-robin (in turn) (default: {DEFAULT_ROUTING})",
    )
    parser.add_argument(
        "--max-local-prefill-tokens",
        type=_non_negative_int,
        default=DEFAULT_MAX_LOCAL_PREFILL_TOKENS,
        metavar="N",
        help="conditional disaggregation: when the part of a prompt the chosen decode worker does not hold "
        "(per its KV events) is at most N tokens, that decode worker prefills it itself and no prefill worker "
        "sees the request (short prompts, a conversation's next turn); 0 disables "
        f"(default: {DEFAULT_MAX_LOCAL_PREFILL_TOKENS}: the crossover `kvservice bench local-prefill` measured for "
        "SmolLM2 on a 2-core CPU; measure yours the same way)",
    )
    parser.add_argument(
        "--peer-pull-min-tokens",
        type=_non_negative_int,
        default=DEFAULT_PEER_PULL_MIN_TOKENS,
        metavar="N",
        help="peer pulls (kv-aware): when another worker's cache holds at least N more of a prompt than the worker "
        "that computes it, that worker pulls those blocks from it instead of computing them (a conversation's "
        "history from the decode worker that served its last turn); 0 disables "
        f"(default: {DEFAULT_PEER_PULL_MIN_TOKENS})",
    )


def routing_argv(args: argparse.Namespace) -> list[str]:
    """The routing flags of `args` as proxy arguments."""
    return [
        "--routing",
        args.routing,
        "--max-local-prefill-tokens",
        str(args.max_local_prefill_tokens),
        "--peer-pull-min-tokens",
        str(args.peer_pull_min_tokens),
    ]


def _non_negative_int(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {number}")
    return number
