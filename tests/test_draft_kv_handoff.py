"""Speculative decoding across the boundary: a prefill worker with a draft model runs the draft
over the prompt while the target's KV save is in flight, and the draft's prompt KV travels on the
same pull, so the decode worker speculates from its first step without recomputing anything.
Both sides must run the same draft; a prefill worker without one leads to a counted recompute."""

from __future__ import annotations

import dataclasses
import logging
import pathlib

import pytest
import torch

from kvservice.connector.kv_transfer_service import KVTransferService, OutgoingChunk
from kvservice.connector.shared_memory import RingWriter
from kvservice.connector.transfer_registry import StagedChunk, StagedTransfer
from kvservice.core.outputs import SpecDecodingStats
from kvservice.engine.engine import LLMEngine
from kvservice.loading.model_files import TINY_CONFIG
from tests.pd_pair import (
    PROMPTS,
    Pair,
    drive_decode,
    drive_prefill,
    pd_pair,
    prompt_blocks,
    reference,  # noqa: F401 - the module-scoped fixture
)

pytestmark = pytest.mark.timeout(120)

NUM_TARGET_LAYERS = TINY_CONFIG.num_hidden_layers
SOME_PROMPTS = PROMPTS[:4]  # 3, 8, 13 and 21 tokens


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A draft with the tiny model's KV geometry but another identity: one layer of its own."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    config = LlamaConfig(
        vocab_size=TINY_CONFIG.vocab_size,
        hidden_size=TINY_CONFIG.hidden_size,
        intermediate_size=TINY_CONFIG.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=TINY_CONFIG.num_attention_heads,
        num_key_value_heads=TINY_CONFIG.num_key_value_heads,
        head_dim=TINY_CONFIG.head_dim,
        max_position_embeddings=TINY_CONFIG.max_position_embeddings,
    )
    path = tmp_path_factory.mktemp("drafts") / "one-layer-draft"
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


async def _run(pair: Pair, prompts: list[list[int]]) -> dict[str, list[int]]:
    """Every prompt through the pair; then, as the proxy does once a request ends, the transfers
    are released (a no-op after a completed pull), and nothing may be left on either side."""
    tokens = {f"req-{i}": pair.add(f"req-{i}", prompt) for i, prompt in enumerate(prompts)}
    await drive_prefill(pair)
    finished = await drive_decode(pair)
    for request_id, token in tokens.items():
        pair.registry.release(request_id, token)
    pair.assert_everything_free()
    return {rid: out.token_ids for rid, out in finished.items()}


def _spec(engine: LLMEngine) -> SpecDecodingStats:
    return engine.core.scheduler.make_stats().spec_decoding


def _draft_blocks(engine: LLMEngine, request_id: str, num_tokens: int) -> list[torch.Tensor]:
    """The request's prompt blocks in the draft's own caches, per draft layer."""
    drafter = engine.core.runner.drafter
    target_blocks = prompt_blocks(engine, request_id, num_tokens)  # checks the block table
    del target_blocks
    block_ids = engine.core.scheduler.kv.block_tables[request_id][: -(-num_tokens // engine.config.block_size)]
    index = torch.tensor(block_ids)
    return [cache.index_select(1, index).clone() for cache in drafter.kv_caches]  # type: ignore[union-attr]


async def test_the_drafts_prompt_kv_travels_with_the_pull(reference: list[list[int]]) -> None:  # noqa: F811
    prefill_kv: dict[str, list[torch.Tensor]] = {}
    decode_kv: dict[str, list[torch.Tensor]] = {}
    lengths = {f"req-{i}": len(p) for i, p in enumerate(SOME_PROMPTS)}
    async with pd_pair(prefill_draft="tiny", decode_draft="tiny") as pair:
        for i, prompt in enumerate(SOME_PROMPTS):
            pair.add(f"req-{i}", prompt)
        await drive_prefill(
            pair, lambda rid: prefill_kv.__setitem__(rid, _draft_blocks(pair.prefill, rid, lengths[rid]))
        )
        finished = await drive_decode(
            pair,
            lambda out: decode_kv.__setitem__(
                out.request_id, _draft_blocks(pair.decode, out.request_id, lengths[out.request_id])
            ),
        )
        pair.assert_everything_free()
        prefill_spec, decode_spec = _spec(pair.prefill), _spec(pair.decode)
    assert [finished[f"req-{i}"].token_ids for i in range(len(SOME_PROMPTS))] == reference[: len(SOME_PROMPTS)]
    num_prompt_tokens = sum(lengths.values())
    assert prefill_spec.num_draft_prompt_tokens_computed == num_prompt_tokens  # the draft ran on the prefill side
    assert decode_spec.num_draft_prompt_tokens_received == num_prompt_tokens
    assert decode_spec.num_draft_prompt_tokens_recomputed == 0
    assert decode_spec.num_draft_prompt_tokens_computed == 0  # nothing of the prompts ran through the draft here
    assert decode_spec.num_draft_tokens > 0 and decode_spec.num_accepted_tokens > 0  # it speculated
    for rid in lengths:  # the draft's blocks arrived bit for bit
        for prefill_layer, decode_layer in zip(prefill_kv[rid], decode_kv[rid]):
            assert torch.equal(prefill_layer.view(torch.int32), decode_layer.view(torch.int32))


async def test_a_prefill_worker_without_the_draft_leads_to_a_counted_recompute(reference: list[list[int]]) -> None:  # noqa: F811
    async with pd_pair(prefill_draft=None, decode_draft="tiny") as pair:
        tokens = await _run(pair, SOME_PROMPTS)
        decode_spec = _spec(pair.decode)
        assert pair.decode_connector.stats.num_failed_transfers == 0  # nothing failed
    assert [tokens[f"req-{i}"] for i in range(len(SOME_PROMPTS))] == reference[: len(SOME_PROMPTS)]
    num_prompt_tokens = sum(map(len, SOME_PROMPTS))
    assert decode_spec.num_draft_prompt_tokens_received == 0
    assert decode_spec.num_draft_prompt_tokens_recomputed == num_prompt_tokens
    assert decode_spec.num_draft_prompt_tokens_computed == num_prompt_tokens


async def test_a_decode_worker_without_a_draft_pulls_the_targets_layers_alone(reference: list[list[int]]) -> None:  # noqa: F811
    async with pd_pair(prefill_draft="tiny", decode_draft=None) as pair:
        tokens = await _run(pair, SOME_PROMPTS)
        assert pair.decode_connector.stats.num_failed_transfers == 0
        received = pair.decode_connector.stats.num_bytes
    async with pd_pair() as plain_pair:  # no draft on either side: the same bytes go over the wire
        await _run(plain_pair, SOME_PROMPTS)
        assert received == plain_pair.decode_connector.stats.num_bytes > 0
    assert [tokens[f"req-{i}"] for i in range(len(SOME_PROMPTS))] == reference[: len(SOME_PROMPTS)]


async def test_a_mismatched_draft_is_refused_naming_both_and_the_prompt_recomputed(
    reference: list[list[int]],  # noqa: F811
    other_draft: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    prompts = SOME_PROMPTS[:2]
    with caplog.at_level(logging.WARNING):
        async with pd_pair(prefill_draft="tiny", decode_draft=other_draft) as pair:
            tokens = await _run(pair, prompts)
            assert pair.decode_connector.stats.num_failed_transfers == len(prompts)
    assert [tokens[f"req-{i}"] for i in range(len(prompts))] == reference[: len(prompts)]
    refusals = [r.getMessage() for r in caplog.records if "speculative draft mismatch" in r.getMessage()]
    assert refusals, [r.getMessage() for r in caplog.records]
    assert "one-layer-draft" in refusals[0] and "'tiny" in refusals[0]


class _CorruptingDraftChunks(KVTransferService):
    """Flips one payload byte of every chunk of a draft layer."""

    async def encode_chunk(
        self, transfer: StagedTransfer, chunk: StagedChunk, ring: RingWriter | None
    ) -> OutgoingChunk | None:
        outgoing = await super().encode_chunk(transfer, chunk, ring)
        if outgoing is None or chunk.layer < NUM_TARGET_LAYERS:
            return outgoing
        assert ring is None
        frame = outgoing.frame
        return dataclasses.replace(outgoing, frame=frame[:-1] + bytes([frame[-1] ^ 0xFF]))


async def test_a_corrupted_draft_chunk_is_a_load_error_and_the_prompt_is_recomputed(
    reference: list[list[int]],  # noqa: F811
) -> None:
    prompts = SOME_PROMPTS[:2]
    async with pd_pair(prefill_draft="tiny", decode_draft="tiny", service=_CorruptingDraftChunks) as pair:
        tokens = await _run(pair, prompts)  # every block of either model freed on both sides
        assert pair.decode_connector.stats.num_failed_transfers == len(prompts)
        assert _spec(pair.decode).num_draft_prompt_tokens_received == 0
    assert [tokens[f"req-{i}"] for i in range(len(prompts))] == reference[: len(prompts)]


def test_the_draft_fingerprint_names_the_model_and_its_shape(other_draft: str) -> None:
    from kvservice.config import EngineConfig
    from kvservice.engine.engine_builder import kv_transfer_layout

    config = EngineConfig(draft_model=other_draft, num_speculative_tokens=3)
    layout = kv_transfer_layout("tiny", config)
    assert (layout.num_target_layers, layout.num_draft_layers) == (NUM_TARGET_LAYERS, 1)
    assert layout.draft_fingerprint.startswith(pathlib.Path(other_draft).name)
    assert kv_transfer_layout("tiny", EngineConfig()).num_draft_layers == 0
