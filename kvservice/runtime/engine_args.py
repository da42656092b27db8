"""The engine's command-line flags: defined once, for `kvservice serve` and `kvservice launch`.

`add_engine_arguments` adds one flag per `EngineConfig` knob; `engine_config` builds the
config from the parsed flags (a bad value fails there, naming the field); `engine_argv`
turns the flags a user gave `launch` back into the same flags for every worker.
"""

from __future__ import annotations

import argparse

from kvservice.config import (
    DEFAULT_KV_CACHE_MIB,
    DEFAULT_MAX_PREFILL_TOKENS_WITH_DECODE,
    DEFAULT_PROMPT_LOOKUP_MAX,
    DEFAULT_PROMPT_LOOKUP_MIN,
    DEFAULT_STEP_TARGET_MS,
    KV_CACHE_DTYPES,
    KV_LOAD_FAILURE_POLICIES,
    SERVING_STEP_TARGET_MS,
    SPECULATIVE_METHODS,
    SUPPORTED_DTYPES,
    EngineConfig,
)


def add_engine_arguments(
    parser: argparse.ArgumentParser, step_target_ms: float = SERVING_STEP_TARGET_MS
) -> list[argparse.Action]:
    """Add the engine flags to `parser` (in their own help section); returns their actions.
    `step_target_ms`: --step-target-ms's default (`launch` aims lower than `serve`)."""
    group = parser.add_argument_group(
        "engine", "the model's placement, the KV cache and batching limits of every worker"
    )
    return [
        group.add_argument("--device", default="cpu", help="'cpu' or 'cuda[:N]' (default: cpu)"),
        group.add_argument(
            "--dtype",
            default="auto",
            choices=SUPPORTED_DTYPES,
            help="weights and KV dtype (default: auto, the checkpoint's)",
        ),
        group.add_argument(
            "--kv-cache-dtype",
            default="auto",
            choices=KV_CACHE_DTYPES,
            help="what the KV cache stores: auto, the compute dtype (exact; float32 on the CPU); bfloat16, half of "
            "float32's bytes (each value rounded to nearest even); int8, about a quarter (8-bit codes with a float32 "
            "scale per token and KV head). Attention computes in float32 all the same; the cache holds 2x / ~3.8x "
            "the tokens and transfers, prefix cache and offload tier move that many fewer bytes, for a small "
            "logprob error (measured in docs/kv_cache_dtype.md). Prefill and decode workers must agree "
            "(default: auto)",
        ),
        group.add_argument(
            "--max-model-len",
            type=int,
            default=None,
            help="longest prompt plus output, in tokens (default: the model's)",
        ),
        group.add_argument(
            "--block-size", type=int, default=16, help="tokens per KV block, a power of two (default: 16)"
        ),
        group.add_argument(
            "--num-blocks",
            type=int,
            default=None,
            help="KV blocks in the cache (default: as many as --kv-cache-mib holds)",
        ),
        group.add_argument(
            "--kv-cache-mib",
            type=int,
            default=DEFAULT_KV_CACHE_MIB,
            help=f"KV cache size in MiB when --num-blocks is not given (default: {DEFAULT_KV_CACHE_MIB})",
        ),
        group.add_argument("--max-num-seqs", type=int, default=64, help="most requests in one step (default: 64)"),
        group.add_argument(
            "--max-num-batched-tokens", type=int, default=2048, help="token budget of one step (default: 2048)"
        ),
        group.add_argument(
            "--max-prefill-tokens-with-decode",
            type=int,
            default=DEFAULT_MAX_PREFILL_TOKENS_WITH_DECODE,
            metavar="N",
            help="prompt tokens one step computes while requests are decoding: longer prompts are chunked so "
            "running streams keep a short inter-token latency; 0: no cap but --max-num-batched-tokens "
            f"(default: {DEFAULT_MAX_PREFILL_TOKENS_WITH_DECODE})",
        ),
        group.add_argument(
            "--step-target-ms",
            type=float,
            default=step_target_ms,
            metavar="MS",
            help="the time from one decode step to the next that arriving prompts may cause, whatever the machine: "
            "a colocated worker's prompt lane and a prefill worker sharing the cores (--core-lease) compute prompts "
            "for what a decode step leaves of it (with --core-lease, of three decode steps where those take longer, "
            "so decode keeps about a third of the cores while prompts wait); "
            "a step that chunks prompts adds prompt tokens until its time, "
            "predicted from the steps measured so far, reaches it; 0: chunks of the fixed "
            f"--max-prefill-tokens-with-decode, and {DEFAULT_STEP_TARGET_MS:g} ms for the lane and the lease "
            f"(default: {step_target_ms:g})",
        ),
        group.add_argument("--seed", type=int, default=0, help="seed of unseeded sampling (default: 0)"),
        group.add_argument(
            "--kv-load-failure-policy",
            default="recompute",
            choices=KV_LOAD_FAILURE_POLICIES,
            help="decode side, when pulling the KV fails: recompute the prompt (default) or fail the request",
        ),
        *_add_speculative_arguments(parser),
        group.add_argument(
            "--prompt-lane",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="colocated worker: compute prompts in batches of up to --max-num-batched-tokens, "
            "a slice of time before each decode step (so decode steps start about --step-target-ms apart), "
            "instead of in chunks inside the decode steps, which run them slower; "
            "prefill and decode workers ignore it (default: on)",
        ),
        group.add_argument(
            "--enable-prefix-caching",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="keep full KV blocks keyed by their tokens and reuse them for prompts that share a prefix "
            "(a decode worker then pulls only the blocks it lacks) (default: on)",
        ),
    ]


def _add_speculative_arguments(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Speculative decoding's flags, in a help section of their own."""
    group = parser.add_argument_group(
        "speculative decoding",
        "a proposer suggests up to K tokens a step and the target verifies them in one forward: greedy output "
        "stays plain greedy's, sampling keeps the target's distribution. Off by default. Decode and colocated "
        "workers speculate. A prefill worker given the same --draft-model runs the draft over each prompt while "
        "its KV save is in flight, and the draft's KV travels to the decode worker with the target's; it ignores "
        "ngram (it samples one token)",
    )
    return [
        group.add_argument(
            "--speculative-method",
            default=None,
            choices=SPECULATIVE_METHODS,
            help="ngram: prompt lookup, no model: propose what followed the latest earlier occurrence of the "
            "request's last tokens (pays off on repetitive text: quoting, editing, extraction); "
            "draft: a draft model proposes (default: off; draft when --draft-model is given)",
        ),
        group.add_argument(
            "--draft-model",
            default=None,
            metavar="MODEL",
            help="the draft model, with the target's vocabulary ('tiny' or a directory); alone, it means "
            "--speculative-method draft; decode workers recompute its KV after a pull (default: none)",
        ),
        group.add_argument(
            "--num-speculative-tokens",
            type=int,
            default=0,
            metavar="K",
            help="tokens proposed per step: > 0 with a method, 0 without one (default: 0)",
        ),
        group.add_argument(
            "--prompt-lookup-max",
            type=int,
            default=DEFAULT_PROMPT_LOOKUP_MAX,
            metavar="N",
            help=f"ngram: the longest run of last tokens looked up (default: {DEFAULT_PROMPT_LOOKUP_MAX})",
        ),
        group.add_argument(
            "--prompt-lookup-min",
            type=int,
            default=DEFAULT_PROMPT_LOOKUP_MIN,
            metavar="N",
            help="ngram: the shortest run of last tokens looked up; shorter ones match too often by chance "
            f"(default: {DEFAULT_PROMPT_LOOKUP_MIN})",
        ),
        group.add_argument(
            "--kv-save-before-draft",
            action="store_true",
            help="a prefill worker with a draft waits for the target's KV save before the draft pass, instead of "
            "running the pass while the save is in flight: a baseline for `kvservice bench spec --served`, "
            "slower by design (default: off)",
        ),
    ]


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The `EngineConfig` the engine flags describe; raises ValueError naming a bad field."""
    return EngineConfig(
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_memory_bytes=args.kv_cache_mib << 20,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_prefill_tokens_with_decode=args.max_prefill_tokens_with_decode or None,
        step_target_ms=args.step_target_ms or None,
        max_model_len=args.max_model_len,
        device=args.device,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        seed=args.seed,
        kv_load_failure_policy=args.kv_load_failure_policy,
        speculative_method=args.speculative_method,
        draft_model=args.draft_model,
        num_speculative_tokens=args.num_speculative_tokens,
        prompt_lookup_max=args.prompt_lookup_max,
        prompt_lookup_min=args.prompt_lookup_min,
        kv_save_before_draft=args.kv_save_before_draft,
        enable_prefix_caching=args.enable_prefix_caching,
        prompt_lane=args.prompt_lane,
    )


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags of `args` that differ from `serve`'s defaults, as a worker's argv."""
    argv: list[str] = []
    for action in add_engine_arguments(argparse.ArgumentParser(add_help=False)):
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(action.option_strings[0] if value else action.option_strings[1])
        else:
            argv += [action.option_strings[0], str(value)]
    return argv
