"""`kvservice bench local-prefill`: the crossover rule, and one small run end to end."""

from __future__ import annotations

import json

import pytest
from conftest import parse_flags

from kvservice.client.bench.local_prefill import ModeResult, add_arguments, crossover, main, report


def mode(medians_ms: dict[int, float], gap_ms: float = 50) -> ModeResult:
    return ModeResult(
        ttft_s={n: [ms / 1000, ms / 1000 + 1.0, ms / 1000 - 0.001] for n, ms in medians_ms.items()},
        max_background_gap_s={n: [gap_ms / 1000, 10.0, 0.0] for n in medians_ms},
    )


@pytest.mark.parametrize(
    ("local_ms", "remote_ms", "expected"),
    [
        ({16: 10, 64: 30, 256: 90}, {16: 20, 64: 40, 256: 60}, 64),  # remote wins from 256 on
        ({16: 10, 64: 30, 256: 50}, {16: 20, 64: 40, 256: 60}, 256),  # local never loses
        ({16: 30, 64: 30, 256: 30}, {16: 20, 64: 40, 256: 60}, 0),  # local loses at once
        ({16: 10, 64: 50, 256: 10}, {16: 20, 64: 40, 256: 60}, 16),  # the first loss ends it
    ],
)
def test_the_crossover_is_the_last_length_before_local_prefill_first_loses(
    local_ms: dict[int, float], remote_ms: dict[int, float], expected: int
) -> None:
    assert crossover(mode(local_ms), mode(remote_ms), sorted(local_ms), num_streams=4) == expected


def test_the_stall_of_running_streams_counts_once_per_stream() -> None:
    local = ModeResult(ttft_s={16: [0.010], 64: [0.020]}, max_background_gap_s={16: [0.012], 64: [0.030]})
    remote = mode({16: 30, 64: 40}, gap_ms=10)
    # 16: 10 + 2 x 2 = 14 <= 30; 64: 20 + 2 x 20 = 60 > 40.
    assert crossover(local, remote, [16, 64], num_streams=2) == 16
    assert crossover(local, remote, [16, 64], num_streams=0) == 64  # an idle decode worker: only TTFT counts


def test_the_report_puts_both_modes_side_by_side() -> None:
    table = report(mode({16: 10, 64: 40}, gap_ms=30), mode({16: 20, 64: 20}, gap_ms=10), [16, 64], num_streams=1)
    rows = {line.split()[0]: line.split() for line in table.splitlines() if line[:1].isdigit()}
    assert rows["16"][1:] == ["10.00", "20.00", "30.00", "10.00", "30.00", "1.50x"]
    assert rows["64"][1:] == ["40.00", "20.00", "30.00", "10.00", "60.00", "3.00x"]


@pytest.mark.slow
def test_a_small_sweep_runs_both_modes_and_names_a_crossover(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse_flags(add_arguments, "--lengths", "8,24", "--repeats", "1", "--background-streams", "1", "--json")
    assert main(args) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["lengths"] == [8, 24] and result["crossover"] in (0, 8, 24)
    for mode_name in ("local", "remote"):
        assert all(len(v) == 1 and v[0] > 0 for v in result[mode_name]["ttft_s"].values())
        assert all(v[0] > 0 for v in result[mode_name]["max_background_gap_s"].values()), (
            "the background stream did not decode"
        )
