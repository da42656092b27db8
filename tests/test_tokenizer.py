from __future__ import annotations

import pathlib

import pytest
from hf_models import TOKENIZER_SENTENCES, save_tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st

from kvservice.loading.tokenizer import (
    TINY_CHAT_TEMPLATE,
    ByteTokenizer,
    HFTokenizer,
    IncrementalDetokenizer,
    Tokenizer,
)

MULTIBYTE = ["héllo wörld", "naïve café", "東京 と 大阪", "🙂🚀 emoji", "a€b", "ça va? — oui"]


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    return HFTokenizer(save_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json"))


def stream(tokenizer: Tokenizer | None, token_ids: list[int], chunk: int = 1) -> list[str]:
    """Push `token_ids` `chunk` at a time; the deltas, with the final flush last."""
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push(token_ids[i : i + chunk]) for i in range(0, len(token_ids), chunk)]
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas


# ------------------------------------------------------------ ByteTokenizer


@pytest.mark.parametrize("text", ["", "plain ascii", *MULTIBYTE])
def test_byte_tokenizer_round_trip(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids[0] == ByteTokenizer.BOS
    assert ids[1:] == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode([*ids, ByteTokenizer.EOS]) == text


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_byte_tokenizer_round_trips_any_text(text: str) -> None:
    tok = ByteTokenizer()
    assert tok.decode(tok.encode(text)) == text


# ------------------------------------------------------------ IncrementalDetokenizer


@pytest.mark.parametrize("text", MULTIBYTE)
def test_streaming_bytes_never_splits_a_character(text: str) -> None:
    tok = ByteTokenizer()
    deltas = stream(tok, tok.encode(text))
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    # Each multibyte character arrives whole, in the delta of its last byte.
    assert [d for d in deltas if d] == list(text)


@settings(max_examples=200, deadline=None)
# Text without U+FFFD itself (the check is that a split character never shows up as one)
# and without lone surrogates, which no text a user sends can hold (UTF-8 cannot encode them).
@given(st.text(st.characters(codec="utf-8", exclude_characters="\ufffd")), st.integers(1, 5))
def test_streaming_any_text_in_any_chunks(text: str, chunk: int) -> None:
    tok = ByteTokenizer()
    deltas = stream(tok, tok.encode(text), chunk)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_a_real_replacement_character_streams_through() -> None:
    tok = ByteTokenizer()
    assert "".join(stream(tok, tok.encode("a\ufffdb"), 1)) == "a\ufffdb"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, ByteTokenizer.VOCAB_SIZE - 1), max_size=40))
def test_streaming_arbitrary_bytes_adds_up_to_the_decode(token_ids: list[int]) -> None:
    # What a random model emits: invalid UTF-8 included. The deltas still add up.
    tok = ByteTokenizer()
    assert "".join(stream(tok, token_ids)) == tok.decode(token_ids)


def test_an_incomplete_character_is_held_back_until_the_end() -> None:
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok)
    euro = "€".encode()
    assert detok.push([ord("a")]) == "a"
    assert detok.push([euro[0]]) == ""
    assert detok.push([euro[1]]) == ""
    assert detok.push([euro[2]]) == "€"
    assert detok.push([euro[0]]) == ""
    # The request ended mid-character: the flush shows what the full decode shows.
    assert detok.flush() == "\ufffd"
    assert detok.text == tok.decode(detok.token_ids)


def test_without_a_tokenizer_there_is_no_text() -> None:
    detok = IncrementalDetokenizer(None)
    assert detok.push([1, 2, 3]) == ""
    assert detok.flush() == ""
    assert detok.token_ids == [1, 2, 3]


# ------------------------------------------------------------ tokenizer.json


@pytest.mark.parametrize("text", [*TOKENIZER_SENTENCES, *MULTIBYTE])
def test_hf_tokenizer_round_trip(hf_tokenizer: HFTokenizer, text: str) -> None:
    ids = hf_tokenizer.encode(text)
    assert ids[0] == 1  # <s>, added by the tokenizer's template
    assert hf_tokenizer.decode(ids) == text


@pytest.mark.parametrize("text", MULTIBYTE)
def test_hf_streaming_never_emits_a_split_character(hf_tokenizer: HFTokenizer, text: str) -> None:
    ids = hf_tokenizer.encode(text)
    deltas = stream(hf_tokenizer, ids)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_hf_stream_really_contains_partial_characters(hf_tokenizer: HFTokenizer) -> None:
    # Guards the test above: byte-level pieces of 東 and 🙂 do not decode on their own.
    ids = hf_tokenizer.encode("東京 🙂")[1:]
    assert any("\ufffd" in hf_tokenizer.decode([i]) for i in ids)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 399), max_size=30), st.integers(1, 4))
def test_hf_streaming_arbitrary_ids_adds_up_to_the_decode(
    hf_tokenizer: HFTokenizer, token_ids: list[int], chunk: int
) -> None:
    assert "".join(stream(hf_tokenizer, token_ids, chunk)) == hf_tokenizer.decode(token_ids)


# ------------------------------------------------------------ tokenizer_config.json: chat template, special tokens, BOS

TEMPLATE = "{% for m in messages %}{{ bos_token }}{{ m['content'] }}{{ eos_token }}{% endfor %}"


def tokenizer_dir(
    tmp_path: pathlib.Path, config: dict[str, object] | None = None, jinja: str | None = None
) -> pathlib.Path:
    """A tokenizer.json (BOS <s> added by its post-processor) with the given tokenizer_config.json beside it."""
    import json

    save_tokenizer(tmp_path / "tokenizer.json")
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (tmp_path / "chat_template.jinja").write_text(jinja)
    return tmp_path / "tokenizer.json"


def test_byte_tokenizer_has_the_plain_text_chatml_template_and_bos_is_optional() -> None:
    tok = ByteTokenizer()
    assert tok.encode("ab", add_special_tokens=False) == [97, 98]
    assert tok.decode([ByteTokenizer.BOS, 97, 98, ByteTokenizer.EOS], skip_special_tokens=False) == "ab"
    # No special tokens in a byte vocabulary: the template writes its markers as text.
    assert (tok.chat_template, tok.bos_token, tok.eos_token) == (TINY_CHAT_TEMPLATE, None, None)


def test_tokenizer_config_gives_template_and_special_tokens(tmp_path: pathlib.Path) -> None:
    config = {
        "chat_template": TEMPLATE,
        "bos_token": {"content": "<s>", "lstrip": False, "normalized": False, "special": True},
        "eos_token": "</s>",
    }
    tok = HFTokenizer(tokenizer_dir(tmp_path, config))
    assert (tok.chat_template, tok.bos_token, tok.eos_token) == (TEMPLATE, "<s>", "</s>")


def test_without_tokenizer_config_there_is_no_template(tmp_path: pathlib.Path) -> None:
    tok = HFTokenizer(tokenizer_dir(tmp_path))
    assert (tok.chat_template, tok.bos_token, tok.eos_token) == (None, None, None)


def test_named_templates_give_the_default_one(tmp_path: pathlib.Path) -> None:
    config = {"chat_template": [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": TEMPLATE}]}
    assert HFTokenizer(tokenizer_dir(tmp_path, config)).chat_template == TEMPLATE


def test_chat_template_jinja_wins_over_tokenizer_config(tmp_path: pathlib.Path) -> None:
    tok = HFTokenizer(tokenizer_dir(tmp_path, {"chat_template": "old"}, jinja=TEMPLATE))
    assert tok.chat_template == TEMPLATE


@pytest.mark.parametrize("add_bos_token", [None, True, False])
def test_encoding_respects_whether_the_model_adds_bos(tmp_path: pathlib.Path, add_bos_token: bool | None) -> None:
    config: dict[str, object] = {"bos_token": "<s>"}
    if add_bos_token is not None:
        config["add_bos_token"] = add_bos_token
    tok = HFTokenizer(tokenizer_dir(tmp_path, config))
    plain = tok.encode("the quick brown fox", add_special_tokens=False)
    assert 1 not in plain
    # None: the tokenizer.json's post-processor decides, and it adds <s>.
    expected = plain if add_bos_token is False else [1, *plain]
    assert tok.encode("the quick brown fox") == expected
    # A template that writes <s> itself is encoded without special tokens: exactly one BOS.
    assert tok.encode("<s>the quick brown fox", add_special_tokens=False) == [1, *plain]


def test_add_bos_token_adds_what_the_post_processor_lacks(tmp_path: pathlib.Path) -> None:
    from tokenizers import Tokenizer as Backend
    from tokenizers import processors

    path = tokenizer_dir(tmp_path, {"bos_token": "<s>", "add_bos_token": True})
    backend = Backend.from_file(str(path))
    backend.post_processor = processors.TemplateProcessing(single="$A")
    backend.save(str(path))
    tok = HFTokenizer(path)
    assert tok.encode("fox") == [1, *tok.encode("fox", add_special_tokens=False)]
    assert tok.decode(tok.encode("fox"), skip_special_tokens=False) == "<s>fox"
    assert tok.decode(tok.encode("fox")) == "fox"
