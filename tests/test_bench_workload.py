"""Benchmark workload: random and ShareGPT datasets, and the arrival process."""

from __future__ import annotations

import asyncio
import json
import math
import statistics
from pathlib import Path

import pytest

from kvservice.client.bench.workload import (
    SampledRequest,
    arrival_intervals,
    prefix_repetition_requests,
    random_requests,
    request_arrivals,
    sharegpt_requests,
    warm_up_requests,
)


def test_random_lengths_stay_in_range_and_cover_it() -> None:
    # input 100, r=0.25 -> [75, 125]; output 8, r=0.25 -> [6, 10].
    reqs = random_requests(500, input_len=100, output_len=8, range_ratio=0.25, vocab_size=50, seed=1)
    assert len(reqs) == 500
    in_lens = {r.prompt_len for r in reqs}
    out_lens = {r.expected_output_len for r in reqs}
    assert min(in_lens) == 75 and max(in_lens) == 125
    assert out_lens == {6, 7, 8, 9, 10}
    for r in reqs:
        assert r.prompt_token_ids is not None and r.prompt is None
        assert len(r.prompt_token_ids) == r.prompt_len
        assert all(0 <= t < 50 for t in r.prompt_token_ids)


def test_random_is_fixed_by_seed_and_ratio_zero_is_exact() -> None:
    a = random_requests(4, 16, 4, 0.0, 1000, seed=7)
    assert a == random_requests(4, 16, 4, 0.0, 1000, seed=7)
    assert a != random_requests(4, 16, 4, 0.0, 1000, seed=8)
    assert {(r.prompt_len, r.expected_output_len) for r in a} == {(16, 4)}
    # Independent draws: two prompts do not share a long prefix.
    assert a[0].prompt_token_ids[:8] != a[1].prompt_token_ids[:8]


@pytest.mark.parametrize("ratio", [1.0, -0.1, 1.5])
def test_random_rejects_bad_range_ratio(ratio: float) -> None:
    with pytest.raises(ValueError, match="range_ratio"):
        random_requests(1, 10, 10, ratio, 100, seed=0)


def test_prefix_repetition_shares_each_prefix_among_its_requests_only() -> None:
    reqs = prefix_repetition_requests(
        12, prefix_len=32, suffix_len=8, num_prefixes=3, output_len=5, vocab_size=50, seed=3
    )
    assert len(reqs) == 12
    assert {(r.prompt_len, r.expected_output_len) for r in reqs} == {(40, 5)}
    assert all(0 <= t < 50 for r in reqs for t in r.prompt_token_ids)
    by_prefix: dict[tuple[int, ...], list[list[int]]] = {}
    for r in reqs:
        by_prefix.setdefault(tuple(r.prompt_token_ids[:32]), []).append(r.prompt_token_ids[32:])
    assert sorted(len(suffixes) for suffixes in by_prefix.values()) == [4, 4, 4]  # 3 prefixes, 4 requests each
    assert len({tuple(s) for suffixes in by_prefix.values() for s in suffixes}) == 12  # every suffix its own
    # Shuffled: the requests of one prefix are not sent back to back.
    assert [tuple(r.prompt_token_ids[:32]) for r in reqs[:4]] != [tuple(reqs[0].prompt_token_ids[:32])] * 4


def test_prefix_repetition_is_fixed_by_seed_and_checks_its_shape() -> None:
    a = prefix_repetition_requests(6, 16, 4, 2, 3, 1000, seed=1)
    assert a == prefix_repetition_requests(6, 16, 4, 2, 3, 1000, seed=1)
    assert a != prefix_repetition_requests(6, 16, 4, 2, 3, 1000, seed=2)
    with pytest.raises(ValueError, match="multiple of num_prefixes"):
        prefix_repetition_requests(7, 16, 4, 2, 3, 1000, seed=1)
    with pytest.raises(ValueError, match="prefix_len"):
        prefix_repetition_requests(2, 0, 0, 1, 3, 1000, seed=1)


def test_warm_ups_keep_the_shape_but_not_the_prefix() -> None:
    reqs = random_requests(2, 64, 4, 0.0, 1000, seed=0)
    warm = warm_up_requests(reqs, 3, seed=0)
    assert [(w.prompt_len, w.expected_output_len) for w in warm] == [(64, 4)] * 3
    for w, r in zip(warm, [reqs[0], reqs[1], reqs[0]]):
        assert sorted(w.prompt_token_ids) == sorted(r.prompt_token_ids)  # same tokens,
        assert w.prompt_token_ids[:16] != r.prompt_token_ids[:16]  # but not a block of the measured prompt's start
    text = SampledRequest(prompt_len=2, expected_output_len=1, prompt="hi")
    assert warm_up_requests([text], 1, seed=0) == [text]


def test_sampled_request_needs_exactly_one_prompt() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        SampledRequest(prompt_len=2, expected_output_len=1)
    with pytest.raises(ValueError, match="exactly one"):
        SampledRequest(prompt_len=2, expected_output_len=1, prompt_token_ids=[1, 2], prompt="hi")
    with pytest.raises(ValueError, match="prompt_len"):
        SampledRequest(prompt_len=3, expected_output_len=1, prompt_token_ids=[1, 2])


def _words(text: str) -> list[int]:
    """A stand-in tokenizer: one token per word."""
    return list(range(len(text.split())))


def _conv(prompt: str, reply: str, first: str = "human") -> dict[str, object]:
    return {"conversations": [{"from": first, "value": prompt}, {"from": "gpt", "value": reply}]}


@pytest.fixture
def sharegpt_file(tmp_path: Path) -> Path:
    data = [
        _conv("one two three four five", "a b c d e f"),  # valid: 5 in, 6 out
        _conv("too short", "a b c d e"),  # prompt < 4 tokens
        _conv("one two three four", "a b"),  # reply < 4 tokens
        {"conversations": [{"from": "human", "value": "only one turn here ok"}]},
        {"id": "no conversations"},
        _conv("w " * 30, "a b c d e f g"),  # valid: 30 in, 7 out
        _conv("not asked by a human", "a b c d e", first="gpt"),
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    return path


def test_sharegpt_filters_like_vllm(sharegpt_file: Path) -> None:
    reqs = sharegpt_requests(sharegpt_file, 2, _words, seed=0)
    assert sorted((r.prompt_len, r.expected_output_len) for r in reqs) == [(5, 6), (30, 7)]
    assert all(r.prompt is not None and r.prompt_token_ids is None for r in reqs)


def test_sharegpt_output_len_override_and_oversampling(sharegpt_file: Path) -> None:
    # With an override the reply length no longer matters: "one two three four" / "a b" is valid.
    reqs = sharegpt_requests(sharegpt_file, 5, _words, seed=3, output_len=16)
    assert len(reqs) == 5
    assert {r.expected_output_len for r in reqs} == {16}
    assert {r.prompt_len for r in reqs} <= {4, 5, 30}
    # Only 3 valid pairs, so 2 are repeats.
    assert len({r.prompt for r in reqs}) == 3


def test_sharegpt_length_limits(sharegpt_file: Path) -> None:
    reqs = sharegpt_requests(sharegpt_file, 1, _words, seed=0, max_prompt_len=10)
    assert [r.prompt_len for r in reqs] == [5]


def test_sharegpt_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="missing.json"):
        sharegpt_requests(tmp_path / "missing.json", 1, _words, seed=0)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        sharegpt_requests(bad, 1, _words, seed=0)
    obj = tmp_path / "obj.json"
    obj.write_text('{"conversations": []}')
    with pytest.raises(ValueError, match="JSON list"):
        sharegpt_requests(obj, 1, _words, seed=0)
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps([_conv("short", "x")]))
    with pytest.raises(ValueError, match="no usable"):
        sharegpt_requests(empty, 1, _words, seed=0)


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_arrival_intervals_mean_is_inverse_rate(burstiness: float) -> None:
    gaps = arrival_intervals(20_000, request_rate=4.0, burstiness=burstiness, seed=0)
    assert len(gaps) == 20_000 and min(gaps) >= 0.0
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.03)  # 1 / 4 req/s
    # Gamma(k, theta) has variance k*theta^2 = 1 / (rate^2 * k): 1/16/k.
    assert statistics.pvariance(gaps) == pytest.approx(1 / 16 / burstiness, rel=0.1)


def test_arrival_intervals_infinite_rate_and_validation() -> None:
    assert arrival_intervals(5, math.inf, 1.0, seed=0) == [0.0] * 5
    assert arrival_intervals(3, 2.0, 1.0, seed=9) == arrival_intervals(3, 2.0, 1.0, seed=9)
    with pytest.raises(ValueError, match="request_rate"):
        arrival_intervals(3, 0.0, 1.0, seed=0)
    with pytest.raises(ValueError, match="burstiness"):
        arrival_intervals(3, 1.0, 0.0, seed=0)


async def test_request_arrivals_yields_all_in_order() -> None:
    reqs = random_requests(6, 4, 2, 0.0, 10, seed=0)
    got = [r async for r in request_arrivals(reqs, math.inf, 1.0, seed=0)]
    assert got == reqs


async def test_request_arrivals_follows_the_schedule() -> None:
    reqs = random_requests(4, 4, 2, 0.0, 10, seed=0)
    gaps = arrival_intervals(3, 50.0, 1.0, seed=5)  # mean 20 ms each
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    times = [loop.time() - t0 async for _ in request_arrivals(reqs, 50.0, 1.0, seed=5)]
    assert times[0] < 0.01  # the first request goes at once
    expected = [sum(gaps[:i]) for i in range(1, 4)]
    for got, want in zip(times[1:], expected):
        assert want - 0.002 <= got < want + 0.1  # never early; late only by loop lag
