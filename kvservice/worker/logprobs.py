"""Logprobs of tokens from a step's logits: the log-softmax of the raw logits, the
token's rank, and the position's top-k (see `kvservice.core.logprobs`)."""

from __future__ import annotations

import torch

from kvservice.core.logprobs import TokenLogprobs


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: int) -> list[TokenLogprobs]:
    """logits: [N, V], raw; token_ids: N tokens, one per row. Each row's logprob of its token,
    that token's rank (1 + the tokens strictly more likely) and the row's `num_top` best."""
    if not token_ids:
        return []
    logprobs = logits.float().log_softmax(-1)  # [N, V]
    chosen = logprobs.gather(1, torch.tensor(token_ids, device=logits.device)[:, None])  # [N, 1]
    ranks = ((logprobs > chosen).sum(-1) + 1).tolist()
    chosen_values = chosen[:, 0].tolist()
    top: list[tuple[tuple[int, float], ...]] = [()] * len(token_ids)
    if num_top > 0:
        values, ids = logprobs.topk(num_top, dim=-1)
        top = [tuple(zip(row_ids, row_values)) for row_ids, row_values in zip(ids.tolist(), values.tolist())]
    return [TokenLogprobs(t, lp, r, tp) for t, lp, r, tp in zip(token_ids, chosen_values, ranks, top)]
