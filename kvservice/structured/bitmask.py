"""Token bitmasks: one bit per vocabulary id, 32 ids per int32 word; applied to logits as -inf."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np
import torch

# Bit b of a word: 1 << b as int32 (bit 31 is the sign bit).
_BITS = torch.tensor([1 << b for b in range(31)] + [-(1 << 31)], dtype=torch.int32)
_NEG_INF_BITS = int(torch.tensor(float("-inf"), dtype=torch.float32).view(torch.int32))


def bitmask_words(vocab_size: int) -> int:
    """Words per mask row: ceil(vocab_size / 32)."""
    return (vocab_size + 31) // 32


def allocate_token_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """An int32 [num_rows, ceil(vocab_size / 32)] CPU mask with every token allowed (all bits set)."""
    return torch.full((num_rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | None = None) -> None:
    """Set `logits[r, t]` to -inf, in place, where bit t of `bitmask[r]` is clear, for each r in `rows`
    (None: every row of `logits`); other rows are left alone.

    logits: [N, V] on any device, any float dtype; bitmask: int32 [>= N, >= ceil(V / 32)]. Bits past V
    are ignored. Vectorised: float32 on the CPU costs ~0.04 ms per 49k-token row on one core.
    """
    num_rows, vocab = logits.shape
    words = bitmask_words(vocab)
    assert bitmask.dtype == torch.int32 and bitmask.shape[0] >= num_rows and bitmask.shape[1] >= words, (
        bitmask.shape,
        logits.shape,
    )
    if rows is not None and len(rows) == 0:
        return
    index = None if rows is None else torch.as_tensor(rows, dtype=torch.long)
    masks = (
        bitmask[:num_rows, :words] if index is None else bitmask[:, :words].index_select(0, index.to(bitmask.device))
    )
    target = logits if index is None else logits.index_select(0, index.to(logits.device))
    if target.device.type == "cpu" and target.dtype == torch.float32 and sys.byteorder == "little":
        _mask_float32(target, masks)
    else:
        _mask_any(target, masks)
    if index is not None:
        logits.index_copy_(0, index.to(logits.device), target)


def _mask_float32(logits: torch.Tensor, masks: torch.Tensor) -> None:
    """The CPU fast path, branch-free: each logit's bits are ANDed with all-ones or zero and ORed with -inf's."""
    # [R, W] int32 -> [R, V] 0/1; little-endian words, so bit b of word w is bit b % 8 of byte 4w + b // 8.
    allowed = np.unpackbits(
        masks.cpu().contiguous().numpy().view(np.uint8), axis=-1, count=logits.shape[1], bitorder="little"
    )
    keep = torch.from_numpy(allowed).to(torch.int32).neg_()  # -1: keep the logit, 0: replace it
    bits = logits.view(torch.int32)
    bits.bitwise_and_(keep).bitwise_or_(keep.bitwise_not_().bitwise_and_(_NEG_INF_BITS))


def _mask_any(logits: torch.Tensor, masks: torch.Tensor) -> None:
    masks = masks.to(logits.device, non_blocking=True)
    # [R, W, 32] -> [R, 32 * W]: bit b of word w is token 32 * w + b.
    disallowed = ((masks.unsqueeze(-1) & _BITS.to(logits.device)) == 0).view(masks.shape[0], -1)[:, : logits.shape[1]]
    logits.masked_fill_(disallowed, float("-inf"))
