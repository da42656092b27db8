"""Sampling parameters of one request: plain Python, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvservice.core.logprobs import check_num_logprobs
from kvservice.core.structured_output import StructuredOutputParams

_GREEDY_EPSILON = 1e-5
MAX_STOP_STRINGS = 16
MAX_N = 64  # sequences of one request (`n`)
MAX_STOP_STRING_CHARS = 256
# Each generated token is checked against the stop ids: the count is bounded so neither
# validation nor that check can be made to cost more than a step.
MAX_STOP_TOKEN_IDS = 1024


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick the next token, and when to stop.

    `temperature=0` (or below 1e-5) is greedy. `top_k=-1` and `top_p=1.0` disable those filters.
    A request with a `seed` samples reproducibly, whatever else is in the batch.
    `stop` strings end the request when its text contains one; the text returned stops
    before it (a str or any sequence of str is accepted, stored as a tuple).
    `logprobs=K` reports each generated token's logprob with the K most likely tokens
    (0: the token's own only); `prompt_logprobs=K` does the same for every prompt token
    after the first. Either is at most MAX_LOGPROBS; None reports none. A request with
    prompt logprobs computes its whole prompt (its prefix is not taken from the cache).
    `structured_output` constrains the output to a JSON schema, a regex, a choice or a
    grammar: every token is sampled under the grammar's mask, and the request ends (EOS)
    where the grammar does; so `ignore_eos` cannot go with it.
    `n` > 1 generates n sequences from one prompt, computed once and shared: sequence i
    samples with `seed + i` (when a seed is given), so it equals the request sent alone
    with that seed.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    stop: tuple[str, ...] = field(default_factory=tuple)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_output: StructuredOutputParams | None = None
    n: int = 1

    def __post_init__(self) -> None:
        # NaN compares False with everything: check finiteness first, or `nan < 0` lets it in.
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1 or self.top_k == 0:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0, got {self.max_tokens}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"stop_token_ids: {len(self.stop_token_ids)} ids, at most {MAX_STOP_TOKEN_IDS} are allowed"
            )
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be >= 0, got {list(self.stop_token_ids)}")
        check_num_logprobs(self.logprobs, "logprobs")
        check_num_logprobs(self.prompt_logprobs, "prompt_logprobs")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.structured_output is not None and self.ignore_eos:
            raise ValueError("ignore_eos: a structured output ends where its grammar does, so it cannot ignore EOS")
        # Accept any iterable of ids (a list from user code) but store a tuple: frozen stays frozen.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop", _validate_stop(self.stop))

    @property
    def is_greedy(self) -> bool:
        # vLLM's epsilon: below it, logits / temperature overflows float32 to inf (NaN probabilities).
        return self.temperature < _GREEDY_EPSILON


def _validate_stop(stop: object) -> tuple[str, ...]:
    strings = (stop,) if isinstance(stop, str) else stop
    if not isinstance(strings, (list, tuple)):
        raise ValueError(f"stop: expected a string or a list of strings, got {type(stop).__name__}")
    if len(strings) > MAX_STOP_STRINGS:
        raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(strings)}")
    for s in strings:
        if not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_STRING_CHARS:
            raise ValueError(f"stop: each stop string must be 1 to {MAX_STOP_STRING_CHARS} characters, got {s!r:.80}")
    return tuple(strings)
