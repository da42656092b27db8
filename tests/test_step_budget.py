"""The prompt tokens a step may add while requests decode, sized by measured step time."""

from __future__ import annotations

import random

import pytest
from test_scheduler import make_request, scheduled_tokens, step

from kvservice import LLM, SamplingParams
from kvservice.core.kv_cache_manager import KVCacheManager
from kvservice.engine.scheduler import Scheduler
from kvservice.engine.step_budget import FixedStepBudget, StepTimeBudget


def _feed(budget: StepTimeBudget, base: float, per_row: float, per_token: float, steps: int, seed: int = 0) -> None:
    """Steps of a machine whose step time is base + per_row x rows + per_token x tokens (+-2% noise)."""
    rng = random.Random(seed)
    for i in range(steps):
        rows = rng.randrange(1, 17)
        tokens = 0 if i % 2 else rng.randrange(16, 129)
        budget.observe(rows, tokens, (base + per_row * rows + per_token * tokens) * rng.uniform(0.98, 1.02))


def test_the_fixed_cap_serves_until_steps_with_prompts_were_measured() -> None:
    budget = StepTimeBudget(target_s=0.12, fixed_cap=64, max_tokens=2048)
    assert budget.prompt_tokens(8) == 64
    for _ in range(20):
        budget.observe(8, 0, 0.03)  # decoding only: what a prompt token costs is still unknown
    assert budget.coefficients is None and budget.prompt_tokens(8) == 64


def test_the_fit_recovers_the_machines_costs_and_fills_the_target() -> None:
    budget = StepTimeBudget(target_s=0.12, fixed_cap=64, max_tokens=2048)
    _feed(budget, base=0.02, per_row=0.002, per_token=0.001, steps=60)
    fit = budget.coefficients
    assert fit is not None
    assert fit == pytest.approx((0.02, 0.002, 0.001), rel=0.15)
    # (120 - 20 - 2 x 10) ms / 1 ms a token, within the fit's error.
    assert 70 <= budget.prompt_tokens(10) <= 90
    assert budget.prompt_tokens(2) > budget.prompt_tokens(16)  # fewer decoding: more prompt tokens


def test_the_budget_follows_a_machine_that_slows_down() -> None:
    budget = StepTimeBudget(target_s=0.12, fixed_cap=64, max_tokens=2048)
    _feed(budget, base=0.02, per_row=0.002, per_token=0.001, steps=60)
    before = budget.prompt_tokens(10)
    _feed(budget, base=0.02, per_row=0.002, per_token=0.002, steps=150, seed=1)  # prompt tokens now cost twice as much
    assert 35 <= budget.prompt_tokens(10) <= 45 < before


def test_the_budget_stays_within_its_floor_and_ceiling() -> None:
    budget = StepTimeBudget(target_s=0.12, fixed_cap=64, max_tokens=512, min_tokens=16)
    _feed(budget, base=0.02, per_row=0.002, per_token=0.001, steps=60)
    assert budget.prompt_tokens(200) == 16  # decoding alone overshoots the target: prompts still progress
    fast = StepTimeBudget(target_s=0.12, fixed_cap=64, max_tokens=512)
    _feed(fast, base=0.0001, per_row=0.00001, per_token=0.00001, steps=60)
    assert fast.prompt_tokens(4) == 512


def test_identical_steps_leave_the_fixed_cap_in_charge() -> None:
    budget = StepTimeBudget(target_s=0.12, fixed_cap=64, max_tokens=2048)
    for _ in range(30):
        budget.observe(4, 32, 0.05)  # rows and tokens never vary: their costs cannot be told apart
    assert budget.prompt_tokens(4) in (64, *range(16, 2049))  # a finite answer, never an error
    fit = budget.coefficients
    assert fit is None or all(abs(c) < 1e6 for c in fit)


def test_the_scheduler_chunks_prompts_by_the_budget_while_requests_decode() -> None:
    budget = StepTimeBudget(target_s=0.12, fixed_cap=64, max_tokens=2048)
    _feed(budget, base=0.02, per_row=0.002, per_token=0.001, steps=60)
    expected = budget.prompt_tokens(1)
    scheduler = Scheduler(KVCacheManager(256, 16), max_num_seqs=8, max_num_batched_tokens=2048, step_budget=budget)
    scheduler.add_request(make_request("decoding", 10, max_tokens=50))
    step(scheduler)  # its prompt done: it decodes from now on
    scheduler.add_request(make_request("prompt", 1000))
    out, _ = step(scheduler)
    assert scheduled_tokens(out) == {"decoding": 1, "prompt": expected}
    assert out.num_prompt_tokens == expected and out.num_scheduled_tokens == expected + 1
    assert FixedStepBudget(48).prompt_tokens(3) == 48


def test_the_engine_reports_every_step_it_timed() -> None:
    llm = LLM("tiny", step_target_ms=50.0)
    budget = llm.engine.core.scheduler.step_budget
    assert isinstance(budget, StepTimeBudget)
    llm.generate([list(range(3, 40)), list(range(5, 9))], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert budget._num_steps >= 6 and budget._num_prompt_steps >= 1
    assert isinstance(LLM("tiny", step_target_ms=None).engine.core.scheduler.step_budget, FixedStepBudget)
    with pytest.raises(ValueError, match="step_target_ms"):
        LLM("tiny", step_target_ms=-1.0)
