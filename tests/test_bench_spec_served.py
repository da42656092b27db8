"""`kvservice bench spec --served`'s pieces: the prefill workers of its recompute mode run
without the draft, and its report puts the two modes side by side."""

from __future__ import annotations

import pytest

from kvservice.client.bench import spec_served


def test_the_recompute_mode_starts_its_prefill_workers_without_the_draft() -> None:
    cmd = ["python", "-m", "kvservice", "serve", "--draft-model", "/d", "--num-speculative-tokens", "3", "--role"]
    assert spec_served._without_flags(cmd, spec_served.DRAFT_FLAGS) == ["python", "-m", "kvservice", "serve", "--role"]


def test_the_report_shows_each_modes_figures_and_their_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    def result(ttft: float, computed: int, received: int) -> dict[str, object]:
        spec = {
            "num_draft_prompt_tokens_computed": computed,
            "num_draft_prompt_tokens_received": received,
            "num_draft_prompt_tokens_recomputed": computed,
            "acceptance_rate": 0.5,
        }
        figures = {key: ttft for _, key in spec_served.ROWS}
        return {**figures, "decode_spec_decode": spec}

    spec_served.report(
        {
            spec_served.RECOMPUTE_ON_DECODE: result(100.0, 64, 0),
            spec_served.EAGER: result(90.0, 0, 64),
            spec_served.DRAFT_ON_PREFILL: result(72.0, 0, 64),
        }
    )
    out = capsys.readouterr().out
    # Deferred against eager (0.80x) and against recompute (0.72x), row by row.
    assert "mean TTFT (ms)" in out and "0.80x" in out and "0.72x" in out
    assert "draft on prefill: decode worker's draft prompt tokens computed 0, received 64, recomputed 0" in out
