"""The asyncio face of the engine: add a request, stream its outputs, abort it.

The step loop runs in a thread of its own so the event loop never blocks on a
forward. Commands (add, abort) reach the thread through a queue and are applied
between steps; outputs come back through `loop.call_soon_threadsafe`, one batch per
step: into each request's queue (`generate`), or straight to its callback (`run`,
for a caller that only forwards them: no task switch per output). With a
`kv_events_sink`, the thread hands it each step's prefix cache events
(`LLMEngine.take_kv_events`) right after the step, so their order and a snapshot taken
with `call` agree. A step that computed nothing (requests waiting for remote KV, or for blocks that
in-flight pulls hold) waits on a wake-up event that the connector sets when a transfer
finishes, never spinning.

When a step raises, the engine is dead: every stream, every queued command and every
later call fails with EngineDeadError, and `wait_failed` returns the error so the
server can stop serving and exit non-zero (an orchestrator restarts it).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from kvservice.core.block_pool import KVCacheEvent
from kvservice.core.sampling_params import SamplingParams
from kvservice.engine.engine import LLMEngine, RequestOutput
from kvservice.engine.errors import EngineDeadError, QueueFull
from kvservice.loading.chat_template import Prompt
from kvservice.runtime.native_thread import name_native_thread

logger = logging.getLogger(__name__)

# Upper bound on an idle wait: transfers and commands report through the wake-up event,
# so this only bounds how late a lease expiry or a missed notification is noticed.
_IDLE_WAIT_S = 0.05


# Where a request's outputs go, on the event loop: each output, or the error that ends it.
Deliver = Callable[[RequestOutput | BaseException], None]


@dataclass(slots=True)
class _Add:
    prompt: Prompt
    params: SamplingParams
    request_id: str | None
    kv_transfer_params: dict[str, Any] | None
    future: asyncio.Future[str]
    deliver: Deliver


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Call:
    """Run a function on the engine thread between steps (e.g. a consistent stats snapshot)."""

    fn: Callable[[LLMEngine], Any]
    future: asyncio.Future[Any]


# Called on the step thread with one step's prefix cache events (never an empty list).
KVEventsSink = Callable[[list[KVCacheEvent]], None]


class AsyncLLMEngine:
    def __init__(
        self, engine: LLMEngine, max_queued_requests: int | None = None, kv_events_sink: KVEventsSink | None = None
    ) -> None:
        """`max_queued_requests` bounds the requests not yet running (waiting, preempted, or
        waiting for remote KV); past it `generate` raises QueueFull at once. None: no bound.
        `kv_events_sink` gets each step's prefix cache events, on the step thread."""
        if max_queued_requests is not None and max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {max_queued_requests}")
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self._kv_events_sink = kv_events_sink
        if kv_events_sink is not None:
            engine.take_kv_events()  # recording starts now, before the step thread does
        self._commands: queue.SimpleQueue[_Add | _Abort | _Call | None] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, Deliver] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        # Guards `_is_closed` against a command put while the step thread drains the queue:
        # once closed, nothing enters the queue, so no future is left unresolved.
        self._submit_lock = threading.Lock()
        self._is_closed = False
        self._failed: asyncio.Future[BaseException] | None = None
        self.error: BaseException | None = None

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the step thread; must be called from the event loop that will consume outputs."""
        self._loop = asyncio.get_running_loop()
        self._failed = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, name="engine-step", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Abort what is left, stop the step thread and wait for it."""
        if self._thread is None:
            return
        self._stopping = True
        self._commands.put(None)
        self._wakeup.set()
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    def wake(self) -> None:
        """Thread-safe: let an idle step loop run (a transfer finished)."""
        self._wakeup.set()

    async def wait_failed(self) -> BaseException:
        """Return the error that killed the step loop, once it has (never, on a clean stop)."""
        assert self._failed is not None, "start() first"
        return await asyncio.shield(self._failed)

    @property
    def step_thread_id(self) -> int:
        """The OS's id of the step thread (start() first)."""
        assert self._thread is not None and self._thread.native_id is not None, "start() first"
        return self._thread.native_id

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # ------------------------------------------------------------ requests

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs until it finishes. Invalid input raises ValueError
        before anything is yielded; leaving early (cancel, break) aborts the request."""
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        future, rid = self._add(prompt, params, request_id, kv_transfer_params, outputs.put_nowait)
        finished = False
        try:
            await future
            while True:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.all_finished
                yield item
                if finished:
                    return
        finally:
            self._abort_unless(finished, future, rid)

    async def run(
        self,
        prompt: Prompt,
        params: SamplingParams,
        on_output: Callable[[RequestOutput], None],
        request_id: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> None:
        """`generate`, with each output handed to `on_output` on the event loop as its step's
        batch arrives (no task switch per output); returns once the request finished. What
        `on_output` raises ends the request with that error, as would raising in the loop
        over `generate`; so does cancelling the call."""
        done: asyncio.Future[None] = self._running_loop().create_future()
        finished = False

        def deliver(item: RequestOutput | BaseException) -> None:
            nonlocal finished
            if done.done():
                return
            if isinstance(item, BaseException):
                done.set_exception(item)
                return
            finished = item.all_finished
            try:
                on_output(item)
            except BaseException as e:  # noqa: BLE001 - handed to the caller through `done`
                done.set_exception(e)
                return
            if finished:
                done.set_result(None)

        future, rid = self._add(prompt, params, request_id, kv_transfer_params, deliver)
        try:
            await future
            await done
        finally:
            self._abort_unless(finished, future, rid)

    def _add(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None,
        kv_transfer_params: dict[str, Any] | None,
        deliver: Deliver,
    ) -> tuple[asyncio.Future[str], str]:
        """Queue a request for the step thread: a future that resolves once it is added (or
        fails: invalid input, a full queue), and its id."""
        future: asyncio.Future[str] = self._running_loop().create_future()
        # The id is fixed here, so a caller cancelled while the add is still queued can
        # abort it too (the abort follows the add through the same queue).
        rid = request_id if request_id is not None else uuid.uuid4().hex
        self._submit(_Add(prompt, params, rid, kv_transfer_params, future, deliver))
        return future, rid

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        if self.error is not None or self._loop is None:
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        return self._loop

    def _abort_unless(self, finished: bool, future: asyncio.Future[str], rid: str) -> None:
        """A request's caller is done with it: abort it unless it finished or was refused."""
        was_refused = future.done() and not future.cancelled() and future.exception() is not None
        if not finished and not was_refused:
            self.abort(rid)

    def abort(self, request_id: str) -> None:
        """Thread-safe and idempotent: abort a request wherever it is."""
        self._submit(_Abort(request_id))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run `fn(engine)` on the step thread between steps and return its result."""
        if self._loop is None:
            raise EngineDeadError("engine is not running")
        future: asyncio.Future[Any] = self._loop.create_future()
        self._submit(_Call(fn, future))
        return await future

    def _submit(self, command: _Add | _Abort | _Call) -> None:
        """Queue a command for the step thread; after it has ended, fail the command at once."""
        with self._submit_lock:
            if not self._is_closed:
                self._commands.put(command)
                self._wakeup.set()
                return
        if not isinstance(command, _Abort):
            command.future.set_exception(self._dead_error())

    def _dead_error(self) -> EngineDeadError:
        if self.error is not None:
            return EngineDeadError(f"engine step failed: {self.error!r}")
        return EngineDeadError("engine stopped")

    # ------------------------------------------------------------ the step thread

    def _run(self) -> None:
        name_native_thread()
        try:
            while not self._stopping:
                self._apply_commands()
                if self._stopping:
                    break
                if not self.engine.has_unfinished_requests():
                    self._wakeup.wait()
                    self._wakeup.clear()
                    continue
                outputs = self.engine.step()
                if self._kv_events_sink is not None:
                    events = self.engine.take_kv_events()
                    if events:
                        self._kv_events_sink(events)
                if outputs:
                    self._deliver(outputs)
                elif self.engine.is_last_step_idle:
                    # Nothing could run: only a finished transfer, a command or freed blocks
                    # change that. Sleep (releasing the GIL to the threads that do) until then.
                    self._wakeup.wait(_IDLE_WAIT_S)
                    self._wakeup.clear()
        except BaseException as e:  # the loop must report, not vanish
            logger.exception("engine step loop failed")
            self.error = e
            self._close()
            self._fail_all(self._dead_error())
            assert self._loop is not None
            self._loop.call_soon_threadsafe(_settle, self._failed, e)
            return
        self._close()
        self._abort_all()

    def _close(self) -> None:
        """Refuse new commands and fail the ones still queued."""
        with self._submit_lock:
            self._is_closed = True
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, (_Add, _Call)):
                self._resolve(command.future, None, self._dead_error())

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command is None:
                continue
            if isinstance(command, _Abort):
                self.engine.abort_request(command.request_id)
            elif isinstance(command, _Call):
                try:
                    self._resolve(command.future, command.fn(self.engine), None)
                except Exception as e:
                    self._resolve(command.future, None, e)
            else:
                if self._is_queue_full():
                    self._resolve(
                        command.future,
                        None,
                        QueueFull(
                            f"server overloaded: {self.max_queued_requests} requests already queued; retry later"
                        ),
                    )
                    continue
                try:
                    rid = self.engine.add_request(
                        command.prompt, command.params, command.request_id, command.kv_transfer_params
                    )
                except Exception as e:  # ValueError for bad input: the caller's to handle
                    self._resolve(command.future, None, e)
                    continue
                self._streams[rid] = command.deliver
                self._resolve(command.future, rid, None)

    def _is_queue_full(self) -> bool:
        if self.max_queued_requests is None:
            return False
        queues = self.engine.core.scheduler.make_stats()
        return queues.num_waiting_requests + queues.num_waiting_for_remote_kv >= self.max_queued_requests

    def _resolve(self, future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
        assert self._loop is not None

        def settle() -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        self._loop.call_soon_threadsafe(settle)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        batch: list[tuple[Deliver, RequestOutput | BaseException]] = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            batch.append((stream, out))
            if out.all_finished:
                del self._streams[out.request_id]
        if batch and self._loop is not None:
            self._loop.call_soon_threadsafe(_put_all, batch)

    def _abort_all(self) -> None:
        for request_id in list(self._streams):
            self.engine.abort_request(request_id)
        self._deliver(self.engine.step() if self.engine.has_unfinished_requests() else [])
        self._fail_all(EngineDeadError("engine stopped"))

    def _fail_all(self, error: BaseException) -> None:
        batch = [(stream, error) for stream in self._streams.values()]
        self._streams.clear()
        if batch and self._loop is not None:
            self._loop.call_soon_threadsafe(_put_all, batch)


def _settle(future: asyncio.Future[BaseException] | None, error: BaseException) -> None:
    if future is not None and not future.done():
        future.set_result(error)


def _put_all(batch: list[tuple[Deliver, RequestOutput | BaseException]]) -> None:
    for deliver, item in batch:
        deliver(item)
