"""The prompt lane: a colocated worker computes its prompts in big batches, a slice at a time
between its decode steps.

Chunking prompts into the decode steps (as many prompt tokens beside the decoding requests as
keep a step within `--step-target-ms`) computes them in chunks of ~50 tokens, at a fraction
of a big batch's speed: bench peers' concurrency-16 workload on 2 Zen 4 cores spent 117 ms on a
step of 13 decoding requests and 50 prompt tokens, 1.6 ms a prompt token against 1.3 in a step
of 2,048. The lane instead runs up to `max_tokens` prompt tokens of several requests as one
forward (`CausalLM.forward_steps`), resumed for a slice of time before each decode step and
stopped at the first pause point past the slice, so the decode steps keep their pace and the
prompts run at a big batch's speed: what `CoreLease` does for a prefill and a decode worker on
the same cores, in one thread.

The lane computes a prompt's tokens but its last: the request then decodes from there, the
last prompt token computed and the first token sampled by an ordinary step (so every sampling
option applies).

The scheduler feeds the lane through a path of its own (`kvservice.engine.prompt_lane_path`):
it queues a waiting request's tokens past its prefix-cache hit but the last one (`add`), drops
an aborted one (`cancel`: its blocks are freed once the lane's forward no longer writes them),
and runs the requests whose batch has ended (`take_finished`) from their last prompt token.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Generator

import torch

from kvservice.core.outputs import LanePrompt
from kvservice.model.model import CausalLM
from kvservice.worker.input_batch import BatchItem, build_batch


class PromptLane:
    """Prompts queue (`add`), run in batches of up to `max_tokens` tokens (`run`), and are
    reported once their KV is in the cache (`take_finished`)."""

    def __init__(
        self, model: CausalLM, kv_caches: list[torch.Tensor], block_size: int, device: torch.device, max_tokens: int
    ) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.model, self.kv_caches, self.block_size, self.device = model, kv_caches, block_size, device
        self.max_tokens = max_tokens
        self._queue: deque[LanePrompt] = deque()
        self._batch: list[LanePrompt] = []  # in the forward now
        self._steps: Generator[str, None, torch.Tensor] | None = None
        self._next_op = ""  # what the forward runs when resumed
        self._segment_s: dict[str, float] = {}  # this batch: how long the ops after each pause point took
        self._finished: set[str] = set()
        self.num_batches = 0
        self.num_slices = 0

    @property
    def has_work(self) -> bool:
        return bool(self._queue or self._batch)

    @property
    def num_queued_tokens(self) -> int:
        return sum(len(p.token_ids) for p in (*self._queue, *self._batch))

    def add(self, prompt: LanePrompt) -> None:
        if not prompt.token_ids:
            raise ValueError(f"request {prompt.request_id!r}: a lane prompt needs at least one token")
        self._queue.append(prompt)

    def cancel(self, request_id: str) -> bool | None:
        """Drop a request's prompt. True: it was queued, its blocks are free to reuse now. False:
        the running forward still writes them, and `take_finished` reports it when that ends.
        None: the lane does not hold it."""
        for prompt in self._queue:
            if prompt.request_id == request_id:
                self._queue.remove(prompt)
                return True
        if any(p.request_id == request_id for p in self._batch):
            return False
        return None

    def take_finished(self) -> set[str]:
        """The requests whose batch ended since the last call (their prompts' KV is in the cache)."""
        finished, self._finished = self._finished, set()
        return finished

    def run(self, budget_s: float | None) -> None:
        """Compute for about `budget_s` seconds: stop at the first pause point where the op that
        follows (timed in the batch's earlier layers) would end past it, or when the queue is
        empty. None: finish the running batch (or the next one), then stop. At least one op runs."""
        started = time.monotonic()
        deadline = None if budget_s is None else started + budget_s
        self.num_slices += 1
        ran = False
        while True:
            if self._steps is None:
                if not self._queue or (ran and budget_s is None):
                    return
                self._start_batch()
            op, op_started = self._next_op, time.monotonic()
            if ran and deadline is not None and op_started + self._segment_s.get(op, 0.0) > deadline:
                return
            try:
                self._next_op = next(self._steps)
            except StopIteration:
                self._end_batch()
            else:
                self._segment_s[op] = time.monotonic() - op_started
            ran = True

    def _start_batch(self) -> None:
        batch = [self._queue.popleft()]
        num_tokens = len(batch[0].token_ids)
        while self._queue and num_tokens + len(self._queue[0].token_ids) <= self.max_tokens:
            num_tokens += len(self._queue[0].token_ids)
            batch.append(self._queue.popleft())
        inputs = build_batch(
            [BatchItem(p.token_ids, p.start, p.block_ids) for p in batch], self.block_size, self.device
        )
        self._batch = batch
        self._steps = self.model.forward_steps(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn)
        self._next_op = "start"  # embedding and the first attention, up to the first pause point
        self._segment_s.clear()  # other rows, other times
        self.num_batches += 1

    def _end_batch(self) -> None:
        self._finished.update(p.request_id for p in self._batch)
        self._batch = []
        self._steps = None
