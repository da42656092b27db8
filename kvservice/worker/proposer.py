"""The contract of speculative decoding's proposers, as the model runner calls them.

Per step, in order:
1. `forget(finished_req_ids)`: before the step, drop what the proposer keeps for finished requests.
2. The target's forward, then sampling; a request that carried proposals has them verified
   (`kvservice.worker.rejection_sampler.verify_draft_tokens`) with its `draft_probs`, popped.
3. `propose(scheduled, sampled, sampler)`: after sampling, while the KV save may be in flight,
   set `request.spec_token_ids` for the next step's verification.

Two proposers satisfy it: `DraftProposer` (a draft model) and `NgramProposer` (prompt lookup).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from kvservice.core.outputs import ScheduledRequest
    from kvservice.worker.sampler import Sampler


class Proposer(Protocol):
    # request_id -> [K, V]: the distributions the proposed tokens were drawn from, for sampled
    # requests' rejection sampling. A request without an entry proposed deterministically (a
    # one-hot draft law, which verification takes as `draft_probs=None`).
    draft_probs: dict[str, torch.Tensor]

    def forget(self, request_ids: set[str]) -> None:
        """Called by the runner before each step with the requests that finished since the last."""
        ...

    def take_num_prompt_tokens_computed(self) -> int:
        """Prompt tokens a draft model ran over since the last call (its stats; 0 without a model)."""
        ...

    def propose(self, scheduled: list[ScheduledRequest], new_token_ids: dict[str, list[int]], sampler: Sampler) -> None:
        """Called by the runner after the target's step: `new_token_ids` are the tokens each
        sampling request got this step (not yet appended to it). Sets `spec_token_ids` on the
        requests that propose: only running, unconstrained requests that sampled, at most
        `max_num_tokens - num_tokens - 1` tokens (the verify step adds one of the target's)."""
        ...
