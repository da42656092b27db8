"""The proxy's token ids of text and chat prompts are the workers': hashed with a worker's
block size and seed, they name exactly the blocks that worker cached for the prompt."""

from __future__ import annotations

import pytest

from kvservice import LLM, SamplingParams
from kvservice.core.block_hash import block_hashes
from kvservice.loading.chat_template import ChatPrompt
from kvservice.loading.model_files import load_tokenizer
from kvservice.server.proxy.prompt_tokens import PromptTokens
from kvservice.v1 import kvservice_pb2 as pb

TEXT = "The quick brown fox jumps over the lazy dog; " * 3
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name three prime numbers, please."},
]


@pytest.mark.parametrize("kind", ["text", "chat"])
def test_prompt_hashes_match_the_blocks_a_worker_caches(kind: str) -> None:
    llm = LLM("tiny", block_size=8)
    engine = llm.engine
    if kind == "text":
        request = pb.GenerateRequest(text=TEXT)
        prompt: str | ChatPrompt = TEXT
    else:
        request = pb.GenerateRequest(chat=pb.ChatPrompt(messages=[pb.ChatMessage(**m) for m in MESSAGES]))
        prompt = ChatPrompt(MESSAGES)
    token_ids = PromptTokens(load_tokenizer("tiny"), 1 << 20).token_ids(request)
    assert token_ids == engine.encode(prompt)
    llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0))
    cached = {event.block_hashes[0] for event in engine.kv_cache_snapshot()}
    hashes = block_hashes(token_ids, 8, engine.core.kv_hash_seed)
    assert len(hashes) >= 4 and set(hashes) <= cached


def test_without_a_tokenizer_only_token_ids_are_known() -> None:
    tokens = PromptTokens(None, 1 << 20)
    assert tokens.token_ids(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[3, 1, 2]))) == [3, 1, 2]
    assert tokens.token_ids(pb.GenerateRequest(text="hello")) is None
    assert (
        tokens.token_ids(pb.GenerateRequest(chat=pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="hi")])))
        is None
    )
