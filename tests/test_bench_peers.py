"""`bench peers` without its peers: flags, workloads, the sanity verdict, the ratio table and the
targets, the vLLM shim's metadata, and the server lifecycle on a stand-in HTTP server."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import sys
import time
from pathlib import Path

import pytest
from conftest import parse_flags

from kvservice.client.bench import peer_servers, peers
from kvservice.client.bench.backend import Backend
from kvservice.client.bench.memory_bandwidth import BandwidthLimit
from kvservice.client.bench.metrics import RequestRecord
from kvservice.client.bench.openai_stream import CHAT, COMPLETIONS
from kvservice.client.bench.peer_install import PeerPaths, cpu_flags, ggml_isa_flags, write_vllm_shim
from kvservice.client.bench.peer_table import (
    KVSERVICE_1P1D,
    KVSERVICE_COLOCATED,
    LLAMA_CPP,
    VLLM,
    ServerResult,
    format_peers_table,
    target_verdicts,
)
from kvservice.client.bench.server_stats import ServerCounters
from kvservice.client.bench.workload import SampledRequest


def _args(*argv: str) -> argparse.Namespace:
    return parse_flags(peers.add_arguments, *argv)


def test_flags_default_to_the_issues_workload_on_all_four_servers() -> None:
    args = _args()
    assert args.servers == [KVSERVICE_COLOCATED, KVSERVICE_1P1D, LLAMA_CPP, VLLM]
    assert (args.input_len, args.output_len, args.num_prompts_c1, args.num_prompts_c16) == (256, 128, 16, 64)
    assert _args("--servers", "vllm,kvservice-1p1d").servers == [VLLM, KVSERVICE_1P1D]  # the order given
    for bad in ("vllm,sglang", "vllm,vllm", ","):
        with pytest.raises(SystemExit):
            _args("--servers", bad)
    with pytest.raises(SystemExit):
        _args("--install-only", "--no-install")


def test_each_level_gets_its_own_prompts_of_the_asked_shape() -> None:
    levels = peers.workloads(
        _args("--num-prompts-c1", "3", "--num-prompts-c16", "5", "--input-len", "40", "--output-len", "7")
    )
    assert {c: len(w) for c, w in levels.items()} == {1: 3, 16: 5}
    every = [r for w in levels.values() for r in w]
    assert {(r.prompt_len, r.expected_output_len) for r in every} == {(40, 7)}
    # No prompt of one level opens like one of the other (a prefix cache would serve it).
    assert not {tuple(r.prompt_token_ids[:16]) for r in levels[1]} & {
        tuple(r.prompt_token_ids[:16]) for r in levels[16]
    }
    assert peers.model_len(256, 128) == 512 and peers.model_len(256, 256) == 512 and peers.model_len(500, 13) == 768


class _Replying(Backend):
    """Answers chat with `text` and completions with `num_tokens` tokens."""

    name, address = "fake", "fake"

    def __init__(self, text: str = "", num_tokens: int = 0) -> None:
        self.text, self.num_tokens = text, num_tokens

    async def close(self) -> None: ...

    async def wait_until_ready(self, timeout: float) -> None: ...

    async def server_counters(self) -> ServerCounters | None:
        return None

    async def send(self, request: SampledRequest, request_id: str, timeout: float | None) -> RequestRecord:
        now = time.perf_counter()
        return RequestRecord(
            request_id,
            request.prompt_len,
            now,
            output_len=self.num_tokens,
            token_times=[now] * self.num_tokens,
            end=now,
            success=True,
            text=self.text,
        )


async def test_sanity_needs_paris_from_both_endpoints_and_the_full_output_length() -> None:
    probe = SampledRequest(prompt_len=4, expected_output_len=8, prompt_token_ids=[1, 2, 3, 4])
    paris = _Replying(" Paris.\n\nThe", 8)

    async def check(completions: Backend, chat: Backend) -> tuple[bool, dict[str, object]]:
        return await peers.check_sanity({COMPLETIONS: completions, CHAT: chat}, probe, 5.0)

    is_sane, seen = await check(paris, _Replying("The capital of France is Paris.", 8))
    assert is_sane and seen["output_len"] == 8
    assert list(seen["answers"].values()) == [" Paris.\n\nThe", "The capital of France is Paris."]
    is_sane, seen = await check(paris, _Replying("L'Etoile, la Marseillaise", 8))  # a broken chat template, say
    assert not is_sane and "Answer in one word.' answered \"L'Etoile, la Marseillaise\", no 'Paris'" in seen["reason"]
    is_sane, seen = await check(_Replying(" Lyon", 5), paris)  # the first failure is the reason
    assert not is_sane and seen["reason"] == "'The capital of France is' answered ' Lyon', no 'Paris'"
    is_sane, seen = await check(_Replying(" Paris", 5), paris)  # stopped at EOS: ignore_eos not honoured
    assert not is_sane and seen["reason"] == "asked for 8 tokens (EOS ignored), got 5"


def _server(name: str, *, tpot_1: float, itl_16: float, tok_s_16: float, startup: float) -> ServerResult:
    run_1 = {
        "failed": 0,
        "output_throughput": 1000.0 / tpot_1,
        "mean_ttft_ms": 50.0,
        "mean_tpot_ms": tpot_1,
        "p99_itl_ms": tpot_1 * 2,
    }
    run_16 = {
        "failed": 0,
        "output_throughput": tok_s_16,
        "mean_ttft_ms": 400.0,
        "mean_tpot_ms": 60.0,
        "p99_itl_ms": itl_16,
    }
    return ServerResult(name, [name], startup_s=startup, is_sane=True, runs={1: run_1, 16: run_16})


def _rows(table: str) -> dict[str, list[str]]:
    lines = table.splitlines()
    return {
        cells[0]: cells[1:]
        for cells in (re.split(r"\s{2,}", line.strip()) for line in lines[1:-1] if not line.startswith("-"))
    }


def _all_four() -> dict[str, ServerResult]:
    return {
        KVSERVICE_COLOCATED: _server(KVSERVICE_COLOCATED, tpot_1=5.0, itl_16=60.0, tok_s_16=500.0, startup=1.5),
        KVSERVICE_1P1D: _server(KVSERVICE_1P1D, tpot_1=7.2, itl_16=120.0, tok_s_16=400.0, startup=3.0),
        LLAMA_CPP: _server(LLAMA_CPP, tpot_1=10.0, itl_16=80.0, tok_s_16=200.0, startup=1.0),
        VLLM: _server(VLLM, tpot_1=25.0, itl_16=200.0, tok_s_16=300.0, startup=60.0),
    }


BANDWIDTH_LIMIT_MS = 2.5  # 3x: 7.5 ms


def test_table_has_every_server_the_ratios_to_each_peer_and_the_verdicts() -> None:
    rows = _rows(format_peers_table(_all_four(), BANDWIDTH_LIMIT_MS))
    assert rows["Metric"] == [
        "coloc",
        "1p1d",
        "llama.cpp",
        "vllm",
        "coloc/llama.cpp",
        "coloc/vllm",
        "1p1d/llama.cpp",
        "1p1d/vllm",
        "target",
        "pass/fail",
    ]
    assert rows["Status"] == ["ok"] * 4
    # TPOT 5 and 7.2 against 0.7x llama.cpp's 10: colocated passes, 1P1D does not.
    assert rows["Mean TPOT c=1 (ms)"] == [
        "5.00",
        "7.20",
        "10.00",
        "25.00",
        "0.50x",
        "0.20x",
        "0.72x",
        "0.29x",
        "<= 0.7x llama.cpp",
        "coloc PASS, 1p1d FAIL",
    ]
    # The same TPOTs against 3x the 2.5 ms bandwidth limit, on the row below: both pass.
    assert rows["<= 3x bandwidth limit"] == ["coloc PASS, 1p1d PASS"]
    # Throughput against 1.5x the better peer (vLLM's 300 -> 450): 500 passes, 400 fails.
    assert rows["Output tok/s c=16"][4:] == [
        "2.50x",
        "1.67x",
        "2.00x",
        "1.33x",
        ">= 1.5x better peer",
        "coloc PASS, 1p1d FAIL",
    ]
    # p99 ITL at 16 against 0.5x vLLM's 200: 60 passes, 120 fails.
    assert rows["P99 ITL c=16 (ms)"][-2:] == ["<= 0.5x vllm", "coloc PASS, 1p1d FAIL"]
    assert rows["Start-up to ready (s)"][-2:] == ["<= 2 s", "coloc PASS, 1p1d FAIL"]
    assert len(rows["Mean TTFT c=1 (ms)"]) == 8  # no target: figures and ratios only


def test_each_target_passes_fails_and_is_undecided_without_its_reference() -> None:
    verdicts = {(v["target"], v["deployment"]): v for v in target_verdicts(_all_four(), BANDWIDTH_LIMIT_MS)}
    expected = {  # target: (bound, its reference, colocated passed, 1P1D passed)
        "<= 0.7x llama.cpp": (7.0, LLAMA_CPP, True, False),
        "<= 3x bandwidth limit": (7.5, "bandwidth limit", True, True),
        ">= 1.5x better peer": (450.0, VLLM, True, False),
        "<= 0.5x vllm": (100.0, VLLM, True, False),
        "<= 2 s": (2.0, "fixed", True, False),
    }
    assert {target for target, _ in verdicts} == set(expected)
    for target, (bound, reference, *passed) in expected.items():
        for deployment, was_met in zip((KVSERVICE_COLOCATED, KVSERVICE_1P1D), passed):
            verdict = verdicts[(target, deployment)]
            assert verdict["bound"] == pytest.approx(bound), target
            assert (verdict["reference"], verdict["passed"]) == (reference, was_met), target
    assert verdicts[("<= 2 s", KVSERVICE_1P1D)]["value"] == 3.0
    # Without vLLM the ITL target is n/a and the better peer is llama.cpp; without a bandwidth
    # figure its target is n/a; without either peer only the figures of kvservice's own remain.
    results = _all_four()
    del results[VLLM]
    undecided = {(v["target"], v["deployment"]): v for v in target_verdicts(results)}
    assert undecided[("<= 0.5x vllm", KVSERVICE_COLOCATED)]["passed"] is None
    assert undecided[("<= 0.5x vllm", KVSERVICE_COLOCATED)]["reference"] is None
    assert undecided[("<= 3x bandwidth limit", KVSERVICE_COLOCATED)]["passed"] is None
    better = undecided[(">= 1.5x better peer", KVSERVICE_1P1D)]
    assert (better["reference"], better["bound"], better["passed"]) == (LLAMA_CPP, 300.0, True)
    del results[LLAMA_CPP]
    rows = _rows(format_peers_table(results))
    assert rows["Mean TPOT c=1 (ms)"][-1] == rows["<= 3x bandwidth limit"][-1] == "coloc n/a, 1p1d n/a"
    assert rows["Output tok/s c=16"][-1] == rows["P99 ITL c=16 (ms)"][-1] == "coloc n/a, 1p1d n/a"
    assert rows["Start-up to ready (s)"][-1] == "coloc PASS, 1p1d FAIL"  # needs no reference
    assert _rows(format_peers_table({KVSERVICE_1P1D: results[KVSERVICE_1P1D]}, 3.0))["<= 3x bandwidth limit"] == [
        "PASS"  # one deployment: its verdict alone
    ]


def test_a_peer_that_failed_sanity_shows_no_figures_and_its_targets_are_undecided() -> None:
    results = {
        KVSERVICE_COLOCATED: _server(KVSERVICE_COLOCATED, tpot_1=5.0, itl_16=60.0, tok_s_16=400.0, startup=1.5),
        LLAMA_CPP: _server(LLAMA_CPP, tpot_1=10.0, itl_16=80.0, tok_s_16=200.0, startup=1.0),
        VLLM: ServerResult(
            VLLM, ["vllm"], startup_s=50.0, error="sanity failed: 'What is the capital of France?' answered 'Lyon'"
        ),
    }
    rows = _rows(format_peers_table(results))
    assert rows["Status"][:3] == ["ok", "ok", "sanity failed"]
    assert rows["Mean TPOT c=16 (ms)"][2] == "-" and rows["Mean TPOT c=16 (ms)"][4] == "n/a"  # coloc/vllm
    assert rows["P99 ITL c=16 (ms)"][-1] == "n/a"  # needs vLLM's figure
    assert rows["Output tok/s c=16"][-1] == "PASS"  # the better peer that was measured: llama.cpp's 200 -> 300
    assert rows["Mean TPOT c=1 (ms)"][-1] == "PASS"  # llama.cpp's target stands
    assert rows["Start-up to ready (s)"][2] == "50.00"  # it did start
    results[KVSERVICE_COLOCATED].runs[16]["failed"] = 1  # a run with failures gives no figures either
    rows = _rows(format_peers_table(results))
    assert rows["Output tok/s c=16"][0] == "-" and rows["Output tok/s c=16"][-1] == "n/a"


def test_the_vllm_shim_is_found_as_the_cpu_build_of_vllm(tmp_path: Path) -> None:
    write_vllm_shim(tmp_path, "0.32.0")
    [dist] = importlib.metadata.distributions(name="vllm", path=[str(tmp_path)])
    assert dist.version == "0.32.0+cpu" and "cpu" in dist.version  # what vLLM's platform detection looks for


def test_llama_cpp_is_built_for_the_cpus_extensions_but_never_amx() -> None:
    cpuinfo = (
        "processor\t: 0\n"
        "flags\t\t: fpu sse4_2 avx avx2 fma f16c bmi2 avx512f avx512cd avx512vl avx512dq amx_tile amx_int8\n"
    )
    flags = ggml_isa_flags(cpu_flags(cpuinfo))
    assert {"-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_SSE42=ON"} <= set(flags)
    assert "-DGGML_AVX512=OFF" in flags  # avx512bw missing: all five AVX-512 subsets or none
    assert {"-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF"} <= set(flags)  # AMX faults on this VM
    assert len({f.split("=")[0] for f in flags}) == len(flags)  # each option set once


def test_server_commands_serve_smollm2_on_the_given_port(tmp_path: Path) -> None:
    paths, gguf = PeerPaths(tmp_path), tmp_path / "m.gguf"

    def argv(name: str) -> list[str]:
        return list(
            peer_servers.server_spec(name, 4321, paths, gguf, max_model_len=512, num_threads=2, cores=[0, 1]).argv
        )

    assert (
        argv(KVSERVICE_COLOCATED)[-8:]
        == ["serve", "--role", "both", "--model", "smollm2", "--port", "0", "--http-port", "4321"][-8:]
    )
    assert argv(KVSERVICE_1P1D)[-7:] == ["launch", "--model", "smollm2", "--port", "0", "--http-port", "4321"]
    llama = argv(LLAMA_CPP)
    assert llama[:3] == [str(paths.llama_server), "-m", str(gguf)] and llama[llama.index("-np") + 1] == "16"
    assert llama[llama.index("-c") + 1] == str(16 * 512)  # the context is split across the 16 slots
    vllm = peer_servers.server_spec(VLLM, 4321, paths, gguf, max_model_len=512, num_threads=2, cores=[0, 1])
    assert vllm.argv[vllm.argv.index("--dtype") + 1] == "float32" and vllm.env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"


async def test_a_server_is_timed_until_it_is_healthy_and_lists_its_model_and_stopped(tmp_path: Path) -> None:
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "models").write_text('{"data": [{"id": "smollm2"}]}')
    port = peer_servers.free_port()
    argv = (sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(tmp_path))
    spec = peer_servers.ServerSpec("stand-in", argv, port)
    # A model list alone is not ready: a proxy lists its model before it has a healthy decode worker.
    with pytest.raises(peer_servers.ServerStartError, match="not ready within"):
        async with peer_servers.PeerServer(spec, tmp_path / "unhealthy.log", ready_timeout=1.0):
            pass
    (tmp_path / "health").write_text("ok")
    async with peer_servers.PeerServer(spec, tmp_path / "log", ready_timeout=30.0) as server:
        assert 0 < server.startup_s < 30
        assert server.process is not None
        process = server.process
    assert process.returncode is not None  # stopped on the way out
    failing = peer_servers.ServerSpec(
        "crash", (sys.executable, "-c", "print('no model here'); raise SystemExit(3)"), port
    )
    with pytest.raises(peer_servers.ServerStartError, match=r"(?s)exited with code 3 .*no model here"):
        async with peer_servers.PeerServer(failing, tmp_path / "crash.log", ready_timeout=30.0):
            pass


def test_the_report_prints_the_bandwidth_limit_under_the_table_and_keeps_it_with_the_verdicts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    limit = BandwidthLimit(bytes_per_token=98_000_000, bandwidth=49e9, num_threads=2)  # 2 ms a token
    monkeypatch.setattr(peers, "measure_limit", lambda model, num_threads: limit)

    async def measure_all(*args: object) -> dict[str, ServerResult]:
        return {KVSERVICE_COLOCATED: _all_four()[KVSERVICE_COLOCATED]}

    monkeypatch.setattr(peers, "_measure_all", measure_all)
    out = tmp_path / "peers.json"
    args = _args("--servers", KVSERVICE_COLOCATED, "--peers-dir", str(tmp_path), "--json", str(out))
    assert peers.main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[lines.index(limit.describe()) - 1].startswith("=")  # right under the table's closing rule
    document = json.loads(out.read_text())
    assert document["memory_bandwidth"]["limit_ms_per_token"] == pytest.approx(2.0)
    [bandwidth] = [v for v in document["targets"] if v["reference"] == "bandwidth limit"]
    assert (bandwidth["bound"], bandwidth["passed"]) == (pytest.approx(6.0), True)  # 5 ms <= 3 x 2 ms


def test_kvservice_args_reach_both_kvservice_commands_and_no_peer(tmp_path: Path) -> None:
    paths, gguf = PeerPaths(tmp_path), tmp_path / "model.gguf"
    extra = ("--kv-cache-dtype", "bfloat16")

    def argv(name: str) -> tuple[str, ...]:
        spec = peer_servers.server_spec(
            name, 4321, paths, gguf, max_model_len=512, num_threads=2, cores=[0, 1], kvservice_args=extra
        )
        return spec.argv

    for name in (KVSERVICE_COLOCATED, KVSERVICE_1P1D):
        assert argv(name)[-2:] == extra
    assert "--kv-cache-dtype" not in argv(LLAMA_CPP)
