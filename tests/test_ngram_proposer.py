"""Prompt lookup: the tokens that followed the latest, longest earlier match of a request's last
tokens; proposed only by running, unconstrained requests that sampled, and never past their end."""

from __future__ import annotations

import torch

from kvservice.core.outputs import ScheduledRequest
from kvservice.core.request import Request, RequestStatus
from kvservice.core.sampling_params import SamplingParams
from kvservice.core.structured_output import StructuredOutputParams
from kvservice.worker.ngram_proposer import SEARCH_WINDOW, NgramProposer, lookup_ngram
from kvservice.worker.proposer import Proposer
from kvservice.worker.sampler import Sampler


def test_a_match_proposes_what_followed_it() -> None:
    # ... 7 8 9 | 10 11 12 13 ... then 7 8 9 again: propose 10 11 12.
    tokens = [1, 2, 7, 8, 9, 10, 11, 12, 13, 4, 7, 8, 9]
    assert lookup_ngram(tokens, 3, max_n=4, min_n=2) == [10, 11, 12]


def test_no_match_proposes_nothing() -> None:
    assert lookup_ngram([1, 2, 3, 4, 5, 6], 3, max_n=4, min_n=1) == []
    assert lookup_ngram([5], 3, max_n=4, min_n=1) == []
    assert lookup_ngram([], 3, max_n=4, min_n=1) == []


def test_matches_shorter_than_min_are_ignored() -> None:
    tokens = [3, 9, 1, 2, 9]  # only the last token (9) occurs earlier
    assert lookup_ngram(tokens, 2, max_n=4, min_n=1) == [1, 2]
    assert lookup_ngram(tokens, 2, max_n=4, min_n=2) == []


def test_a_match_near_the_end_proposes_fewer_tokens() -> None:
    # The earlier "5 6" is followed by 7, then by the suffix itself: 3 tokens where 4 were asked for.
    assert lookup_ngram([5, 6, 7, 5, 6], 4, max_n=4, min_n=2) == [7, 5, 6]
    # A run of one token: every earlier position matches; the latest leaves one token to propose.
    assert lookup_ngram([4, 4, 4, 4], 3, max_n=2, min_n=2) == [4]


def test_the_longest_match_wins_over_a_more_recent_shorter_one() -> None:
    tokens = [1, 2, 3, 50, 51, 9, 2, 3, 60, 61, 7, 1, 2, 3]
    # "1 2 3" occurs at the start (-> 50 51); "2 3" more recently (-> 60 61).
    assert lookup_ngram(tokens, 2, max_n=3, min_n=2) == [50, 51]
    # Capped at 2 tokens, both are "2 3" matches: the latest wins.
    assert lookup_ngram(tokens, 2, max_n=2, min_n=2) == [60, 61]


def test_among_equally_long_matches_the_latest_wins() -> None:
    tokens = [8, 9, 1, 1, 8, 9, 2, 2, 8, 9]
    assert lookup_ngram(tokens, 2, max_n=4, min_n=2) == [2, 2]


def _running(
    prompt: list[int], max_tokens: int = 50, num_computed: int | None = None, **params: object
) -> ScheduledRequest:
    request = Request("r", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, **params))  # type: ignore[arg-type]
    request.status = RequestStatus.RUNNING
    request.num_computed_tokens = len(prompt) - 1 if num_computed is None else num_computed
    return ScheduledRequest(request, 1, [0])


SAMPLER = Sampler(torch.device("cpu"), 0)  # the proposer draws nothing


def test_the_proposer_looks_up_the_new_tokens_too() -> None:
    proposer = NgramProposer(3, prompt_lookup_max=4, prompt_lookup_min=2)
    s = _running([10, 20, 30, 40, 50, 60, 1, 10])
    proposer.propose([s], {"r": [20]}, SAMPLER)  # 10 20 is the suffix once 20 is appended
    assert s.request.spec_token_ids == [30, 40, 50]
    assert proposer.draft_probs == {}  # deterministic: one-hot laws, left to the verifier


def test_only_requests_that_sampled_and_run_propose() -> None:
    proposer = NgramProposer(3, prompt_lookup_max=4, prompt_lookup_min=2)
    prompt = [10, 20, 30, 40, 50, 10, 20]
    mid_prompt = _running(prompt, num_computed=2)  # a chunk that samples nothing
    proposer.propose([mid_prompt], {}, SAMPLER)
    assert mid_prompt.request.spec_token_ids == []
    preempted = _running(prompt)
    preempted.request.status = RequestStatus.PREEMPTED
    proposer.propose([preempted], {"r": [30]}, SAMPLER)
    assert preempted.request.spec_token_ids == []
    constrained = _running(prompt, structured_output=StructuredOutputParams(regex="[0-9]+"))
    proposer.propose([constrained], {"r": [30]}, SAMPLER)
    assert constrained.request.spec_token_ids == []


def test_proposals_stop_where_the_request_must() -> None:
    proposer = NgramProposer(4, prompt_lookup_max=4, prompt_lookup_min=2)
    prompt = [10, 20, 30, 40, 50, 60, 70, 10]
    # max_tokens 4: after this step's token 3 remain; the verify step adds one of the target's.
    s = _running(prompt, max_tokens=4)
    proposer.propose([s], {"r": [20]}, SAMPLER)
    assert s.request.spec_token_ids == [30, 40]
    last = _running(prompt, max_tokens=2)  # one token left: the target's own
    proposer.propose([last], {"r": [20]}, SAMPLER)
    assert last.request.spec_token_ids == []


def test_the_search_looks_at_a_bounded_window() -> None:
    proposer = NgramProposer(2, prompt_lookup_max=3, prompt_lookup_min=3)
    filler = [7] * SEARCH_WINDOW
    far = _running([1, 2, 3, 4, 5, *filler, 1, 2])
    proposer.propose([far], {"r": [3]}, SAMPLER)
    assert far.request.spec_token_ids == []  # "1 2 3" lies before the window
    near = _running([*filler, 1, 2, 3, 4, 5, 1, 2])
    proposer.propose([near], {"r": [3]}, SAMPLER)
    assert near.request.spec_token_ids == [4, 5]


def test_it_satisfies_the_proposer_contract() -> None:
    proposer: Proposer = NgramProposer(3, prompt_lookup_max=4, prompt_lookup_min=1)
    proposer.forget({"r", "unknown"})  # nothing kept: a no-op
    assert proposer.draft_probs == {}
