"""The greedy LM head (`kvservice.model.greedy_head`): its tokens are the argmax of the full
float32 logits `block_quant_linear` computes, exactly, whatever the rows (ties, near-ties,
outliers, zeros); rows it cannot serve come back to the caller; a model serves greedy
requests with it and gives the tokens the logits give.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import require_cpu_kernels
from gguf_models import random_block_quant_weight

from kvservice import LLM, SamplingParams
from kvservice.model.block_quant import BlockQuantWeight
from kvservice.model.cpu_kernels import load_cpu_kernels
from kvservice.model.greedy_head import MIN_ROWS, GreedyHead
from kvservice.model.model import CausalLM


@pytest.fixture(scope="module")
def greedy_head_built() -> None:
    require_cpu_kernels()
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip(
            "neither the AVX2 nor the AVX-512 build: models compute full logits (test_smollm2_* checks that path)"
        )
    assert torch.ops.kvservice.greedy_head_supported(), "the AVX2 and AVX-512 builds serve the greedy head"


def _full_argmax(weight: BlockQuantWeight, x: torch.Tensor) -> list[int]:
    logits = weight.linear(x)
    assert logits.shape[0] >= MIN_ROWS  # the in-order sums the head's exact part reproduces
    return logits.argmax(-1).tolist()  # the first of equal values, as the sampler's argmax


@pytest.mark.parametrize("num_rows", [4, 5, 8, 9, 16, 17, 40])
@pytest.mark.parametrize("is_signed", [True, False])
def test_tokens_are_the_full_logits_argmax(greedy_head_built: None, num_rows: int, is_signed: bool) -> None:
    weight = random_block_quant_weight(4096, 576, is_signed, seed=num_rows)
    head = GreedyHead.build(weight)
    gen = torch.Generator().manual_seed(num_rows)
    x = torch.randn(num_rows, 576, generator=gen)
    x[1, 17] = 60.0  # an outlier, as final hidden states have
    x[2, :32] = 0.0  # a block of zeros
    x[3] *= 1e-3
    assert head.tokens(x) == _full_argmax(weight, x)


def test_signed_codes_with_mins_keep_them_in_the_estimates(greedy_head_built: None) -> None:
    base = random_block_quant_weight(2048, 576, True, seed=3)
    gen = torch.Generator().manual_seed(3)
    mins = (torch.rand(base.mins.shape, generator=gen) * 0.3 - 0.15).half()
    weight = BlockQuantWeight(base.codes, base.scales, mins)
    head = GreedyHead.build(weight)
    assert head.with_mins and not GreedyHead.build(base).with_mins
    x = torch.randn(9, 576, generator=gen)
    x[1, 40] = 50.0
    assert head.tokens(x) == _full_argmax(weight, x)


def test_equal_logits_go_to_the_first_index(greedy_head_built: None) -> None:
    x = torch.randn(6, 288, generator=torch.Generator().manual_seed(1))
    codes = torch.randint(-20, 20, (512, 288), generator=torch.Generator().manual_seed(2), dtype=torch.int8)
    codes[37] = codes[300] = (x[0].sign() * 127).to(torch.int8)  # two equal columns, largest for row 0
    scales = torch.full((512, 288 // 32), 0.01).half().float()
    weight = BlockQuantWeight.from_rows(codes, scales, torch.zeros_like(scales))
    tokens = GreedyHead.build(weight).tokens(x)
    assert tokens is not None and tokens[0] == 37
    assert tokens == _full_argmax(weight, x)


def test_near_ties_are_decided_by_the_float32_logits(greedy_head_built: None) -> None:
    # Columns one code step apart in one place: their logits differ far less than the 8-bit
    # estimate's error, so only the float32 pass can tell them apart.
    x = torch.randn(8, 576, generator=torch.Generator().manual_seed(3)).abs()
    codes = torch.randint(-30, 30, (256, 576), generator=torch.Generator().manual_seed(4), dtype=torch.int8)
    best = torch.full((576,), 100, dtype=torch.int8)
    for i, column in enumerate((10, 90, 170, 250)):
        codes[column] = best
        codes[column, 5 * i] = 101 if i % 2 else 99
    scales = torch.full((256, 576 // 32), 0.005).half().float()
    weight = BlockQuantWeight.from_rows(codes, scales, torch.zeros_like(scales))
    tokens = GreedyHead.build(weight).tokens(x)
    assert tokens == _full_argmax(weight, x)
    assert set(tokens or []) <= {90, 250}


def test_a_row_that_is_not_finite_is_left_to_the_caller(greedy_head_built: None) -> None:
    weight = random_block_quant_weight(512, 288, True, seed=5)
    x = torch.randn(4, 288, generator=torch.Generator().manual_seed(6))
    x[2, 40] = float("inf")
    assert GreedyHead.build(weight).tokens(x) is None


def test_the_op_rejects_arguments_it_cannot_read(greedy_head_built: None) -> None:
    weight = random_block_quant_weight(512, 288, True, seed=7)
    head = GreedyHead.build(weight)
    x = torch.randn(4, 288)
    with pytest.raises(RuntimeError, match="code_offset"):
        torch.ops.kvservice.greedy_head(
            x, head.vnni_codes, 0, weight.codes, weight.scales, weight.mins, head.abs_sums, True
        )
    with pytest.raises(RuntimeError, match="vnni_codes"):
        torch.ops.kvservice.greedy_head(
            torch.randn(4, 320), head.vnni_codes, 128, weight.codes, weight.scales, weight.mins, head.abs_sums, True
        )


_TOKEN_TESTS = "full_logits_argmax or keep_them_in_the_estimates or first_index or decided_by_the_float32"


@pytest.mark.skipif(os.environ.get("KVSERVICE_GREEDY_HEAD_DOT") == "maddubs", reason="already the AVX2 estimates")
def test_the_avx2_estimates_give_the_same_tokens(greedy_head_built: None) -> None:
    """The AVX2 estimates (vpmaddubsw) serve CPUs without VNNI; where the CPU has it, they would
    go untested: this file's token tests again, with the op made to take them."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            __file__,
            "-m",
            "not slow",
            "-k",
            _TOKEN_TESTS,
        ],
        env={**os.environ, "KVSERVICE_GREEDY_HEAD_DOT": "maddubs"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert "17 passed" in result.stdout, result.stdout[-3000:]


@pytest.mark.slow
def test_smollm2_greedy_batches_take_the_head_and_keep_their_tokens(
    smollm2_llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch of greedy requests samples through `greedy_tokens` (the AVX2 and AVX-512 builds) and
    generates the tokens the full logits give; one that wants logprobs computes the logits."""
    model = smollm2_llm.engine.core.loaded.model
    supported = load_cpu_kernels() and torch.ops.kvservice.greedy_head_supported()
    assert (model._greedy_head is not None) == supported
    prompts = [[1, 504, 3458, 282 + i] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    served: list[int] = []
    original = CausalLM.greedy_tokens

    def counted(self: CausalLM, hidden: torch.Tensor) -> list[int] | None:
        tokens = original(self, hidden)
        served.append(tokens is not None)
        return tokens

    monkeypatch.setattr(CausalLM, "greedy_tokens", counted)
    fast = smollm2_llm.generate(prompts, params)
    assert any(served) == supported
    with monkeypatch.context() as full:
        full.setattr(CausalLM, "greedy_tokens", lambda self, hidden: None)
        reference = smollm2_llm.generate(prompts, params)
    assert [o.token_ids for o in fast] == [o.token_ids for o in reference]
    served.clear()
    smollm2_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1))
    assert not served
