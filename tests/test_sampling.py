"""Sampling parameters, request validation and sampling behaviour, on the `tiny` model."""

from __future__ import annotations

import pathlib

import pytest
import torch

from kvservice import LLM, SamplingParams
from kvservice.worker.sampler import apply_top_k_top_p

PROMPT = [256, *b"The cache"]
OTHER_PROMPTS = [[256, *b"hello"], [256, *b"a much longer prompt that needs more than one block"], [256, 7]]


@pytest.fixture(scope="module")
def tiny() -> LLM:
    return LLM("tiny", num_blocks=64, max_model_len=128, max_num_batched_tokens=64)


def sample(llm: LLM, prompt: list[int], **params: object) -> list[int]:
    [out] = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True, **params))  # type: ignore[arg-type]
    return out.token_ids


# ------------------------------------------------------------ SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": -0.2}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 0}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"stop_token_ids": [5, -1]}, "stop_token_ids"),
        ({"stop_token_ids": range(1025)}, "stop_token_ids"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_boundary_sampling_params_are_accepted() -> None:
    p = SamplingParams(temperature=0, top_p=1.0, top_k=-1, max_tokens=1, stop_token_ids=[3, 4])
    assert p.is_greedy
    assert p.stop_token_ids == (3, 4)
    assert not SamplingParams(temperature=0.01, top_k=1, top_p=1e-9).is_greedy


# ------------------------------------------------------------ request validation


def test_empty_prompt_is_refused(tiny: LLM) -> None:
    with pytest.raises(ValueError, match="prompt: empty"):
        tiny.generate([[]])
    with pytest.raises(ValueError, match="prompt: empty"):
        tiny.engine.add_request([], SamplingParams())
    assert tiny.engine.core.scheduler.num_unfinished == 0


def test_prompt_at_the_max_model_len_is_refused(tiny: LLM) -> None:
    with pytest.raises(ValueError, match="prompt.*128"):
        tiny.generate([[65] * 128])
    [out] = tiny.generate([[65] * 127], SamplingParams(max_tokens=5, ignore_eos=True))
    assert len(out.token_ids) == 1 and out.finish_reason == "length"  # one slot left


@pytest.mark.parametrize("bad", [320, 10_000, -1])
def test_token_id_outside_the_vocabulary_is_refused(tiny: LLM, bad: int) -> None:
    with pytest.raises(ValueError, match="prompt_token_ids"):
        tiny.generate([[1, 2, bad]])


def test_text_prompt_without_a_tokenizer_is_refused(llama_dir: pathlib.Path) -> None:
    llm = LLM(str(llama_dir), num_blocks=8)
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate("hello")


def test_a_bad_prompt_in_a_batch_leaves_the_engine_clean() -> None:
    # An engine of its own: the failed call's aborted requests must not leak into the next call.
    tiny = LLM("tiny", num_blocks=64, max_model_len=128)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = tiny.generate(OTHER_PROMPTS, greedy)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        tiny.generate([*OTHER_PROMPTS, [999]], greedy)
    assert tiny.engine.core.scheduler.num_unfinished == 0
    assert tiny.engine.num_free_blocks == tiny.engine.num_blocks
    again = tiny.generate(OTHER_PROMPTS, greedy)
    assert [o.token_ids for o in again] == [o.token_ids for o in expected]


# ------------------------------------------------------------ sampling


def test_seeded_sampling_is_reproducible(tiny: LLM) -> None:
    first = sample(tiny, PROMPT, temperature=1.0, seed=7)
    assert sample(tiny, PROMPT, temperature=1.0, seed=7) == first
    # Another engine, with another engine-wide seed: a request's seed alone decides.
    other_engine = LLM("tiny", num_blocks=64, max_model_len=128, seed=99)
    assert sample(other_engine, PROMPT, temperature=1.0, seed=7) == first


def test_seeded_sampling_does_not_depend_on_the_batch(tiny: LLM) -> None:
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    alone = tiny.generate([PROMPT], params)[0].token_ids
    others = [
        SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=7, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
    ]
    outputs = tiny.generate(
        [OTHER_PROMPTS[0], PROMPT, OTHER_PROMPTS[1], OTHER_PROMPTS[2]], [others[0], params, *others[1:]]
    )
    assert outputs[1].token_ids == alone


def test_top_k_one_is_greedy(tiny: LLM) -> None:
    greedy = sample(tiny, PROMPT, temperature=0)
    assert sample(tiny, PROMPT, temperature=1.5, top_k=1) == greedy
    assert sample(tiny, PROMPT, temperature=1.5, top_k=1, seed=3) == greedy


def test_tiny_top_p_is_greedy(tiny: LLM) -> None:
    greedy = sample(tiny, PROMPT, temperature=0)
    assert sample(tiny, PROMPT, temperature=1.5, top_p=1e-6) == greedy


def test_temperature_sampling_varies_with_the_seed(tiny: LLM) -> None:
    greedy = sample(tiny, PROMPT, temperature=0)
    outputs = {tuple(sample(tiny, PROMPT, temperature=1.0, seed=s)) for s in range(6)}
    assert len(outputs) >= 4
    assert all(o != tuple(greedy) for o in outputs)


def test_top_k_filter_keeps_the_k_largest() -> None:
    logits = torch.tensor([1.0, 4.0, 3.0, -2.0, 2.0])
    kept = apply_top_k_top_p(logits, top_k=2, top_p=1.0)
    assert torch.isfinite(kept).tolist() == [False, True, True, False, False]
    assert kept[1] == 4.0 and kept[2] == 3.0


@pytest.mark.parametrize(("top_p", "keep"), [(0.3, 1), (0.5, 1), (0.7, 2), (0.9, 3), (0.99, 4), (1.0, 4)])
def test_top_p_filter_keeps_the_smallest_nucleus(top_p: float, keep: int) -> None:
    probs = torch.tensor([0.05, 0.6, 0.25, 0.1])  # by rank: 0.6, 0.25, 0.1, 0.05
    kept = apply_top_k_top_p(probs.log(), top_k=-1, top_p=top_p)
    ranked = [1, 2, 3, 0]
    assert [bool(torch.isfinite(kept[i])) for i in ranked] == [True] * keep + [False] * (4 - keep)
