"""Prompt lookup (vLLM's `ngram` method): speculative proposals without a model.

A request's next tokens often repeat its own earlier ones: a passage being quoted, code being
edited, a name or a list coming back. After each step the proposer finds the latest earlier
occurrence of the request's last n tokens in its prompt and output, for the largest n from
`prompt_lookup_max` down to `prompt_lookup_min` that occurs, and proposes the up to K tokens that
followed it (fewer where the occurrence is near the end).

No model and no KV cache of its own: the proposals are a function of the tokens alone, so a
sampled request's draft law is one-hot and `draft_probs` stays empty (verification then accepts a
proposed token d with probability p(d)). The search looks at the last `SEARCH_WINDOW` tokens only,
a bounded cost per request and step whatever the context's length.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvservice.core.outputs import ScheduledRequest
from kvservice.core.request import RequestStatus
from kvservice.worker.sampler import Sampler

# Tokens searched per request and step, the latest ones: a quoted passage or the code being edited
# is usually this recent. A full window's lookup takes 50-70 us (2 busy cores): ~1 ms of a
# 16-request decode step of ~50 ms.
SEARCH_WINDOW = 2048


class NgramProposer:
    """Proposes by prompt lookup; satisfies `kvservice.worker.proposer.Proposer`."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_max: int, prompt_lookup_min: int) -> None:
        assert 1 <= prompt_lookup_min <= prompt_lookup_max and num_speculative_tokens > 0
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup_max = prompt_lookup_max
        self.prompt_lookup_min = prompt_lookup_min
        # Deterministic proposals have one-hot laws: no entry ever (the verifier's draft_probs=None).
        self.draft_probs: dict[str, torch.Tensor] = {}

    def take_num_prompt_tokens_computed(self) -> int:
        return 0  # no model runs over the prompt

    def forget(self, request_ids: set[str]) -> None:
        """Nothing is kept per request: every lookup reads the request's tokens afresh."""

    def propose(self, scheduled: list[ScheduledRequest], new_token_ids: dict[str, list[int]], sampler: Sampler) -> None:
        """After the target's step: each running, unconstrained request that sampled proposes
        from its tokens and the new ones (which the scheduler appends after this pass)."""
        for s in scheduled:
            request = s.request
            new = new_token_ids.get(request.request_id)
            # A mid-prompt chunk samples nothing; a constrained request decodes without drafts
            # (its verification would not apply its grammar's masks).
            is_constrained = request.sampling_params.structured_output is not None
            if not new or request.status is not RequestStatus.RUNNING or is_constrained:
                continue
            # Never more than the request may still emit: the verify step adds the target's own token.
            num_tokens = min(self.num_speculative_tokens, request.max_num_tokens - request.num_tokens - len(new) - 1)
            if num_tokens <= 0:
                continue
            recent = request.all_token_ids[-(SEARCH_WINDOW - len(new)) :] + new
            request.spec_token_ids = lookup_ngram(recent, num_tokens, self.prompt_lookup_max, self.prompt_lookup_min)


def lookup_ngram(token_ids: Sequence[int], num_tokens: int, max_n: int, min_n: int) -> list[int]:
    """The up to `num_tokens` tokens that followed the latest earlier occurrence of the last n of
    `token_ids`, for the largest n in [min_n, max_n] that occurs earlier; [] if none does."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    num_candidates = len(tokens) - 1  # an occurrence ends at j <= len - 2: one token must follow it
    if num_candidates < min_n:
        return []
    # match[j]: the occurrence ending at j agrees with the suffix for `i + 1` tokens so far;
    # length[j]: for how many tokens it agrees (at most max_n).
    match = tokens[:-1] == tokens[-1]
    length = match.astype(np.int32)
    for i in range(1, min(max_n, num_candidates)):
        deeper = np.zeros(num_candidates, dtype=bool)
        deeper[i:] = tokens[: num_candidates - i] == tokens[-1 - i]
        match &= deeper
        if not match.any():
            break
        length += match
    best = int(length.max())
    if best < min_n:
        return []
    end = int(np.flatnonzero(length == best)[-1])  # the latest of the longest
    return tokens[end + 1 : end + 1 + num_tokens].tolist()
