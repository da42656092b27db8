"""Logprobs: the log-softmax of the model's raw logits, for generated tokens and prompt
tokens, equal to transformers' on the same random checkpoint (float32, within 1e-4),
through chunked prefill and with prefix caching on (a prompt-logprobs request computes
the positions it reports; it never takes them from the cache)."""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hf_models import random_prompts

from kvservice import LLM, SamplingParams
from kvservice.core.logprobs import MAX_LOGPROBS, TokenLogprobs
from kvservice.worker.logprobs import token_logprobs

ATOL = 1e-4
NUM_TOP = 5
MAX_TOKENS = 8
PROMPT_LENGTHS = (2, 9, 17, 33, 40)
# 16 tokens a step: the longer prompts run in chunks, so prompt logprobs are gathered across steps.
ENGINE = dict(num_blocks=64, max_num_batched_tokens=16, max_num_seqs=4)
SMOLLM2_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Bees make honey and",
]


def hf_log_softmax(path: pathlib.Path, token_ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax of its logits over `token_ids`: row p predicts token p + 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0]
    return logits.float().log_softmax(-1)


def assert_position(got: TokenLogprobs, expected_row: torch.Tensor, token_id: int, num_top: int) -> None:
    """One reported position against the reference row: the token's logprob and rank, the top list."""
    assert got.token_id == token_id
    assert got.logprob == pytest.approx(float(expected_row[token_id]), abs=ATOL)
    # Ranks of tokens tied with this one within the tolerance may go either way.
    chosen = expected_row[token_id]
    assert int((expected_row > chosen + ATOL).sum()) + 1 <= got.rank <= int((expected_row > chosen - ATOL).sum())
    values, ids = expected_row.topk(num_top)
    assert [v for _, v in got.top] == pytest.approx(values.tolist(), abs=ATOL)
    # Ids may swap only where two logprobs tie within the tolerance.
    for (got_id, _), want_id, want in zip(got.top, ids.tolist(), values.tolist()):
        assert got_id == want_id or abs(float(expected_row[got_id]) - want) <= ATOL


@pytest.mark.parametrize(("kind", "enable_prefix_caching"), [("llama", True), ("qwen2", True), ("llama", False)])
def test_prompt_and_sampled_logprobs_match_transformers(
    kind: str, enable_prefix_caching: bool, hf_model_dir: Callable[[str], pathlib.Path]
) -> None:
    path = hf_model_dir(kind)
    prompts = random_prompts(PROMPT_LENGTHS, seed=3)
    llm = LLM(str(path), enable_prefix_caching=enable_prefix_caching, **ENGINE)
    params = SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=NUM_TOP, prompt_logprobs=NUM_TOP
    )
    # Twice: the second round's prompts are all in the prefix cache, and are still computed.
    for round_ in range(2):
        outputs = llm.generate(prompts, params)
        for prompt, out in zip(prompts, outputs):
            assert len(out.token_ids) == MAX_TOKENS
            reference = hf_log_softmax(path, prompt + out.token_ids)
            assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt) - 1, round_
            for p, got in enumerate(out.prompt_logprobs):
                assert_position(got, reference[p], prompt[p + 1], NUM_TOP)
            assert out.logprobs is not None and len(out.logprobs) == MAX_TOKENS
            for i, (token_id, got) in enumerate(zip(out.token_ids, out.logprobs)):
                assert_position(got, reference[len(prompt) - 1 + i], token_id, NUM_TOP)
                assert got.rank == 1  # greedy: the sampled token is the most likely one
            assert out.num_cached_tokens == 0  # a prompt-logprobs request computes its whole prompt


def test_logprobs_are_of_the_raw_logits_not_the_tempered_ones(llama_dir: pathlib.Path) -> None:
    prompt = random_prompts((12,), seed=5)[0]
    llm = LLM(str(llama_dir), **ENGINE)
    out = llm.generate(
        prompt, SamplingParams(temperature=1.7, top_k=40, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    )[0]
    reference = hf_log_softmax(llama_dir, prompt + out.token_ids)
    assert out.logprobs is not None and len(out.logprobs) == MAX_TOKENS
    for i, (token_id, got) in enumerate(zip(out.token_ids, out.logprobs)):
        assert got.top == ()  # logprobs=0: the token's own only
        assert got.logprob == pytest.approx(float(reference[len(prompt) - 1 + i, token_id]), abs=ATOL)
    # A request without logprobs reports none, and the cached prefix counts once it is cached.
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2))[0]
    assert plain.logprobs is None and plain.prompt_logprobs is None
    assert plain.num_cached_tokens == 0  # 12 tokens: less than a full block of 16 was cached


def test_requests_with_and_without_logprobs_in_one_batch_get_their_own(llama_dir: pathlib.Path) -> None:
    prompts = random_prompts((20, 7, 30), seed=8)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    asks = [dataclasses.replace(greedy, logprobs=k) for k in (3, None, MAX_LOGPROBS)]
    llm = LLM(str(llama_dir), **ENGINE)
    outputs = llm.generate(prompts, asks)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in llm.generate(prompts, greedy)]
    assert outputs[1].logprobs is None
    assert [len(lp.top) for lp in outputs[0].logprobs or []] == [3] * MAX_TOKENS
    assert [len(lp.top) for lp in outputs[2].logprobs or []] == [MAX_LOGPROBS] * MAX_TOKENS


def test_prompt_logprobs_skip_the_prefix_cache_but_later_requests_use_it(llama_dir: pathlib.Path) -> None:
    prompt = random_prompts((40,), seed=9)[0]
    llm = LLM(str(llama_dir), **ENGINE)
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    first = llm.generate(prompt, greedy)[0]
    assert first.num_cached_tokens == 0
    with_prompt_logprobs = llm.generate(prompt, dataclasses.replace(greedy, prompt_logprobs=0))[0]
    assert with_prompt_logprobs.num_cached_tokens == 0
    assert (
        with_prompt_logprobs.prompt_logprobs is not None
        and len(with_prompt_logprobs.prompt_logprobs) == len(prompt) - 1
    )
    assert llm.generate(prompt, greedy)[0].num_cached_tokens == 32  # two full blocks of 16


@pytest.mark.parametrize("value", [-1, MAX_LOGPROBS + 1, True, 2.0])
def test_out_of_range_logprobs_are_refused_naming_the_field(value: object) -> None:
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=name):
            SamplingParams(**{name: value})  # type: ignore[arg-type]


def test_token_logprobs_ranks_and_top() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0], [5.0, -1.0, 0.0, 0.0]])
    rows = token_logprobs(logits, [2, 0], num_top=2)
    expected = logits.log_softmax(-1)
    assert rows[0].rank == 3 and rows[1].rank == 1  # ties share the better rank: 1, 1, then 3
    assert rows[0].logprob == pytest.approx(float(expected[0, 2]))
    assert {t for t, _ in rows[0].top} == {1, 3}
    assert rows[1].top[0] == (0, pytest.approx(float(expected[1, 0])))


@pytest.mark.slow
def test_smollm2_logprobs_match_transformers(
    smollm2_llm: LLM, smollm2_hf_tokenizer: Any, smollm2_hf_model: Any
) -> None:
    """The real model (its kernels on the GGUF's Q4_1 blocks) against transformers on the
    same weights dequantized to float32: prompt and generated positions within 1e-4."""
    prompts = [smollm2_hf_tokenizer(text)["input_ids"] for text in SMOLLM2_PROMPTS]
    params = SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=NUM_TOP, prompt_logprobs=NUM_TOP
    )
    worst = 0.0
    for prompt, out in zip(prompts, smollm2_llm.generate(prompts, params)):
        with torch.no_grad():
            logits = smollm2_hf_model(torch.tensor([prompt + out.token_ids])).logits[0]
        reference = logits.float().log_softmax(-1)
        assert out.prompt_logprobs is not None and out.logprobs is not None
        for p, got in enumerate(out.prompt_logprobs):
            assert_position(got, reference[p], prompt[p + 1], NUM_TOP)
            worst = max(worst, abs(got.logprob - float(reference[p, prompt[p + 1]])))
        for i, (token_id, got) in enumerate(zip(out.token_ids, out.logprobs)):
            assert_position(got, reference[len(prompt) - 1 + i], token_id, NUM_TOP)
    assert worst > 0.0  # the comparison ran over real differences, not one path twice
