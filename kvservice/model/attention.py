"""Attention over a paged KV cache.

A layer's cache is one tensor `kv_layer` [2, num_blocks, block_size, num_kv_heads, head_dim]
(K then V), of the compute dtype or of a narrower `--kv-cache-dtype` (`kv_dtype`): K and V are
rounded to it as they are written, and read back as the compute dtype, attention itself
computing as without it. A token at position p of a request lives in slot
`block_ids[p // block_size] * block_size + p % block_size` of the flattened cache.

A step's flat batch holds the decode group first: requests with the same small number
of new tokens Q (one for plain decoding, 1 + K when verifying K draft tokens), batched
into one attention call; then one span per prefill chunk. The decode group reads the
cache in place through its block table with the C++ kernel when it is loaded
(`kvservice.model.cpu_kernels`), else gathers its contexts and attends with matmuls. A
prompt's first chunk attends to its own keys with the C++ `prompt_attention` where that
beats SDPA (AVX-512 or AVX2, up to `PROMPT_KERNEL_MAX_TOKENS`), later chunks to the cached context
with SDPA.
`AttentionMetadata` is built once per step and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from kvservice.model.cpu_kernels import kernels_loaded, prompt_attention_is_faster
from kvservice.model.kv_dtype import decode_rows, encode_rows

# Up to this many tokens a fresh prompt's attention is faster in the C++ kernel than in SDPA
# (SmolLM2, 2 Zen 4 cores: 64 tokens 0.06 vs 0.12 ms a layer, 256: 0.76 vs 1.05, 1,024: 11.3
# vs 11.5; 2,048: 44.5 vs 40.6, where SDPA's tiling wins).
PROMPT_KERNEL_MAX_TOKENS = 1024


@dataclass(slots=True)
class PrefillSpan:
    """Tokens [start, end) of the flat batch: one request's prompt chunk."""

    start: int
    end: int
    # Chunks after the first also attend to cached tokens: the slots of the whole
    # context [0, num_computed + n) and a causal mask [n, context]. None for a first chunk.
    context_slots: torch.Tensor | None = None
    mask: torch.Tensor | None = None


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    num_decode_tokens: int  # the first B * Q tokens: B requests of Q queries each
    decode_context_slots: torch.Tensor | None  # [B, L] context slots, padded
    decode_mask: torch.Tensor | None  # [B, 1, 1, Q, L] True where query q may attend key l
    prefills: list[PrefillSpan]
    decode_block_table: torch.Tensor | None = None  # [B, max_blocks] int64, for the kernel
    decode_starts: torch.Tensor | None = None  # [B] int64: position of each request's first query


class LayerKVHooks(Protocol):
    """What the forward needs of a KV connector: its two per-layer hooks, and whether it has
    any (without, a decode step runs its layers in one call).

    `KVConnectorBase` satisfies it; the model knows nothing else of connectors."""

    @property
    def has_layer_hooks(self) -> bool: ...

    def wait_for_layer_load(self, layer: int) -> None: ...

    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata) -> None: ...


def write_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the step's new keys and values. k, v: [T, Hkv, D], a token's row contiguous (the
    qkv projection's columns in place). On the CPU with the kernels loaded one row copy a
    token (`csrc/decode_layer.cpp`, which the one-call decode layers use too), else two
    index_copy_ calls. Either rounds them to the cache's dtype."""
    if kv_layer.device.type == "cpu" and kernels_loaded():
        torch.ops.kvservice.write_kv_(kv_layer, k, v, slot_mapping)
        return
    flat = kv_layer.flatten(1, 2)  # [2, num_blocks * block_size, Hkv, D]
    flat[0].index_copy_(0, slot_mapping, encode_rows(k, kv_layer.dtype))
    flat[1].index_copy_(0, slot_mapping, encode_rows(v, kv_layer.dtype))


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata
) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D] (this step's, already written). Returns [T, Hq, D]."""
    flat = kv_layer.flatten(1, 2)
    out = torch.empty_like(q)
    num_decode = meta.num_decode_tokens
    if num_decode:
        use_kernel = kv_layer.device.type == "cpu" and kernels_loaded()
        if use_kernel and meta.decode_block_table is not None and meta.decode_starts is not None:
            batch = meta.decode_block_table.shape[0]
            out[:num_decode] = torch.ops.kvservice.paged_decode_attention(
                q[:num_decode].contiguous(),
                kv_layer,
                meta.decode_block_table,
                meta.decode_starts,
                num_decode // batch,
                q.shape[-1] ** -0.5,
            )
        else:
            assert meta.decode_context_slots is not None and meta.decode_mask is not None
            out[:num_decode] = _decode_attention(q[:num_decode], flat, meta.decode_context_slots, meta.decode_mask)
    own_keys_kernel = q.dtype == torch.float32 and q.device.type == "cpu" and prompt_attention_is_faster()
    for span in meta.prefills:
        if span.context_slots is None and own_keys_kernel and span.end - span.start <= PROMPT_KERNEL_MAX_TOKENS:
            rows = slice(span.start, span.end)
            torch.ops.kvservice.prompt_attention_out(q[rows], k[rows], v[rows], q.shape[-1] ** -0.5, out[rows])
            continue
        q_s = q[span.start : span.end].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, Dh]
        if span.context_slots is None:
            k_s = k[span.start : span.end].transpose(0, 1).unsqueeze(0)
            v_s = v[span.start : span.end].transpose(0, 1).unsqueeze(0)
            o = _sdpa(q_s, k_s, v_s, None, True)
        else:
            k_s = decode_rows(flat[0][span.context_slots], q.dtype).transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, Dh]
            v_s = decode_rows(flat[1][span.context_slots], q.dtype).transpose(0, 1).unsqueeze(0)
            o = _sdpa(q_s, k_s, v_s, span.mask, False)
        out[span.start : span.end] = o.squeeze(0).transpose(0, 1)
    return out


def _decode_attention(q: torch.Tensor, flat: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """B requests of Q queries each. q: [B * Q, Hq, D]; slots: [B, L]; mask: [B, 1, 1, Q, L].

    Plain matmuls rather than SDPA: for a handful of queries the fused kernel's set-up
    (and its thread fan-out on a small CPU) costs more than the arithmetic.
    """
    batch = slots.shape[0]
    num_queries = q.shape[0] // batch
    _, num_heads, head_dim = q.shape
    kv_ctx = decode_rows(flat[:, slots], q.dtype)  # [2, B, L, Hkv, D]: K and V gathered in one indexing op
    k_ctx = kv_ctx[0].permute(0, 2, 3, 1).unsqueeze(2)  # [B, Hkv, 1, D, L]
    v_ctx = kv_ctx[1].transpose(1, 2).unsqueeze(2)  # [B, Hkv, 1, L, D]
    num_kv_heads = k_ctx.shape[1]
    # Group the query heads that share a KV head: [B, Hkv, G, Q, D].
    qg = q.view(batch, num_queries, num_kv_heads, num_heads // num_kv_heads, head_dim).permute(0, 2, 3, 1, 4)
    scores = torch.matmul(qg, k_ctx) * (head_dim**-0.5)  # [B, Hkv, G, Q, L]
    scores = scores.masked_fill(~mask, float("-inf"))
    out = torch.matmul(scores.softmax(-1), v_ctx)  # [B, Hkv, G, Q, D]
    return out.permute(0, 3, 1, 2, 4).reshape(batch * num_queries, num_heads, head_dim)


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool
) -> torch.Tensor:
    # Grouped-query attention: each KV head serves Hq / Hkv query heads, read in place (the same
    # numbers as repeating K and V per query head, 5-15% faster for SmolLM2's prompt chunks).
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=q.shape[1] != k.shape[1]
    )
