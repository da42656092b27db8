"""Parallel sampling (`n` > 1) in the engine: the prompt is computed once and its blocks are
shared by reference count (with prefix caching off too); sequence i equals the request sent
alone with seed + i; aborting the request aborts every sequence and frees every block."""

from __future__ import annotations

import dataclasses

import pytest

from kvservice import LLM, SamplingParams
from kvservice.core.sampling_params import MAX_N

BLOCK_SIZE = 16
PROMPT = [(7 * i + 3) % 250 + 3 for i in range(40)]  # two full blocks, and 8 tokens in a third
NUM_SHARED_BLOCKS = (len(PROMPT) - 1) // BLOCK_SIZE
N = 4
MAX_TOKENS = 8  # each sequence's tail stays inside the prompt's third block
SEEDED = SamplingParams(temperature=0.9, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True, n=N)


def tiny(enable_prefix_caching: bool) -> LLM:
    return LLM(
        "tiny", block_size=BLOCK_SIZE, num_blocks=64, max_model_len=256, enable_prefix_caching=enable_prefix_caching
    )


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_each_sequence_equals_the_request_alone_with_its_seed(enable_prefix_caching: bool) -> None:
    llm = tiny(enable_prefix_caching)
    outputs = llm.generate(PROMPT, SEEDED)
    assert [o.index for o in outputs] == list(range(N))
    assert len({o.request_id for o in outputs}) == 1
    alone = [llm.generate(PROMPT, dataclasses.replace(SEEDED, n=1, seed=SEEDED.seed + i))[0] for i in range(N)]  # type: ignore[operator]
    assert [o.token_ids for o in outputs] == [a.token_ids for a in alone]
    assert len({tuple(o.token_ids) for o in outputs}) == N  # different seeds, different sequences
    assert all(o.finish_reason == "length" for o in outputs)


def test_the_prompt_runs_once_and_its_blocks_are_shared() -> None:
    llm = tiny(enable_prefix_caching=False)  # sharing must not depend on the prefix cache
    engine = llm.engine
    free_at_start = engine.core.scheduler.kv.num_free_blocks
    request_id = engine.add_request(PROMPT, SEEDED)
    sequence_ids = [request_id, *(f"{request_id}/{i}" for i in range(1, N))]
    num_prompt_tokens_computed = 0
    tables: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        scheduler_output = engine.core.scheduler.schedule()
        num_prompt_tokens_computed += sum(
            min(s.num_new_tokens, max(0, len(PROMPT) - s.request.num_computed_tokens))
            for s in scheduler_output.scheduled
        )
        runner_output = engine.core.runner.execute_model(scheduler_output)
        engine.core.scheduler.update_from_output(
            scheduler_output, runner_output.sampled_token_ids, runner_output.kv_connector_output
        )
        tables.update(
            {
                r: list(engine.core.scheduler.kv.get_block_ids(r))
                for r in sequence_ids
                if engine.core.scheduler.kv.get_block_ids(r)
            }
        )
    leader_blocks = tables[request_id][:NUM_SHARED_BLOCKS]
    assert all(tables[r][:NUM_SHARED_BLOCKS] == leader_blocks for r in sequence_ids)
    # Past the shared blocks each sequence has its own (its tail of the prompt, then its tokens).
    tails = [b for r in sequence_ids for b in tables[r][NUM_SHARED_BLOCKS:]]
    assert len(set(tails)) == len(tails) == N
    # The prompt once, plus each sibling's tail past the shared blocks.
    assert num_prompt_tokens_computed == len(PROMPT) + (N - 1) * (len(PROMPT) - NUM_SHARED_BLOCKS * BLOCK_SIZE)
    assert engine.core.scheduler.kv.num_free_blocks == free_at_start


def test_greedy_sequences_are_all_the_greedy_answer() -> None:
    llm = tiny(enable_prefix_caching=True)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    [expected] = llm.generate(PROMPT, greedy)
    outputs = llm.generate(PROMPT, dataclasses.replace(greedy, n=3, logprobs=2))
    assert [o.token_ids for o in outputs] == [expected.token_ids] * 3
    assert all(o.logprobs is not None and len(o.logprobs) == MAX_TOKENS for o in outputs)


def test_abort_ends_every_sequence_and_frees_every_block() -> None:
    llm = tiny(enable_prefix_caching=False)
    engine = llm.engine
    free_at_start = engine.core.scheduler.kv.num_free_blocks
    request_id = engine.add_request(PROMPT, dataclasses.replace(SEEDED, max_tokens=50))
    outputs = engine.step() + engine.step()
    assert engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        outputs += engine.step()
    ends = [o for o in outputs if o.finished]
    assert sorted(o.index for o in ends) == list(range(N)) and all(o.finish_reason == "abort" for o in ends)
    assert [o.all_finished for o in ends].count(True) == 1 and ends[-1].all_finished
    assert engine.core.scheduler.kv.num_free_blocks == free_at_start


@pytest.mark.parametrize("n", [0, MAX_N + 1, True])
def test_out_of_range_n_is_refused(n: object) -> None:
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=n)  # type: ignore[arg-type]


def test_a_sequence_id_in_use_is_refused() -> None:
    llm = tiny(enable_prefix_caching=True)
    llm.engine.add_request(PROMPT, SamplingParams(max_tokens=50), request_id="r/1")
    with pytest.raises(ValueError, match="r/1"):
        llm.engine.add_request(PROMPT, SEEDED, request_id="r")
