"""Request bookkeeping in front of the engine core: what a caller sees of its request.

The core steps requests by id and emits token ids (`EngineCoreOutput`); this turns them into
`RequestOutput`s: detokenized text, stop strings (text held back until it cannot start one),
n > 1 fan-out into sequences of their own, and streams resumed on another worker (migration),
which continue exactly where they stopped. No torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kvservice.core.logprobs import TokenLogprobs
from kvservice.core.outputs import EngineCoreOutput
from kvservice.core.request import Request
from kvservice.core.sampling_params import SamplingParams
from kvservice.engine.stop_checker import OutputText
from kvservice.loading.tokenizer import Tokenizer


@dataclass(slots=True)
class RequestOutput:
    """A request's state after a step: all its generated tokens so far, plus what is new.

    With `SamplingParams.logprobs`, `logprobs` (all so far) and `new_logprobs` have one entry
    per token of `token_ids` and `new_token_ids`. From the first output with tokens on,
    `num_cached_tokens` is the number of prompt tokens found in the prefix cache and, with
    `SamplingParams.prompt_logprobs`, `prompt_logprobs` has one entry per prompt token after the first.

    With `SamplingParams.n` > 1 the request has n sequences: each output is one sequence's
    (`index`), `finished` says that sequence ended, `all_finished` that every one has."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    new_text: str
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    new_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int | None = None
    index: int = 0
    all_finished: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class _Tracked:
    request_id: str  # the caller's: a sequence of an n > 1 request runs under an id of its own
    index: int
    prompt_token_ids: list[int]
    output_text: OutputText
    token_ids: list[int] = field(default_factory=list)
    wants_logprobs: bool = False
    # All of them so far (not for a resumed stream, whose first tokens' came from elsewhere).
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int | None = None


class OutputProcessor:
    """Makes the core's requests from a caller's (`make_requests`) and its outputs into the
    caller's (`process`)."""

    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._tracked: dict[str, _Tracked] = {}  # by the id each sequence runs under
        self._sequence_ids: dict[str, list[str]] = {}  # caller's id -> its unfinished sequences' ids

    def sequence_ids(self, request_id: str) -> list[str]:
        """The ids the request's unfinished sequences run under (its own id if unknown)."""
        return self._sequence_ids.get(request_id, [request_id])

    def is_tracked(self, sequence_id: str) -> bool:
        return sequence_id in self._sequence_ids or sequence_id in self._tracked

    def make_requests(
        self,
        request_id: str,
        token_ids: list[int],
        num_resumed: int,
        params: SamplingParams,
        kv_transfer_params: dict[str, Any] | None,
    ) -> list[Request]:
        """The core's requests for one caller's request: one per sequence, the first the leader
        (it alone carries `kv_transfer_params`). The last `num_resumed` of `token_ids` are a
        migrated stream's tokens so far: they count as output, and the limits shrink by them."""
        resumed = token_ids[len(token_ids) - num_resumed :] if num_resumed else []
        output_text = OutputText(self.tokenizer, params.stop)
        if resumed:
            params = _resumed_params(params, len(resumed))
            # The same detokenizer and stop-string state as the stream had: text held back
            # there stays held back here, and nothing already sent is sent again.
            output_text.push(resumed)
            if params.n > 1:
                raise ValueError("n: a resumed stream continues one sequence, so n must be 1")
        sequence_ids = sequence_ids_of(request_id, params.n)
        requests: list[Request] = []
        for index, sequence_id in enumerate(sequence_ids):
            requests.append(
                Request(
                    sequence_id,
                    token_ids,
                    _sequence_params(params, index),
                    eos_token_ids=self.eos_token_ids,
                    max_model_len=self.max_model_len,
                    kv_transfer_params=kv_transfer_params if index == 0 else None,
                    leader=requests[0] if requests else None,
                )
            )
            # Outputs read as the original request's, continued: resumed tokens count as output.
            self._tracked[sequence_id] = _Tracked(
                request_id,
                index,
                token_ids[: len(token_ids) - len(resumed)],
                output_text if index == 0 else OutputText(self.tokenizer, params.stop),
                list(resumed),
                params.logprobs is not None,
                [] if params.logprobs is not None and not resumed else None,
            )
        self._sequence_ids[request_id] = sequence_ids
        return requests

    def forget(self, request_id: str) -> None:
        """Drop a request whose sequences never reached the core (it refused one)."""
        for sequence_id in self._sequence_ids.pop(request_id, []):
            self._tracked.pop(sequence_id, None)

    def process(self, core_outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """The callers' outputs, and the sequences a stop string ended: the core must finish
        those (it goes on until told)."""
        outputs: list[RequestOutput] = []
        stopped: list[str] = []
        for core in core_outputs:
            tracked = self._tracked.get(core.request_id)
            if tracked is None:
                continue
            output = self._to_request_output(tracked, core)
            if output.finish_reason == "stop" and core.finish_reason is None:
                stopped.append(core.request_id)
            outputs.append(output)
        return outputs, stopped

    def _to_request_output(self, tracked: _Tracked, core: EngineCoreOutput) -> RequestOutput:
        finish_reason = core.finish_reason
        num_kept, new_text = tracked.output_text.push(core.new_token_ids, is_last=finish_reason is not None)
        new_token_ids = list(core.new_token_ids[:num_kept])
        tracked.token_ids.extend(new_token_ids)
        new_logprobs = None
        if tracked.wants_logprobs:
            new_logprobs = list(core.logprobs[:num_kept]) if core.logprobs is not None else []
            if tracked.logprobs is not None:
                tracked.logprobs.extend(new_logprobs)
        if core.prompt_logprobs is not None:
            tracked.prompt_logprobs = core.prompt_logprobs
        if core.num_cached_tokens is not None:
            tracked.num_cached_tokens = core.num_cached_tokens
        if tracked.output_text.is_stopped:
            finish_reason = "stop"
        all_finished = finish_reason is not None and self._finish_sequence(tracked, core.request_id)
        return RequestOutput(
            request_id=tracked.request_id,
            prompt_token_ids=tracked.prompt_token_ids,
            token_ids=list(tracked.token_ids),
            text=tracked.output_text.text,
            new_token_ids=new_token_ids,
            new_text=new_text,
            finish_reason=finish_reason,
            error=core.error,
            logprobs=None if tracked.logprobs is None else list(tracked.logprobs),
            new_logprobs=new_logprobs,
            prompt_logprobs=tracked.prompt_logprobs,
            num_cached_tokens=tracked.num_cached_tokens,
            index=tracked.index,
            all_finished=all_finished,
        )

    def _finish_sequence(self, tracked: _Tracked, sequence_id: str) -> bool:
        """Forget a finished sequence; True when it was its request's last."""
        del self._tracked[sequence_id]
        unfinished = self._sequence_ids[tracked.request_id]
        unfinished.remove(sequence_id)
        if unfinished:
            return False
        del self._sequence_ids[tracked.request_id]
        return True


def sequence_ids_of(request_id: str, n: int) -> list[str]:
    """The ids the n sequences of a request run under: its own, then `request_id/1` ... `/n-1`."""
    return [request_id, *(f"{request_id}/{i}" for i in range(1, n))]


def _sequence_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sequence `index` of an n > 1 request: one sequence, seed + index (so it equals the
    request sent alone with that seed); the prompt's logprobs are the first sequence's."""
    if params.n == 1:
        return params
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, seed=seed, prompt_logprobs=params.prompt_logprobs if index == 0 else None)


def _resumed_params(params: SamplingParams, num_resumed: int) -> SamplingParams:
    """The limits of what is left to generate after `num_resumed` tokens."""
    if num_resumed >= params.max_tokens:
        raise ValueError(f"resume_token_ids: {num_resumed} tokens already reach max_tokens ({params.max_tokens})")
    # The prompt's logprobs went out with the stream's first output.
    return dataclasses.replace(params, max_tokens=params.max_tokens - num_resumed, prompt_logprobs=None)
