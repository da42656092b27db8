"""Verifying a draft's proposed tokens against the target model: speculative decoding's
acceptance rule.

Greedy: accept draft tokens while they equal the target's argmax; the first mismatch
is replaced by the target's token (or, all accepted, the target adds a bonus token).
The output equals plain greedy decoding exactly.

Sampling (Leviathan et al., 2023): accept draft token d_i with probability
min(1, p_i(d_i) / q_i(d_i)); on rejection sample from normalise(max(p_i - q_i, 0)) and
stop; all accepted, sample a bonus token from p_{K+1}. The output is distributed as
sampling from the target alone. A deterministic proposer (prompt lookup) has no q: its law is
one-hot on d_i, so d_i is accepted with probability p_i(d_i), and a rejection samples from p_i
with d_i removed (max(p_i - q_i, 0) is p_i with d_i zeroed).
"""

from __future__ import annotations

import torch

from kvservice.core.sampling_params import SamplingParams
from kvservice.worker.sampler import apply_top_k_top_p


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[N, V] logits -> [N, V] probabilities after temperature, top-k and top-p."""
    rows = [apply_top_k_top_p(row / params.temperature, params.top_k, params.top_p) for row in logits]
    return torch.stack(rows).softmax(-1)


def verify_draft_tokens(
    target_logits: torch.Tensor,
    draft_token_ids: list[int],
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> list[int]:
    """target_logits: [K + 1, V] at the last verified token and each draft token;
    draft_probs: [K, V] the draft's distributions (None for greedy, or for deterministic
    proposals: one-hot laws). Returns the accepted draft tokens followed by one token from the
    target (1..K+1 tokens)."""
    num_draft = len(draft_token_ids)
    assert target_logits.shape[0] == num_draft + 1
    if params.is_greedy:
        target_ids = target_logits.argmax(-1).tolist()
        out: list[int] = []
        for i, token in enumerate(draft_token_ids):
            if token != target_ids[i]:
                break
            out.append(token)
        out.append(target_ids[len(out)])
        return out
    assert draft_probs is None or draft_probs.shape[0] == num_draft
    p = target_probs(target_logits, params)  # [K + 1, V]
    device = p.device
    q = draft_probs if draft_probs is not None else _one_hot(draft_token_ids, p[:num_draft])  # [K, V]
    out = []
    for i, token in enumerate(draft_token_ids):
        p_i, q_i = p[i], q[i]
        accept_prob = torch.clamp(p_i[token] / q_i[token].clamp_min(1e-20), max=1.0)
        r = torch.rand((), generator=generator, device=device)
        if r < accept_prob:
            out.append(token)
            continue
        residual = (p_i - q_i).clamp_min(0.0)
        total = residual.sum()
        # p == q up to rounding: the residual vanishes and p itself is the right law.
        dist = residual / total if total > 0 else p_i
        out.append(int(torch.multinomial(dist, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(p[num_draft], 1, generator=generator)))
    return out


def _one_hot(token_ids: list[int], like: torch.Tensor) -> torch.Tensor:
    """[K, V] the one-hot laws of deterministic proposals, shaped and typed as `like`."""
    index = torch.tensor(token_ids, device=like.device)[:, None]
    return torch.zeros_like(like).scatter_(1, index, 1.0)
