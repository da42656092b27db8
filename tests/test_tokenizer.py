from __future__ import annotations

import pathlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_models import TOKENIZER_SENTENCES, save_tokenizer
from kvservice.tokenizer import ByteTokenizer, HFTokenizer, IncrementalDetokenizer, Tokenizer

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
# and without lone surrogates, which have no UTF-8 encoding.
@given(st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\ufffd")), st.integers(1, 5))
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
