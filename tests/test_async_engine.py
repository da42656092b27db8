"""The asyncio engine: when its step fails nothing hangs (every waiter gets EngineDeadError),
and when nothing can run it sleeps instead of spinning."""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import threading
from collections.abc import AsyncIterator, Callable

import grpc
import pytest
import pytest_asyncio
import torch

from kvservice.config import EngineConfig
from kvservice.connector.decode_connector import REMOTE_ADDRESS, TRANSFER_TOKEN, DecodeKVConnector
from kvservice.core.sampling_params import SamplingParams
from kvservice.engine.async_engine import AsyncLLMEngine, EngineDeadError
from kvservice.engine.engine import LLMEngine
from kvservice.engine.engine_builder import build_engine
from kvservice.loading.model_files import load_model_config
from kvservice.model.kv_cache import KVCacheLayout

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
    async_engine = AsyncLLMEngine(build_engine("tiny", CONFIG))
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


async def test_the_step_thread_has_its_name_in_the_os(engine: AsyncLLMEngine) -> None:
    """So `top -H`, `perf` and scripts/sched_trace.py tell it from the event loop's thread."""
    assert await _collect(engine, [1, 2, 3], 2)  # the step thread has run
    names = [(task / "comm").read_text().strip() for task in pathlib.Path("/proc/self/task").iterdir()]
    assert "engine-step" in names


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


async def test_run_hands_each_output_to_its_callback_as_generate_yields_them(engine: AsyncLLMEngine) -> None:
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    expected = [out.new_token_ids async for out in engine.generate([1, 2, 3], params)]
    seen: list[list[int]] = []
    finished: list[bool] = []
    await asyncio.wait_for(
        engine.run([1, 2, 3], params, lambda out: (seen.append(out.new_token_ids), finished.append(out.all_finished))),
        DEADLINE_S,
    )
    assert seen == expected and sum(map(len, seen)) == 5
    assert finished == [False] * (len(seen) - 1) + [True]
    with pytest.raises(ValueError):  # refused input raises, as generate's first step does
        await asyncio.wait_for(engine.run([], params, seen.append), DEADLINE_S)


async def test_run_aborts_its_request_when_the_callback_raises_or_the_call_is_cancelled(engine: AsyncLLMEngine) -> None:
    free = await engine.call(lambda e: e.num_free_blocks)
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)

    def fail(out: object) -> None:
        raise RuntimeError("the consumer went away")

    with pytest.raises(RuntimeError, match="consumer went away"):
        await asyncio.wait_for(engine.run([1, 2, 3], long, fail), DEADLINE_S)
    first = asyncio.get_running_loop().create_future()
    call = asyncio.create_task(engine.run([4, 5, 6], long, lambda out: first.done() or first.set_result(None)))
    await asyncio.wait_for(first, DEADLINE_S)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    # Both aborts reached the step thread: every block is back and nothing runs.
    stats = await engine.call(lambda e: e.core.scheduler.make_stats())
    assert (stats.num_blocks_free, stats.num_running_requests, stats.num_waiting_requests) == (free, 0, 0)
    assert stats.num_aborted_requests == 2


async def test_a_clean_stop_fails_later_calls(engine: AsyncLLMEngine) -> None:
    await engine.stop()
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(engine.call(lambda e: e.num_free_blocks), DEADLINE_S)


# ---------------------------------------------------------------- no busy-spinning


class _StepCounter:
    def __init__(self, engine: LLMEngine) -> None:
        self._step = engine.step
        self.num_steps = 0
        engine.step = self  # type: ignore[method-assign]

    def __call__(self) -> list:
        self.num_steps += 1
        return self._step()


async def _silent_prefill() -> tuple[grpc.aio.Server, str]:
    """A prefill worker whose PullKV never sends anything (until the pull is cancelled)."""

    async def pull(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        await asyncio.Event().wait()
        yield b""

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "kvservice.v1.KVTransfer", {"PullKV": grpc.unary_stream_rpc_method_handler(pull)}
            )
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def test_requests_waiting_for_blocks_held_by_a_pull_do_not_spin() -> None:
    server, address = await _silent_prefill()
    config = EngineConfig(block_size=8, num_blocks=8, max_model_len=128)
    llm = build_engine(
        "tiny", config, DecodeKVConnector(KVCacheLayout.for_model(load_model_config("tiny"), 8, torch.float32))
    )
    engine = AsyncLLMEngine(llm)
    assert isinstance(llm.connector, DecodeKVConnector)
    llm.connector.on_load_done = engine.wake
    engine.start()
    try:
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        # 6 of the 8 blocks wait for a pull that never ends; 4 more are needed by the second.
        remote = engine.generate(list(range(1, 49)), params, "remote", {REMOTE_ADDRESS: address, TRANSFER_TOKEN: b"t"})
        pulling = asyncio.create_task(anext(remote))
        await asyncio.wait_for(
            _wait_until(engine, lambda e: len(e.core.scheduler.waiting_for_remote_kv) == 1), DEADLINE_S
        )
        local = asyncio.create_task(_collect(engine, list(range(1, 30)), 2))
        await asyncio.wait_for(_wait_until(engine, lambda e: len(e.core.scheduler.waiting) == 1), DEADLINE_S)
        counter = _StepCounter(llm)
        await asyncio.sleep(0.5)  # a measurement window, not synchronisation
        # Spinning ran ~48,000 empty steps a second; waiting on the wake-up event, ~20.
        assert counter.num_steps < 100, f"{counter.num_steps} steps in 0.5 s while nothing could run"
        engine.abort("remote")  # the pull is cancelled, its blocks come back, the other runs
        assert len(await asyncio.wait_for(local, DEADLINE_S)) == 2
        pulling.cancel()
        with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
            await pulling
        await remote.aclose()
    finally:
        await engine.stop()
        llm.connector.shutdown()
        await server.stop(None)


async def _wait_until(engine: AsyncLLMEngine, predicate: Callable[[LLMEngine], bool]) -> None:
    """Poll the engine's state between steps (the state has no event of its own)."""
    while not await engine.call(predicate):
        await asyncio.sleep(0.01)
