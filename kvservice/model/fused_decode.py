"""A decode step's layers in one C++ call each (`torch.ops.kvservice.decode_layer_`, see
`csrc/decode_layer.cpp`): the per-op path's kernels and ATen ops in the same order, so the
same numbers, without the ~20 Python dispatches a layer costs (and the GIL hand-offs between
them that a server's event loop turns into waits). SmolLM2, batch 1: a step 9.5 -> 7.5 ms.

Used for steps of decode queries only, on the CPU, when every projection is block-quantized;
the connector's per-layer hooks still run around each layer.
"""

from __future__ import annotations

from typing import Any

import torch

from kvservice.model.attention import AttentionMetadata, LayerKVHooks


def run_decode_layers(
    layer_args: list[tuple[Any, ...]],
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
    head_dim = layer_args[0][-1]
    step = (*rope_tables, meta.slot_mapping, meta.decode_block_table,
            meta.decode_starts, num_queries, head_dim**-0.5)
    last = len(layer_args) - 1
    for i, args in enumerate(layer_args):
        if connector is not None:
            connector.wait_for_layer_load(i)
        next_kv = kv_caches[i + 1] if i < last else None  # its first rows get prefetched
        x = torch.ops.kvservice.decode_layer_(h, x, *args, kv_caches[i], *step, next_kv)
        if connector is not None:
            connector.save_kv_layer(i, kv_caches[i], meta)
    return x
