"""`kvservice bench proxy-cpu`'s accounting: a process's CPU seconds from /proc, per relayed token."""

from __future__ import annotations

import math
import os
import time

from kvservice.client.bench.proxy_cpu import ProxyCost
from kvservice.client.bench.tcp_baseline import process_cpu_seconds


def test_process_cpu_seconds_grows_with_the_work_this_process_does() -> None:
    before = process_cpu_seconds(os.getpid())
    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:  # burn 0.2 CPU-s in this process
        pass
    spent = process_cpu_seconds(os.getpid()) - before
    assert 0.15 <= spent <= 5.0, spent  # clock ticks are 10 ms; other threads may add a little


def test_a_fronts_cost_is_cpu_microseconds_per_token() -> None:
    cost = ProxyCost("grpc", num_tokens=1000, cpu_s=0.05, wall_s=2.0)
    assert math.isclose(cost.us_per_token, 50.0) and math.isclose(cost.tokens_per_s, 500.0)
    assert math.isnan(ProxyCost("http", 0, 0.0, 1.0).us_per_token)


def test_the_grpc_floor_is_a_bare_servers_cpu_per_streamed_message() -> None:
    from kvservice.client.bench.grpc_message_floor import grpc_us_per_message

    us = grpc_us_per_message(concurrency=8, messages_per_call=256)  # ~0.1 CPU-s: ticks are 10 ms
    # Real work was measured: more than nothing, less than a millisecond a message.
    assert 0.0 < us < 1000.0, us
