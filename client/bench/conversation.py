"""Multi-turn conversations: each turn's prompt is the whole history so far, so a prefix cache
that keeps earlier turns (their prompts and the server's answers) spares recomputing them.

Turn 0 sends its prompt as it is; turn k > 0 sends turn k-1's prompt, the tokens the server
answered to it, then a new user message, and is sent only once that answer has arrived. A
single request is a conversation of one turn, so one driver runs every workload.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvservice.client.bench.metrics import RequestRecord
from kvservice.client.bench.workload import SampledRequest

# Sends one request under the given id and returns its record (answer token ids included).
SendRequest = Callable[[SampledRequest, str], Awaitable[RequestRecord]]


@dataclass(frozen=True, slots=True)
class Conversation:
    """`turns[0]` is the first request; each later turn holds only its new user message (token ids)
    and its output length, since its full prompt depends on the answers before it."""

    turns: tuple[SampledRequest, ...]

    def __post_init__(self) -> None:
        if not self.turns:
            raise ValueError("a conversation needs at least one turn")
        if len(self.turns) > 1 and any(t.prompt_token_ids is None for t in self.turns):
            raise ValueError("a multi-turn conversation's messages must be token ids (answers are appended as ids)")


def next_turn_request(previous: SampledRequest, answer: Sequence[int], message: SampledRequest) -> SampledRequest:
    """The request of the turn after `previous`: its prompt, the `answer` to it, then `message`'s tokens."""
    assert previous.prompt_token_ids is not None and message.prompt_token_ids is not None
    prompt = [*previous.prompt_token_ids, *answer, *message.prompt_token_ids]
    return SampledRequest(len(prompt), message.expected_output_len, prompt_token_ids=prompt)


def multi_turn_conversations(
    num_conversations: int, num_turns: int, input_len: int, output_len: int, vocab_size: int, seed: int
) -> list[Conversation]:
    """Synthetic chats: every user message is `input_len` random token ids in [0, vocab_size), every
    answer `output_len` tokens; fixed by `seed`."""
    for name, value in (
        ("num_conversations", num_conversations),
        ("num_turns", num_turns),
        ("input_len", input_len),
        ("output_len", output_len),
        ("vocab_size", vocab_size),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    rng = np.random.default_rng(seed)

    def message() -> SampledRequest:
        return SampledRequest(
            input_len, output_len, prompt_token_ids=rng.integers(0, vocab_size, size=input_len).tolist()
        )

    return [Conversation(tuple(message() for _ in range(num_turns))) for _ in range(num_conversations)]


async def run_conversation(conversation: Conversation, request_id: str, send: SendRequest) -> list[RequestRecord]:
    """Send the turns one after the other; one record per turn, `turn` set.

    A failed turn has no answer to build on: the turns after it are not sent and are
    recorded as failed, so every turn of the workload is counted.
    """
    records: list[RequestRecord] = []
    request = conversation.turns[0]
    for turn, message in enumerate(conversation.turns):
        turn_id = request_id if turn == 0 else f"{request_id}-turn{turn}"
        if records and not records[-1].success:
            now = time.perf_counter()
            records.append(
                RequestRecord(turn_id, 0, now, end=now, error=f"not sent: turn {turn - 1} failed", turn=turn)
            )
            continue
        if turn > 0:
            request = next_turn_request(request, records[-1].output_token_ids, message)
        record = await send(request, turn_id)
        record.turn = turn
        records.append(record)
    return records
