"""The scheduler driven by hand: `schedule()`, then `update_from_output()` with made-up tokens."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvservice.core.kv_cache_manager import KVCacheManager, cdiv
from kvservice.core.outputs import EngineCoreOutput, SchedulerOutput
from kvservice.core.request import Request, RequestStatus
from kvservice.core.sampling_params import SamplingParams
from kvservice.engine.scheduler import Scheduler

EOS = 2


def make_request(request_id: str, num_prompt_tokens: int, max_tokens: int = 4, **params: object) -> Request:
    """A request whose prompt shares no prefix with other ids' (prefix caching has its own tests)."""
    offset = sum(map(ord, request_id))
    prompt = [10 + ((i + offset) % 50) for i in range(num_prompt_tokens)]
    return Request(
        request_id,
        prompt,
        SamplingParams(temperature=0, max_tokens=max_tokens, **params),  # type: ignore[arg-type]
        eos_token_ids=frozenset({EOS}),
    )


def make_scheduler(
    num_blocks: int, block_size: int, max_num_seqs: int = 8, budget: int = 64, prefill_cap: int | None = None
) -> Scheduler:
    return Scheduler(
        KVCacheManager(num_blocks, block_size), max_num_seqs, budget, max_prefill_tokens_with_decode=prefill_cap
    )


def fake_token(request: Request) -> int:
    """A 'model' whose next token depends only on the request and its position: recompute-proof."""
    return 100 + (hash(request.request_id) + request.num_tokens) % 100


def step(
    sched: Scheduler, token_for: Callable[[Request], int] = fake_token
) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    out = sched.schedule()
    sampled = {s.request.request_id: [token_for(s.request)] for s in out.scheduled if s.is_sampling}
    return out, sched.update_from_output(out, sampled)


def scheduled_tokens(out: SchedulerOutput) -> dict[str, int]:
    return {s.request.request_id: s.num_new_tokens for s in out.scheduled}


def run_to_completion(sched: Scheduler, max_steps: int = 1000) -> dict[str, str]:
    finish_reasons: dict[str, str] = {}
    for _ in range(max_steps):
        if not sched.num_unfinished:
            return finish_reasons
        _, outputs = step(sched)
        finish_reasons.update({o.request_id: o.finish_reason for o in outputs if o.finish_reason})
    raise AssertionError(f"not finished after {max_steps} steps")


# ------------------------------------------------------------ batching limits


def test_token_budget_is_shared_decode_first() -> None:
    sched = make_scheduler(num_blocks=32, block_size=4, budget=16)
    for name in "abc":
        sched.add_request(make_request(name, 10))
    out, _ = step(sched)
    assert scheduled_tokens(out) == {"a": 10, "b": 6}
    assert out.num_scheduled_tokens == 16
    out, _ = step(sched)
    # a decodes one token, b finishes its prompt, c takes what is left.
    assert scheduled_tokens(out) == {"a": 1, "b": 4, "c": 10}
    out, _ = step(sched)
    assert scheduled_tokens(out) == {"a": 1, "b": 1, "c": 1}


def test_max_num_seqs_caps_the_running_set() -> None:
    sched = make_scheduler(num_blocks=32, block_size=4, max_num_seqs=2)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", 3, max_tokens=2))
    out, _ = step(sched)
    assert set(scheduled_tokens(out)) == {"r0", "r1"}
    assert len(sched.running) == 2 and len(sched.waiting) == 3
    out, outputs = step(sched)
    assert set(scheduled_tokens(out)) == {"r0", "r1"}
    assert {o.request_id for o in outputs if o.finish_reason} == {"r0", "r1"}
    out, _ = step(sched)
    assert set(scheduled_tokens(out)) == {"r2", "r3"}
    assert len(sched.running) == 2
    reasons = run_to_completion(sched)
    assert reasons == {"r2": "length", "r3": "length", "r4": "length"}


def test_long_prompt_is_prefilled_in_chunks() -> None:
    sched = make_scheduler(num_blocks=16, block_size=4, budget=16)
    request = make_request("long", 40, max_tokens=2)
    sched.add_request(request)
    for chunk, computed_after, num_blocks in [(16, 16, 4), (16, 32, 8)]:
        out, outputs = step(sched)
        assert scheduled_tokens(out) == {"long": chunk}
        assert not out.scheduled[0].is_sampling
        assert outputs == []  # no token before the whole prompt has run
        assert request.num_computed_tokens == computed_after
        assert len(sched.kv.get_block_ids("long")) == num_blocks
    out, outputs = step(sched)
    assert scheduled_tokens(out) == {"long": 8}
    assert [o.new_token_ids for o in outputs] == [[request.output_token_ids[0]]]
    assert len(sched.kv.get_block_ids("long")) == 10


def test_prompts_are_capped_while_requests_decode() -> None:
    """The cap bounds every step's prompt tokens while a request decodes, and only then."""
    sched = make_scheduler(num_blocks=64, block_size=4, budget=64, prefill_cap=8)
    sched.add_request(make_request("a", 30, max_tokens=20))
    out, _ = step(sched)
    assert scheduled_tokens(out) == {"a": 30}  # nothing decodes yet: the whole budget
    sched.add_request(make_request("b", 20, max_tokens=4))
    sched.add_request(make_request("c", 5, max_tokens=4))
    chunks = []
    for _ in range(3):
        out, _ = step(sched)
        tokens = scheduled_tokens(out)
        assert tokens["a"] == 1  # a decodes every step
        chunks.append({k: v for k, v in tokens.items() if k != "a"})
    assert chunks == [{"b": 8}, {"b": 8}, {"b": 4, "c": 4}]  # 8 prompt tokens a step, b's chunks first


def test_decodes_go_before_a_running_prompts_chunks() -> None:
    """A long prompt admitted earlier does not take the budget from requests behind it that decode."""
    sched = make_scheduler(num_blocks=64, block_size=4, budget=12)
    sched.add_request(make_request("a", 4, max_tokens=20))
    step(sched)
    sched.add_request(make_request("long", 60, max_tokens=2))
    sched.add_request(make_request("b", 3, max_tokens=20))
    out, _ = step(sched)
    assert scheduled_tokens(out) == {"a": 1, "long": 11}
    sched.running.reverse()  # long now runs before a: decode order must not depend on it
    out, _ = step(sched)
    assert scheduled_tokens(out) == {"a": 1, "long": 11}


# ------------------------------------------------------------ preemption


def test_preemption_frees_the_newest_request_and_requeues_it_first() -> None:
    # 4 blocks of 4 tokens; a and b each take 2 blocks for a 7-token prompt.
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=2)
    a, b, c = make_request("a", 7, max_tokens=8), make_request("b", 7, max_tokens=8), make_request("c", 3)
    for r in (a, b, c):
        sched.add_request(r)
    step(sched)
    step(sched)  # tokens 8 of a and b still fit their second block
    assert sched.kv.num_free_blocks == 0
    b_outputs = list(b.output_token_ids)

    out, _ = step(sched)  # a's 9th token needs a third block: b goes
    assert out.preempted_req_ids == {"b"}
    assert scheduled_tokens(out) == {"a": 1}
    assert b.status is RequestStatus.PREEMPTED and b.num_preemptions == 1
    assert b.num_computed_tokens == 0
    assert sched.kv.get_block_ids("b") == []
    assert sched.running == [a]
    assert list(sched.waiting) == [b, c]
    assert b.output_token_ids == b_outputs  # kept, and recomputed as part of the prefill

    reasons = run_to_completion(sched)
    assert reasons == {"a": "length", "b": "length", "c": "length"}
    expected_b = [100 + (hash("b") + n) % 100 for n in range(7, 15)]
    assert b.output_token_ids == expected_b
    assert sched.kv.num_free_blocks == 4


def test_no_new_request_is_admitted_in_a_step_that_preempted() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=4)
    a, b = make_request("a", 7, max_tokens=8), make_request("b", 7, max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    step(sched)
    out, _ = step(sched)
    assert out.preempted_req_ids == {"b"}
    assert "b" not in scheduled_tokens(out)
    assert sched.kv.num_free_blocks == 1


# ------------------------------------------------------------ abort


def test_abort_waiting_request() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=1)
    sched.add_request(make_request("a", 3))
    sched.add_request(make_request("b", 3))
    step(sched)
    assert sched.abort_request("b")
    assert list(sched.waiting) == []
    out, outputs = step(sched)
    assert "b" not in scheduled_tokens(out)
    assert EngineCoreOutput("b", [], "abort") in outputs
    assert "b" in out.finished_req_ids
    assert sched.num_aborted == 1


def test_abort_running_request_frees_its_blocks() -> None:
    sched = make_scheduler(num_blocks=8, block_size=4)
    request = make_request("a", 10, max_tokens=8)
    sched.add_request(request)
    step(sched)
    assert sched.kv.num_free_blocks == 5
    assert sched.abort_request("a")
    assert request.status is RequestStatus.FINISHED_ABORTED
    assert sched.kv.num_free_blocks == 8
    assert sched.running == [] and sched.num_unfinished == 0
    assert not sched.abort_request("a")  # already gone


def test_abort_mid_prefill_frees_the_chunks_blocks() -> None:
    sched = make_scheduler(num_blocks=8, block_size=4, budget=8)
    sched.add_request(make_request("a", 20))
    step(sched)
    assert sched.kv.num_free_blocks == 6
    assert sched.abort_request("a")
    assert sched.kv.num_free_blocks == 8


def test_abort_preempted_request() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=2)
    sched.add_request(make_request("a", 7, max_tokens=8))
    b = make_request("b", 7, max_tokens=8)
    sched.add_request(b)
    for _ in range(3):
        step(sched)
    assert b.status is RequestStatus.PREEMPTED
    assert sched.abort_request("b")
    assert list(sched.waiting) == []
    reasons = run_to_completion(sched)
    assert reasons == {"a": "length", "b": "abort"}
    assert sched.kv.num_free_blocks == 4


def test_abort_between_schedule_and_update_emits_no_token() -> None:
    sched = make_scheduler(num_blocks=8, block_size=4)
    sched.add_request(make_request("a", 5))
    out = sched.schedule()
    assert sched.abort_request("a")
    outputs = sched.update_from_output(out, {"a": [123]})
    assert outputs == [EngineCoreOutput("a", [], "abort")]
    assert sched.kv.num_free_blocks == 8


def test_abort_unknown_request_is_false() -> None:
    assert not make_scheduler(num_blocks=2, block_size=4).abort_request("nope")


def test_finish_request_stops_a_running_request_without_an_abort() -> None:
    # The engine matched a stop string: the request ends as "stop", its blocks free now,
    # and the scheduler emits nothing more for it (the engine reported the end itself).
    sched = make_scheduler(num_blocks=8, block_size=4)
    request = make_request("a", 10, max_tokens=8)
    sched.add_request(request)
    step(sched)
    assert sched.finish_request("a", RequestStatus.FINISHED_STOPPED)
    assert request.status is RequestStatus.FINISHED_STOPPED
    assert sched.kv.num_free_blocks == 8 and sched.num_unfinished == 0
    assert sched.num_finished == 1 and sched.num_aborted == 0
    assert step(sched)[1] == []
    assert not sched.finish_request("a", RequestStatus.FINISHED_STOPPED)
    assert not sched.abort_request("a")


# ------------------------------------------------------------ finishing


def run_one(request: Request, tokens: list[int]) -> tuple[str, list[int]]:
    sched = make_scheduler(num_blocks=16, block_size=4)
    sched.add_request(request)
    feed = iter(tokens)
    reason = None
    while reason is None:
        _, outputs = step(sched, lambda _r: next(feed))
        reason = next((o.finish_reason for o in outputs if o.finish_reason), None)
    assert sched.kv.num_free_blocks == 16
    return reason, request.output_token_ids


def test_eos_stops() -> None:
    assert run_one(make_request("a", 3, max_tokens=8), [5, 6, EOS, 7]) == ("stop", [5, 6, EOS])


def test_ignore_eos_runs_to_max_tokens() -> None:
    request = make_request("a", 3, max_tokens=4, ignore_eos=True)
    assert run_one(request, [EOS, EOS, 5, EOS, 6]) == ("length", [EOS, EOS, 5, EOS])


def test_stop_token_ids_stop_even_with_ignore_eos() -> None:
    request = make_request("a", 3, max_tokens=8, stop_token_ids=[42], ignore_eos=True)
    assert run_one(request, [5, EOS, 42, 6]) == ("stop", [5, EOS, 42])


def test_max_tokens_is_exact() -> None:
    assert run_one(make_request("a", 3, max_tokens=3), [5, 6, 7, 8]) == ("length", [5, 6, 7])


def test_max_model_len_stops() -> None:
    request = Request("a", [5] * 6, SamplingParams(temperature=0, max_tokens=50), max_model_len=9)
    assert run_one(request, [7] * 10) == ("length", [7, 7, 7])


def test_finished_request_is_reported_to_the_next_step() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4)
    sched.add_request(make_request("a", 3, max_tokens=1))
    _, outputs = step(sched)
    assert outputs[0].finish_reason == "length"
    assert sched.num_finished == 1
    out = sched.schedule()
    assert out.finished_req_ids == {"a"}
    assert sched.schedule().finished_req_ids == set()


# ------------------------------------------------------------ admission


def test_request_larger_than_the_cache_is_refused() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        sched.add_request(make_request("big", 12, max_tokens=5))  # 17 tokens > 16 slots
    assert sched.num_unfinished == 0
    sched.add_request(make_request("fits", 12, max_tokens=4))
    assert sched.num_unfinished == 1


def test_duplicate_request_id_is_refused() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4)
    sched.add_request(make_request("a", 3))
    with pytest.raises(ValueError, match="request_id"):
        sched.add_request(make_request("a", 3))


# ------------------------------------------------------------ any workload


@settings(max_examples=60, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4, 16]),
    num_blocks_extra=st.integers(0, 12),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(1, 48),
    prefill_cap=st.one_of(st.none(), st.integers(1, 24)),
    requests=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12)), min_size=1, max_size=10),
)
def test_any_workload_finishes_within_limits_with_recompute_proof_output(
    block_size: int,
    num_blocks_extra: int,
    max_num_seqs: int,
    budget: int,
    prefill_cap: int | None,
    requests: list[tuple[int, int]],
) -> None:
    largest = max(cdiv(p + m, block_size) for p, m in requests)
    num_blocks = largest + num_blocks_extra
    sched = make_scheduler(num_blocks, block_size, max_num_seqs, budget, prefill_cap)
    reqs = [make_request(f"r{i}", p, max_tokens=m, ignore_eos=True) for i, (p, m) in enumerate(requests)]
    for r in reqs:
        sched.add_request(r)

    for _ in range(5000):
        if not sched.num_unfinished:
            break
        decoding_before = any(r.num_tokens - r.num_computed_tokens <= 1 for r in sched.running)
        out, _ = step(sched)
        assert out.num_scheduled_tokens <= budget
        if decoding_before and prefill_cap is not None:  # chunks of more than one token are prompt chunks
            assert sum(s.num_new_tokens for s in out.scheduled if s.num_new_tokens > 1) <= prefill_cap
        assert len(out.scheduled) <= max_num_seqs and len(sched.running) <= max_num_seqs
        tables = {r.request_id: sched.kv.get_block_ids(r.request_id) for r in sched.running}
        owned = [b for t in tables.values() for b in t]
        assert len(owned) == len(set(owned)), "two running requests share a block"
        assert sched.kv.num_free_blocks + len(owned) == num_blocks
        for r in sched.running:
            assert len(tables[r.request_id]) >= cdiv(r.num_computed_tokens, block_size)
    else:
        raise AssertionError("workload did not finish")

    assert sched.kv.num_free_blocks == num_blocks
    for r, (p, m) in zip(reqs, requests):
        assert r.status is RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == [100 + (hash(r.request_id) + n) % 100 for n in range(p, p + m)]
