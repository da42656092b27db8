"""Block-quantized weights: the C++ kernel equals the PyTorch formula, and the weights it
reads are the GGUF loader's float32 (or bfloat16) weights bit for bit (so the model computes
the same function with either path).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import threading

import pytest
import torch
from conftest import require_cpu_kernels
from gguf_models import GGUFSpec, random_block_quant_weight, random_state, write_gguf

from kvservice import LLM, SamplingParams
from kvservice.loading.gguf_loader import (
    block_rows,
    gguf_block_quant_rows,
    gguf_model_config,
    gguf_state_dict,
    open_gguf,
)
from kvservice.loading.model_loader import load_model
from kvservice.model import model as model_module
from kvservice.model.block_quant import BlockQuantWeight
from kvservice.model.model import Linear

SPEC = GGUFSpec(arch="llama", hidden_size=256, intermediate_size=320, num_layers=2, num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module")
def kernels() -> None:
    require_cpu_kernels()


@pytest.mark.parametrize("num_rows", [1, 2, 3, 5, 6, 7, 9, 13, 16, 17, 64, 81, 300])
# (1024, 288): rows of the output 4 KiB apart, which the buffered path sums in a tile of its own.
@pytest.mark.parametrize(
    ("shape", "is_signed"), [((960, 576), False), ((576, 1536), False), ((160, 288), True), ((1024, 288), False)]
)
def test_kernel_equals_the_pytorch_formula(
    kernels: None, num_rows: int, shape: tuple[int, int], is_signed: bool
) -> None:
    weight = random_block_quant_weight(*shape, is_signed, seed=num_rows)
    x = torch.randn(num_rows, shape[1], generator=torch.Generator().manual_seed(7))
    # Only the order of each dot product's additions differs: float32 rounding, nothing more.
    torch.testing.assert_close(weight.linear(x), weight.linear_reference(x), rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize(("shape", "is_signed"), [((960, 576), False), ((160, 288), True), ((1024, 288), False)])
def test_a_rows_result_is_the_same_in_every_batch_of_four_or_more_rows(
    kernels: None, shape: tuple[int, int], is_signed: bool
) -> None:
    # Decode batches take the direct path, prompt steps the buffered one, in row blocks: every
    # row's dot products still add in the same order, so batching never changes a result.
    weight = random_block_quant_weight(*shape, is_signed, seed=3)
    x = torch.randn(300, shape[1], generator=torch.Generator().manual_seed(5))
    full = weight.linear(x)
    for num_rows in (4, 5, 8, 9, 13, 16, 17, 64, 257):
        assert torch.equal(weight.linear(x[:num_rows]), full[:num_rows]), num_rows
    assert torch.equal(weight.linear(x[290:]), full[290:])  # 10 rows, from a later block


@pytest.mark.parametrize("num_rows", [1, 2, 6, 7, 16, 64])
@pytest.mark.parametrize(("shape", "is_signed"), [((960, 576), False), ((160, 288), True), ((1024, 288), False)])
def test_bfloat16_kernel_rounds_the_float32_sum_once(
    kernels: None, num_rows: int, shape: tuple[int, int], is_signed: bool
) -> None:
    weight = random_block_quant_weight(*shape, is_signed, seed=num_rows)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(num_rows, shape[1], generator=gen).bfloat16()
    bias = torch.randn(shape[0], generator=gen).bfloat16()
    got = weight.linear(x, bias)
    assert got.dtype == torch.bfloat16
    # The float32 sum of the bfloat16 weights' products, unrounded: the kernel's result is it
    # rounded to bfloat16 (half a unit in the last place: 2^-8 relative), up to the float32
    # summation order, which flips the rounding only where the sum sits at a tie.
    exact = torch.nn.functional.linear(x.float(), weight.dequantize(torch.bfloat16).float(), bias.float())
    torch.testing.assert_close(got.float(), exact, rtol=2**-8, atol=1e-5)
    expected = weight.linear_reference(x, bias)
    assert (got == expected).float().mean() >= 0.99


@pytest.mark.parametrize(("num_outputs", "num_rows"), [(160, 5), (160, 40), (1024, 40)])
def test_float32_kernel_adds_the_bias(kernels: None, num_outputs: int, num_rows: int) -> None:
    weight = random_block_quant_weight(num_outputs, 288, True, seed=3)
    gen = torch.Generator().manual_seed(8)
    x, bias = torch.randn(num_rows, 288, generator=gen), torch.randn(num_outputs, generator=gen)
    torch.testing.assert_close(weight.linear(x, bias), weight.linear_reference(x, bias), rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(weight.linear(x, bias), weight.linear(x) + bias, rtol=0, atol=0)


def test_kernel_takes_a_non_contiguous_input(kernels: None) -> None:
    weight = random_block_quant_weight(64, 96, False, seed=1)
    x = torch.randn(8, 192)[:, ::2]  # not contiguous
    torch.testing.assert_close(weight.linear(x), weight.linear_reference(x), rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_blocks_dequantize_to_the_loaders_weights_exactly(
    tmp_path: pathlib.Path, qtype: str, dtype: torch.dtype
) -> None:
    path = write_gguf(tmp_path / f"{qtype}.gguf", SPEC, random_state(SPEC, 256, seed=5), qtype)
    file = open_gguf(path)
    config = gguf_model_config(file)
    dense = gguf_state_dict(file, config, dtype)
    rows = gguf_block_quant_rows(file, config)
    assert set(rows) == {name for name, t in dense.items() if t.dim() == 2}  # every matrix, q/k un-permuted too
    for name, r in rows.items():
        weight = BlockQuantWeight.from_rows(*r)
        assert torch.equal(weight.dequantize(dtype), dense[name]), name


@pytest.mark.parametrize("num_rows", [1, 16])
def test_bfloat16_kernel_reads_the_loaders_bfloat16_weights(
    kernels: None, tmp_path: pathlib.Path, num_rows: int
) -> None:
    """The kernel's own rounding of each weight to bfloat16 (not the PyTorch `dequantize`):
    one-hot rows of x pick single weights, which come back exactly."""
    path = write_gguf(tmp_path / "q4.gguf", SPEC, random_state(SPEC, 256, seed=6), "Q4_1")
    file = open_gguf(path)
    config = gguf_model_config(file)
    name = "model.layers.0.mlp.down_proj.weight"
    dense = gguf_state_dict(file, config, torch.bfloat16)[name]  # [N, K]
    weight = BlockQuantWeight.from_rows(*gguf_block_quant_rows(file, config)[name])
    columns = torch.arange(num_rows) * (dense.shape[1] // num_rows)
    x = torch.nn.functional.one_hot(columns, dense.shape[1]).bfloat16()  # [M, K]
    assert torch.equal(weight.linear(x), dense[:, columns].T)


def test_other_types_have_no_blocks(tmp_path: pathlib.Path) -> None:
    path = write_gguf(tmp_path / "f16.gguf", SPEC, random_state(SPEC, 256), "F16")
    assert all(block_rows(t) is None for t in open_gguf(path).reader.tensors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gguf_models_use_the_blocks(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path, dtype: torch.dtype
) -> None:
    monkeypatch.setattr(model_module, "has_native_bf16_matmul", lambda: False)
    path = write_gguf(tmp_path / "q4.gguf", SPEC, random_state(SPEC, 256, seed=2), "Q4_1")
    net = load_model(str(path), dtype=str(dtype).removeprefix("torch.")).model
    linears = {name: m for name, m in net.named_modules() if isinstance(m, Linear)}
    assert all(m.block_quant is not None for m in linears.values()), [
        n for n, m in linears.items() if m.block_quant is None
    ]
    for module in linears.values():
        assert module.block_quant is not None
        assert torch.equal(module.block_quant.dequantize(dtype), module.weight)


def test_bfloat16_models_keep_native_bfloat16_matmuls(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.setattr(model_module, "has_native_bf16_matmul", lambda: True)
    path = write_gguf(tmp_path / "q4.gguf", SPEC, random_state(SPEC, 256, seed=2), "Q4_1")
    bf16 = load_model(str(path), dtype="bfloat16").model
    assert all(m.block_quant is None for m in bf16.modules() if isinstance(m, Linear))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_tokens_are_the_same_with_and_without_the_kernel(
    kernels: None, monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path, dtype: str
) -> None:
    monkeypatch.setattr(model_module, "has_native_bf16_matmul", lambda: False)  # bfloat16: widened without the kernel
    path = write_gguf(tmp_path / "q4.gguf", SPEC, random_state(SPEC, 256, seed=4), "Q4_1")
    llm = LLM(str(path), dtype=dtype)
    prompts = [list(range(3, 3 + n)) for n in (5, 9, 17, 2)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with_kernel = [o.token_ids for o in llm.generate(prompts, params)]
    for module in llm.engine.core.loaded.model.modules():
        if isinstance(module, Linear):
            module.block_quant = None  # the dense weights (bfloat16: widened): the path without the kernel
    llm.engine.core.loaded.model.prepare_for_cpu(batch_hint=16)
    assert [o.token_ids for o in llm.generate(prompts, params)] == with_kernel


def _thread_cpu_ticks() -> dict[int, int]:
    """utime + stime of each of this process's threads, in clock ticks."""
    ticks = {}
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(FileNotFoundError), open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
            ticks[int(tid)] = int(fields[11]) + int(fields[12])
    return ticks


def test_kernel_splits_its_work_over_torchs_threads_with_the_same_result(kernels: None) -> None:
    """Built with OpenMP, so at::parallel_for really runs on torch's threads (it ran on one
    when the extension was built without -fopenmp): another thread does a good share of the
    calls' work, and the output is bit for bit the one-thread result."""
    weight = random_block_quant_weight(8192, 576, False, seed=1)  # 512 panels: many per thread
    x = torch.randn(16, 576, generator=torch.Generator().manual_seed(2))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        expected = weight.linear(x)
        torch.set_num_threads(2)
        weight.linear(x)  # the pool exists before counting
        main = threading.get_native_id()
        before = _thread_cpu_ticks()
        # Enough calls for this thread to spend 20 ticks (faster CPUs need more calls); only
        # the kernel runs in the loop, so no other op's threads are counted.
        for _ in range(50):
            for _ in range(100):
                y = weight.linear(x)
            if _thread_cpu_ticks()[main] - before[main] >= 20:
                break
        after = _thread_cpu_ticks()
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(y, expected)
    ticks = {tid: t - before.get(tid, 0) for tid, t in after.items()}
    helper = max(t for tid, t in ticks.items() if tid != main)
    assert ticks[main] >= 20 and helper >= 0.3 * ticks[main], f"only this thread ran the kernel: {ticks}"
