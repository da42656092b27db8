"""`bench prefix`: its configurations, the message when a proxy refuses a flag, the table, and one
run of caching off vs on (the configurations today's workers and proxy support)."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
from pathlib import Path

import pytest
from conftest import parse_flags

from kvservice.client.bench import prefix
from kvservice.client.cluster import LaunchError


def test_configurations_pass_caching_to_workers_and_routing_to_the_proxy() -> None:
    off, rr, local = prefix.configurations(["off", "round-robin", "kv-aware-local"], max_local_prefill_tokens=40)
    assert (off.worker_args, off.proxy_args) == (("--no-enable-prefix-caching",), ())
    assert (rr.worker_args, rr.proxy_args) == (("--enable-prefix-caching",), ("--routing", "round-robin"))
    assert local.proxy_args == ("--routing", "kv-aware", "--max-local-prefill-tokens", "40")
    assert prefix.default_configuration_names("prefix_repetition") == ["off", "round-robin", "kv-aware"]
    assert prefix.default_configuration_names("multi_turn")[-1] == "kv-aware-local"
    with pytest.raises(ValueError, match="unknown configuration fast"):
        prefix.configurations(["off", "fast"], 40)


def test_a_proxy_that_refuses_its_flags_is_named_with_them() -> None:
    [rr] = prefix.configurations(["round-robin"], 40)
    refused = LaunchError("proxy exited with code 2 before it was ready (...)", "proxy", 2)
    message = prefix.launch_error_message(rr, refused)
    assert "'round-robin'" in message and "rejected its flags `--routing round-robin`" in message
    # Any other failure keeps its own words.
    crashed = LaunchError("decode-1 exited with code 1 before it was ready (...)", "decode-1", 1)
    assert (
        prefix.launch_error_message(rr, crashed)
        == "configuration 'round-robin': decode-1 exited with code 1 before it was ready (...)"
    )


def test_table_puts_configurations_side_by_side_with_ratios_to_the_first() -> None:
    def result(ttft: float, hit_rate: float | None) -> dict[str, object]:
        return {
            "completed": 4,
            "failed": 0,
            "mean_ttft_ms": ttft,
            "prefix_cache_hit_rate": hit_rate,
            "kv_bytes_received_per_request": 2048.0,
        }

    lines = prefix.format_prefix_table({"off": result(100.0, None), "on": result(40.0, 0.75)}).splitlines()
    assert lines[1].split() == ["Metric", "off", "on", "on/off"]
    rows = {cells[0]: cells[1:] for cells in (re.split(r"\s{2,}", line.strip()) for line in lines[3:-1])}
    assert rows["Mean TTFT (ms)"] == ["100.00", "40.00", "0.40x"]
    assert rows["Prefix cache hit rate (%)"] == ["n/a", "75.0"]
    assert rows["KV received per request (KiB)"] == ["2.00", "2.00", "1.00x"]
    assert "Mean TTFT, later turns (ms)" not in rows  # not a multi-turn run


def _prefix_args(*argv: str) -> argparse.Namespace:
    return parse_flags(prefix.add_arguments, *argv)


@pytest.mark.slow
async def test_bench_prefix_runs_caching_off_and_on_side_by_side(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result_file = tmp_path / "prefix.json"
    args = _prefix_args(
        "--configs",
        "off,on",
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
        "--num-warmups",
        "0",
        # One at a time: four at once could share one prefill step, where none finds another's blocks.
        "--request-rate",
        "inf",
        "--max-concurrency",
        "1",
        "--disable-tqdm",
        "--result-filename",
        str(result_file),
    )
    assert await asyncio.to_thread(prefix.main, args) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[1].split() == ["Metric", "off", "on", "on/off"]
    result = json.loads(result_file.read_text())
    assert result["settings"]["configurations"]["off"]["worker_args"] == ["--no-enable-prefix-caching"]
    for name in ("off", "on"):
        assert result[name]["completed"] == 4 and result[name]["failed"] == 0
        assert result[name]["dataset"] == "prefix_repetition"
        assert result[name]["kv_bytes_received_per_request"] > 0  # two decode workers, each pulled
    # Same workload in both: same prompt lengths, same order.
    assert result["off"]["input_lens"] == result["on"]["input_lens"] == [40] * 4
    # Each 32-token prefix is two blocks of 16: from its second use on, the prefill worker finds them.
    assert not result["off"]["prefix_cache_hit_rate"]
    assert result["on"]["prefill_prefix_cache_hit_rate"] > 0
