"""The prompt lane: a colocated engine computes prompts in batches, in slices between its decode
steps, and samples the same tokens as one that chunks them into its steps."""

from __future__ import annotations

import argparse

import pytest

from kvservice.config import EngineConfig
from kvservice.core.request import RequestStatus
from kvservice.core.sampling_params import SamplingParams
from kvservice.engine.engine import LLMEngine, RequestOutput
from kvservice.engine.engine_builder import build_engine
from kvservice.worker.prompt_lane import PromptLane
from server import worker_server
from server.stats import engine_stats
from tests.recording_connector import REMOTE, RecordingConnector

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [list(range(1, 40)), list(range(50, 53)), list(range(7, 100)), [5, 6]]


def _engine(prompt_lane: bool, **config: object) -> LLMEngine:
    return build_engine("tiny", EngineConfig(num_blocks=64, prompt_lane=prompt_lane, **config))  # type: ignore[arg-type]


def _run(engine: LLMEngine) -> dict[str, RequestOutput]:
    finished: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        finished.update((out.request_id, out) for out in engine.step() if out.finished)
    return finished


def _lane(engine: LLMEngine) -> PromptLane:
    assert engine.core.prompt_lane is not None
    return engine.core.prompt_lane


def test_the_lane_samples_what_chunked_prompts_sample_and_frees_every_block() -> None:
    results = []
    for prompt_lane in (False, True):
        # A chunk of 8 prompt tokens a step: without the lane, the prompts run in many mixed steps.
        engine = _engine(prompt_lane, max_prefill_tokens_with_decode=8, step_target_ms=None)
        engine.add_request(PROMPTS[0], GREEDY, "first")
        engine.step()  # "first" decodes while the others' prompts run
        for i, prompt in enumerate(PROMPTS[1:]):
            engine.add_request(prompt, GREEDY, f"r{i}")
        results.append({rid: out.token_ids for rid, out in _run(engine).items()})
        assert engine.num_free_blocks == engine.num_blocks
    chunked, laned = results
    assert laned == chunked and all(len(tokens) == 10 for tokens in laned.values())


def test_the_lane_computes_a_prompt_past_its_cached_prefix() -> None:
    engine = _engine(True)
    engine.add_request(PROMPTS[2], GREEDY, "a")
    first = _run(engine)["a"]
    engine.add_request(PROMPTS[2][:80] + [1, 2, 3], GREEDY, "b")  # shares 5 full blocks with "a"
    [(rid, second)] = _run(engine).items()
    assert second.num_cached_tokens == 80
    reference = _engine(False, enable_prefix_caching=False)
    reference.add_request(PROMPTS[2][:80] + [1, 2, 3], GREEDY, "b")
    assert second.token_ids == _run(reference)["b"].token_ids
    assert first.num_cached_tokens == 0 and _lane(engine).num_batches == 2


def test_a_colocated_workers_stats_count_lane_prompts_as_waiting_not_as_pulling_kv() -> None:
    engine = _engine(True, step_target_ms=0.001)  # every slice runs one op: the prompt stays in the lane
    engine.add_request(PROMPTS[2], GREEDY, "prompt")
    engine.step()
    assert engine.core.scheduler.requests["prompt"].status is RequestStatus.WAITING_FOR_PROMPT_LANE
    stats = engine_stats(engine, "both")
    assert (stats.num_waiting_requests, stats.num_waiting_for_remote_kv, stats.num_running_requests) == (1, 0, 0)
    _run(engine)
    stats = engine_stats(engine, "both")
    assert (stats.num_waiting_requests, stats.num_waiting_for_remote_kv, stats.num_finished_requests) == (0, 0, 1)


def test_decode_steps_run_between_the_slices_of_a_prompt_batch() -> None:
    engine = _engine(True, step_target_ms=0.001)  # every slice runs one op
    engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True), "decoding")
    engine.step()
    engine.step()
    assert engine.core.scheduler.requests["decoding"].status is RequestStatus.RUNNING
    engine.add_request(PROMPTS[2], GREEDY, "prompt")
    lane = _lane(engine)
    tokens_while_in_lane = 0
    while engine.core.scheduler.requests["prompt"].status is not RequestStatus.RUNNING:
        outputs = engine.step()
        tokens_while_in_lane += sum(len(o.new_token_ids) for o in outputs if o.request_id == "decoding")
    # The tiny model's 2 layers: 4 pause points each, a slice per op, a decode step after each slice.
    assert lane.num_batches == 2 and lane.num_slices >= 2 + 2 * 4
    assert tokens_while_in_lane >= 2 * 4


def test_aborting_a_request_in_the_lane_frees_its_blocks_once_the_forward_is_done() -> None:
    engine = _engine(True, step_target_ms=0.001, max_num_batched_tokens=64)
    engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), "decoding")
    engine.step()
    engine.step()
    engine.add_request(PROMPTS[2][:60], GREEDY, "in_flight")
    engine.add_request(PROMPTS[2][10:60], GREEDY, "queued")  # past the lane's 64 tokens: the next batch
    engine.step()  # both admitted to the lane
    engine.step()  # the first slice of "in_flight"'s batch
    lane = _lane(engine)
    assert [p.request_id for p in lane._batch] == ["in_flight"] and [p.request_id for p in lane._queue] == ["queued"]
    free_before = engine.num_free_blocks
    num_queued_blocks = len(engine.core.scheduler.kv.get_block_ids("queued"))
    assert engine.abort_request("queued") and engine.abort_request("in_flight")
    outputs = engine.step()
    assert {o.request_id for o in outputs if o.finish_reason == "abort"} == {"queued", "in_flight"}
    assert num_queued_blocks == 4 and engine.num_free_blocks == free_before + 4  # the queued one's; the other's wait
    assert "in_flight" in engine.core.scheduler.pending_free
    while lane.has_work:
        engine.step()
    engine.step()
    assert not engine.core.scheduler.pending_free
    _run(engine)
    assert engine.num_free_blocks == engine.num_blocks


def test_requests_that_need_every_prompt_position_skip_the_lane() -> None:
    engine = _engine(True)
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=0, ignore_eos=True)
    engine.add_request(PROMPTS[0], params, "p")
    [out] = _run(engine).values()
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(PROMPTS[0]) - 1
    assert _lane(engine).num_batches == 0
    engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=3, n=2, ignore_eos=True), "n")
    assert len(_run(engine)) == 1
    assert _lane(engine).num_batches == 1  # the leader; its sibling shares the leader's prompt blocks


def test_the_lane_keeps_to_max_num_seqs() -> None:
    engine = _engine(True, max_num_seqs=2)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, GREEDY, f"r{i}")
    while engine.has_unfinished_requests():
        engine.step()
        scheduler = engine.core.scheduler
        assert len(scheduler.running) + len(scheduler.in_prompt_lane) + len(scheduler.waiting_for_remote_kv) <= 2
    assert engine.num_free_blocks == engine.num_blocks


def test_a_colocated_engine_keeps_its_lane_beside_a_kv_connector() -> None:
    """The lane is the scheduler's own path: a connector (a KV source) may sit beside it, and the
    requests it does not load still run their prompts in the lane."""
    connector = RecordingConnector()
    engine = build_engine("tiny", EngineConfig(num_blocks=64, prompt_lane=True), connector)
    engine.add_request(PROMPTS[0], GREEDY, "loaded", {REMOTE: True})
    engine.add_request(PROMPTS[2], GREEDY, "r")
    engine.step()
    scheduler = engine.core.scheduler
    assert scheduler.requests["loaded"].status is RequestStatus.WAITING_FOR_REMOTE_KV
    assert scheduler.requests["r"].status in (RequestStatus.WAITING_FOR_PROMPT_LANE, RequestStatus.RUNNING)
    assert ("start_load_kv",) in connector.calls
    assert engine.abort_request("loaded")
    outputs = _run(engine)
    assert _lane(engine).num_batches == 1
    reference = _engine(False)
    reference.add_request(PROMPTS[2], GREEDY, "r")
    assert outputs["r"].token_ids == _run(reference)["r"].token_ids
    assert engine.num_free_blocks == engine.num_blocks


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--role", "both"], True),
        (["--role", "both", "--no-prompt-lane"], False),
        (["--role", "prefill"], False),
        (["--role", "decode"], False),
    ],
)
def test_a_colocated_server_computes_prompts_in_its_lane_unless_told_not_to(argv: list[str], expected: bool) -> None:
    parser = argparse.ArgumentParser()
    worker_server.add_arguments(parser)
    args = parser.parse_args([*argv, "--model", "tiny"])
    assert worker_server.engine_config(args).prompt_lane is expected
