"""Log-probabilities of tokens as the engine reports them: plain Python, no torch.

A logprob is the log-softmax of the model's raw logits (before temperature, top-k and
top-p), as vLLM reports them by default. One `TokenLogprobs` describes one position: the
token that is there (sampled, or the prompt's own), its logprob and rank, and the
position's most likely tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

# OpenAI's and vLLM's bound on `logprobs` / `top_logprobs`: each is a top-k over the vocabulary.
MAX_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One position: `token_id` with its `logprob` and `rank` (1 = the most likely token;
    ties share the better rank), then the `top` tokens as (token id, logprob), most likely first."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


def check_num_logprobs(value: int | None, name: str) -> None:
    """Raise ValueError unless `value` is None (no logprobs) or in [0, MAX_LOGPROBS]."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
        raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")
