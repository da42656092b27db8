from __future__ import annotations

import pytest

from kvservice import LLM, SamplingParams
from kvservice.engine.engine import RequestOutput
from kvservice.loading.chat_template import apply_chat_template, render_chat_template
from kvservice.loading.tokenizer import ByteTokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
CONVERSATION = [
    {"role": "system", "content": "You are a test."},
    {"role": "user", "content": "Say something."},
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", num_blocks=64)


def test_chat_equals_generate_on_the_rendered_prompt(llm: LLM) -> None:
    [out] = llm.chat(CONVERSATION, GREEDY)
    prompt_ids = apply_chat_template(llm.tokenizer, CONVERSATION)
    [expected] = llm.generate(prompt_ids, GREEDY)
    assert out.prompt_token_ids == prompt_ids
    assert prompt_ids == list(render_chat_template(llm.tokenizer, CONVERSATION).encode("utf-8"))
    assert out.token_ids == expected.token_ids and len(out.token_ids) == 12
    assert out.text == expected.text


def test_chat_takes_a_list_of_conversations_and_options(llm: LLM) -> None:
    second = [{"role": "user", "content": [{"type": "text", "text": "Other"}]}]
    outs = llm.chat([CONVERSATION, second], GREEDY, add_generation_prompt=False)
    assert len(outs) == 2
    assert outs[0].prompt_token_ids == apply_chat_template(llm.tokenizer, CONVERSATION, add_generation_prompt=False)
    assert outs[1].prompt_token_ids == list(b"<|im_start|>user\nOther<|im_end|>\n")
    [custom] = llm.chat(CONVERSATION, GREEDY, chat_template="{{ messages[-1]['content'] }}")
    assert custom.prompt_token_ids == list(b"Say something.")


def test_chat_refuses_bad_conversations(llm: LLM) -> None:
    with pytest.raises(ValueError, match="messages"):
        llm.chat([], GREEDY)
    with pytest.raises(ValueError, match=r"messages\[0\].role"):
        llm.chat([{"content": "x"}], GREEDY)
    assert llm.engine.num_free_blocks == llm.engine.num_blocks


# ------------------------------------------------------------ stop strings

STOP_PROMPT = "The capital of France"
NUM_TOKENS = 24


def pick_stop(text: str, length: int, after: int = 1) -> str:
    """A printable ASCII substring of `text`, neither at its start nor at its end: byte-level
    tokens end exactly where such a string ends."""
    for start in range(after, len(text) - length - 1):
        candidate = text[start : start + length]
        if candidate.isascii() and candidate.isprintable() and text.find(candidate) >= after:
            return candidate
    raise AssertionError(f"no printable substring of length {length} in {text!r}")


def tokens_until(token_ids: list[int], stop: str) -> int:
    """How many tokens it takes for the text to contain `stop`."""
    tokenizer = ByteTokenizer()
    return next(n for n in range(1, len(token_ids) + 1) if stop in tokenizer.decode(token_ids[:n]))


@pytest.fixture(scope="module")
def full(llm: LLM) -> RequestOutput:
    [out] = llm.generate(STOP_PROMPT, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True))
    assert len(out.token_ids) == NUM_TOKENS and out.finish_reason == "length"
    return out


@pytest.mark.parametrize("length", [1, 2, 3])
def test_stop_string_cuts_the_text_and_frees_the_blocks(llm: LLM, full: RequestOutput, length: int) -> None:
    stop = pick_stop(full.text, length)
    [out] = llm.generate(
        STOP_PROMPT, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, stop=[stop])
    )
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.index(stop)]
    num_tokens = tokens_until(full.token_ids, stop)
    assert out.token_ids == full.token_ids[:num_tokens] and num_tokens < NUM_TOKENS
    assert llm.engine.num_free_blocks == llm.engine.num_blocks
    assert llm.engine.core.scheduler.num_unfinished == 0


def test_first_of_two_stop_strings_wins(llm: LLM, full: RequestOutput) -> None:
    early = pick_stop(full.text, 2)
    late = pick_stop(full.text, 2, after=full.text.index(early) + 2)
    [out] = llm.generate(
        STOP_PROMPT, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, stop=[late, early])
    )
    assert out.finish_reason == "stop" and out.text == full.text[: full.text.index(early)]


def stream(llm: LLM, params: SamplingParams) -> list[RequestOutput]:
    request_id = llm.engine.add_request(STOP_PROMPT, params)
    outputs: list[RequestOutput] = []
    while llm.engine.has_unfinished_requests():
        outputs.extend(out for out in llm.engine.step() if out.request_id == request_id)
    return outputs


def test_streamed_deltas_never_show_the_stop_string(llm: LLM, full: RequestOutput) -> None:
    stop = pick_stop(full.text, 3)
    outputs = stream(llm, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, stop=stop))
    final = outputs[-1]
    assert final.finish_reason == "stop" and [o.finished for o in outputs].count(True) == 1
    assert "".join(o.new_text for o in outputs) == final.text == full.text[: full.text.index(stop)]
    assert [t for o in outputs for t in o.new_token_ids] == final.token_ids
    shown = ""
    for o in outputs:
        shown += o.new_text
        assert o.text == shown
        assert final.text.startswith(shown)  # nothing shown is ever cut: no part of the stop string
    # The stop string's first two characters arrived a step or more before it completed, held back.
    before_last = outputs[-2]
    assert ByteTokenizer().decode(before_last.token_ids) == before_last.text + stop[:2]
    assert llm.engine.num_free_blocks == llm.engine.num_blocks


def test_held_back_prefix_is_released_when_it_cannot_stop(llm: LLM, full: RequestOutput) -> None:
    # A stop string whose first two characters appear but which never completes.
    start = full.text.index(pick_stop(full.text, 2))
    stop = full.text[start : start + 2] + "\x00\x00"
    assert stop not in full.text
    outputs = stream(llm, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, stop=stop))
    assert outputs[-1].finish_reason == "length"
    assert "".join(o.new_text for o in outputs) == outputs[-1].text == full.text
    # While the prefix was the tail, it was held back: some step showed less than it decoded.
    tokenizer = ByteTokenizer()
    held = [len(tokenizer.decode(o.token_ids)) - len(o.text) for o in outputs]
    assert max(held) >= 2 and held[-1] == 0


def test_stop_token_ids_still_work(llm: LLM, full: RequestOutput) -> None:
    stop_id = full.token_ids[5]
    [out] = llm.generate(
        STOP_PROMPT, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, stop_token_ids=[stop_id])
    )
    assert out.finish_reason == "stop" and out.token_ids == full.token_ids[: full.token_ids.index(stop_id) + 1]


def test_stop_string_with_speculative_decoding(full: RequestOutput) -> None:
    # The target as its own draft: every draft token is accepted, so one step brings several
    # tokens and the stop string ends the request in the middle of them.
    llm = LLM("tiny", num_blocks=64, draft_model="tiny", num_speculative_tokens=4)
    stop = pick_stop(full.text, 2)
    [out] = llm.generate(STOP_PROMPT, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, stop=stop))
    assert out.finish_reason == "stop" and out.text == full.text[: full.text.index(stop)]
    assert out.token_ids == full.token_ids[: tokens_until(full.token_ids, stop)]
    assert llm.engine.core.scheduler.num_accepted_tokens > 0
    assert llm.engine.num_free_blocks == llm.engine.num_blocks


@pytest.mark.parametrize("stop", [(), ("zz",)])
def test_a_resumed_prompt_continues_the_request_exactly(llm: LLM, stop: tuple[str, ...]) -> None:
    """A migrated stream: the prompt plus the tokens already streamed, resumed elsewhere, yields
    exactly the rest of the undisturbed output (tokens, text, the max_tokens limit, stop strings)."""
    from kvservice.loading.chat_template import ResumedPrompt

    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=list(stop))
    prompt = [5, 17, 42, 9, 100, 3]
    [full] = llm.generate(prompt, params)
    assert len(full.token_ids) == 20
    for num_resumed in (1, 7, 19):
        [rest] = llm.generate([ResumedPrompt(prompt, full.token_ids[:num_resumed])], params)  # type: ignore[list-item]
        assert rest.prompt_token_ids == prompt
        assert rest.token_ids == full.token_ids and rest.text == full.text and rest.finish_reason == full.finish_reason
        assert rest.new_token_ids == full.token_ids[-1:]  # the last step's token: nothing resumed is new
    with pytest.raises(ValueError, match="resume_token_ids"):
        llm.generate([ResumedPrompt(prompt, full.token_ids)], params)  # type: ignore[list-item]
