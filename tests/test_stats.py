"""A worker's Stats name its compute path (the C++ kernels and their ISA, or PyTorch and why), and
so do its `/metrics` and `kvservice stats`, for a worker and for each worker behind a proxy."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from conftest import local_cluster, scrape, serving_worker

from kvservice import LLM
from kvservice.cli import main
from kvservice.model.cpu_kernels import compute_path, kernels_loaded
from kvservice.server.metrics import ServerMetrics, metrics_app, start_http
from kvservice.server.stats import engine_stats
from kvservice.v1 import kvservice_pb2 as pb
from kvservice.v1 import kvservice_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def decode_stats() -> pb.StatsResponse:
    """What a decode worker on the tiny model answers to Stats."""
    return engine_stats(LLM("tiny").engine, "decode")


async def in_thread_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """`kvservice ARGS` in this process, on a thread (the command runs its own event loop): its exit
    code and stdout."""
    capsys.readouterr()
    code = await asyncio.to_thread(main, list(args))
    return code, capsys.readouterr().out


class FixedStats(pb_grpc.WorkerServicer):
    """A worker whose Stats answer is `stats`."""

    def __init__(self, stats: pb.StatsResponse) -> None:
        self.stats = stats

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        return self.stats


def test_a_workers_stats_name_the_compute_path_of_this_process(decode_stats: pb.StatsResponse) -> None:
    assert decode_stats.compute_path == compute_path("cpu")
    assert decode_stats.compute_path.startswith(("cpu-kernels (", "pytorch"))


async def test_metrics_export_the_compute_path(decode_stats: pb.StatsResponse) -> None:
    async def stats() -> pb.StatsResponse:
        return decode_stats

    runner, port = await start_http(metrics_app(ServerMetrics("decode"), stats), "127.0.0.1", 0)
    try:
        samples = await asyncio.to_thread(scrape, f"127.0.0.1:{port}")
    finally:
        await runner.cleanup()
    info = {labels: value for (name, labels), value in samples.items() if name == "kvservice_compute_path_info"}
    assert info == {(("compute_path", decode_stats.compute_path),): 1.0}


async def test_kvservice_stats_prints_a_workers_compute_path(
    decode_stats: pb.StatsResponse, capsys: pytest.CaptureFixture[str]
) -> None:
    async with serving_worker(FixedStats(decode_stats)) as address:
        code, table = await in_thread_main(capsys, "stats", "--target", address)
        assert code == 0
        code, as_json = await in_thread_main(capsys, "stats", "--target", address, "--json")
        assert code == 0
    assert f"compute_path                 {decode_stats.compute_path}\n" in table
    assert json.loads(as_json)["compute_path"] == decode_stats.compute_path


async def test_kvservice_stats_on_a_proxy_prints_each_workers_compute_path(
    decode_stats: pb.StatsResponse, capsys: pytest.CaptureFixture[str]
) -> None:
    fallback = pb.StatsResponse(role="prefill", compute_path="pytorch fallback (kernel build failed: no compiler)")
    proxy = pb.StatsResponse(
        role="proxy",
        workers=[
            pb.WorkerStats(address="10.0.0.1:50051", stats=decode_stats, is_healthy=True),
            pb.WorkerStats(address="10.0.0.2:50051", stats=fallback, is_healthy=True),
        ],
    )
    async with serving_worker(FixedStats(proxy)) as address:
        code, table = await in_thread_main(capsys, "stats", "--target", address)
    assert code == 0
    lines = {line.split()[1]: line for line in table.splitlines() if line.strip().startswith("worker ")}
    assert f"): {decode_stats.compute_path}, blocks free" in lines["10.0.0.1:50051"]
    assert "): pytorch fallback (kernel build failed: no compiler), blocks free" in lines["10.0.0.2:50051"]
    assert "compute_path " not in table  # the proxy computes nothing itself


@pytest.mark.slow
async def test_a_served_worker_reports_its_compute_path_in_stats_and_metrics(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A real `--role both` worker process: it loads the kernels this session built (the same
    build key), and says so in Stats and /metrics alike."""
    expected = compute_path("cpu")
    worker_args = ["--num-threads", "1", "--num-blocks", "32", "--metrics-port", "0"]
    async with local_cluster("tiny", colocated=True, worker_args=worker_args) as cluster:
        code, as_json = await in_thread_main(capsys, "stats", "--target", cluster.address, "--json")
        samples = await asyncio.to_thread(scrape, cluster.children[0].metrics_address)
    assert code == 0
    assert json.loads(as_json)["compute_path"] == expected
    assert expected.startswith("cpu-kernels (") == kernels_loaded()
    assert samples[("kvservice_compute_path_info", (("compute_path", expected),))] == 1.0
