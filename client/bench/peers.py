"""`kvservice bench peers`: kvservice against llama.cpp and vLLM, same model, same workload, one table.

Four servers run one after the other on this machine, never two at once (`peer_servers.py`):
kvservice colocated (`serve --role both`), kvservice 1P1D (`launch`), llama.cpp's
`llama-server` and vLLM's CPU build, each on SmolLM2-135M-Instruct (the `smollm2` GGUF; vLLM a
float32 directory converted from it). Peers missing from `--peers-dir` are installed first
(`peer_install.py`; `--install-only` does just that).

Per server, in order:
1. start it and time it until `/health` and `/v1/models` answer 200 (start-up);
2. sanity: at temperature 0 the completion of "The capital of France is" and the chat answer to
   "What is the capital of France? Answer in one word." must name Paris, and one workload-shaped
   completion must stream exactly its output length (EOS ignored). A server that fails is
   reported, not timed;
3. the `bench serve --backend openai` workload (random prompts, ignore_eos, temperature 0,
   all sent at once) at concurrency 1, then at concurrency 16, each after `--num-warmups` warm-ups;
4. stop it (its whole process group).

Before the first server starts, on a machine nothing else runs on yet, the bench measures the
memory-bandwidth limit of a decode step (`memory_bandwidth.py`): SmolLM2's weight bytes a token
over the read bandwidth of as many threads as the servers get.

The table (`peer_table.py`) puts the figures side by side with kvservice / peer ratios and the
issue's targets as pass/fail, the bandwidth limit on a line below it; the commands used follow,
and `--json OUT` keeps everything.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import aiohttp

from kvservice.client.bench.backend import Backend, OpenAIBackend
from kvservice.client.bench.memory_bandwidth import measure_limit
from kvservice.client.bench.openai_stream import CHAT, COMPLETIONS
from kvservice.client.bench.peer_install import DEFAULT_PEERS_DIR, InstallError, PeerPaths, install
from kvservice.client.bench.peer_servers import (
    SERVED_MODEL_NAME,
    PeerServer,
    ServerSpec,
    ServerStartError,
    free_port,
    server_spec,
)
from kvservice.client.bench.peer_table import (
    LOADED,
    PEERS,
    SERVERS,
    SINGLE,
    ServerResult,
    format_peers_table,
    target_verdicts,
)
from kvservice.client.bench.runner import result_json, run_benchmark
from kvservice.client.bench.workload import SampledRequest, random_requests
from kvservice.client.bench.workload_args import DEFAULT_VOCAB_SIZE
from kvservice.loading.model_files import smollm2_path

# Greedy SmolLM2-135M-Instruct (float32 reference) puts " Paris" first after the completion prompt,
# 2.5 nats ahead of the runner-up, and answers the one-word chat question with it (its first token
# 1.5 nats ahead). Not the bare "What is the capital of France?": its first token is a 0.08-nat tie
# ("The" vs "L"), which llama.cpp's quantized activations flip into "L'Etoile, la Marseillaise".
SANITY_PROMPTS = (
    (COMPLETIONS, "The capital of France is"),
    (CHAT, "What is the capital of France? Answer in one word."),
)
SANITY_ANSWER = "Paris"
SANITY_MAX_TOKENS = 8  # EOS is ignored: the text runs on past a short answer
_MODEL_LEN_STEP = 256


def parse_servers(value: str) -> list[str]:
    """`--servers`: names from SERVERS, comma-separated, each once; run in the order given."""
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in SERVERS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown server {', '.join(unknown)}; expected some of {','.join(SERVERS)}")
    if not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"name each server once: {value!r}")
    return names


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {number}")
    return number


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--servers",
        type=parse_servers,
        default=list(SERVERS),
        metavar="NAME,...",
        help=f"servers to run, in order (default: {','.join(SERVERS)})",
    )
    parser.add_argument(
        "--peers-dir",
        type=Path,
        default=DEFAULT_PEERS_DIR,
        help=f"where llama.cpp and vLLM are installed, and the logs (default: {DEFAULT_PEERS_DIR})",
    )
    install_mode = parser.add_mutually_exclusive_group()
    install_mode.add_argument(
        "--install-only", action="store_true", help="install the missing peers of --servers, then exit"
    )
    install_mode.add_argument("--no-install", action="store_true", help="fail instead of installing a missing peer")
    parser.add_argument(
        "--num-prompts-c1", type=_positive, default=16, help=f"requests at concurrency {SINGLE} (default: 16)"
    )
    parser.add_argument(
        "--num-prompts-c16", type=_positive, default=64, help=f"requests at concurrency {LOADED} (default: 64)"
    )
    parser.add_argument(
        "--input-len",
        "--random-input-len",
        dest="input_len",
        type=_positive,
        default=256,
        help="prompt tokens (default: 256)",
    )
    parser.add_argument(
        "--output-len",
        "--random-output-len",
        dest="output_len",
        type=_positive,
        default=128,
        help="tokens generated per request (default: 128)",
    )
    parser.add_argument(
        "--vocab-size",
        type=_positive,
        default=DEFAULT_VOCAB_SIZE,
        help=f"prompt token ids are drawn from [0, N) (default: {DEFAULT_VOCAB_SIZE}, as bench serve)",
    )
    parser.add_argument(
        "--num-warmups",
        type=int,
        default=2,
        help="requests sent and discarded before each concurrency level (default: 2)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts (default: 0)")
    parser.add_argument(
        "--kvservice-args",
        default="",
        metavar="FLAGS",
        help="flags added to both kvservice commands, e.g. '--kv-cache-dtype bfloat16' (default: none)",
    )
    parser.add_argument(
        "--ready-timeout", type=float, default=600.0, help="seconds a server may take to start (default: 600)"
    )
    parser.add_argument(
        "--request-timeout", type=float, default=600.0, help="deadline of one request in seconds (default: 600)"
    )
    parser.add_argument(
        "--json",
        type=Path,
        metavar="OUT",
        help="write every figure, the sanity answers, the commands and the verdicts here",
    )


def model_len(input_len: int, output_len: int) -> int:
    """Each server's context per request: prompt + output, rounded up to a multiple of 256."""
    return -(-(input_len + output_len) // _MODEL_LEN_STEP) * _MODEL_LEN_STEP


def workloads(args: argparse.Namespace) -> dict[int, list[SampledRequest]]:
    """The requests per concurrency level; each level its own seed, so no prompt repeats one a
    prefix cache (kvservice's, llama.cpp's slots) could still hold."""
    counts = {SINGLE: args.num_prompts_c1, LOADED: args.num_prompts_c16}
    return {
        c: random_requests(n, args.input_len, args.output_len, 0.0, args.vocab_size, args.seed + i)
        for i, (c, n) in enumerate(counts.items())
    }


def sanity_probe(args: argparse.Namespace) -> SampledRequest:
    """One workload-shaped request with a seed of its own."""
    [probe] = random_requests(1, args.input_len, args.output_len, 0.0, args.vocab_size, args.seed + 2)
    return probe


async def check_sanity(
    backends: dict[str, Backend], probe: SampledRequest, timeout: float
) -> tuple[bool, dict[str, Any]]:
    """Whether the server's greedy text names Paris for each of SANITY_PROMPTS (`backends` by
    endpoint: completions, chat) and a completion streams exactly `probe`'s output length (EOS
    ignored); returns the verdict and what was seen."""
    seen: dict[str, Any] = {"answers": {}}
    for i, (endpoint, prompt) in enumerate(SANITY_PROMPTS):
        request = SampledRequest(prompt_len=1, expected_output_len=SANITY_MAX_TOKENS, prompt=prompt)
        answer = await backends[endpoint].send(request, f"sanity-{i}", timeout)
        seen["answers"][prompt] = answer.text
        if "reason" not in seen and (not answer.success or SANITY_ANSWER not in answer.text):
            error = f" ({answer.error})" if answer.error else ""
            seen["reason"] = f"{prompt!r} answered {answer.text[:80]!r}{error}, no {SANITY_ANSWER!r}"
    length = await backends[COMPLETIONS].send(probe, "sanity-length", timeout)
    seen.update(expected_output_len=probe.expected_output_len, output_len=length.output_len, length_error=length.error)
    if "reason" not in seen and (not length.success or length.output_len != probe.expected_output_len):
        seen["reason"] = (
            f"asked for {probe.expected_output_len} tokens (EOS ignored), "
            f"got {length.output_len} {length.error}".rstrip()
        )
    return "reason" not in seen, seen


async def measure(spec: ServerSpec, args: argparse.Namespace, log: Path) -> ServerResult:
    """Start, check and time one server, then stop it; failures end up in `ServerResult.error`."""
    result = ServerResult(spec.name, list(spec.argv))
    print(f"{spec.name}: starting (log: {log})", file=sys.stderr, flush=True)
    try:
        async with PeerServer(spec, log, args.ready_timeout) as server:
            result.startup_s = server.startup_s
            print(f"{spec.name}: ready in {server.startup_s:.1f} s", file=sys.stderr, flush=True)
            await _check_and_time(spec, args, result)
    except ServerStartError as e:
        result.error = f"start failed: {e}"
    except (RuntimeError, ValueError, TimeoutError, aiohttp.ClientError) as e:  # a failed warm-up, a bad /v1/models
        result.error = f"run failed: {e}"
    if result.error:
        print(f"{spec.name}: {result.error}", file=sys.stderr, flush=True)
    return result


async def _check_and_time(spec: ServerSpec, args: argparse.Namespace, result: ServerResult) -> None:
    """The sanity check, then the workload at each concurrency, on the ready server into `result`."""
    # A connection per request, for every server alike: llama-server closes kept-alive ones
    # after a few requests, and aiohttp then fails some requests that reuse them.
    async with (
        OpenAIBackend(COMPLETIONS, spec.base_url, keep_alive=False) as completions,
        OpenAIBackend(CHAT, spec.base_url, keep_alive=False) as chat,
    ):
        models = await completions.served_models()
        if not models:
            raise ValueError(f"{spec.base_url}/v1/models lists no model")
        completions.model = chat.model = models[0]
        backends: dict[str, Backend] = {COMPLETIONS: completions, CHAT: chat}
        result.is_sane, result.sanity = await check_sanity(backends, sanity_probe(args), args.request_timeout)
        if not result.is_sane:
            result.error = f"sanity failed: {result.sanity['reason']}"
            return
        for concurrency, workload in workloads(args).items():
            metrics, records, extra = await run_benchmark(
                completions,
                workload,
                max_concurrency=concurrency,
                seed=args.seed,
                num_warmups=args.num_warmups,
                request_timeout=args.request_timeout,
            )
            result.runs[concurrency] = result_json(metrics, records, extra)
            print(
                f"{spec.name}: c={concurrency}: {metrics.completed} completed, {metrics.failed} failed in "
                f"{metrics.duration_s:.1f} s, {metrics.output_throughput:.1f} tok/s",
                file=sys.stderr,
                flush=True,
            )
            if metrics.failed and not result.error:
                first = next(r.error for r in records if not r.success)
                result.error = f"run failed: {metrics.failed} requests at c={concurrency}; first: {first}"


def format_commands(specs: list[ServerSpec]) -> str:
    """The commands the servers ran, with the environment each added."""
    lines = ["Commands:"]
    for spec in specs:
        env = "".join(
            f"{name}={value} " for name, value in spec.env.items() if not name.startswith(("GLIBC_", "PYTHON"))
        )
        lines.append(f"  {spec.name}: {env}{' '.join(spec.argv)}")
    return "\n".join(lines)


async def _measure_all(
    args: argparse.Namespace, paths: PeerPaths, gguf: Path, cores: list[int], specs: list[ServerSpec]
) -> dict[str, ServerResult]:
    """Every server of `--servers` in turn, each on a port picked just before it starts (into `specs`)."""
    results: dict[str, ServerResult] = {}
    for name in args.servers:
        spec = server_spec(
            name,
            free_port(),
            paths,
            gguf,
            max_model_len=model_len(args.input_len, args.output_len),
            num_threads=len(cores),
            cores=cores,
            kvservice_args=shlex.split(args.kvservice_args),
        )
        specs.append(spec)
        results[name] = await measure(spec, args, paths.logs / f"{name}.log")
    return results


def main(args: argparse.Namespace) -> int:
    paths = PeerPaths(args.peers_dir.expanduser())
    gguf = smollm2_path()
    missing = [peer for peer in args.servers if peer in PEERS and not paths.is_installed(peer)]
    if missing and args.no_install:
        print(
            f"kvservice bench peers: error: not installed in {paths.root}: {', '.join(missing)} (drop --no-install)",
            file=sys.stderr,
        )
        return 2
    try:
        for peer in missing:
            install(peer, paths, gguf)
    except InstallError as e:
        print(f"kvservice bench peers: error: {e}", file=sys.stderr)
        return 1
    if args.install_only:
        print(f"installed in {paths.root}: {', '.join(p for p in PEERS if paths.is_installed(p)) or 'nothing'}")
        return 0
    cores = sorted(os.sched_getaffinity(0))
    length = model_len(args.input_len, args.output_len)
    print("measuring the memory-bandwidth limit", file=sys.stderr, flush=True)
    limit = measure_limit(SERVED_MODEL_NAME, len(cores))
    print(limit.describe(), file=sys.stderr, flush=True)
    specs: list[ServerSpec] = []
    results = asyncio.run(_measure_all(args, paths, gguf, cores, specs))
    print(format_peers_table(results, limit.ms_per_token))
    print(limit.describe())
    print(format_commands(specs))
    if args.json is not None:
        settings = {
            key: value for key, value in vars(args).items() if key not in ("run", "json", "command", "benchmark")
        }
        document = {
            "settings": {
                **json.loads(json.dumps(settings, default=str)),
                "model": str(gguf),
                "cores": cores,
                "max_model_len": length,
            },
            "servers": {name: result.to_json() for name, result in results.items()},
            "memory_bandwidth": limit.to_json(),
            "targets": target_verdicts(results, limit.ms_per_token),
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
        print(f"result written to {args.json}")
    return 0 if all(not r.error for r in results.values()) else 1
