"""A decode step's layers in C++ (`csrc/decode_layer.cpp`): the per-op path's kernels and ATen
ops in the same order, so the same numbers, without the ~20 Python dispatches a layer costs
(and the GIL hand-offs between them that a server's event loop turns into waits). SmolLM2,
batch 1: a step 9.5 -> 7.5 ms.

A step whose KV connector has per-layer hooks calls `decode_layer_` once a layer, the hooks
between; any other step calls `decode_layers_` once for all of them (between two layers' calls
Python took ~10 us, with one core idle: ~0.3 ms of a SmolLM2 step).

Used for steps of decode queries only, on the CPU, when every projection is block-quantized.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvservice.model.attention import AttentionMetadata, LayerKVHooks


@dataclass(frozen=True, slots=True)
class DecodeLayerArgs:
    """The layers' static arguments, per layer for `decode_layer_` and flat for `decode_layers_`."""

    per_layer: list[tuple[Any, ...]]  # decode_layer_'s, from qkv_w to head_dim
    weights: list[torch.Tensor]  # 14 a layer: qkv, o, gate_up, down (codes, scales, mins), post_norm, next_norm
    biases: list[torch.Tensor | None]  # 2 a layer: qkv, o
    eps: list[float]  # 2 a layer: post, next
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, per_layer: list[tuple[Any, ...]]) -> DecodeLayerArgs:
        weights: list[torch.Tensor] = []
        biases: list[torch.Tensor | None] = []
        eps: list[float] = []
        for qkv_w, qkv_bias, o_w, o_bias, gate_up_w, down_w, post_norm, post_eps, next_norm, next_eps, *_ in per_layer:
            weights += [*qkv_w, *o_w, *gate_up_w, *down_w, post_norm, next_norm]
            biases += [qkv_bias, o_bias]
            eps += [post_eps, next_eps]
        num_heads, num_kv_heads, head_dim = per_layer[0][-3:]
        return cls(per_layer, weights, biases, eps, num_heads, num_kv_heads, head_dim)


def run_decode_layers(
    layers: DecodeLayerArgs,
    h: torch.Tensor,
    x: torch.Tensor,
    rope_tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    kv_caches: list[torch.Tensor],
    meta: AttentionMetadata,
    connector: LayerKVHooks | None,
) -> torch.Tensor:
    """h: the residual stream [T, hidden] (updated in place); x: the first layer's normed
    input; rope_tables: the positions [T] and the cos/sin tables. Returns the final norm's
    output, as the per-op path does."""
    assert meta.decode_block_table is not None and meta.decode_starts is not None
    num_queries = h.shape[0] // meta.decode_block_table.shape[0]
    step = (
        *rope_tables,
        meta.slot_mapping,
        meta.decode_block_table,
        meta.decode_starts,
        num_queries,
        layers.head_dim**-0.5,
    )
    if connector is None or not connector.has_layer_hooks:
        return torch.ops.kvservice.decode_layers_(
            h,
            x,
            layers.weights,
            layers.biases,
            layers.eps,
            layers.num_heads,
            layers.num_kv_heads,
            layers.head_dim,
            kv_caches[: len(layers.per_layer)],
            *step,
        )
    last = len(layers.per_layer) - 1
    for i, args in enumerate(layers.per_layer):
        connector.wait_for_layer_load(i)
        next_kv = kv_caches[i + 1] if i < last else None  # its first rows get prefetched
        x = torch.ops.kvservice.decode_layer_(h, x, *args, kv_caches[i], *step, next_kv)
        connector.save_kv_layer(i, kv_caches[i], meta)
    return x
