"""`kvservice demo`: the main job. Launches 1 prefill + 1 decode worker and a proxy on
SmolLM2-135M-Instruct (or `--model tiny`), asks a handful of real questions at once through
the proxy's OpenAI-compatible `/v1/chat/completions` with the official `openai` client,
prints each question with its streamed answer, then the latency report (TTFT, time to
second token, TPOT) with the KV transfer figures, and stops everything, leaving no
process behind. Exit code 1 if any request failed or any KV block stayed in use.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator

import openai

from kvservice.client.bench.metrics import RequestRecord, compute_metrics, format_report
from kvservice.client.bench.record import StreamedChunk, record_stream
from kvservice.client.client import KVServiceClient
from kvservice.client.cluster import LocalCluster
from kvservice.runtime.event_loop import run_event_loop

DEMO_QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about the sea.",
    "What is the difference between a list and a tuple in Python?",
    "Suggest a name for a friendly robot.",
]
DEMO_WORKER_ARGS = ("--max-model-len", "2048", "--kv-cache-mib", "96")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="smollm2",
        help="'smollm2' (SmolLM2-135M-Instruct, installed by make setup), 'tiny', a model directory or a GGUF file "
        "(default: smollm2)",
    )
    parser.add_argument("--max-tokens", type=int, default=96, help="most tokens per answer (default: 96)")
    parser.add_argument(
        "--num-questions",
        type=int,
        default=len(DEMO_QUESTIONS),
        help=f"questions asked at once (default: {len(DEMO_QUESTIONS)})",
    )


def main(args: argparse.Namespace) -> int:
    if not 1 <= args.num_questions <= len(DEMO_QUESTIONS):
        print(f"kvservice demo: error: --num-questions must be in [1, {len(DEMO_QUESTIONS)}]")
        return 2
    return run_event_loop(_demo(args))


async def _demo(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    print(f"kvservice demo: launching 1 prefill + 1 decode worker and a proxy on model {args.model!r} ...", flush=True)
    proxy_args = ("--http-port", "0", "--model", args.model)
    async with LocalCluster(
        args.model, worker_args=DEMO_WORKER_ARGS, proxy_args=proxy_args, startup_timeout=300
    ) as cluster:
        http = cluster.child("proxy").http_address
        print(
            f"  ready in {time.perf_counter() - t0:.1f} s: proxy gRPC {cluster.address}, HTTP http://{http}/v1, "
            f"prefill {cluster.prefill_addresses[0]}, decode {cluster.decode_addresses[0]}",
            flush=True,
        )
        questions = DEMO_QUESTIONS[: args.num_questions]
        print(f"  asking {len(questions)} questions at once through /v1/chat/completions (streamed) ...\n", flush=True)
        async with openai.AsyncOpenAI(
            base_url=f"http://{http}/v1", api_key="demo", max_retries=0, timeout=300
        ) as client:
            model = (await client.models.list()).data[0].id
            start = time.perf_counter()
            records = await asyncio.gather(
                *(_ask(client, model, f"demo-{i}", question, args.max_tokens) for i, question in enumerate(questions))
            )
            duration = time.perf_counter() - start
        async with KVServiceClient(cluster.address) as grpc_client:
            stats = await grpc_client.stats()
    metrics = compute_metrics(records, duration)
    kv = stats.kv_receiving
    extra = [
        ("KV transfers:", str(kv.num_transfers)),
        ("KV bytes moved:", f"{kv.num_bytes}"),
        ("Mean KV transfer time (ms):", f"{1000 * kv.total_seconds / max(kv.num_transfers, 1):.2f}"),
    ]
    print()
    print(format_report(metrics, extra))
    leaked = [
        (w.address, w.stats.num_blocks_total - w.stats.num_blocks_free)
        for w in stats.workers
        if w.stats.num_blocks_free != w.stats.num_blocks_total
    ]
    print(f"kvservice demo: stopped every process ({time.perf_counter() - t0:.1f} s in all)")
    if metrics.failed or leaked:
        print(f"kvservice demo: FAILED ({metrics.failed} failed requests; blocks still in use: {leaked})")
        return 1
    return 0


async def _ask(
    client: openai.AsyncOpenAI, model: str, request_id: str, question: str, max_tokens: int
) -> RequestRecord:
    """One streamed chat request, timed token by token; its answer printed when it is complete."""
    record = RequestRecord(request_id, prompt_len=0, start=time.perf_counter())
    messages = [{"role": "user", "content": question}]  # the model's template adds its own system prompt
    await record_stream(record, _chat_chunks(client, model, request_id, messages, max_tokens))
    ttft = f"{record.ttft * 1000:.0f} ms" if record.ttft is not None else "-"
    answer = record.text.strip() if record.success else f"FAILED: {record.error}"
    print(f"Q: {question}\nA: {answer}\n   [{record.output_len} tokens, first after {ttft}]\n", flush=True)
    return record


async def _chat_chunks(
    client: openai.AsyncOpenAI, model: str, request_id: str, messages: list[dict[str, str]], max_tokens: int
) -> AsyncIterator[StreamedChunk]:
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True},
            extra_headers={"X-Request-Id": request_id},
        )
        async for chunk in stream:
            num_prompt_tokens = chunk.usage.prompt_tokens if chunk.usage is not None else 0
            if not chunk.choices:
                yield StreamedChunk(0, num_prompt_tokens=num_prompt_tokens)
                continue
            choice = chunk.choices[0]
            # kvservice's front sends each event's token ids alongside its text.
            token_ids = (choice.model_extra or {}).get("token_ids") or []
            yield StreamedChunk(len(token_ids), choice.delta.content or "", choice.finish_reason)
    except openai.APIError as e:
        raise OSError(f"{type(e).__name__}: {e}") from None
