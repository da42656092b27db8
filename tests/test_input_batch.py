"""A step's flat batch: the decode group (padded verify steps included) and the spans after it."""

from __future__ import annotations

import torch

from kvservice.worker.input_batch import BatchItem, build_batch, decode_group

BS = 4
CPU = torch.device("cpu")


def _item(num_tokens: int, start: int, num_blocks: int, first_block: int) -> BatchItem:
    return BatchItem(list(range(100, 100 + num_tokens)), start, list(range(first_block, first_block + num_blocks)))


def test_verify_steps_of_different_lengths_share_one_padded_group() -> None:
    # 1 + drafted tokens: 1, 3 and 2 queries, each with room for 3 in its blocks.
    items = [_item(1, 5, 2, 0), _item(3, 2, 2, 10), _item(2, 4, 2, 20)]
    assert decode_group(items, BS) == ([0, 1, 2], 3)
    batch = build_batch(items, BS, CPU)
    assert batch.attn.num_decode_tokens == 9 and batch.attn.prefills == []
    # Each request's real tokens end where its outputs are read; padding repeats its last token.
    assert batch.ends == [1, 6, 8]
    assert batch.input_ids.tolist() == [100, 100, 100, 100, 101, 102, 100, 101, 101]
    assert batch.positions.tolist() == [5, 6, 7, 2, 3, 4, 4, 5, 6]
    # Padding queries write into their own request's blocks, past its tokens.
    assert batch.attn.slot_mapping.tolist() == [1 * BS + 1, 1 * BS + 2, 1 * BS + 3, 42, 43, 44, 84, 85, 86]
    assert batch.attn.decode_starts is not None and batch.attn.decode_starts.tolist() == [5, 2, 4]


def test_a_request_without_room_for_the_padding_leaves_the_group_to_the_common_length() -> None:
    # The first request's last block ends at position 7: no room for 3 queries from 6.
    items = [_item(1, 6, 2, 0), _item(3, 2, 2, 10), _item(1, 9, 3, 20)]
    assert decode_group(items, BS) == ([0, 2], 1)
    batch = build_batch(items, BS, CPU)
    assert batch.attn.num_decode_tokens == 2
    assert [(s.start, s.end) for s in batch.attn.prefills] == [(2, 5)]
    assert batch.ends == [1, 5, 2]


def test_padding_that_would_more_than_double_the_rows_is_not_done() -> None:
    items = [_item(8, 0, 3, 0)] + [_item(1, 3, 3, 10 * i) for i in range(1, 4)]
    assert decode_group(items, BS) == ([1, 2, 3], 1)  # 32 rows for 11 tokens: plain decode group
    assert decode_group(items[:2], BS) == ([0, 1], 8)  # 16 rows for 9 tokens


def test_a_prompt_chunk_longer_than_a_group_runs_as_a_span() -> None:
    items = [_item(1, 3, 1, 0), _item(20, 0, 5, 10)]
    assert decode_group(items, BS) == ([0], 1)
    batch = build_batch(items, BS, CPU)
    assert [(s.start, s.end) for s in batch.attn.prefills] == [(1, 21)]
