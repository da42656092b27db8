"""Which workers take a request: the routing policy (`--routing`), apart from the request flow (`proxy.py`).

- `round-robin`: each worker in turn.
- `least-loaded`: the fewest outstanding requests (`WorkerHandle.num_outstanding`).
- `kv-aware` (default): the lowest cost, in prompt tokens, from each worker's index of the
  blocks in its KV cache and its offload tier (`kv_index`, fed by its KV events). A block in
  the worker's cache is free; one in its offload tier costs a load from it, OFFLOAD_LOAD_COST
  of a token each; any other is computed (prefill) or pulled (decode):
    prefill worker: prompt tokens it holds nowhere (what it computes) + the loads
                    + PEER_PULL_COST per token it would pull from the worker whose cache holds
                    the longest run of the prompt (a peer pull; see `prefix_source`)
                    + PREFILL_LOAD_TOKENS per outstanding request;
    decode worker:  tokens of the blocks it would pull (prompt blocks past what it holds, the
                    partial last block included) + the loads + DECODE_LOAD_TOKENS per outstanding request.
  Without the prompt's token ids (text or chat and no tokenizer) it is least-loaded.
Ties go to the next worker in turn, so equal workers share the work. Unhealthy workers are
never picked.

Peer pulls (kv-aware only): when another worker, of either pool, caches at least
`--peer-pull-min-tokens` (64) more of the prompt than the worker that computes it holds (the prefill
worker, or the decode worker that prefills itself), the route names it as the prefix source:
the proxy asks it to stage those blocks (ExportKV) and that worker pulls them instead of
computing them (a decode worker holds the previous turn's answer too; a migrated stream's new
decode worker finds its prompt on the prefill worker or another decode worker). A decode worker
ignores a source its --kv-peers does not allow (`launch` allows every worker of its cluster).

Conditional disaggregation (`--max-local-prefill-tokens N`, any policy): when the chosen
decode worker lacks at most N tokens of the prompt, it prefills them itself and no prefill
worker takes part.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvservice.runtime.routing_args import (
    DEFAULT_MAX_LOCAL_PREFILL_TOKENS,
    DEFAULT_PEER_PULL_MIN_TOKENS,
    DEFAULT_ROUTING,
    ROUTING_POLICIES,
)
from kvservice.server.errors import NoWorkerAvailable
from kvservice.server.proxy.kv_index import PrefixLocation
from kvservice.server.proxy.worker_pool import WorkerHandle, WorkerPool

logger = logging.getLogger(__name__)

# A request already on a prefill worker delays a new one by its own prefill: counted as a
# medium prompt's uncached part, so a worker that holds a long prefix still wins over a
# less busy one that would compute it again, and equal caches split by load.
PREFILL_LOAD_TOKENS = 256
# A request already on a decode worker slows each of its steps a little; pulling a missing
# prefix costs its transfer and, for the prefill worker, its compute. 64 tokens per request
# keeps a conversation or a shared prefix on the worker that holds it until that worker
# runs many (a 1,536-token prefix: ~24) more requests than another.
DECODE_LOAD_TOKENS = 64
# A token's KV read back from a worker's own offload tier instead of computed: SmolLM2 keeps
# ~46 KB of float32 KV a token, read from a local store at GB/s in a few microseconds, against
# the ~0.5 ms a token its prefill costs on two cores. A tenth keeps a store hit far ahead of a
# recompute, yet behind the same blocks in a worker's cache.
OFFLOAD_LOAD_COST = 0.1
# A token's KV pulled from another worker's cache instead of computed: a few hundred microseconds
# of a local transfer for a 16-token block against ~8 ms of prefill compute, plus the ExportKV call.
PEER_PULL_COST = 0.2


def _missing_cost(num_tokens: int, held: PrefixLocation, num_peer_tokens: int = 0) -> float:
    """What `num_tokens` of a prompt cost a worker that holds `held` of them when a peer's cache
    holds the first `num_peer_tokens`: a token computed or pulled for each held nowhere,
    OFFLOAD_LOAD_COST for each in its offload tier, PEER_PULL_COST for each pulled from the peer."""
    num_pulled = max(0, num_peer_tokens - held.num_held_tokens)
    return (
        num_tokens
        - held.num_held_tokens
        - num_pulled
        + OFFLOAD_LOAD_COST * held.num_offloaded_tokens
        + PEER_PULL_COST * num_pulled
    )


@dataclass(frozen=True, slots=True)
class PrefixSource:
    """A worker whose cache holds more of the prompt than the worker that computes it: a peer pull's source."""

    worker: WorkerHandle
    role: str  # its pool's
    num_cached_tokens: int  # by the proxy's index


@dataclass(frozen=True, slots=True)
class Route:
    decode: WorkerHandle
    prefill: WorkerHandle | None  # None: the decode worker prefills the prompt itself
    num_uncached_tokens: int | None  # prompt tokens the decode worker holds nowhere; None: unknown
    # Where the worker that computes the prompt (the prefill worker, else the decode worker) pulls
    # the prompt's prefix from.
    prefix_source: PrefixSource | None = None


class Router:
    def __init__(
        self,
        prefill: WorkerPool,
        decode: WorkerPool,
        policy: str = DEFAULT_ROUTING,
        max_local_prefill_tokens: int = DEFAULT_MAX_LOCAL_PREFILL_TOKENS,
        peer_pull_min_tokens: int = DEFAULT_PEER_PULL_MIN_TOKENS,
    ) -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing: expected one of {', '.join(ROUTING_POLICIES)}, got {policy!r}")
        if max_local_prefill_tokens < 0:
            raise ValueError(f"max_local_prefill_tokens must be >= 0, got {max_local_prefill_tokens}")
        self.prefill = prefill
        self.decode = decode
        self.policy = policy
        self.max_local_prefill_tokens = max_local_prefill_tokens
        self.peer_pull_min_tokens = peer_pull_min_tokens  # 0: no peer pulls
        self._turns = {id(prefill): itertools.count(), id(decode): itertools.count()}

    @property
    def needs_kv_events(self) -> bool:
        """Whether any decision reads the workers' cache indexes (subscribe to their events)."""
        return self.policy == "kv-aware" or self.max_local_prefill_tokens > 0

    def route(
        self,
        token_ids: Sequence[int] | None,
        exclude_decode: frozenset[str] | set[str] = frozenset(),
        use_prefill: bool = True,
    ) -> Route:
        """The workers for a prompt (`token_ids`, None when unknown); `use_prefill=False`: the
        decode worker prefills (a retry). Raises NoWorkerAvailable without a healthy decode worker."""
        decoders = [w for w in self.decode.healthy if w.address not in exclude_decode]
        if not decoders:
            raise NoWorkerAvailable("no healthy decode worker")
        hashes: dict[tuple[int, int], list[int]] = {}
        located: dict[int, PrefixLocation] = {}  # per worker: the costs, the peer and the source ask again

        def where(worker: WorkerHandle) -> PrefixLocation:
            assert token_ids is not None
            if (location := located.get(id(worker))) is None:
                location = located[id(worker)] = worker.kv_index.locate(token_ids, hashes)
            return location

        def pull_cost(worker: WorkerHandle) -> float:
            assert token_ids is not None
            block_size = worker.kv_index.block_size or 1
            num_prompt_tokens = -(-len(token_ids) // block_size) * block_size
            return _missing_cost(num_prompt_tokens, where(worker)) + DECODE_LOAD_TOKENS * worker.num_outstanding

        peer = None
        if token_ids is not None and self.policy == "kv-aware" and self.peer_pull_min_tokens:
            peer = self._best_cached(token_ids, where)

        def prefill_cost(worker: WorkerHandle) -> float:
            assert token_ids is not None
            num_peer_tokens = peer.num_cached_tokens if peer is not None and peer.worker is not worker else 0
            held = where(worker)
            return _missing_cost(len(token_ids), held, num_peer_tokens) + PREFILL_LOAD_TOKENS * worker.num_outstanding

        decode = self._pick(self.decode, decoders, token_ids, pull_cost)
        num_uncached = (
            len(token_ids) - where(decode).num_held_tokens if token_ids is not None and self.needs_kv_events else None
        )
        prefill = None
        if not (
            num_uncached is not None
            and 0 < self.max_local_prefill_tokens
            and num_uncached <= self.max_local_prefill_tokens
        ):
            prefillers = self.prefill.healthy if use_prefill else []
            prefill = self._pick(self.prefill, prefillers, token_ids, prefill_cost) if prefillers else None
        # The worker that computes the prompt pulls from the peer that caches more of it.
        computing = prefill if prefill is not None else decode
        source = None
        if peer is not None and peer.worker is not computing:
            if peer.num_cached_tokens - where(computing).num_held_tokens >= self.peer_pull_min_tokens:
                source = peer
        return Route(decode, prefill, num_uncached, source)

    def _best_cached(
        self,
        token_ids: Sequence[int],
        where: Callable[[WorkerHandle], PrefixLocation],
    ) -> PrefixSource | None:
        """The healthy worker, of either pool, whose cache holds the longest run of the prompt."""
        best: PrefixSource | None = None
        for role, pool in (("decode", self.decode), ("prefill", self.prefill)):
            for worker in pool.healthy:
                num_cached = where(worker).num_cached_tokens
                if num_cached and (best is None or num_cached > best.num_cached_tokens):
                    best = PrefixSource(worker, role, num_cached)
        return best

    def _pick(
        self,
        pool: WorkerPool,
        candidates: list[WorkerHandle],
        token_ids: Sequence[int] | None,
        kv_cost: Callable[[WorkerHandle], float],
    ) -> WorkerHandle:
        start = next(self._turns[id(pool)]) % len(candidates)
        in_turn = candidates[start:] + candidates[:start]
        if self.policy == "round-robin":
            return in_turn[0]
        if self.policy == "kv-aware" and token_ids is not None:
            return min(in_turn, key=kv_cost)
        return min(in_turn, key=lambda w: w.num_outstanding)
