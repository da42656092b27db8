"""`bench serve` against a real 1P1D pair, and `bench compare`'s table and core plan."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from conftest import local_cluster, parse_flags

from kvservice.client.bench import serve as bench_serve
from kvservice.client.bench.compare import format_compare_table, plan_cores
from kvservice.client.bench.workload_args import DEFAULT_VOCAB_SIZE
from kvservice.loading.tokenizer import ByteTokenizer

_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
_LATENCIES = ("ttft", "tpot", "itl", "e2el", "ttst")


def _serve_args(*argv: str) -> argparse.Namespace:
    return parse_flags(bench_serve.add_arguments, *argv)


@pytest.mark.slow
async def test_bench_serve_on_a_prefill_decode_pair(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result_file, plot_dir = tmp_path / "result.json", tmp_path / "plots"
    async with local_cluster("tiny", num_prefill=1, num_decode=1) as cluster:
        launched_unix = time.time()
        args = _serve_args(
            "--target",
            cluster.address,
            "--num-prompts",
            "8",
            "--input-len",
            "40",
            "--output-len",
            "8",
            "--request-rate",
            "20",
            "--goodput",
            "e2el:60000",
            "--disable-tqdm",
            "--save-result",
            "--result-filename",
            str(result_file),
            "--plot",
            str(plot_dir),
        )
        # main() owns its event loop (asyncio.run), so it runs in a thread here.
        assert await asyncio.to_thread(bench_serve.main, args) == 0

    result = json.loads(result_file.read_text())
    for key in (
        "completed",
        "failed",
        "duration",
        "request_throughput",
        "request_goodput",
        "output_throughput",
        "total_token_throughput",
        "total_input_tokens",
        "total_output_tokens",
    ):
        assert key in result, key
    for name in _LATENCIES:
        for stat in ("mean", "median", "std", "p90", "p99"):
            assert f"{stat}_{name}_ms" in result, f"{stat}_{name}_ms"

    assert result["completed"] == 8 and result["failed"] == 0
    assert result["errors"] == [""] * 8
    assert result["total_input_tokens"] == 8 * 40 and result["total_output_tokens"] == 8 * 8
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    for name in ("ttft", "e2el"):
        assert result[f"p99_{name}_ms"] >= result[f"median_{name}_ms"] > 0
    assert 0 < result["mean_ttft_ms"] < result["mean_ttst_ms"] < result["mean_e2el_ms"]
    assert [len(r["token_times"]) for r in result["requests"]] == [8] * 8
    # The first send on the wall clock: after this test began, before the run's end.
    assert launched_unix < result["start_unix"] < launched_unix + result["duration"] + 60

    assert result["kv_transfer_has_receiver"] is True
    assert result["kv_transfer_count"] == 8 and result["kv_transfer_failures"] == 0
    assert result["kv_transfer_bytes"] > 0
    assert result["kv_transfer_gbps"] > 0 and result["kv_transfer_mean_ms"] > 0

    report = capsys.readouterr().out
    assert "Serving Benchmark Result" in report
    assert "KV transfers (failed):                   8 (0)" in report
    for name in ("latency_cdf.png", "request_timeline.png"):
        assert (plot_dir / name).read_bytes()[:8] == _PNG_MAGIC


@pytest.mark.slow
async def test_bench_serve_prefix_repetition_and_multi_turn_on_a_prefill_decode_pair(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix_file, multi_file = tmp_path / "prefix.json", tmp_path / "multi.json"
    async with local_cluster("tiny", num_prefill=1, num_decode=1) as cluster:
        prefix = _serve_args(
            "--target",
            cluster.address,
            "--dataset-name",
            "prefix_repetition",
            "--num-prompts",
            "4",
            "--prefix-repetition-prefix-len",
            "32",
            "--prefix-repetition-suffix-len",
            "8",
            "--prefix-repetition-num-prefixes",
            "2",
            "--prefix-repetition-output-len",
            "3",
            "--disable-tqdm",
            "--result-filename",
            str(prefix_file),
        )
        assert await asyncio.to_thread(bench_serve.main, prefix) == 0
        prefix_report = capsys.readouterr().out
        multi = _serve_args(
            "--target",
            cluster.address,
            "--dataset-name",
            "multi_turn",
            "--multi-turn-num-conversations",
            "2",
            "--multi-turn-turns",
            "3",
            "--multi-turn-input-len",
            "8",
            "--multi-turn-output-len",
            "4",
            "--max-concurrency",
            "2",
            "--disable-tqdm",
            "--result-filename",
            str(multi_file),
        )
        assert await asyncio.to_thread(bench_serve.main, multi) == 0
        multi_report = capsys.readouterr().out

    result = json.loads(prefix_file.read_text())
    assert result["completed"] == 4 and result["input_lens"] == [40] * 4 and result["output_lens"] == [3] * 4
    assert result["prefix_repetition_num_prefixes"] == 2 and "multi_turn_turns" not in result
    assert (
        result["kv_transfer_count"] == 4
        and result["kv_bytes_received_per_request"] == result["kv_transfer_bytes"] / 4 > 0
    )
    for key in (
        "prefix_cache_queries",
        "prefix_cache_hits",
        "prefill_prefix_cache_queries",
        "prefill_prefix_cache_hits",
    ):
        assert result[key] >= 0, key
    assert "Prefix cache hit rate (tokens):" in prefix_report and "KV received per request (KiB):" in prefix_report

    result = json.loads(multi_file.read_text())
    assert result["completed"] == 6 and result["failed"] == 0 and result["num_conversations"] == 2
    turns = [(r["request_id"].split("-turn")[0], r["turn"], r["prompt_len"]) for r in result["requests"]]
    for conversation in range(2):
        first, second, third = turns[3 * conversation : 3 * conversation + 3]
        assert first[0] == second[0] == third[0]
        # Each turn resends the history: the previous prompt, its 4-token answer, then 8 new tokens.
        assert [t[1:] for t in (first, second, third)] == [(0, 8), (1, 8 + 4 + 8), (2, 20 + 4 + 8)]
    assert result["mean_ttft_first_turn_ms"] > 0 and result["p99_ttft_later_turns_ms"] > 0
    assert "Mean TTFT, later turns (ms):" in multi_report


@pytest.mark.parametrize("value", ["ttft", "latency:5", "ttft:fast", "tpot:-1", "e2el:inf"])
def test_goodput_flag_rejects_bad_slos(value: str) -> None:
    with pytest.raises(SystemExit):
        _serve_args("--target", "x:1", "--goodput", value)


def _result(ttft: float, tpot: float, throughput: float, gbps: float | None) -> dict[str, object]:
    result: dict[str, object] = {
        "completed": 32,
        "failed": 0,
        "request_throughput": throughput,
        "output_throughput": throughput * 64,
        "kv_transfer_gbps": gbps,
        "kv_transfer_mean_ms": None if gbps is None else 12.5,
    }
    for name, mean in (
        ("ttft", ttft),
        ("ttst", ttft + tpot),
        ("tpot", tpot),
        ("itl", tpot),
        ("e2el", ttft + 63 * tpot),
    ):
        result[f"mean_{name}_ms"], result[f"p99_{name}_ms"] = mean, 2 * mean
    result["p99_itl_ms"] = 0.0  # a zero baseline has no ratio
    return result


def test_compare_table_puts_deployments_side_by_side_with_ratios() -> None:
    table = format_compare_table(
        {"colocated": _result(100.0, 20.0, 4.0, None), "disaggregated": _result(110.0, 8.0, 3.8, 1.25)}
    )
    lines = table.splitlines()
    assert lines[1].split() == ["Metric", "colocated", "disaggregated", "disagg/coloc"]
    rows = {line[:28].strip(): line[28:].split() for line in lines[3:-1]}
    assert rows["Mean TTFT (ms)"] == ["100.00", "110.00", "1.10x"]
    assert rows["P99 TPOT (ms)"] == ["40.00", "16.00", "0.40x"]
    assert rows["Mean TTST (ms)"] == ["120.00", "118.00", "0.98x"]
    assert rows["Request throughput (req/s)"] == ["4.00", "3.80", "0.95x"]
    assert rows["P99 ITL (ms)"] == ["0.00", "0.00", "n/a"]
    assert rows["Successful / failed requests"] == ["32", "/", "0", "32", "/", "0"]
    assert rows["KV transfer (GB/s, mean ms)"] == ["none", "1.250,", "12.5"]
    assert len({len(line) for line in lines[1:-1]}) <= 2  # aligned columns (rules may differ)


def test_plan_cores_pins_prefill_and_decode_apart_and_falls_back_on_one_core() -> None:
    plan = plan_cores({3, 1, 2})
    assert (plan.colocated, plan.prefill, plan.decode, plan.note) == ((1, 2), (1,), (2,), "")
    single = plan_cores({5})
    assert single.colocated == single.prefill == single.decode == (5,)
    assert "only core 5" in single.note


@pytest.mark.slow
async def test_bench_serve_openai_backend_on_the_http_front(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    proxy_args = ("--http-port", "0", "--served-model-name", "tiny")
    async with local_cluster("tiny", num_prefill=1, num_decode=1, proxy_args=proxy_args) as cluster:
        base_url = f"http://{cluster.child('proxy').http_address}"
        common = (
            "--backend",
            "openai",
            "--base-url",
            base_url,
            "--num-prompts",
            "4",
            "--random-input-len",
            "24",
            "--random-output-len",
            "6",
            "--disable-tqdm",
        )
        args = _serve_args(*common, "--stats-target", cluster.address, "--save-result", "--result-dir", str(tmp_path))
        assert await asyncio.to_thread(bench_serve.main, args) == 0
        report = capsys.readouterr().out
        # Without --stats-target there are no KV figures, and the report says why.
        assert await asyncio.to_thread(bench_serve.main, _serve_args(*common, "--num-prompts", "2")) == 0
        assert "not measured (HTTP has no Stats" in capsys.readouterr().out
        # Chat: the random ids as text in one user message, rendered with tiny's template on the worker.
        chat_file = tmp_path / "chat" / "result.json"
        chat = _serve_args(
            "--backend",
            "openai-chat",
            "--base-url",
            base_url,
            "--num-prompts",
            "2",
            "--random-input-len",
            "16",
            "--random-output-len",
            "5",
            "--disable-tqdm",
            "--result-filename",
            str(chat_file),
        )
        assert await asyncio.to_thread(bench_serve.main, chat) == 0
    chat_result = json.loads(chat_file.read_text())
    assert chat_result["completed"] == 2 and chat_result["output_lens"] == [5, 5]
    assert all(n > 16 for n in chat_result["input_lens"])  # the server's count: the template's tokens too
    assert chat_result["tokenizer_id"] == "tiny"

    (result_file,) = tmp_path.glob("*.json")
    assert re.fullmatch(r"openai-infqps-tiny-\d{8}-\d{6}\.json", result_file.name), result_file.name
    result = json.loads(result_file.read_text())
    assert (result["backend"], result["target"], result["model_id"]) == ("openai", base_url, "tiny")
    assert result["completed"] == 4 and result["failed"] == 0
    # Token ids as the prompt, and kvservice's token_ids per event: exact counts both ways.
    assert result["total_input_tokens"] == 4 * 24 and result["total_output_tokens"] == 4 * 6
    assert [len(r["token_times"]) for r in result["requests"]] == [6] * 4
    assert 0 < result["mean_ttft_ms"] < result["mean_ttst_ms"] < result["mean_e2el_ms"]
    assert result["kv_transfer_count"] == 4 and result["kv_transfer_bytes"] > 0
    assert "KV transfers (failed):                   4 (0)" in report


class _FakeChatServer:
    """A vLLM-like `/v1/chat/completions`: one content delta per token (two tokens in one
    delta once), no token ids, a usage event; it keeps what each request asked for."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.bodies: list[dict[str, Any]] = []
        self.authorizations: list[str | None] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.authorizations.append(request.headers.get("Authorization"))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        async def send(event: object) -> None:
            await response.write(f"data: {json.dumps(event)}\n\n".encode())

        def delta(content: dict[str, str], finish_reason: str | None = None) -> dict[str, Any]:
            return {
                "id": "chatcmpl-1",
                "object": "chat.completion.chunk",
                "model": self.model,
                "choices": [{"index": 0, "delta": content, "finish_reason": finish_reason}],
            }

        num_tokens = body["max_completion_tokens"]
        await send(delta({"role": "assistant", "content": ""}))
        await send(delta({"content": "ab"}))  # two tokens in one delta
        for _ in range(num_tokens - 2):
            await send(delta({"content": "c"}))
        await send(delta({}, "length"))
        prompt_tokens = len(body["messages"][0]["content"]) + 5  # the chat template's tokens too
        await send(
            {
                "id": "chatcmpl-1",
                "choices": [],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": num_tokens},
            }
        )
        await response.write(b"data: [DONE]\n\n")
        return response


@contextlib.asynccontextmanager
async def _serve(app: web.Application) -> AsyncIterator[str]:
    """`app` on 127.0.0.1, a port the OS picks; yields its base URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


async def test_bench_serve_openai_chat_backend_on_a_vllm_like_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    server = _FakeChatServer("tiny")
    result_file = tmp_path / "chat.json"
    async with _serve(server.app()) as base_url:
        args = _serve_args(
            "--backend",
            "openai-chat",
            "--base-url",
            base_url + "/v1",
            "--dataset-name",
            "random",
            "--random-input-len",
            "12",
            "--random-output-len",
            "5",
            "--num-prompts",
            "3",
            "--disable-tqdm",
            "--result-filename",
            str(result_file),
        )
        assert await asyncio.to_thread(bench_serve.main, args) == 0

    assert len(server.bodies) == 3 and server.authorizations == ["Bearer sk-test"] * 3
    expected_prompts = bench_serve.random_requests(3, 12, 5, 0.0, DEFAULT_VOCAB_SIZE, 0)
    for body, request in zip(server.bodies, expected_prompts):
        # The served model's tokenizer ('tiny', from /v1/models) turned the random ids into text.
        assert body["messages"] == [{"role": "user", "content": ByteTokenizer().decode(request.prompt_token_ids or [])}]
        assert (body["model"], body["max_completion_tokens"], body["ignore_eos"], body["stream"]) == (
            "tiny",
            5,
            True,
            True,
        )
    result = json.loads(result_file.read_text())
    assert result["completed"] == 3 and result["failed"] == 0
    assert result["output_lens"] == [5, 5, 5]  # usage fixed the delta that held two tokens
    assert result["input_lens"] == [len(b["messages"][0]["content"]) + 5 for b in server.bodies]
    assert result["tokenizer_id"] == "tiny" and result["kv_transfer_note"]
    assert "KV transfers:" in capsys.readouterr().out


async def test_bench_serve_http_asks_for_a_tokenizer_when_the_served_model_is_not_local(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async with _serve(_FakeChatServer("meta-llama/Llama-3.1-8B-Instruct").app()) as base_url:
        args = _serve_args("--backend", "openai-chat", "--base-url", base_url, "--num-prompts", "1", "--disable-tqdm")
        assert await asyncio.to_thread(bench_serve.main, args) == 2
    err = capsys.readouterr().err
    assert "'meta-llama/Llama-3.1-8B-Instruct' is neither a preset" in err and "give --tokenizer" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--num-prompts", "1"), "--backend grpc needs --target"),
        (("--backend", "openai", "--num-prompts", "1"), "--backend openai needs --base-url"),
        (("--backend", "openai", "--base-url", "http://x", "--target", "x:1"), "--target is for --backend grpc"),
    ],
)
def test_bench_serve_names_the_missing_or_misplaced_address(
    argv: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench_serve.main(_serve_args(*argv)) == 2
    assert message in capsys.readouterr().err


def test_multi_turn_needs_the_grpc_backend(capsys: pytest.CaptureFixture[str]) -> None:
    args = _serve_args("--backend", "openai", "--base-url", "http://127.0.0.1:1", "--dataset-name", "multi_turn")
    assert bench_serve.main(args) == 2
    assert "only --backend grpc streams" in capsys.readouterr().err


def test_vllm_flag_names_are_aliases() -> None:
    vllm = _serve_args(
        "--target",
        "x:1",
        "--dataset-name",
        "sharegpt",
        "--random-input-len",
        "7",
        "--random-output-len",
        "3",
        "--random-range-ratio",
        "0.5",
    )
    ours = _serve_args(
        "--target", "x:1", "--dataset", "sharegpt", "--input-len", "7", "--output-len", "3", "--range-ratio", "0.5"
    )
    assert vars(vllm) == vars(ours)


def test_result_path_follows_vllms_naming_and_the_older_save_result_file() -> None:
    assert bench_serve.result_path(_serve_args("--target", "x:1"), "grpc", "tiny") is None
    default = bench_serve.result_path(
        _serve_args("--target", "x:1", "--save-result", "--request-rate", "2.5", "--max-concurrency", "4"),
        "openai",
        "/models/Llama-3-8B/",
    )
    assert default is not None and re.fullmatch(
        r"openai-2\.5qps-concurrency4-Llama-3-8B-\d{8}-\d{6}\.json", str(default)
    )
    in_dir = bench_serve.result_path(
        _serve_args("--target", "x:1", "--result-dir", "out", "--result-filename", "r.json"), "grpc", "tiny"
    )
    assert in_dir == Path("out/r.json")
    assert bench_serve.result_path(_serve_args("--target", "x:1", "--save-result", "old.json"), "grpc", "tiny") == Path(
        "old.json"
    )
