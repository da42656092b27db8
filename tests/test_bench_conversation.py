"""Multi-turn conversations: synthetic chats, and the driver that builds each turn from the history."""

from __future__ import annotations

import time

import pytest

from kvservice.client.bench.conversation import Conversation, multi_turn_conversations, run_conversation
from kvservice.client.bench.metrics import RequestRecord
from kvservice.client.bench.workload import SampledRequest


def test_conversations_have_the_asked_shape_and_are_fixed_by_seed() -> None:
    chats = multi_turn_conversations(3, num_turns=4, input_len=10, output_len=5, vocab_size=50, seed=2)
    assert len(chats) == 3 and {len(c.turns) for c in chats} == {4}
    assert {(t.prompt_len, t.expected_output_len) for c in chats for t in c.turns} == {(10, 5)}
    assert all(0 <= token < 50 for c in chats for t in c.turns for token in t.prompt_token_ids)
    assert chats == multi_turn_conversations(3, 4, 10, 5, 50, seed=2)
    assert chats != multi_turn_conversations(3, 4, 10, 5, 50, seed=3)
    with pytest.raises(ValueError, match="num_turns"):
        multi_turn_conversations(1, 0, 10, 5, 50, seed=0)


class _EchoServer:
    """Answers each prompt with `expected_output_len` tokens derived from its length; remembers what it was sent."""

    def __init__(self, fail_turn: int | None = None) -> None:
        self.sent: list[tuple[str, list[int]]] = []
        self.fail_turn = fail_turn

    async def send(self, request: SampledRequest, request_id: str) -> RequestRecord:
        assert request.prompt_token_ids is not None and request.prompt_len == len(request.prompt_token_ids)
        self.sent.append((request_id, list(request.prompt_token_ids)))
        answer = [1000 + len(self.sent) * 10 + i for i in range(request.expected_output_len)]
        now = time.perf_counter()
        is_ok = len(self.sent) - 1 != self.fail_turn
        return RequestRecord(
            request_id,
            request.prompt_len,
            now,
            output_len=len(answer),
            token_times=[now] * len(answer),
            end=now,
            success=is_ok,
            output_token_ids=answer if is_ok else [],
        )


async def test_each_turn_resends_the_previous_prompt_and_its_answer() -> None:
    [chat] = multi_turn_conversations(1, num_turns=3, input_len=4, output_len=2, vocab_size=50, seed=0)
    server = _EchoServer()
    records = await run_conversation(chat, "c0", server.send)
    assert [r.turn for r in records] == [0, 1, 2]
    assert [request_id for request_id, _ in server.sent] == ["c0", "c0-turn1", "c0-turn2"]
    prompts = [prompt for _, prompt in server.sent]
    assert prompts[0] == chat.turns[0].prompt_token_ids
    for turn in (1, 2):
        previous = records[turn - 1]
        assert prompts[turn] == prompts[turn - 1] + previous.output_token_ids + chat.turns[turn].prompt_token_ids
    assert [r.prompt_len for r in records] == [4, 4 + 2 + 4, 10 + 2 + 4]


async def test_turns_after_a_failed_one_are_not_sent_but_counted_as_failed() -> None:
    [chat] = multi_turn_conversations(1, num_turns=4, input_len=4, output_len=2, vocab_size=50, seed=0)
    server = _EchoServer(fail_turn=1)
    records = await run_conversation(chat, "c", server.send)
    assert len(server.sent) == 2
    assert [(r.turn, r.success) for r in records] == [(0, True), (1, False), (2, False), (3, False)]
    assert records[2].error == "not sent: turn 1 failed"


def test_multi_turn_messages_must_be_token_ids() -> None:
    text = SampledRequest(prompt_len=2, expected_output_len=1, prompt="hi")
    assert Conversation((text,)).turns == (text,)  # a single text request is fine
    with pytest.raises(ValueError, match="token ids"):
        Conversation((text, text))
