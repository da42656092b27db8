"""The `kvservice` command line: every command's --help, and generate/stats/health
against one colocated server on the built-in tiny model (started once for the module).

The main paths run the installed console script as a user would; the rest call
`kvservice.cli.main` in this process (each new process pays torch's import, seconds
on a small machine)."""

from __future__ import annotations

import asyncio
import json
import pathlib
import re
import sys
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from conftest import local_cluster

from kvservice import LLM, SamplingParams
from kvservice.cli import BENCHMARKS, COMMANDS, build_parser, main

pytestmark = pytest.mark.asyncio(loop_scope="module")

# The installed console script, next to this Python.
KVSERVICE = str(pathlib.Path(sys.executable).with_name("kvservice"))

# Subcommands as the user types them, with the one-line description each should print.
SUBCOMMANDS = {name: command.help for name, command in COMMANDS.items()}
SUBCOMMANDS["bench"] = "benchmarks: " + ", ".join(BENCHMARKS)
SUBCOMMANDS.update({f"bench {name}": command.help for name, command in BENCHMARKS.items()})


def words(text: str) -> str:
    """`text` with its whitespace collapsed (argparse re-wraps descriptions)."""
    return " ".join(text.split())


async def run(*cmd: str, timeout: float = 120.0) -> tuple[int, str, str]:
    """Run `cmd`; returns (exit code, stdout, stderr)."""
    process = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        stdout, stderr = await asyncio.wait_for(process.communicate(), timeout)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode is not None
    return process.returncode, stdout.decode(), stderr.decode()


async def kvservice(*args: str) -> tuple[int, str, str]:
    return await run(KVSERVICE, *args)


async def in_process(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """`kvservice ARGS` through `kvservice.cli.main`, on a thread (the commands run their own
    event loop); returns (exit code, stdout, stderr), a `--help` or a usage error's SystemExit too."""
    capsys.readouterr()
    try:
        code = await asyncio.to_thread(main, list(args))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server() -> AsyncIterator[str]:
    """A colocated (`--role both`) tiny server; yields its address."""
    async with local_cluster(
        "tiny", colocated=True, worker_args=["--num-threads", "1", "--num-blocks", "32"]
    ) as cluster:
        yield cluster.address


async def test_top_level_help() -> None:
    code, stdout, stderr = await kvservice("--help")
    assert code == 0, stderr
    assert "usage: kvservice" in stdout
    assert "prefill" in stdout and "decode" in stdout  # says what the tool is
    for name in [*COMMANDS, "bench"]:
        assert name in stdout


@pytest.mark.parametrize(("command", "description"), SUBCOMMANDS.items(), ids=list(SUBCOMMANDS))
async def test_subcommand_help(command: str, description: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, stdout, stderr = await in_process(capsys, *command.split(), "--help")
    assert code == 0, stderr
    assert f"usage: kvservice {command}" in stdout
    assert words(description) in words(stdout)


async def test_generate_json(server: str) -> None:
    code, stdout, stderr = await kvservice(
        "generate",
        "--target",
        server,
        "--prompt-token-ids",
        "1,2,3",
        "--max-tokens",
        "4",
        "--temperature",
        "0",
        "--json",
    )
    assert code == 0, stderr
    result = json.loads(stdout.strip().splitlines()[-1])
    assert len(result["token_ids"]) == 4
    assert all(isinstance(t, int) for t in result["token_ids"])
    assert isinstance(result["text"], str)
    assert result["finish_reason"] == "length"


async def test_generate_is_greedy_and_repeatable(server: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Two greedy runs of the same prompt print the same tokens (--temperature defaults to 0)."""
    args = ("generate", "--target", server, "--prompt-token-ids", "5,6,7,8", "--max-tokens", "6", "--json")
    code1, out1, err1 = await in_process(capsys, *args)
    code2, out2, err2 = await in_process(capsys, *args)
    assert (code1, code2) == (0, 0), err1 + err2
    first, second = (json.loads(out.strip().splitlines()[-1]) for out in (out1, out2))
    assert first["token_ids"] == second["token_ids"]
    assert len(first["token_ids"]) == 6


async def test_generate_stop_strings(server: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`--stop` (repeatable): the text ends before the first stop string, finish_reason stop."""
    args = ("generate", "--target", server, "abc", "--max-tokens", "12", "--ignore-eos", "--json")
    code, out, err = await in_process(capsys, *args)
    assert code == 0, err
    text = json.loads(out.strip().splitlines()[-1])["text"]
    index = next(
        i for i in range(1, len(text)) if text[i].isascii() and text[i].isprintable() and text.index(text[i]) == i
    )
    code, out, err = await in_process(capsys, *args, "--stop", "never seen", "--stop", text[index])
    assert code == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["text"] == text[:index] and result["finish_reason"] == "stop"


async def test_generate_bad_request_exits_nonzero_with_status(server: str) -> None:
    code, stdout, stderr = await kvservice(
        "generate", "--target", server, "--prompt-token-ids", "1,2,3", "--max-tokens", "0", "--json"
    )
    assert code != 0
    assert "INVALID_ARGUMENT" in stderr
    assert "max_tokens" in stderr


async def test_generate_needs_a_prompt(server: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, stderr = await in_process(capsys, "generate", "--target", server)
    assert code == 2
    assert "prompt" in stderr


async def test_stats_json(server: str) -> None:
    code, stdout, stderr = await kvservice("stats", "--target", server, "--json")
    assert code == 0, stderr
    stats = json.loads(stdout.strip().splitlines()[-1])
    assert stats["role"] == "both"
    assert stats["num_blocks_total"] == 32
    assert 0 <= stats["num_blocks_free"] <= stats["num_blocks_total"]
    assert 0 <= int(stats["prefix_cache"]["hits"]) <= int(stats["prefix_cache"]["queries"])


async def test_stats_table_shows_the_prefix_cache(server: str) -> None:
    code, stdout, stderr = await kvservice("stats", "--target", server)
    assert code == 0, stderr
    assert re.search(r"prefix_cache: hits \d+/\d+ tokens \((n/a|\d+\.\d%)\)", stdout), stdout


async def test_health_serving(server: str) -> None:
    code, stdout, stderr = await kvservice("health", "--target", server)
    assert code == 0, stderr
    assert stdout.strip() == "SERVING"


async def test_health_unreachable_exits_nonzero(capsys: pytest.CaptureFixture[str]) -> None:
    # Port 1 on loopback: nothing listens there (and it is never ours to bind).
    code, stdout, stderr = await in_process(capsys, "health", "--target", "127.0.0.1:1", "--timeout", "2")
    assert code != 0
    assert "SERVING" not in stdout
    assert "UNAVAILABLE" in stderr or "DEADLINE_EXCEEDED" in stderr


@pytest.mark.parametrize("command", ["health", "stats", "generate", "chat", "proxy"])
async def test_client_commands_and_the_proxy_do_not_import_torch(command: str) -> None:
    """A container's health check runs `kvservice health` every few seconds, and a launch waits
    for its proxy: neither imports torch (~1 s of CPU)."""
    probe = (
        f"import sys; from kvservice.cli import build_parser; build_parser({command!r}); "
        "print(sorted({'torch', 'numpy'} & set(sys.modules)))"
    )
    code, stdout, stderr = await run(sys.executable, "-c", probe)
    assert code == 0, stderr
    assert stdout.strip() == "[]"


async def test_python_dash_m_help() -> None:
    code, stdout, stderr = await run(sys.executable, "-m", "kvservice", "--help")
    assert code == 0, stderr
    assert "usage: kvservice" in stdout


@pytest.mark.slow
async def test_demo_launches_asks_reports_and_stops(tmp_path: pathlib.Path) -> None:
    """`kvservice demo` end to end (on tiny: the same path as on SmolLM2, faster): every
    question answered through /v1/chat/completions, the report printed, exit 0."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvservice",
        "demo",
        "--model",
        "tiny",
        "--max-tokens",
        "8",
        "--num-questions",
        "3",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(process.communicate(), 300)
    text = out.decode()
    assert process.returncode == 0, text
    assert text.count("\nQ: ") + text.startswith("Q: ") == 3 and text.count("A: ") == 3
    assert re.search(r"Successful requests:\s+3\b", text) and re.search(r"Failed requests:\s+0\b", text)
    assert re.search(r"KV transfers:\s+3\b", text)  # every answer's prompt KV came from the prefill worker
    assert "stopped every process" in text


def tiny_chat(conversation: list[dict[str, str]], max_tokens: int) -> tuple[list[int], str]:
    (out,) = LLM("tiny").chat(conversation, SamplingParams(temperature=0, max_tokens=max_tokens))
    return list(out.token_ids), out.text


async def test_generate_chat_is_one_turn_with_the_models_template(server: str) -> None:
    code, stdout, stderr = await kvservice(
        "generate", "--target", server, "--chat", "Hello there", "--system", "Be brief.", "--max-tokens", "6", "--json"
    )
    assert code == 0, stderr
    expected, _ = tiny_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}], 6)
    assert json.loads(stdout.strip().splitlines()[-1])["token_ids"] == expected
    code, _, stderr = await kvservice("generate", "--target", server, "--system", "x", "--prompt-token-ids", "1")
    assert code == 2 and "--system goes with --chat" in stderr


async def test_chat_keeps_the_history_and_quits_at_end_of_input(server: str) -> None:
    process = await asyncio.create_subprocess_exec(
        KVSERVICE,
        "chat",
        "--target",
        server,
        "--max-tokens",
        "6",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(b"Hi\n\nAnd then?\n"), 120)
    assert process.returncode == 0, stderr.decode()
    _, first = tiny_chat([{"role": "user", "content": "Hi"}], 6)
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "And then?"},
    ]
    _, second = tiny_chat(history, 6)
    # Three prompts (the empty line is skipped, end of input quits), each answer after its prompt.
    assert stdout.decode() == f"you> {first}\nyou> you> {second}\nyou> \n"


@pytest.mark.parametrize("argv", [["serve", "--role", "both"], ["proxy", "--decode", "127.0.0.1:1"]])
async def test_log_level_takes_any_case_and_only_real_levels(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    parser = build_parser(argv[0])
    assert parser.parse_args([*argv, "--log-level", "info"]).log_level == "INFO"
    assert parser.parse_args([*argv, "--log-level", "Debug"]).log_level == "DEBUG"
    assert parser.parse_args(argv).log_level == "WARNING"
    with pytest.raises(SystemExit):
        parser.parse_args([*argv, "--log-level", "verbose"])
    assert "invalid choice: 'VERBOSE'" in capsys.readouterr().err
