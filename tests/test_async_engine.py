"""The asyncio engine when its step fails: nothing hangs, every waiter gets EngineDeadError."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from kvservice.async_engine import AsyncLLMEngine, EngineDeadError
from kvservice.config import EngineConfig
from kvservice.engine import LLMEngine
from kvservice.sampling_params import SamplingParams

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

CONFIG = EngineConfig(block_size=8, num_blocks=32, max_model_len=128)
# Every wait below is bounded: a hang is the failure this module looks for.
DEADLINE_S = 10.0


class _FailingStep:
    """Wraps `engine.step`: the first step after `arm()` blocks until `release()`, then raises."""

    def __init__(self, engine: LLMEngine) -> None:
        self._step = engine.step
        self.is_armed = False
        self.entered = threading.Event()
        self.released = threading.Event()
        engine.step = self  # type: ignore[method-assign]

    def __call__(self) -> list:
        if not self.is_armed:
            return self._step()
        self.entered.set()
        self.released.wait(DEADLINE_S)
        raise RuntimeError("injected step failure")


@pytest_asyncio.fixture
async def engine() -> AsyncIterator[AsyncLLMEngine]:
    async_engine = AsyncLLMEngine(LLMEngine("tiny", CONFIG))
    async_engine.start()
    try:
        yield async_engine
    finally:
        await async_engine.stop()


async def _collect(engine: AsyncLLMEngine, prompt: list[int], max_tokens: int) -> list[int]:
    token_ids: list[int] = []
    async for out in engine.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)):
        token_ids = out.token_ids
    return token_ids


async def test_a_failed_step_fails_running_queued_and_later_calls(engine: AsyncLLMEngine) -> None:
    step = _FailingStep(engine.engine)
    assert len(await _collect(engine, [1, 2, 3], 2)) == 2  # healthy before the fault

    step.is_armed = True
    running = asyncio.create_task(_collect(engine, [1, 2, 3], 50))
    await asyncio.wait_for(asyncio.to_thread(step.entered.wait, DEADLINE_S), DEADLINE_S)
    # Queued while the failing step runs: applied never, resolved all the same.
    queued = asyncio.create_task(_collect(engine, [4, 5, 6], 4))
    stats = asyncio.create_task(engine.call(lambda e: e.num_free_blocks))
    await asyncio.sleep(0)  # let both reach the command queue before the step fails
    step.released.set()

    error = await asyncio.wait_for(engine.wait_failed(), DEADLINE_S)
    assert "injected step failure" in repr(error)
    for task in (running, queued, stats):
        with pytest.raises(EngineDeadError, match="injected step failure"):
            await asyncio.wait_for(task, DEADLINE_S)
    # After the death: at once, never a hang.
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(engine.call(lambda e: e.num_free_blocks), DEADLINE_S)
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(_collect(engine, [7], 2), DEADLINE_S)
    assert not engine.is_alive


async def test_a_clean_stop_fails_later_calls(engine: AsyncLLMEngine) -> None:
    await engine.stop()
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(engine.call(lambda e: e.num_free_blocks), DEADLINE_S)
