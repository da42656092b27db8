"""One request's place in its grammar: which tokens may come next, and the tokens it has taken."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import llguidance

if TYPE_CHECKING:
    import torch


class GrammarMatcher:
    """Built by `GrammarCompiler.matcher`; owned by one request.

    Per step: `fill_next_token_bitmask` (the tokens allowed next), then, once the token is sampled,
    `accept_token`. Once `is_terminated()`, the mask allows the model's EOS ids only: the request
    may end there ("stop") without sampling that EOS.

    Not for two threads at once (llguidance raises rather than race), but any one thread will do:
    the fill drops the GIL, so it can run beside the model's forward. The mask for step t+1 needs
    only the tokens up to step t, so it can be filled while the forward of step t+1 runs.
    """

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self._mask_bytes = 4 * ((vocab_size + 31) // 32)

    def accept_token(self, token_id: int) -> bool:
        """Advance past `token_id`. False if the grammar does not allow it: the matcher is then in
        error for good (`error`), and the request must be aborted."""
        return self._matcher.consume_token(token_id)

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]`: bit `t % 32` of word `t // 32` is set
        iff token t is allowed. `bitmask` is `allocate_token_bitmask`'s int32 [num_rows, words] on the CPU."""
        address = _row_address(bitmask, row, self._mask_bytes)
        self._matcher.unsafe_compute_mask_ptr(address, self._mask_bytes)

    def is_terminated(self) -> bool:
        """True once the grammar is complete and nothing may follow but EOS (or EOS was accepted)."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    def rollback(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` accepted tokens (rejected speculative tokens)."""
        if not self._matcher.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self._matcher.get_error()}")

    @property
    def error(self) -> str | None:
        """Why the matcher failed (a token the grammar forbids, a parser limit), or None."""
        return self._matcher.get_error() if self._matcher.is_error() else None


def fill_next_token_bitmasks(rows: Sequence[tuple[GrammarMatcher, int]], bitmask: torch.Tensor) -> None:
    """`matcher.fill_next_token_bitmask(bitmask, row)` for every (matcher, row) pair, on llguidance's
    thread pool, without the GIL: the batch's masks in one call. Rows must be distinct."""
    if not rows:
        return
    mask_bytes = rows[0][0]._mask_bytes
    base = _row_address(bitmask, 0, mask_bytes)
    assert len({row for _, row in rows}) == len(rows), "two matchers would write one row"
    for matcher, row in rows:
        assert matcher._mask_bytes == mask_bytes, "matchers of one vocabulary only"
        _row_address(bitmask, row, mask_bytes)  # bounds
    _executor().unsafe_compute_mask_ptr([(m._matcher, row) for m, row in rows], base, mask_bytes, bitmask.shape[0])


@functools.cache
def _executor() -> llguidance.LLExecutor:
    return llguidance.LLExecutor()


def _row_address(bitmask: torch.Tensor, row: int, mask_bytes: int) -> int:
    """The address of `bitmask[row]`, after the checks that make llguidance's raw write safe."""
    if (
        bitmask.device.type != "cpu"
        or bitmask.dim() != 2
        or bitmask.element_size() != 4
        or bitmask.dtype.is_floating_point
    ):
        raise ValueError(
            "bitmask: expected an int32 [num_rows, words] CPU tensor, "
            f"got {bitmask.dtype} {tuple(bitmask.shape)} on {bitmask.device}"
        )
    if not bitmask.is_contiguous() or bitmask.shape[1] * 4 != mask_bytes:
        raise ValueError(f"bitmask: expected {mask_bytes // 4} contiguous words per row, got {tuple(bitmask.shape)}")
    if not 0 <= row < bitmask.shape[0]:
        raise IndexError(f"bitmask row {row} out of range for {bitmask.shape[0]} rows")
    return bitmask.data_ptr() + row * mask_bytes
