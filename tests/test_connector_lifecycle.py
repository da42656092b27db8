"""The per-step connector lifecycle: exact worker-side call order, and what reaches the scheduler.

A `RecordingConnector` logs every worker-side call with its arguments; the tests drive the
real engine, runner and context managers on the built-in `tiny` model (4 layers).
"""

from __future__ import annotations

import pytest
from recording_connector import (
    NUM_LAYERS,
    REMOTE,
    RecordingConnector,
    StepMeta,
    after_forward,
    forward_calls,
    no_forward_step,
    normal_step,
)

from kvservice.config import EngineConfig
from kvservice.connector.base import KVConnectorBase
from kvservice.connector.lifecycle import (
    finalize_kv_connector,
    kv_connector_no_forward,
    maybe_get_kv_connector_output,
)
from kvservice.core.outputs import (
    KVConnectorWorkerMeta,
    SchedulerOutput,
)
from kvservice.core.request import RequestStatus
from kvservice.core.sampling_params import SamplingParams
from kvservice.engine.engine import LLMEngine, RequestOutput
from kvservice.engine.engine_builder import build_engine

CONFIG = EngineConfig(block_size=8, num_blocks=32, max_model_len=128)
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPT = [10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110]  # 2 blocks of 8


def make_engine(connector: KVConnectorBase | None = None, config: EngineConfig = CONFIG) -> LLMEngine:
    return build_engine("tiny", config, connector)


def run_to_completion(engine: LLMEngine, max_steps: int = 100) -> dict[str, RequestOutput]:
    finished: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finished
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    raise AssertionError(f"not finished after {max_steps} steps")


@pytest.fixture(scope="module")
def reference_tokens() -> list[int]:
    """Greedy tokens of PROMPT from an engine with no connector at all."""
    engine = make_engine()
    engine.add_request(PROMPT, GREEDY, "ref")
    return run_to_completion(engine)["ref"].token_ids


# ---------------------------------------------------------------- call order


def test_normal_step_calls_the_connector_in_lifecycle_order() -> None:
    connector = RecordingConnector()
    engine = make_engine(connector)
    engine.add_request(PROMPT, GREEDY, "r")
    outputs = engine.step()
    assert [o.new_token_ids for o in outputs if o.request_id == "r"] != [[]]
    assert connector.take_calls() == normal_step(StepMeta(1))
    # The next (decode) step has the same shape, with the next step's metadata.
    engine.step()
    assert connector.take_calls() == normal_step(StepMeta(2))


def test_layer_hooks_wrap_each_layers_attention() -> None:
    """wait_for_layer_load(i) runs before layer i writes its KV; save_kv_layer(i) after."""
    connector = RecordingConnector()
    engine = make_engine(connector)
    engine.add_request(PROMPT, GREEDY, "r")
    engine.step()  # the cache starts all zeros: only this step's forward writes it
    assert connector.layer_had_kv_at_load == {layer: False for layer in range(NUM_LAYERS)}
    assert connector.layer_had_kv_at_save == {layer: True for layer in range(NUM_LAYERS)}


def test_no_forward_step_still_drives_the_connector_without_waiting_for_saves() -> None:
    """Only a request waiting for remote KV: no forward, no wait_for_save, transfers still polled."""
    connector = RecordingConnector()
    engine = make_engine(connector)
    engine.add_request(PROMPT, GREEDY, "r", {REMOTE: True})
    assert engine.step() == []
    assert engine.core.scheduler.requests["r"].status is RequestStatus.WAITING_FOR_REMOTE_KV
    assert connector.take_calls() == no_forward_step(StepMeta(1))
    # Still waiting: every step keeps polling the connector (the decode worker does not stall).
    engine.step()
    assert connector.take_calls() == no_forward_step(StepMeta(2))


def test_kv_connector_no_forward_directly() -> None:
    connector = RecordingConnector()
    connector.report_sending = {"done-sending"}
    connector.report_recving = {"done-recving"}
    connector.report_load_errors = {3}
    connector.report_first_tokens = {"done-recving": 7}
    scheduler_output = SchedulerOutput([], 0, finished_req_ids={"old"}, kv_connector_metadata=StepMeta(0))
    output = kv_connector_no_forward(connector, scheduler_output)
    assert connector.take_calls() == no_forward_step(StepMeta(0), {"old"})
    assert output.finished_sending == {"done-sending"}
    assert output.finished_recving == {"done-recving"}
    assert output.invalid_block_ids == {3}
    assert output.kv_connector_stats == {"num_steps": 1}
    assert output.kv_connector_worker_meta == KVConnectorWorkerMeta(first_token_ids={"done-recving": 7})


def test_deferred_step_leaves_save_and_clear_to_finalize(reference_tokens: list[int]) -> None:
    connector = RecordingConnector()
    engine = make_engine(connector)
    engine.add_request(PROMPT, GREEDY, "r")
    scheduler_output = engine.core.scheduler.schedule()
    runner_output = engine.core.runner.execute_model(scheduler_output, defer_finalize=True)
    meta = StepMeta(1)
    assert connector.take_calls() == [
        ("bind_connector_metadata", meta),
        ("start_load_kv",),
        *forward_calls(meta),
        *after_forward(),
    ]
    # The metadata stays bound for the caller's draft pass.
    assert connector.connector_metadata == meta
    engine.core.runner.finalize()
    assert connector.take_calls() == [("wait_for_save",), ("clear_connector_metadata",)]
    # The deferred step sampled what an eager one does.
    assert runner_output.sampled_token_ids == {"r": [reference_tokens[0]]}
    assert runner_output.kv_connector_output is not None
    outputs = engine.core.scheduler.update_from_output(
        scheduler_output, runner_output.sampled_token_ids, runner_output.kv_connector_output
    )
    assert [o.new_token_ids for o in outputs] == [[reference_tokens[0]]]


def test_deferred_step_without_a_connector_runs_and_finalize_is_a_no_op(reference_tokens: list[int]) -> None:
    finalize_kv_connector(None)
    engine = make_engine()
    engine.add_request(PROMPT, GREEDY, "r")
    runner_output = engine.core.runner.execute_model(engine.core.scheduler.schedule(), defer_finalize=True)
    engine.core.runner.finalize()
    assert runner_output.kv_connector_output is None
    assert runner_output.sampled_token_ids == {"r": [reference_tokens[0]]}


def test_no_connector_yields_none_and_the_engine_runs(reference_tokens: list[int]) -> None:
    scheduler_output = SchedulerOutput([], 0)
    with maybe_get_kv_connector_output(None, scheduler_output) as output:
        assert output is None
    engine = make_engine()
    engine.add_request(PROMPT, GREEDY, "r")
    scheduler_output = engine.core.scheduler.schedule()
    assert scheduler_output.kv_connector_metadata is None
    runner_output = engine.core.runner.execute_model(scheduler_output)
    assert runner_output.kv_connector_output is None
    assert runner_output.sampled_token_ids == {"r": [reference_tokens[0]]}


def test_a_pass_through_connector_does_not_change_the_output(reference_tokens: list[int]) -> None:
    connector = RecordingConnector()
    engine = make_engine(connector)
    engine.add_request(PROMPT, GREEDY, "r")
    assert run_to_completion(engine)["r"].token_ids == reference_tokens
    assert len(reference_tokens) == GREEDY.max_tokens
    assert engine.num_free_blocks == engine.num_blocks


# ---------------------------------------------------------------- what reaches the scheduler


def test_get_finished_receives_the_requests_finished_in_the_previous_step() -> None:
    connector = RecordingConnector()
    engine = make_engine(connector)
    engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), "short")
    engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), "long")

    def finished_ids_of_step() -> frozenset[str]:
        (call,) = [c for c in connector.take_calls() if c[0] == "get_finished"]
        return call[1]

    outputs = {o.request_id: o for o in engine.step()}  # both prefill; "short" finishes
    assert outputs["short"].finished and not outputs["long"].finished
    assert finished_ids_of_step() == frozenset()
    engine.step()  # "long" decodes
    assert finished_ids_of_step() == {"short"}
    outputs = {o.request_id: o for o in engine.step()}  # "long" finishes
    assert outputs["long"].finished
    assert finished_ids_of_step() == frozenset()
    assert engine.has_unfinished_requests()  # the connector must still hear of "long"
    engine.step()
    assert finished_ids_of_step() == {"long"}
    assert not engine.has_unfinished_requests()


def test_delay_free_keeps_blocks_until_finished_sending_reports_the_request() -> None:
    connector = RecordingConnector(delay_free=True)
    engine = make_engine(connector)
    engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), "r")
    (output,) = engine.step()
    assert output.finished
    assert connector.finished_requests == [("r", RequestStatus.FINISHED_LENGTH)]
    held = engine.core.scheduler.kv.get_block_ids("r")
    assert len(held) == 2 and engine.num_free_blocks == engine.num_blocks - 2
    # Steps pass and the connector reports nothing: the blocks stay allocated.
    for _ in range(3):
        engine.step()
        assert engine.num_free_blocks == engine.num_blocks - 2
        assert engine.has_unfinished_requests()
    connector.report_sending = {"r"}
    engine.step()
    assert connector.connector_outputs[-1].finished_sending == {"r"}
    assert engine.num_free_blocks == engine.num_blocks
    assert engine.core.scheduler.kv.get_block_ids("r") == []
    assert not engine.has_unfinished_requests()


def test_finished_recving_resumes_the_request_with_the_remote_first_token() -> None:
    connector = RecordingConnector()
    engine = make_engine(connector)
    engine.add_request(PROMPT, GREEDY, "r", {REMOTE: True})
    engine.step()
    assert engine.core.scheduler.requests["r"].status is RequestStatus.WAITING_FOR_REMOTE_KV
    connector.report_recving = {"r"}
    connector.report_first_tokens = {"r": 123}
    (output,) = engine.step()
    assert (output.request_id, output.new_token_ids) == ("r", [123])
    request = engine.core.scheduler.requests["r"]
    assert request.status is RequestStatus.RUNNING
    assert request.num_computed_tokens == len(PROMPT)  # the prompt is not recomputed
    # The next step decodes from the remote token: one token through the model.
    connector.take_calls()
    engine.step()
    assert ("save_kv_layer", 0, StepMeta(3)) in connector.take_calls()
    assert run_to_completion(engine)["r"].token_ids[0] == 123


def test_load_errors_reported_by_the_lifecycle_make_the_scheduler_recompute(reference_tokens: list[int]) -> None:
    connector = RecordingConnector()
    engine = make_engine(connector)
    engine.add_request(PROMPT, GREEDY, "r", {REMOTE: True})
    engine.step()
    connector.report_recving = {"r"}
    connector.report_load_errors = set(engine.core.scheduler.kv.get_block_ids("r"))
    assert engine.step() == []  # the load failed: no remote first token
    # Default policy recompute: the prompt runs on this engine and the output is still right.
    assert run_to_completion(engine)["r"].token_ids == reference_tokens
    assert engine.num_free_blocks == engine.num_blocks


def test_load_errors_with_policy_fail_end_the_request_with_an_error() -> None:
    connector = RecordingConnector()
    engine = make_engine(
        connector, EngineConfig(block_size=8, num_blocks=32, max_model_len=128, kv_load_failure_policy="fail")
    )
    engine.add_request(PROMPT, GREEDY, "r", {REMOTE: True})
    engine.step()
    connector.report_recving = {"r"}
    connector.report_load_errors = set(engine.core.scheduler.kv.get_block_ids("r"))
    (output,) = engine.step()
    assert output.finish_reason == "error" and output.token_ids == []
    assert output.error is not None and "kv_load_failure_policy=fail" in output.error
    run_to_completion(engine)
    assert engine.num_free_blocks == engine.num_blocks


def test_stats_reach_the_scheduler_every_step() -> None:
    connector = RecordingConnector()
    engine = make_engine(connector)
    engine.add_request(PROMPT, GREEDY, "r")
    engine.step()
    engine.step()
    assert [o.kv_connector_stats for o in connector.connector_outputs] == [{"num_steps": 1}, {"num_steps": 2}]
