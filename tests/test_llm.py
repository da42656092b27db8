from __future__ import annotations

import pytest

from kvservice import LLM, SamplingParams
from kvservice.chat_template import apply_chat_template, render_chat_template

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
