"""Token sampling from logits: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import torch

from kvservice.core.sampling_params import SamplingParams


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits: [V] (already temperature-scaled); filtered entries become -inf."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens before it already reach top_p (keep at least one).
        drop = (probs.cumsum(-1) - probs) >= top_p
        drop[0] = False
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


# Mixes a request's seed with a token's position (and the stream: the target's or the draft's).
_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int, stream: int = 0) -> int:
    """The seed of the draw for output token `position` of a request seeded `seed`."""
    return (seed * _GOLDEN + (position + 1) * 0xBF58476D1CE4E5B9 + stream * 0x94D049BB133111EB) & _MASK64


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's index of its largest value (the first of equals, as torch.argmax). On the
    CPU through numpy: torch's parallel reduction over a 49k-wide row costs ~45 us a call
    (its OpenMP region), numpy's ~4 us."""
    if logits.device.type == "cpu":
        return logits.numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()


class Sampler:
    """Samples one token per row. A request with a seed draws each token from a generator
    seeded by (seed, the token's position): its output does not depend on the batch, nor on
    where its earlier tokens were sampled (a prefill worker's first token, a migrated
    stream, a parallel-sampling sibling's shared prompt), only on the seed.
    """

    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self._default_generator = torch.Generator(device=device).manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_ids: set[str]) -> None:
        for request_id in request_ids:
            self._generators.pop(request_id, None)

    def sample(
        self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams], positions: list[int]
    ) -> list[int]:
        """logits: [N, V] float32, one row per request id; `positions`: each row's output
        token index (how many tokens the request has emitted so far)."""
        if all(p.is_greedy for p in params):
            return argmax_rows(logits)
        tokens: list[int] = []
        for row, request_id, p, position in zip(logits, request_ids, params, positions):
            if p.is_greedy:
                tokens.append(argmax_rows(row[None])[0])
                continue
            row = apply_top_k_top_p(row / p.temperature, p.top_k, p.top_p)
            probs = row.softmax(-1)
            token = torch.multinomial(probs, 1, generator=self.generator_for(request_id, p, position))
            tokens.append(int(token))
        return tokens

    def generator_for(self, request_id: str, params: SamplingParams, position: int, stream: int = 0) -> torch.Generator:
        """The generator for one draw: the engine's own for unseeded requests; for a seeded
        one, its generator set to (seed, position, stream): stream 0 is the target's, 1 the draft's."""
        if params.seed is None:
            return self._default_generator
        gen = self._generators.get(request_id)
        if gen is None:
            gen = self._generators[request_id] = torch.Generator(device=self.device)
        return gen.manual_seed(position_seed(params.seed, position, stream))
