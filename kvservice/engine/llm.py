"""Offline generation: `LLM("tiny").generate(prompts, SamplingParams(max_tokens=16))`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvservice.config import EngineConfig
from kvservice.core.sampling_params import SamplingParams
from kvservice.engine.engine import RequestOutput
from kvservice.engine.engine_builder import build_engine
from kvservice.loading.chat_template import apply_chat_template


class LLM:
    """A model plus an engine in this process.

    `model` is "tiny", "smollm2", a Hugging Face model directory or a GGUF file.
    """

    def __init__(self, model: str, dtype: str = "auto", block_size: int = 16, **engine_kwargs: object) -> None:
        self.engine = build_engine(model, EngineConfig(dtype=dtype, block_size=block_size, **engine_kwargs))  # type: ignore[arg-type]

    @property
    def tokenizer(self):  # noqa: ANN201 - Tokenizer | None
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One finished output per prompt and sequence, in order (with `n` > 1, a prompt's n
        sequences one after the other, by index). A prompt is text or a list of token ids."""
        prompts, params = _paired(prompts, sampling_params)
        request_ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params):
                request_ids.append(self.engine.add_request(prompt, p))  # type: ignore[arg-type]
            pending = set(request_ids)
            finished: dict[tuple[str, int], RequestOutput] = {}
            while pending:
                for out in self.engine.step():
                    # Outputs of other requests (aborts of an earlier failed call) are not ours.
                    if out.finished and out.request_id in pending:
                        finished[out.request_id, out.index] = out
                        if out.all_finished:
                            pending.discard(out.request_id)
            return [finished[r, i] for r, p in zip(request_ids, params) for i in range(p.n)]
        except BaseException:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of `{"role", "content"}` messages)
        or to a list of them; one finished output per conversation, as `generate` returns.

        Each conversation is rendered with `chat_template`, or the model's own, and
        tokenized as it is (see `kvservice.loading.chat_template.apply_chat_template`)."""
        if not messages:
            raise ValueError("messages: empty")
        is_one = isinstance(messages[0], Mapping)
        conversations = [messages] if is_one else list(messages)
        prompts = [
            apply_chat_template(self.tokenizer, conversation, add_generation_prompt, chat_template)
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params)


def _paired(
    prompts: str | list[int] | Sequence[str | list[int]],
    sampling_params: SamplingParams | Sequence[SamplingParams] | None,
) -> tuple[list[str | list[int]], list[SamplingParams]]:
    """One prompt or many, each with its sampling params (one for all, or one each)."""
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]  # type: ignore[list-item]
    prompt_list = list(prompts)  # type: ignore[arg-type]
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        params = [sampling_params] * len(prompt_list)
    else:
        params = list(sampling_params)
    if len(params) != len(prompt_list):
        raise ValueError(f"sampling_params: {len(params)} given for {len(prompt_list)} prompts")
    return prompt_list, params
