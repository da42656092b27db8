"""Structured output in the step: each constrained request's grammar masks its logits row
before sampling, so whatever the sampler picks keeps the output inside the grammar.

A request's matcher follows its output tokens, whatever produced them: its own sampled
tokens, the first token a prefill worker sampled (under the same mask), or the tokens a
migrated stream resumes with. So the one rule is "before masking, accept what the request
emitted since", and remote first tokens, preemption and resumption need no case of their own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvservice.core.request import Request
from kvservice.structured.bitmask import allocate_token_bitmask, apply_token_bitmask
from kvservice.structured.grammar import GrammarCompiler
from kvservice.structured.matcher import GrammarMatcher, fill_next_token_bitmasks


@dataclass(slots=True)
class _Following:
    matcher: GrammarMatcher
    num_accepted: int = 0  # of the request's output tokens


class GrammarMasks:
    """The constrained requests' matchers on one worker; `compiler()` is called on first use
    (building a tokenizer's grammar vocabulary takes ~0.2 s: only workers that need it pay)."""

    def __init__(self, compiler: Callable[[], GrammarCompiler]) -> None:
        self._compiler = compiler
        self._following: dict[str, _Following] = {}
        self._bitmask: torch.Tensor | None = None

    def forget(self, request_ids: set[str]) -> None:
        for request_id in request_ids:
            self._following.pop(request_id, None)

    def apply(self, logits: torch.Tensor, requests: list[Request]) -> dict[str, str]:
        """logits: [N, V], row i for requests[i], masked in place where a request has a
        `structured_output`. Returns {request_id: error} for requests whose output left
        their grammar (a token produced elsewhere without the mask): those must fail."""
        rows: list[tuple[GrammarMatcher, int]] = []
        errors: dict[str, str] = {}
        for row, request in enumerate(requests):
            params = request.sampling_params.structured_output
            if params is None:
                continue
            following = self._following.get(request.request_id)
            if following is None:
                following = self._following[request.request_id] = _Following(self._compiler().matcher(params))
            output = request.output_token_ids
            for token_id in output[following.num_accepted :]:
                if not following.matcher.accept_token(token_id):
                    errors[request.request_id] = (
                        f"structured output: token {token_id} is outside the grammar ({following.matcher.error})"
                    )
                    break
            following.num_accepted = len(output)
            if request.request_id not in errors:
                rows.append((following.matcher, row))
        if rows:
            bitmask = self._bitmask_for(len(requests), logits.shape[-1])
            fill_next_token_bitmasks(rows, bitmask)
            apply_token_bitmask(logits, bitmask, [row for _, row in rows])
        for request_id in errors:
            self._following.pop(request_id, None)
        return errors

    def _bitmask_for(self, num_rows: int, vocab_size: int) -> torch.Tensor:
        """A reused [rows, words] buffer; rows not filled this step are never read."""
        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            self._bitmask = allocate_token_bitmask(max(num_rows, 16), vocab_size)
        return self._bitmask
