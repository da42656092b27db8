"""The C++ attention kernels equal the PyTorch path: decode on random paged caches, and a
fresh prompt over its own keys against causal SDPA.

The reference is the fallback the engine uses when the kernel cannot be built: the
context gathered through the block table, then masked matmuls (in float32 here, so
the comparison measures the kernel, not bfloat16 rounding of the reference).
"""

from __future__ import annotations

import pytest
import torch
from conftest import require_cpu_kernels

from kvservice.model.attention import AttentionMetadata, paged_attention
from kvservice.worker.input_batch import BatchItem, build_batch

BLOCK_SIZE = 16
HEAD_DIM = 64


@pytest.fixture(scope="module")
def kernel():
    require_cpu_kernels()
    return torch.ops.kvservice.paged_decode_attention


def _random_case(
    batch: int,
    num_queries: int,
    num_heads: int,
    num_kv_heads: int,
    dtype: torch.dtype,
    seed: int,
    head_dim: int = HEAD_DIM,
) -> tuple[torch.Tensor, torch.Tensor, list[BatchItem]]:
    """A cache with shuffled blocks, and B requests of Q queries at random positions."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 64
    kv_layer = torch.randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen).to(dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    items = []
    for _ in range(batch):
        start = int(torch.randint(0, 5 * BLOCK_SIZE, (1,), generator=gen))  # rarely a block multiple
        context = start + num_queries
        block_ids = [free.pop() for _ in range(-(-context // BLOCK_SIZE))]
        items.append(BatchItem(list(range(num_queries)), start, block_ids))
    q = torch.randn(batch * num_queries, num_heads, head_dim, generator=gen).to(dtype)
    return q, kv_layer, items


def _reference(q: torch.Tensor, kv_layer: torch.Tensor, items: list[BatchItem]) -> torch.Tensor:
    """Per request, per query: softmax over exactly the visible keys, in float64."""
    num_queries = len(items[0].token_ids)
    group = q.shape[1] // kv_layer.shape[3]
    flat = kv_layer.double().flatten(1, 2)  # [2, num_blocks * block_size, Hkv, D]
    out = torch.empty(q.shape, dtype=torch.float64)
    for b, item in enumerate(items):
        for i in range(num_queries):
            visible = item.start + i + 1
            slots = torch.tensor(
                [item.block_ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(visible)]
            )
            k = flat[0][slots].repeat_interleave(group, dim=1)  # [visible, Hq, D]
            v = flat[1][slots].repeat_interleave(group, dim=1)
            qi = q[b * num_queries + i].double()  # [Hq, D]
            weights = (torch.einsum("hd,lhd->hl", qi, k) * q.shape[-1] ** -0.5).softmax(-1)
            out[b * num_queries + i] = torch.einsum("hl,lhd->hd", weights, v)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("batch", [1, 3, 16])
@pytest.mark.parametrize("num_queries", [1, 4])
def test_kernel_matches_reference(
    kernel, batch: int, num_queries: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype
) -> None:
    q, kv_layer, items = _random_case(batch, num_queries, num_heads, num_kv_heads, dtype, seed=batch * 31 + num_heads)
    meta = build_batch(items, BLOCK_SIZE, torch.device("cpu")).attn
    assert meta.decode_block_table is not None and meta.decode_starts is not None
    out = kernel(q, kv_layer, meta.decode_block_table, meta.decode_starts, num_queries, HEAD_DIM**-0.5)
    expected = _reference(q, kv_layer, items)
    # float32: summation order only; bfloat16: the output's own rounding (8 bits of mantissa).
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("num_queries", [1, 3])
def test_kernel_matches_reference_at_head_dim_128(kernel, batch: int, num_queries: int) -> None:
    q, kv_layer, items = _random_case(batch, num_queries, 8, 2, torch.float32, seed=batch, head_dim=128)
    meta = build_batch(items, BLOCK_SIZE, torch.device("cpu")).attn
    assert meta.decode_block_table is not None and meta.decode_starts is not None
    out = kernel(q, kv_layer, meta.decode_block_table, meta.decode_starts, num_queries, 128**-0.5)
    torch.testing.assert_close(out.double(), _reference(q, kv_layer, items), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_kernel_and_fallback_agree(kernel, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    q, kv_layer, items = _random_case(16, 1, 9, 3, dtype, seed=7)
    meta = build_batch(items, BLOCK_SIZE, torch.device("cpu")).attn
    k = v = torch.empty(0)  # decode reads only the cache
    fast = paged_attention(q, k, v, kv_layer, meta)
    monkeypatch.setattr("kvservice.model.attention.kernels_loaded", lambda: False)
    slow = paged_attention(q, k, v, kv_layer, meta)
    assert not torch.equal(fast, torch.zeros_like(fast))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fast.float(), slow.float(), atol=tol, rtol=tol)


def test_kernel_rejects_a_block_id_outside_the_cache(kernel) -> None:
    q, kv_layer, items = _random_case(2, 1, 4, 2, torch.float32, seed=3)
    meta: AttentionMetadata = build_batch(items, BLOCK_SIZE, torch.device("cpu")).attn
    assert meta.decode_block_table is not None and meta.decode_starts is not None
    table = meta.decode_block_table.clone()
    table[1, 0] = kv_layer.shape[1]
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernel(q, kv_layer, table, meta.decode_starts, 1, HEAD_DIM**-0.5)


# ---------------------------------------------------------------- a fresh prompt over its own keys


def _sdpa_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention in float64: [T, H, D] in, [T, Hq, D] out."""
    q64, k64, v64 = (t.double().transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(
        q64, k64, v64, is_causal=True, enable_gqa=q.shape[1] != k.shape[1]
    )
    return out.squeeze(0).transpose(0, 1)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 4, 64), (8, 2, 128), (4, 2, 32)])
@pytest.mark.parametrize("num_tokens", [1, 7, 33, 130, 300])
def test_prompt_attention_matches_causal_sdpa(
    kernel, num_heads: int, num_kv_heads: int, head_dim: int, num_tokens: int
) -> None:
    """Views of one fused qkv projection, as the model passes them (rows strided, heads contiguous)."""
    gen = torch.Generator().manual_seed(num_tokens * 31 + head_dim)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen) * 2
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k, v = (
        q.view(num_tokens, num_heads, head_dim),
        k.view(num_tokens, num_kv_heads, head_dim),
        v.view(num_tokens, num_kv_heads, head_dim),
    )
    out = torch.ops.kvservice.prompt_attention(q, k, v, head_dim**-0.5)
    assert out.shape == (num_tokens, num_heads, head_dim)
    exact = _sdpa_reference(q, k, v)
    # As close to the float64 result as torch's own float32 SDPA is (within 4x, or 1e-5).
    sdpa32 = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        is_causal=True,
        enable_gqa=num_heads != num_kv_heads,
    )[0].transpose(0, 1)
    tolerance = max(1e-5, 4 * float((sdpa32.double() - exact).abs().max()))
    torch.testing.assert_close(out.double(), exact, atol=tolerance, rtol=0)


def test_paged_attention_runs_fresh_prompts_through_the_kernel_as_sdpa_would(
    kernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model's path: two fresh prompts and a decode request in one step, with the prompt
    kernel (where it is the faster path) and with SDPA, agree."""
    gen = torch.Generator().manual_seed(5)
    num_blocks = 32
    kv_layer = torch.randn(2, num_blocks, BLOCK_SIZE, 3, HEAD_DIM, generator=gen)
    items = [
        BatchItem([1], 40, [0, 1, 2]),
        BatchItem(list(range(50)), 0, [3, 4, 5, 6]),
        BatchItem(list(range(21)), 0, [7, 8]),
    ]
    meta = build_batch(items, BLOCK_SIZE, torch.device("cpu")).attn
    assert len(meta.prefills) == 2 and all(span.context_slots is None for span in meta.prefills)
    num_tokens = 1 + 50 + 21
    q = torch.randn(num_tokens, 9, HEAD_DIM, generator=gen)
    k, v = torch.randn(num_tokens, 3, HEAD_DIM, generator=gen), torch.randn(num_tokens, 3, HEAD_DIM, generator=gen)
    monkeypatch.setattr("kvservice.model.attention.prompt_attention_is_faster", lambda: True)
    with_kernel = paged_attention(q, k, v, kv_layer, meta)
    monkeypatch.setattr("kvservice.model.attention.prompt_attention_is_faster", lambda: False)
    with_sdpa = paged_attention(q, k, v, kv_layer, meta)
    torch.testing.assert_close(with_kernel, with_sdpa, atol=1e-5, rtol=1e-5)
    assert not torch.equal(with_kernel[1:], with_sdpa[1:])  # the prompts really took the other path


def test_prompt_attention_out_writes_the_ops_result_into_a_slice(kernel) -> None:
    gen = torch.Generator().manual_seed(4)
    q, k, v = (
        torch.randn(40, 9, HEAD_DIM, generator=gen),
        torch.randn(40, 3, HEAD_DIM, generator=gen),
        torch.randn(40, 3, HEAD_DIM, generator=gen),
    )
    out = torch.full((50, 9, HEAD_DIM), 7.0)
    torch.ops.kvservice.prompt_attention_out(q, k, v, 0.125, out[5:45])
    assert torch.equal(out[5:45], torch.ops.kvservice.prompt_attention(q, k, v, 0.125))
    assert bool((out[:5] == 7.0).all()) and bool((out[45:] == 7.0).all())  # nothing outside the slice
    with pytest.raises(RuntimeError, match="q's shape"):
        torch.ops.kvservice.prompt_attention_out(q, k, v, 0.125, out[:39])
    with pytest.raises(RuntimeError, match="contiguous float32"):
        torch.ops.kvservice.prompt_attention_out(q, k, v, 0.125, torch.empty(9, 40, HEAD_DIM).transpose(0, 1))


def test_prompt_attention_rejects_a_layout_it_cannot_read(kernel) -> None:
    q = torch.randn(8, 4, HEAD_DIM)
    k = torch.randn(8, HEAD_DIM, 2).transpose(1, 2)  # heads not contiguous
    with pytest.raises(RuntimeError, match="contiguous row"):
        torch.ops.kvservice.prompt_attention(q, k, k, 0.125)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.kvservice.prompt_attention(q.double(), k.double(), k.double(), 0.125)


def test_a_long_fresh_prompt_goes_to_sdpa(kernel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past PROMPT_KERNEL_MAX_TOKENS SDPA is the faster path: the kernel is not called."""
    monkeypatch.setattr("kvservice.model.attention.PROMPT_KERNEL_MAX_TOKENS", 16)
    monkeypatch.setattr("kvservice.model.attention.prompt_attention_is_faster", lambda: True)
    calls: list[int] = []
    real = torch.ops.kvservice.prompt_attention_out

    class _Ops:
        def prompt_attention_out(self, q: torch.Tensor, *args: object) -> None:
            calls.append(q.shape[0])
            real(q, *args)

    monkeypatch.setattr("kvservice.model.attention.torch.ops.kvservice", _Ops(), raising=False)
    items = [BatchItem(list(range(17)), 0, [0, 1]), BatchItem(list(range(16)), 0, [2])]
    meta = build_batch(items, BLOCK_SIZE, torch.device("cpu")).attn
    gen = torch.Generator().manual_seed(9)
    q, k, v = (
        torch.randn(33, 4, HEAD_DIM, generator=gen),
        torch.randn(33, 2, HEAD_DIM, generator=gen),
        torch.randn(33, 2, HEAD_DIM, generator=gen),
    )
    out = paged_attention(q, k, v, torch.zeros(2, 4, BLOCK_SIZE, 2, HEAD_DIM), meta)
    assert calls == [16]  # the 17-token prompt took SDPA
    torch.testing.assert_close(out[:17].double(), _sdpa_reference(q[:17], k[:17], v[:17]), atol=1e-5, rtol=1e-5)
