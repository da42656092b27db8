"""`kvservice bench transfer`: a small real run end to end, and the checks that make it honest."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from kvservice.client.bench import transfer
from kvservice.client.bench.transfer_worker import FIRST_TOKEN_ID, Pulled, layer_checksums
from kvservice.model.kv_cache import KVCacheLayout, allocate_kv_caches


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
    # Verified bit for bit: each repeat's gRPC pull and its same-host (shared-memory) pull.
    assert (
        report["num_verified_bytes"] == 2 * report["num_bytes"] * report["repeats"]
        and report["dst_blocks"] == "reversed"
    )
    assert (
        report["grpc_gbps"] > 0 and report["tcp_gbps"] > 0 and report["shm_gbps"] > 0 and report["plain_grpc_gbps"] > 0
    )
    assert report["ratio"] == pytest.approx(report["grpc_gbps"] / report["tcp_gbps"])
    assert report["shm_ratio"] == pytest.approx(report["shm_gbps"] / report["tcp_gbps"])
    assert report["grpc_of_plain_grpc_median"] == pytest.approx(
        report["grpc_gbps_median"] / report["plain_grpc_gbps_median"]
    )
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
    expected = layer_checksums(src, [0, 1, 2])
    assert layer_checksums(dst, [3, 2, 1]) == expected
    assert layer_checksums(dst, [1, 2, 3]) != expected
    dst[1][1, 2, 0, 0, 0] += 1  # one value of one V block of the last layer
    assert layer_checksums(dst, [3, 2, 1])[1] != expected[1]


@pytest.mark.parametrize("flag", ["--size-mib", "--repeats"])
def test_rejects_non_positive_sizes(flag: str) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args([flag, "0"])


def _pulled(**changes: object) -> Pulled:
    fields: dict[str, object] = {
        "seconds": 0.1,
        "cpu_seconds": 0.1,
        "error": None,
        "first_token_id": FIRST_TOKEN_ID,
        "checksums": [1, 2, 3],
        "is_guard_zero": True,
    }
    return Pulled(**{**fields, **changes})  # type: ignore[arg-type]


def test_verify_pull_refuses_anything_but_the_prefills_bytes() -> None:
    sent = [1, 2, 3]
    transfer.verify_pull(_pulled(), sent)  # the same bytes: accepted
    for bad, message in (
        (_pulled(checksums=[1, 9, 3]), "layers \\[1\\]"),
        (_pulled(error="lease expired"), "pull failed"),
        (_pulled(first_token_id=7), "first token"),
        (_pulled(is_guard_zero=False), "outside its transfer"),
    ):
        with pytest.raises(RuntimeError, match=message):
            transfer.verify_pull(bad, sent)
    with pytest.raises(ValueError):  # a layer missing altogether
        transfer.verify_pull(_pulled(checksums=[1, 2]), sent)
