"""The KV cache tensors: one [2, num_blocks, block_size, num_kv_heads, head_dim] tensor per layer."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvservice.config import ModelConfig
from kvservice.core.kv_cache_manager import cdiv
from kvservice.model.kv_dtype import row_width


@dataclass(frozen=True, slots=True)
class KVCacheLayout:
    """The geometry both ends of a KV transfer must agree on.

    With a speculative draft model whose KV has the target's geometry, the last
    `num_draft_layers` of `num_layers` are the draft's (`with_draft`): its KV travels on the
    same pull, and both ends must run the same draft (`draft_fingerprint`).

    `dtype` is what the cache stores (`--kv-cache-dtype`); `head_dim` the values a row holds."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    num_draft_layers: int = 0
    draft_fingerprint: str = ""

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVCacheLayout.{name} must be a positive int, got {value!r}")
        if self.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.int8):
            raise ValueError(f"unsupported KV dtype {self.dtype}")
        if not 0 <= self.num_draft_layers < self.num_layers:
            raise ValueError(
                f"KVCacheLayout.num_draft_layers must be in [0, {self.num_layers}), got {self.num_draft_layers}"
            )
        if bool(self.num_draft_layers) != bool(self.draft_fingerprint):
            raise ValueError("KVCacheLayout: draft layers and a draft fingerprint go together")

    @property
    def num_target_layers(self) -> int:
        return self.num_layers - self.num_draft_layers

    @property
    def target(self) -> KVCacheLayout:
        """The target model's layers alone."""
        return dataclasses.replace(self, num_layers=self.num_target_layers, num_draft_layers=0, draft_fingerprint="")

    def with_draft(self, draft: KVCacheLayout, fingerprint: str) -> KVCacheLayout | None:
        """This (target) layout followed by a draft's layers, if the draft's KV has the same
        geometry (block size, KV heads, head size, dtype); None if it does not."""
        if (draft.block_size, draft.num_kv_heads, draft.head_dim, draft.dtype) != (
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
            self.dtype,
        ):
            return None
        return dataclasses.replace(
            self,
            num_layers=self.num_target_layers + draft.num_layers,
            num_draft_layers=draft.num_layers,
            draft_fingerprint=fingerprint,
        )

    @classmethod
    def for_model(cls, config: ModelConfig, block_size: int, dtype: torch.dtype) -> KVCacheLayout:
        return cls(config.num_hidden_layers, block_size, config.num_key_value_heads, config.head_dim, dtype)

    @property
    def row_width(self) -> int:
        """Elements of one cache row (a token's values of one KV head) of this dtype."""
        return row_width(self.dtype, self.head_dim)

    @property
    def bytes_per_block_per_layer(self) -> int:
        """K and V of one block in one layer: the unit of a KV transfer chunk."""
        return 2 * self.block_size * self.num_kv_heads * self.row_width * self.dtype.itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_block_per_layer * self.num_layers

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens (the last one partly filled)."""
        return cdiv(num_tokens, self.block_size)

    def blocks_shape(self, num_blocks: int) -> tuple[int, int, int, int, int]:
        """Shape of `num_blocks` blocks of one layer: [2, n, block_size, kv_heads, row_width]."""
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.row_width)


def allocate_kv_caches(layout: KVCacheLayout, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
    """One zeroed cache tensor per layer. On 4 KiB pages: huge pages (madvise) made decode attention
    over a served cache's scattered blocks ~7% faster, but this VM backs fresh huge pages slowly
    (1 GiB: 2.3 s against 0.2), and `launch` took 6.4-7.2 s to be ready instead of 3.3-3.7."""
    return [
        torch.zeros(layout.blocks_shape(num_blocks), dtype=layout.dtype, device=device)
        for _ in range(layout.num_layers)
    ]
