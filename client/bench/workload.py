"""The benchmark workload: which prompts are sent, and when.

Datasets and the arrival process follow vLLM's `bench serve` (random, prefix_repetition
and ShareGPT datasets; gamma-distributed inter-arrival gaps, Poisson at burstiness 1) so a run
here and a run against vLLM load the server the same way.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

# vLLM's ShareGPT filter: drop too-short pairs and ones that would not fit a small model.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class SampledRequest:
    """One prompt to send: token ids or text (exactly one), and how much to generate."""

    prompt_len: int
    expected_output_len: int
    prompt_token_ids: list[int] | None = None
    prompt: str | None = None

    def __post_init__(self) -> None:
        if (self.prompt_token_ids is None) == (self.prompt is None):
            raise ValueError("SampledRequest needs exactly one of prompt_token_ids and prompt")
        if self.prompt_token_ids is not None and len(self.prompt_token_ids) != self.prompt_len:
            raise ValueError(f"prompt_len {self.prompt_len} != len(prompt_token_ids) {len(self.prompt_token_ids)}")
        if self.prompt_len < 1:
            raise ValueError(f"prompt_len must be >= 1, got {self.prompt_len}")
        if self.expected_output_len < 1:
            raise ValueError(f"expected_output_len must be >= 1, got {self.expected_output_len}")


def _require_positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def random_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    vocab_size: int,
    seed: int,
) -> list[SampledRequest]:
    """Random token-id prompts, lengths uniform in [len*(1-r), len*(1+r)] (vLLM's random set).

    Token ids are drawn independently per request, so prompts share no prefix by chance.
    """
    if num_prompts < 0:
        raise ValueError(f"num_prompts must be >= 0, got {num_prompts}")
    _require_positive("input_len", input_len)
    _require_positive("output_len", output_len)
    _require_positive("vocab_size", vocab_size)
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)

    def lengths(center: int) -> np.ndarray:
        low = max(1, int(center * (1 - range_ratio)))
        high = max(low, int(center * (1 + range_ratio)))
        return rng.integers(low, high + 1, size=num_prompts)

    input_lens, output_lens = lengths(input_len), lengths(output_len)
    return [
        SampledRequest(
            prompt_len=int(n_in),
            expected_output_len=int(n_out),
            prompt_token_ids=rng.integers(0, vocab_size, size=int(n_in)).tolist(),
        )
        for n_in, n_out in zip(input_lens, output_lens)
    ]


def prefix_repetition_requests(
    num_prompts: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    vocab_size: int,
    seed: int,
) -> list[SampledRequest]:
    """`num_prompts` token-id prompts, each one of `num_prefixes` shared random prefixes followed by
    its own random suffix, in a seeded random order (vLLM's prefix_repetition set).

    Every prefix serves `num_prompts / num_prefixes` requests (vLLM asks for an exact division too),
    so a prefix cache can hit on all but its first use of each prefix.
    """
    _require_positive("num_prompts", num_prompts)
    _require_positive("num_prefixes", num_prefixes)
    _require_positive("output_len", output_len)
    _require_positive("vocab_size", vocab_size)
    if prefix_len < 0 or suffix_len < 0 or prefix_len + suffix_len < 1:
        raise ValueError(f"prefix_len and suffix_len must be >= 0 with a sum >= 1, got {prefix_len} and {suffix_len}")
    if num_prompts % num_prefixes != 0:
        raise ValueError(f"num_prompts ({num_prompts}) must be a multiple of num_prefixes ({num_prefixes})")
    rng = np.random.default_rng(seed)
    requests = []
    for _ in range(num_prefixes):
        prefix = rng.integers(0, vocab_size, size=prefix_len).tolist()
        for _ in range(num_prompts // num_prefixes):
            prompt = prefix + rng.integers(0, vocab_size, size=suffix_len).tolist()
            requests.append(SampledRequest(len(prompt), output_len, prompt_token_ids=prompt))
    return [requests[i] for i in rng.permutation(len(requests))]


def warm_up_requests(requests: Sequence[SampledRequest], num_warmups: int, seed: int) -> list[SampledRequest]:
    """`num_warmups` requests shaped as the first ones of `requests` (cycled), their token ids shuffled.

    Same lengths, so they warm the server up the same way; but no block of a measured prompt,
    so they leave no prefix-cache hit behind for the measured run. Text prompts stay as they are.
    """
    rng = np.random.default_rng(seed)
    warm_ups = []
    for i in range(num_warmups):
        request = requests[i % len(requests)]
        if request.prompt_token_ids is not None:
            request = replace(request, prompt_token_ids=rng.permutation(request.prompt_token_ids).tolist())
        warm_ups.append(request)
    return warm_ups


def _load_sharegpt(path: Path) -> list[Any]:
    if not path.is_file():
        raise FileNotFoundError(f"ShareGPT dataset not found: {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"ShareGPT dataset {path} is not valid JSON: {e}") from e
    if not isinstance(data, list):
        raise ValueError(f"ShareGPT dataset {path} must be a JSON list of conversations")
    return data


def _prompt_and_reply(entry: Any) -> tuple[str, str] | None:
    """The first human turn and the gpt turn answering it, if the entry has them."""
    turns = entry.get("conversations") if isinstance(entry, dict) else None
    if not isinstance(turns, list) or len(turns) < 2:
        return None
    for turn, reply in zip(turns, turns[1:]):
        if not (isinstance(turn, dict) and isinstance(reply, dict)):
            return None
        if turn.get("from") == "human":
            prompt, completion = turn.get("value"), reply.get("value")
            is_answered = reply.get("from") == "gpt"
            if is_answered and isinstance(prompt, str) and isinstance(completion, str):
                return prompt, completion
            return None
    return None


def sharegpt_requests(
    path: str | Path,
    num_prompts: int,
    tokenizer_encode: Callable[[str], list[int]],
    seed: int,
    output_len: int | None = None,
    max_prompt_len: int = SHAREGPT_MAX_PROMPT_LEN,
    max_total_len: int = SHAREGPT_MAX_TOTAL_LEN,
) -> list[SampledRequest]:
    """Text prompts from a ShareGPT JSON file, shuffled with `seed` (vLLM's ShareGPT set).

    The reply's token count is the expected output length unless `output_len`
    overrides it. Pairs with a prompt (or, without override, a reply) under 4 tokens,
    or beyond the length limits, are skipped. When fewer valid pairs than
    `num_prompts` exist, some are repeated (vLLM's oversampling).
    """
    _require_positive("num_prompts", num_prompts)
    if output_len is not None:
        _require_positive("output_len", output_len)
    entries = _load_sharegpt(Path(path))
    rng = random.Random(seed)
    rng.shuffle(entries)
    sampled: list[SampledRequest] = []
    for entry in entries:
        if len(sampled) == num_prompts:
            break
        pair = _prompt_and_reply(entry)
        if pair is None:
            continue
        prompt, completion = pair
        prompt_len = len(tokenizer_encode(prompt))
        new_output_len = len(tokenizer_encode(completion)) if output_len is None else output_len
        is_reply_short = output_len is None and new_output_len < SHAREGPT_MIN_LEN
        if prompt_len < SHAREGPT_MIN_LEN or is_reply_short:
            continue
        if prompt_len > max_prompt_len or prompt_len + new_output_len > max_total_len:
            continue
        sampled.append(SampledRequest(prompt_len, new_output_len, prompt=prompt))
    if not sampled:
        raise ValueError(f"ShareGPT dataset {path} has no usable conversations")
    sampled.extend(rng.choices(sampled, k=num_prompts - len(sampled)))
    return sampled


def _validate_arrival(request_rate: float, burstiness: float) -> None:
    if math.isnan(request_rate) or request_rate <= 0:
        raise ValueError(f"request_rate must be > 0 (or inf), got {request_rate}")
    if not (math.isfinite(burstiness) and burstiness > 0):
        raise ValueError(f"burstiness must be a finite value > 0, got {burstiness}")


def arrival_intervals(n: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """`n` inter-arrival gaps in seconds: gamma(shape=burstiness, mean=1/request_rate).

    Burstiness 1 is a Poisson process; below 1 arrivals are burstier, above 1 more
    regular. An infinite rate gives zero gaps (everything is sent at once).
    """
    _validate_arrival(request_rate, burstiness)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if math.isinf(request_rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n).tolist()


async def request_arrivals(
    requests: Sequence[T], request_rate: float, burstiness: float, seed: int
) -> AsyncIterator[T]:
    """Yield requests (or conversations: their first turns arrive so) at their arrival times; the first one at once.

    Arrival times are cumulative from the start, so time the consumer spends between
    items does not stretch the schedule.
    """
    gaps = arrival_intervals(max(len(requests) - 1, 0), request_rate, burstiness, seed)
    loop = asyncio.get_running_loop()
    due = loop.time()
    for index, request in enumerate(requests):
        if index > 0 and gaps[index - 1] > 0:
            due += gaps[index - 1]
            await asyncio.sleep(max(0.0, due - loop.time()))
        yield request
