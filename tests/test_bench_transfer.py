"""`kvservice bench transfer`: a small real run end to end, and the checks that make it honest."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from kvservice.client.bench import transfer
from kvservice.kv_cache import KVCacheLayout, allocate_kv_caches


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    transfer.add_arguments(parser)
    return parser


def test_small_run_reports_verified_figures_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    # 8 MiB = 64 tokens = 4 blocks per layer; decode-side ids reversed, so every block moves.
    args = _parser().parse_args(["--size-mib", "8", "--repeats", "1", "--reversed-blocks", "--json"])
    assert transfer.main(args) == 0  # nonzero: a process went over its memory bound
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["num_bytes"] == 8 << 20 and report["num_tokens"] == 64
    assert report["is_verified"] is True and report["dst_blocks"] == "reversed"
    assert report["grpc_gbps"] > 0 and report["tcp_gbps"] > 0
    assert report["ratio"] == pytest.approx(report["grpc_gbps"] / report["tcp_gbps"])
    assert report["ratio"] > 0
    for role in ("prefill", "decode"):
        memory = report["memory"][role]
        assert memory["is_within_bound"] and memory["peak_rss_bytes"] >= memory["kv_cache_bytes"]
    assert report["memory"]["prefill"]["staging_bytes_in_use_at_end"] == 0  # every pull released its staging


def test_checksums_see_the_block_mapping() -> None:
    # The verification compares per-layer checksums taken in the prompt's block order on each
    # side: blocks at the wrong ids, or in the wrong order, must not compare equal.
    layout = KVCacheLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    src = allocate_kv_caches(layout, 3, torch.device("cpu"))
    for kv_layer in src:
        kv_layer.normal_(generator=torch.Generator().manual_seed(0))
    dst = allocate_kv_caches(layout, 4, torch.device("cpu"))
    for s, d in zip(src, dst):
        d[:, [3, 2, 1]] = s[:, [0, 1, 2]]
    expected = transfer._layer_checksums(src, [0, 1, 2])
    assert transfer._layer_checksums(dst, [3, 2, 1]) == expected
    assert transfer._layer_checksums(dst, [1, 2, 3]) != expected
    dst[1][1, 2, 0, 0, 0] += 1  # one value of one V block of the last layer
    assert transfer._layer_checksums(dst, [3, 2, 1])[1] != expected[1]


@pytest.mark.parametrize("flag", ["--size-mib", "--repeats"])
def test_rejects_non_positive_sizes(flag: str) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args([flag, "0"])
