"""Matmul weights prepared for the CPU (packed LM head, bfloat16 widened) and the fused
C++ norm and rotary kernels change no result."""

from __future__ import annotations

import pytest
import torch
from conftest import require_cpu_kernels

from kvservice.loading.model_files import TINY_CONFIG
from kvservice.loading.model_loader import load_model
from kvservice.model import model as model_module
from kvservice.model.attention import AttentionMetadata, PrefillSpan, write_kv
from kvservice.model.model import CausalLM, Linear, RMSNorm
from kvservice.model.rotary import RotaryEmbedding


def _logits(net: CausalLM, num_tokens: int) -> torch.Tensor:
    """Float32 logits [T, V] of one prefill of `num_tokens` random tokens."""
    cfg = net.config
    ids = torch.randint(0, cfg.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(0))
    dtype = net.model.embed_tokens.weight.dtype
    kv = [
        torch.zeros(2, 4, 16, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype) for _ in range(cfg.num_hidden_layers)
    ]
    meta = AttentionMetadata(torch.arange(num_tokens), 0, None, None, [PrefillSpan(0, num_tokens)])
    return net.compute_logits(net(ids, torch.arange(num_tokens), kv, meta))


@pytest.mark.parametrize("num_tokens", [1, 16, 37])
def test_packed_lm_head_gives_the_same_logits(num_tokens: int) -> None:
    net = load_model("tiny").model
    expected = _logits(net, num_tokens)
    net.prepare_for_cpu(batch_hint=16)
    assert isinstance(net.lm_head, Linear) and net.lm_head.is_packed
    got = _logits(net, num_tokens)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_bfloat16_widened_matches_the_bfloat16_matmuls(monkeypatch: pytest.MonkeyPatch) -> None:
    net = load_model("tiny", dtype="bfloat16").model
    expected = _logits(net, 24)  # torch's own bfloat16 matmuls, float32 accumulation
    monkeypatch.setattr(model_module, "has_native_bf16_matmul", lambda: False)
    net.prepare_for_cpu(batch_hint=16)
    widened = [m for m in net.modules() if isinstance(m, Linear) and m.compute_weight is not None]
    assert len(widened) == 4 * TINY_CONFIG.num_hidden_layers + 1
    assert all(p.dtype == torch.bfloat16 for p in net.parameters())  # the parameters stay as loaded
    got = _logits(net, 24)
    # Same products, same float32 accumulation: only the summation order differs, and
    # bfloat16 rounding of each layer's output may flip a last bit.
    torch.testing.assert_close(got, expected, atol=0.05, rtol=0.02)
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9


@pytest.fixture(scope="module")
def kernels() -> None:
    require_cpu_kernels()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_norm_and_rotary_match_the_pytorch_formulas(kernels: None, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    residual = torch.randn(37, 96, generator=gen).to(dtype)
    x = torch.randn(37, 96, generator=gen).to(dtype)
    norm = RMSNorm(96, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(96, generator=gen) + 0.5)
    expected_residual = residual + x
    expected = norm(expected_residual)
    got = torch.ops.kvservice.add_rms_norm_(residual, x, norm.weight, norm.eps)
    assert torch.equal(residual, expected_residual)  # the add rounds once, like `+`
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
    # Rows are normalised side by side, but each as it would be alone: bit for bit.
    for row in (0, 7, 8, 36):
        alone = torch.ops.kvservice.add_rms_norm_(expected_residual[row : row + 1].clone(), None, norm.weight, norm.eps)
        assert torch.equal(alone[0], got[row]), row

    rotary = RotaryEmbedding(TINY_CONFIG, 300)  # head_dim 32
    num_heads, head_dim = 6, TINY_CONFIG.head_dim
    qkv = torch.randn(37, (num_heads + 2) * head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, 300, (37,), generator=gen)
    expected_qkv = qkv.clone()
    rotary(positions, dtype, fused=False).apply_(expected_qkv, num_heads, head_dim)
    rotary(positions, dtype, fused=True).apply_(qkv, num_heads, head_dim)
    assert not torch.equal(qkv[:, :head_dim], qkv.new_zeros(37, head_dim))
    if dtype == torch.float32:
        assert torch.equal(qkv, expected_qkv)  # same products, same rounding: bit for bit
    else:
        torch.testing.assert_close(qkv, expected_qkv, atol=2e-2, rtol=2e-2)
    assert torch.equal(qkv[:, num_heads * head_dim :], expected_qkv[:, num_heads * head_dim :])  # v untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 16, 600])  # 600 x 200: more than one task's worth, on both threads
def test_silu_mul_matches_the_pytorch_formula(kernels: None, dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 205, generator=gen) * 6).to(dtype)  # 205: vector loops plus a scalar tail
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, -200.0, 200.0])  # zeros, tiny, exp's edges
    gate, up = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate.float()).to(dtype).float().mul(up.float()).to(dtype)
    got = torch.ops.kvservice.silu_mul(gate_up)
    assert got.shape == (rows, 205) and got.dtype == dtype and got.is_contiguous()
    if dtype == torch.float32:  # a few ulp: sigmoid from exp(-|x|), not x / (1 + exp(-x))
        torch.testing.assert_close(got, expected, atol=1e-30, rtol=6e-7)
    else:  # rounding silu to bfloat16 may go the other way on a float32 ulp
        torch.testing.assert_close(got, expected, atol=1e-30, rtol=2e-2)
        assert (got != expected).float().mean() < 0.01
    assert float(got[0, 6]) == 0.0 and float(got[0, 7]) == pytest.approx(200.0 * float(up[0, 7]), rel=1e-2)


def test_silu_mul_refuses_an_odd_width(kernels: None) -> None:
    with pytest.raises(RuntimeError, match="contiguous \\[T, 2I\\]"):
        torch.ops.kvservice.silu_mul(torch.zeros(2, 7))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_stores_the_rows_index_copy_stores(kernels: None, dtype: torch.dtype) -> None:
    """The C++ write_kv_ (one row copy a token) fills the same slots as two index_copy_ calls,
    reading k and v as the qkv projection's strided columns."""
    gen = torch.Generator().manual_seed(3)
    num_heads, num_kv_heads, head_dim, tokens = 4, 2, 8, 5
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    _, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    k, v = k.view(tokens, num_kv_heads, head_dim), v.view(tokens, num_kv_heads, head_dim)
    slots = torch.tensor([9, 0, 31, 4, 17])
    cache = torch.randn(2, 4, 8, num_kv_heads, head_dim, generator=gen).to(dtype)
    expected = cache.clone()
    expected.flatten(1, 2)[0].index_copy_(0, slots, k)
    expected.flatten(1, 2)[1].index_copy_(0, slots, v)
    write_kv(cache, k, v, slots)
    assert torch.equal(cache, expected)


def test_write_kv_refuses_a_slot_outside_the_cache_before_writing(kernels: None) -> None:
    cache = torch.zeros(2, 4, 8, 2, 8)
    k = v = torch.ones(3, 2, 8)
    with pytest.raises(RuntimeError, match="slot 32 outside the cache's 32"):
        torch.ops.kvservice.write_kv_(cache, k, v, torch.tensor([1, 2, 32]))
    assert not cache.any()  # the two valid slots were not written either
    with pytest.raises(RuntimeError, match="each token's row contiguous"):
        torch.ops.kvservice.write_kv_(cache, k.transpose(1, 2).contiguous().transpose(1, 2), v, torch.tensor([1, 2, 3]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_with_kernels_equals_the_pytorch_path(kernels: None, dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    net = load_model("tiny", dtype=dtype).model
    fast = _logits(net, 29)
    monkeypatch.setattr(model_module, "kernels_loaded", lambda: False)
    slow = _logits(net, 29)
    tol = 1e-5 if dtype == "float32" else 5e-2
    torch.testing.assert_close(fast, slow, atol=tol, rtol=tol)
    assert (fast.argmax(-1) == slow.argmax(-1)).float().mean() >= (1.0 if dtype == "float32" else 0.9)
