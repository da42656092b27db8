"""Workers on the same cores take turns (`CoreLease`): a decode step waiting for the turn gets it
at a prefill step's first pause point, then at the next one past the quantum, never before it;
a dead holder frees it;
pause points run between every layer's matmuls without changing a token; `LocalCluster` gives
a lease to prefill and decode workers only where their cores overlap."""

from __future__ import annotations

import asyncio
import os
import pathlib
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from kvservice.client.cluster import LocalCluster
from kvservice.config import EngineConfig
from kvservice.core.sampling_params import SamplingParams
from kvservice.engine.engine import LLMEngine
from kvservice.engine.engine_builder import build_engine
from kvservice.worker.core_lease import CoreLease, DecodeCycle, LeaseRole

# A decode worker's end in another process (record locks do not conflict within one): it
# says when it starts waiting, when it holds the turn, and (with "hold") keeps it until stdin closes.
_DECODE_STEP = """
import sys
from kvservice.worker.core_lease import CoreLease, LeaseRole
lease = CoreLease(sys.argv[1], LeaseRole.FIRST, 1.0)
print("waiting", flush=True)
with lease.turn():
    print("holding", flush=True)
    if sys.argv[2] == "hold":
        sys.stdin.read()
print("released", flush=True)
"""
_DEADLINE_S = 30.0


@pytest.fixture
def lease_path(tmp_path: pathlib.Path) -> str:
    return str(tmp_path / "cores")


def _decode_step(path: str, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _DECODE_STEP, path, mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


@pytest.fixture
def decode_steps() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:
        process.kill()
        process.wait()


def _read(process: subprocess.Popen[str]) -> str:
    assert process.stdout is not None
    return process.stdout.readline().strip()


def _until(condition: object, what: str) -> None:
    """Poll `condition()` (a lock's state has no event to wait on) until true or the deadline."""
    deadline = time.monotonic() + _DEADLINE_S
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


def _waiting_decode_step(
    path: str, decode_steps: list[subprocess.Popen[str]], prefill: CoreLease
) -> subprocess.Popen[str]:
    """A decode step in another process, once `prefill` sees it waiting for the turn."""
    decode = _decode_step(path, "once")
    decode_steps.append(decode)
    assert _read(decode) == "waiting"
    _until(prefill.others_wait, "a decode step to wait")
    return decode


def test_a_prefill_step_hands_the_turn_to_a_waiting_decode_step_and_takes_its_time_from_the_quantum(
    lease_path: str, decode_steps: list[subprocess.Popen[str]]
) -> None:
    prefill = CoreLease(lease_path, LeaseRole.YIELDING, target_s=0.05)
    with prefill.turn():
        decode = _waiting_decode_step(lease_path, decode_steps, prefill)
        prefill.pause("matmul")  # the step's first pause point: its quantum counts as spent
        assert prefill.num_handovers == 1
        # pause() returns once the decode step has had the turn and given it back; what that took
        # is taken from the next quantum (of the cycle: the target, or three such decode steps),
        # down to a quarter of the cycle.
        cycle = prefill.cycle.cycle_s
        assert cycle == max(0.05, 3 * prefill.cycle.decode_step_s)
        assert cycle / 4 <= prefill.quantum_s < cycle
        assert [_read(decode), _read(decode)] == ["holding", "released"]
        assert not prefill.others_wait()
    assert decode.wait(_DEADLINE_S) == 0


def test_the_cycle_is_the_target_or_three_smoothed_decode_steps() -> None:
    cycle = DecodeCycle(0.07)
    assert cycle.cycle_s == 0.07  # nothing timed yet
    cycle.observe(0.02)
    assert cycle.cycle_s == 0.07  # three such steps fit in the target
    cycle.observe(0.1)  # one slow step moves the smoothed time a fifth of the way
    assert cycle.decode_step_s == pytest.approx(0.036) and cycle.cycle_s == pytest.approx(0.108)
    for _ in range(60):
        cycle.observe(0.05)
    assert cycle.cycle_s == pytest.approx(0.15, rel=1e-4)
    with pytest.raises(ValueError, match="target_s"):
        DecodeCycle(0.0)


def test_slow_decode_steps_widen_the_cycle_to_three_of_them(
    lease_path: str, decode_steps: list[subprocess.Popen[str]]
) -> None:
    """Decode steps far longer than the target leave the prompts two of them, not a quarter of
    the target: while prompts wait, decode keeps about a third of the cores."""
    prefill = CoreLease(lease_path, LeaseRole.YIELDING, target_s=0.01)
    with prefill.turn():
        decode = _decode_step(lease_path, "hold")
        decode_steps.append(decode)
        assert _read(decode) == "waiting"
        _until(prefill.others_wait, "a decode step to wait")
        assert decode.stdin is not None
        release = threading.Timer(0.2, decode.stdin.close)  # the decode step holds the turn >= 0.2 s
        release.start()
        prefill.pause("matmul")
        release.join()
        assert [_read(decode), _read(decode)] == ["holding", "released"]
        waited = prefill.cycle.decode_step_s
        assert waited is not None and waited >= 0.2
        assert prefill.cycle.cycle_s == pytest.approx(3 * waited)
        assert prefill.quantum_s == pytest.approx(2 * waited)  # what the decode step left of the cycle
    assert decode.wait(_DEADLINE_S) == 0


def test_a_prefill_step_keeps_the_turn_within_its_quantum_and_while_nobody_waits(
    lease_path: str, decode_steps: list[subprocess.Popen[str]]
) -> None:
    alone = CoreLease(lease_path, LeaseRole.YIELDING, target_s=1e-6)
    with alone.turn():
        alone.pause("matmul")  # past its quantum, but no decode step waits
    assert alone.num_handovers == 0
    alone.close()

    prefill = CoreLease(lease_path, LeaseRole.YIELDING, target_s=600.0)
    with prefill.turn():
        first = _waiting_decode_step(lease_path, decode_steps, prefill)
        # A step's first pause point hands over at once (the decode step after it can take
        # the requests whose first token the previous step produced) ...
        prefill.pause("matmul")
        assert prefill.num_handovers == 1 and [_read(first), _read(first)] == ["holding", "released"]
        second = _waiting_decode_step(lease_path, decode_steps, prefill)
        for _ in range(3):  # ... then the step keeps the turn for its quantum
            prefill.pause("matmul")
        assert prefill.num_handovers == 1 and prefill.others_wait()
    assert [_read(second), _read(second)] == ["holding", "released"]  # the end of the step hands it over


def test_the_turn_of_a_worker_that_died_holding_it_is_free(
    lease_path: str, decode_steps: list[subprocess.Popen[str]]
) -> None:
    decode = _decode_step(lease_path, "hold")
    decode_steps.append(decode)
    assert [_read(decode), _read(decode)] == ["waiting", "holding"]
    prefill = CoreLease(lease_path, LeaseRole.YIELDING, target_s=0.05)
    took = threading.Event()

    def take() -> None:
        with prefill.turn():
            took.set()

    taker = threading.Thread(target=take, daemon=True)
    taker.start()
    assert not took.wait(0.2)  # the decode worker holds it
    decode.kill()
    decode.wait()
    assert took.wait(_DEADLINE_S), "the dead worker's turn was never freed"
    taker.join(_DEADLINE_S)


class _RecordingLease(CoreLease):
    def __init__(self, path: str) -> None:
        super().__init__(path, LeaseRole.YIELDING, target_s=1e-6)
        self.points: list[str] = []

    def pause(self, next_op: str) -> None:
        self.points.append(next_op)
        super().pause(next_op)


def _greedy(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, SamplingParams(max_tokens=6, temperature=0), request_id=str(i))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id] = output.token_ids
    return [tokens[str(i)] for i in range(len(prompts))]


def test_a_yielding_engine_pauses_between_every_layers_matmuls_and_samples_the_same_tokens(lease_path: str) -> None:
    config = EngineConfig(max_model_len=128, num_blocks=64)
    prompts = [[1, 5, 9, 12, 40, 3], [7, 7, 2]]
    lease = _RecordingLease(lease_path)
    engine = build_engine("tiny", config, core_lease=lease)
    assert _greedy(engine, prompts) == _greedy(build_engine("tiny", config), prompts)
    num_layers = engine.model_config.num_hidden_layers
    per_step = ["o_proj", "mlp", "down_proj", "attention"] * num_layers
    assert lease.points[: len(per_step)] == per_step
    assert len(lease.points) % len(per_step) == 0 and lease.num_handovers == 0  # nobody waited


@pytest.mark.parametrize(
    ("prefill_cores", "decode_cores", "gets_lease"),
    [(None, None, True), ([0, 1], [1], True), ([0], [1], False)],
)
def test_a_cluster_gives_a_lease_to_workers_whose_cores_overlap(
    prefill_cores: list[int] | None, decode_cores: list[int] | None, gets_lease: bool
) -> None:
    cluster = LocalCluster(prefill_cores=prefill_cores, decode_cores=decode_cores)
    args = cluster._core_lease_args()
    if not gets_lease:
        assert args == [] and cluster.core_lease_path is None
        return
    path = cluster.core_lease_path
    assert path is not None and args == ["--core-lease", path] and os.path.exists(path)
    asyncio.run(cluster.stop())
    assert not os.path.exists(path) and cluster.core_lease_path is None


def test_a_cluster_told_not_to_share_or_given_a_lease_makes_none() -> None:
    assert LocalCluster(core_lease=False)._core_lease_args() == []
    assert LocalCluster(worker_args=["--core-lease", "/tmp/x"])._core_lease_args() == []


def test_a_traced_lease_logs_each_turn_a_hand_over_ends_and_the_one_it_takes_back(
    lease_path: str, decode_steps: list[subprocess.Popen[str]]
) -> None:
    prefill = CoreLease(lease_path, LeaseRole.YIELDING, target_s=0.05)
    prefill.turn_log = []
    with prefill.turn():
        decode = _waiting_decode_step(lease_path, decode_steps, prefill)
        prefill.pause("matmul")
        assert [_read(decode), _read(decode)] == ["holding", "released"]
    assert decode.wait(_DEADLINE_S) == 0
    (asked, taken, handed_over), (asked_back, taken_back, released) = prefill.turn_log
    assert asked <= taken <= handed_over <= asked_back <= taken_back <= released
    # Between the two: the decode step's turn (another process: its own log, were it traced).
    assert taken_back - asked_back > 0
    first = CoreLease(lease_path, LeaseRole.FIRST, target_s=0.05)
    first.turn_log = []
    with first.turn():
        pass
    assert len(first.turn_log) == 1 and first.turn_log[0][0] <= first.turn_log[0][1] <= first.turn_log[0][2]
