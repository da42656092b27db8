"""The engine's front: prompts in, `RequestOutput`s out.

`LLMEngine` validates and encodes a request, has its `OutputProcessor` make the core's requests
(n > 1 fan-out, resumed streams) and turns each `EngineCore` step's token ids into what the
caller sees (text, stop strings). Build one with `kvservice.engine.engine_builder.build_engine`.
"""

from __future__ import annotations

import itertools
from typing import Any

from kvservice.config import EngineConfig, ModelConfig
from kvservice.connector.base import KVConnectorBase
from kvservice.core.block_pool import KVCacheEvent
from kvservice.core.request import RequestStatus, check_request_id
from kvservice.core.sampling_params import SamplingParams
from kvservice.engine.engine_core import EngineCore
from kvservice.engine.output_processor import OutputProcessor, RequestOutput, sequence_ids_of
from kvservice.loading.chat_template import Prompt, ResumedPrompt, encode_prompt
from kvservice.loading.tokenizer import Tokenizer
from kvservice.structured.grammar import GrammarCompiler

__all__ = ["LLMEngine", "RequestOutput"]


class LLMEngine:
    """One engine in this process: an `EngineCore` and the request bookkeeping in front of it."""

    def __init__(self, core: EngineCore, processor: OutputProcessor) -> None:
        self.core = core
        self.processor = processor
        self._ids = itertools.count()

    # ------------------------------------------------------------ what callers read

    @property
    def config(self) -> EngineConfig:
        return self.core.config

    @property
    def model_config(self) -> ModelConfig:
        return self.core.model_config

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.core.loaded.tokenizer

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.processor.eos_token_ids

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def connector(self) -> KVConnectorBase | None:
        return self.core.connector

    @property
    def is_last_step_idle(self) -> bool:
        return self.core.is_last_step_idle

    @property
    def num_free_blocks(self) -> int:
        return self.core.scheduler.kv.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.core.scheduler.kv.num_blocks

    # ------------------------------------------------------------ requests

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt (a conversation rendered with the model's chat template),
        validated against the vocabulary and the maximum length."""
        token_ids = encode_prompt(self.tokenizer, prompt)
        if not token_ids:
            raise ValueError("prompt: empty prompt")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(token_ids)} tokens, but the model's maximum length is {self.max_model_len} "
                "(prompt plus at least one generated token)"
            )
        _check_token_ids("prompt_token_ids", token_ids, self.model_config.vocab_size)
        return token_ids

    def grammar_compiler(self) -> GrammarCompiler:
        """Structured output's grammars for this model, built on first use (~0.2 s)."""
        return self.core.grammar_compiler()

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> str:
        token_ids = self.encode(prompt)
        _check_token_ids("stop_token_ids", params.stop_token_ids, self.model_config.vocab_size)
        if params.structured_output is not None:
            # Compiled now (then cached): a schema it cannot enforce is refused before it runs.
            self.grammar_compiler().compile(params.structured_output)
        num_resumed = len(prompt.token_ids) if isinstance(prompt, ResumedPrompt) else 0
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        check_request_id(request_id)
        sequence_ids = sequence_ids_of(request_id, params.n)
        in_use = self.core.scheduler.requests
        taken = next((r for r in sequence_ids if self.processor.is_tracked(r) or r in in_use), None)
        if taken is not None:
            raise ValueError(f"request_id {taken!r} is already in use")
        requests = self.processor.make_requests(request_id, token_ids, num_resumed, params, kv_transfer_params)
        try:
            for request in requests:
                self.core.add_request(request)
        except ValueError:
            self.processor.forget(request_id)
            for request in requests:
                self.core.finish_request(request.request_id, RequestStatus.FINISHED_ABORTED)
            raise
        return request_id

    def abort_request(self, request_id: str) -> bool:
        """Abort every sequence of the request; False if none was still running."""
        aborted = [self.core.abort_request(r) for r in self.processor.sequence_ids(request_id)]
        return any(aborted)

    def has_unfinished_requests(self) -> bool:
        return self.core.scheduler.has_work()

    # ------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """One engine step; the outputs of the requests that advanced, finished or failed."""
        outputs, stopped = self.processor.process(self.core.step())
        for sequence_id in stopped:
            # The scheduler goes on until told: end the sequence there, its blocks free now.
            self.core.finish_request(sequence_id, RequestStatus.FINISHED_STOPPED)
        return outputs

    # ------------------------------------------------------------ introspection

    def take_kv_events(self) -> list[KVCacheEvent]:
        """The prefix cache's changes since the last call (recorded from the first call on)."""
        return self.core.take_kv_events()

    def kv_cache_snapshot(self) -> list[KVCacheEvent]:
        """Everything the prefix cache holds now, as `stored` events."""
        return self.core.kv_cache_snapshot()


def _check_token_ids(field_name: str, token_ids: list[int], vocab_size: int) -> None:
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"{field_name}: token id {bad} is outside the vocabulary [0, {vocab_size})")
