"""`--kv-cache-dtype`: a KV cache stored in fewer bytes than the compute dtype.

Attention over such a cache must compute what float32 attention computes over the same cache
dequantized (`kv_dtype.decode_rows`), on the C++ kernels' paths (AVX2 here, the portable loops
for other head sizes) and on the PyTorch fallback; the writes round as `kv_dtype.encode_rows`
does, bit for bit on either path; and an engine with such a cache stays close to transformers.
"""

from __future__ import annotations

import argparse
import pathlib

import pytest
import torch
from conftest import parse_flags, require_cpu_kernels
from gguf_models import random_state, write_gguf
from hf_models import random_prompts
from test_attention import BLOCK_SIZE, _random_case
from test_block_quant import SPEC
from test_logprobs import hf_log_softmax

from kvservice import LLM, SamplingParams
from kvservice.config import EngineConfig
from kvservice.model.attention import paged_attention, write_kv
from kvservice.model.kv_cache import KVCacheLayout
from kvservice.model.kv_dtype import decode_rows, encode_rows, kv_storage_dtype
from kvservice.runtime.engine_args import add_engine_arguments, engine_argv, engine_config
from kvservice.worker.input_batch import BatchItem, build_batch

KV_DTYPES = [torch.bfloat16, torch.int8]
# The worst logprob error against transformers (float32) that a cache of each dtype may add on the
# random llama checkpoint (prompt and sampled positions, 16-token chunks): measured 0.025 (bfloat16) and
# 0.081 (int8); float32 is within 1e-5.
LOGPROB_ATOL = {"bfloat16": 0.05, "int8": 0.2}


@pytest.fixture(scope="module")
def kernels() -> None:
    require_cpu_kernels()


def _quantized_case(
    batch: int, num_queries: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, list[BatchItem]]:
    """test_attention's random case, its cache written in `dtype`."""
    q, kv_layer, items = _random_case(batch, num_queries, num_heads, num_kv_heads, torch.float32, seed, head_dim)
    return q, encode_rows(kv_layer, dtype), items


@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 32])  # 32: the portable loops
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (8, 1)])
@pytest.mark.parametrize("batch", [1, 3, 16])  # AVX2: a task per query head below 4 a thread, per request above
@pytest.mark.parametrize("num_queries", [1, 4])
def test_the_kernel_reads_the_cache_as_its_float32_values(
    kernels: None, dtype: torch.dtype, head_dim: int, num_heads: int, num_kv_heads: int, batch: int, num_queries: int
) -> None:
    q, kv_layer, items = _quantized_case(batch, num_queries, num_heads, num_kv_heads, head_dim, dtype, seed=batch)
    assert kv_layer.dtype == dtype
    meta = build_batch(items, BLOCK_SIZE, torch.device("cpu")).attn
    assert meta.decode_block_table is not None and meta.decode_starts is not None
    args = (meta.decode_block_table, meta.decode_starts, num_queries, head_dim**-0.5)
    out = torch.ops.kvservice.paged_decode_attention(q, kv_layer, *args)
    expected = torch.ops.kvservice.paged_decode_attention(q, decode_rows(kv_layer, torch.float32), *args)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize("use_kernels", [True, False])
def test_decode_and_later_prompt_chunks_read_the_cache_as_its_float32_values(
    kernels: None, dtype: torch.dtype, use_kernels: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One step of two decode requests and a prompt's second chunk (SDPA over the gathered cache),
    against the same step over the float32 dequantized cache."""
    monkeypatch.setattr("kvservice.model.attention.kernels_loaded", lambda: use_kernels)
    gen = torch.Generator().manual_seed(11)
    cache32 = torch.randn(2, 16, BLOCK_SIZE, 3, 64, generator=gen)
    kv_layer = encode_rows(cache32, dtype)
    items = [BatchItem([1], 40, [0, 1, 2]), BatchItem([2], 20, [3, 4]), BatchItem(list(range(12)), 30, [5, 6, 7])]
    meta = build_batch(items, BLOCK_SIZE, torch.device("cpu")).attn
    assert [span.context_slots is not None for span in meta.prefills] == [True]
    q = torch.randn(14, 9, 64, generator=gen)
    k, v = torch.randn(14, 3, 64, generator=gen), torch.randn(14, 3, 64, generator=gen)
    out = paged_attention(q, k, v, kv_layer, meta)
    expected = paged_attention(q, k, v, decode_rows(kv_layer, torch.float32), meta)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
    assert not torch.equal(out, paged_attention(q, k, v, cache32, meta))  # the rounding is really there


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_writes_round_alike_on_the_kernel_and_the_pytorch_path(
    kernels: None, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(5, 3 * 2 * 64, generator=gen) * 3
    k, v = (t.view(5, 2, 64) for t in qkv[:, 128:].split(128, dim=1))  # strided token rows, as the model's
    slots = torch.tensor([17, 3, 40, 41, 8])
    caches = []
    for use_kernels in (True, False):
        monkeypatch.setattr("kvservice.model.attention.kernels_loaded", lambda use=use_kernels: use)
        cache = torch.zeros(KVCacheLayout(1, BLOCK_SIZE, 2, 64, dtype).blocks_shape(4), dtype=dtype)
        write_kv(cache, k, v, slots)
        caches.append(cache)
    assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))
    flat = caches[0].flatten(1, 2)
    assert torch.equal(flat[0][slots].view(torch.uint8), encode_rows(k, dtype).view(torch.uint8))
    assert torch.equal(flat[1][slots].view(torch.uint8), encode_rows(v, dtype).view(torch.uint8))


def test_bfloat16_writes_round_to_nearest_even(kernels: None) -> None:
    # Exactly halfway between two bfloat16 values: to the even one (down for 0x3F80, up for 0x3F81).
    halfway = torch.tensor([0x3F808000, 0x3F818000, 0x3F808001], dtype=torch.int32).view(torch.float32)
    k = halfway.repeat(64 // 3 + 1)[:64].view(1, 1, 64)
    cache = torch.zeros(2, 1, BLOCK_SIZE, 1, 64, dtype=torch.bfloat16)
    torch.ops.kvservice.write_kv_(cache, k, k, torch.tensor([0]))
    bits = cache[0, 0, 0, 0, :3].view(torch.int16).tolist()
    assert bits == [0x3F80, 0x3F82, 0x3F81]


def test_the_storage_dtype_of_each_choice() -> None:
    assert kv_storage_dtype("auto", torch.float32) == torch.float32
    assert kv_storage_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_storage_dtype("bfloat16", torch.float32) == torch.bfloat16
    assert kv_storage_dtype("int8", torch.bfloat16) == torch.int8
    assert KVCacheLayout(1, BLOCK_SIZE, 3, 64, torch.int8).blocks_shape(2) == (2, 2, BLOCK_SIZE, 3, 68)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_storage_dtype("fp4", torch.float32)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp4")


def test_the_flag_reaches_the_config_and_every_worker() -> None:
    args = parse_flags(add_engine_arguments, "--kv-cache-dtype", "bfloat16")
    assert engine_config(args).kv_cache_dtype == "bfloat16"
    assert engine_argv(args) == ["--kv-cache-dtype", "bfloat16"]
    assert engine_config(parse_flags(add_engine_arguments, "--kv-cache-dtype", "int8")).kv_cache_dtype == "int8"
    assert engine_config(parse_flags(add_engine_arguments)).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        parse_flags(add_engine_arguments, "--kv-cache-dtype", "fp4")
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert "--kv-cache-dtype" in parser.format_help()


def test_a_narrower_cache_holds_more_blocks_in_the_same_memory(llama_dir: pathlib.Path) -> None:
    sizes = {}
    for kv_cache_dtype in ("auto", "bfloat16", "int8"):
        llm = LLM(str(llama_dir), kv_cache_dtype=kv_cache_dtype, kv_cache_memory_bytes=4 << 20)
        sizes[kv_cache_dtype] = llm.engine.num_blocks
        assert {c.dtype for c in llm.engine.core.kv_caches} == {kv_storage_dtype(kv_cache_dtype, torch.float32)}
    head_dim = llm.engine.core.layout.head_dim
    assert sizes["bfloat16"] == 2 * sizes["auto"]
    assert sizes["int8"] == 4 * head_dim * sizes["auto"] // (head_dim + 4)  # the scale: 4 bytes a row


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "int8"])
def test_a_narrower_cache_stays_close_to_transformers(llama_dir: pathlib.Path, kv_cache_dtype: str) -> None:
    """Prompt logprobs (16-token chunks: later chunks read the cache) and sampled ones (decode reads it)."""
    prompts = random_prompts((2, 9, 17, 33, 40), seed=3)
    llm = LLM(str(llama_dir), kv_cache_dtype=kv_cache_dtype, num_blocks=64, max_num_batched_tokens=16, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    errors = []
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        reference = hf_log_softmax(llama_dir, prompt + out.token_ids)
        assert out.prompt_logprobs is not None and out.logprobs is not None
        targets = prompt[1:] + out.token_ids
        for p, got in enumerate([*out.prompt_logprobs, *out.logprobs]):
            assert got.token_id == targets[p]
            errors.append(abs(got.logprob - float(reference[p, targets[p]])))
    assert max(errors) <= LOGPROB_ATOL[kv_cache_dtype]
    assert max(errors) > 1e-5  # the cache really rounded (float32 is within 1e-5)


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "int8"])
def test_the_one_call_decode_layers_write_and_read_a_narrower_cache_as_the_per_op_path(
    kernels: None, tmp_path: pathlib.Path, kv_cache_dtype: str
) -> None:
    """A block-quantized model decodes through `decode_layers_` (rotary, the rounded write and
    attention in C++); with it turned off, through write_kv_ and the kernel: the same caches, bit
    for bit, and the same tokens and logprobs."""
    path = write_gguf(tmp_path / "q4.gguf", SPEC, random_state(SPEC, 256, seed=4), "Q4_1")
    prompts = [list(range(3, 3 + n)) for n in (5, 9, 17, 2)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    runs = []
    for fused in (True, False):
        llm = LLM(str(path), kv_cache_dtype=kv_cache_dtype, num_blocks=32)
        if not fused:
            llm.engine.core.loaded.model._decode_args = False  # the per-op path
        outputs = llm.generate(prompts, params)
        if fused:
            assert llm.engine.core.loaded.model._decode_args, "the one-call decode layers did not run"
        runs.append(([(o.token_ids, [lp.logprob for lp in o.logprobs or []]) for o in outputs], llm.engine.core))
    (fused_out, fused_core), (per_op_out, per_op_core) = runs
    assert fused_out == per_op_out
    for a, b in zip(fused_core.kv_caches, per_op_core.kv_caches):
        assert a.dtype == kv_storage_dtype(kv_cache_dtype, torch.float32)
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
