"""Turning a step's requests into one flat batch of tokens plus its attention metadata.

Shared by the target model and the draft model: each item is the tokens a request
runs this step, the position of the first one, and the request's block table.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from kvservice.core.kv_cache_manager import cdiv
from kvservice.model.attention import AttentionMetadata, PrefillSpan

# Requests with at most this many new tokens may join the batched decode group.
MAX_DECODE_GROUP_QUERIES = 8
# A group padded to its longest member's query count runs at most this many rows per real token.
_MAX_PADDED_ROWS_PER_TOKEN = 2


@dataclass(frozen=True, slots=True)
class BatchItem:
    token_ids: list[int]
    start: int  # position of token_ids[0]
    block_ids: list[int]


@dataclass(slots=True)
class InputBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn: AttentionMetadata
    ends: list[int]  # ends[i]: one past item i's last token in the flat batch

    def last_indices(self, item_index: int, count: int) -> range:
        """Flat indices of the last `count` tokens of item `item_index`."""
        end = self.ends[item_index]
        return range(end - count, end)


def decode_group(items: list[BatchItem], block_size: int) -> tuple[list[int], int]:
    """The items that run as the decode group (their indices) and its query count Q.

    Verify steps give requests different query counts (1 + however many tokens were drafted
    for each). The group takes them all, the shorter ones padded to the longest, when each has
    room for Q queries in its blocks and padding at most doubles the rows: the step then stays
    on the one-call decode path, where splitting it would send the whole step down the per-op
    path. Otherwise the group is the most common small query count, unpadded."""
    small = [i for i, item in enumerate(items) if len(item.token_ids) <= MAX_DECODE_GROUP_QUERIES]
    if not small:
        return [], 0
    longest = max(len(items[i].token_ids) for i in small)
    num_tokens = sum(len(items[i].token_ids) for i in small)
    has_room = all(items[i].start + longest <= len(items[i].block_ids) * block_size for i in small)
    if has_room and longest * len(small) <= _MAX_PADDED_ROWS_PER_TOKEN * num_tokens:
        return small, longest
    group_q = Counter(len(items[i].token_ids) for i in small).most_common(1)[0][0]
    return [i for i in small if len(items[i].token_ids) == group_q], group_q


def build_batch(items: list[BatchItem], block_size: int, device: torch.device) -> InputBatch:
    """Lay the items out decode group first (`decode_group`), then spans."""
    bs = block_size
    group, group_q = decode_group(items, bs)
    in_group = set(group)
    order = group + [i for i in range(len(items)) if i not in in_group]

    token_ids: list[int] = []
    positions: list[int] = []
    token_blocks: list[int] = []
    flat_start: dict[int, int] = {}
    for i in order:
        item = items[i]
        flat_start[i] = len(token_ids)
        # A group member with fewer than Q tokens runs padding queries after its own (its last
        # token again): their keys land in its own blocks past its tokens, which nothing reads
        # before its later tokens overwrite them, and their outputs are never read.
        num_padding = group_q - len(item.token_ids) if i in in_group else 0
        token_ids.extend(item.token_ids + item.token_ids[-1:] * num_padding)
        span = range(item.start, item.start + len(item.token_ids) + num_padding)
        positions.extend(span)
        token_blocks.extend(item.block_ids[p // bs] for p in span)
    pos = torch.tensor(positions, dtype=torch.long)
    slot_mapping = torch.tensor(token_blocks, dtype=torch.long) * bs + pos % bs

    decode_slots = decode_mask = decode_table = decode_starts = None
    if group:
        starts = torch.tensor([items[i].start for i in group])
        max_len = int(starts.max()) + group_q
        max_blocks = cdiv(max_len, bs)
        decode_table = torch.tensor(
            [(items[i].block_ids + [0] * max_blocks)[:max_blocks] for i in group], dtype=torch.long
        )
        decode_starts = starts
        decode_slots = (decode_table[:, :, None] * bs + torch.arange(bs)).flatten(1)[:, :max_len]  # [B, L]
        # Query q of request b sits at position start_b + q and sees keys at positions <= it.
        query_pos = starts[:, None] + torch.arange(group_q)[None, :]  # [B, Q]
        decode_mask = (torch.arange(max_len)[None, None, :] <= query_pos[:, :, None])[:, None, None]  # [B,1,1,Q,L]

    spans: list[PrefillSpan] = []
    for i in order[len(group) :]:
        item = items[i]
        n, start = len(item.token_ids), item.start
        span = PrefillSpan(flat_start[i], flat_start[i] + n)
        if start > 0:
            context = start + n
            table = torch.tensor(item.block_ids[: cdiv(context, bs)], dtype=torch.long)
            span.context_slots = (table[:, None] * bs + torch.arange(bs)).flatten()[:context].to(device)
            # Query j (position start + j) sees keys at positions <= start + j.
            span.mask = (torch.arange(context)[None, :] <= (start + torch.arange(n))[:, None]).to(device)
        spans.append(span)

    ends = [flat_start[i] + len(items[i].token_ids) for i in range(len(items))]
    attn = AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        num_decode_tokens=len(group) * group_q,
        decode_context_slots=None if decode_slots is None else decode_slots.to(device),
        decode_mask=None if decode_mask is None else decode_mask.to(device),
        prefills=spans,
        decode_block_table=None if decode_table is None else decode_table.to(device),
        decode_starts=None if decode_starts is None else decode_starts.to(device),
    )
    return InputBatch(torch.tensor(token_ids, dtype=torch.long, device=device), pos.to(device), attn, ends)
