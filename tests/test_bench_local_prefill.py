"""`kvservice bench local-prefill`: the crossover rule, and one small run end to end."""

from __future__ import annotations

import pytest

from kvservice.client.bench.local_prefill import ModeResult, crossover, report


def mode(medians_ms: dict[int, float]) -> ModeResult:
    return ModeResult(
        ttft_s={n: [ms / 1000, ms / 1000 + 1.0, ms / 1000 - 0.001] for n, ms in medians_ms.items()},
        max_background_gap_s={n: 0.05 for n in medians_ms},
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
    assert crossover(mode(local_ms), mode(remote_ms), sorted(local_ms)) == expected


def test_the_report_puts_both_modes_side_by_side_with_their_ratio() -> None:
    table = report(mode({16: 10, 64: 40}), mode({16: 20, 64: 20}), [16, 64])
    rows = {line.split()[0]: line.split() for line in table.splitlines() if line[:1].isdigit()}
    assert rows["16"][1:4] == ["10.00", "20.00", "2.00x"]
    assert rows["64"][1:4] == ["40.00", "20.00", "0.50x"]
