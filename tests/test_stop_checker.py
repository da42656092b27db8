from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvservice.core.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, SamplingParams
from kvservice.engine.stop_checker import OutputText, StopStringChecker
from kvservice.loading.tokenizer import ByteTokenizer


def push_all(checker: StopStringChecker, pieces: list[str]) -> list[str]:
    """The released delta after each piece, then the flush (if nothing stopped)."""
    deltas = []
    for piece in pieces:
        deltas.append(checker.push(piece))
        if checker.is_stopped:
            return deltas
    deltas.append(checker.flush())
    return deltas


# ------------------------------------------------------------ StopStringChecker


def test_stop_inside_one_piece() -> None:
    checker = StopStringChecker(["lo w"])
    assert checker.push("hello world") == "hel"
    assert checker.is_stopped and checker.text == "hel"
    assert checker.push("more") == "" and checker.flush() == ""  # nothing after the stop


def test_stop_spanning_pieces() -> None:
    checker = StopStringChecker(["lo w"])
    assert checker.push("hel") == "he"  # "l" could start "lo w"
    assert checker.push("lo") == "l"  # "llo": "lo" still could
    assert checker.push(" wide") == ""
    assert checker.is_stopped and checker.text == "hel"


def test_prefix_held_back_then_released() -> None:
    checker = StopStringChecker(["abc"])
    assert checker.push("xa") == "x"
    assert checker.push("b") == ""
    assert checker.push("d") == "abd"  # "abd" cannot become "abc" any more
    assert checker.push("ab") == ""
    assert checker.flush() == "ab"  # the request ended for another reason
    assert not checker.is_stopped and checker.text == "xabdab"


def test_two_stop_strings_the_earliest_wins() -> None:
    checker = StopStringChecker(["world", "lo"])
    assert checker.push("hello world") == "hel"
    checker = StopStringChecker(["xyz", "\n\n"])
    assert push_all(checker, ["one\n", "\ntwo xyz"]) == ["one", ""]
    assert checker.text == "one"


def test_stop_at_the_very_start() -> None:
    checker = StopStringChecker(["Hi"])
    assert checker.push("Hi there") == ""
    assert checker.is_stopped and checker.text == ""


def test_no_stop_strings_releases_everything_at_once() -> None:
    checker = StopStringChecker([])
    assert checker.push("abc") == "abc" and checker.flush() == "" and not checker.is_stopped


def test_held_tail_is_the_longest_possible_start() -> None:
    # "xbab" ends with "ab" (starts "abx") and with "bab" (starts "babbq"): hold the longer.
    checker = StopStringChecker(["abx", "babbq"])
    assert checker.push("xbab") == "x"
    assert checker.push("bq") == ""
    assert checker.is_stopped and checker.text == "x"
    checker = StopStringChecker(["abx", "babbq"])
    assert push_all(checker, ["xbab", "x"]) == ["x", "b"]  # "babx" no; "abx" matched at 1
    assert checker.is_stopped and checker.text == "xb"


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc\n", max_size=40),
    stop=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=10),
)
def test_streamed_text_is_the_text_before_the_first_stop(text: str, stop: list[str], cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    checker = StopStringChecker(stop)
    deltas = push_all(checker, pieces)
    assert "".join(deltas) == checker.text
    assert not any(s in checker.text for s in stop)  # nothing shown was later cut
    if checker.is_stopped:
        assert any(text.startswith(checker.text + s) for s in stop)
    else:
        assert checker.text == text


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="ab", max_size=30),
    stop=st.lists(st.text(alphabet="ab", min_size=2, max_size=5), min_size=1, max_size=3),
)
def test_at_most_the_longest_stop_minus_one_is_held(text: str, stop: list[str]) -> None:
    checker = StopStringChecker(stop)
    pushed = ""
    for char in text:
        checker.push(char)
        pushed += char
        if checker.is_stopped:
            return
        assert len(pushed) - len(checker.text) <= max(map(len, stop)) - 1


# ------------------------------------------------------------ OutputText (tokens in)


def test_output_text_counts_tokens_up_to_the_stop() -> None:
    out = OutputText(ByteTokenizer(), ["cd"])
    assert out.push(list(b"ab")) == (2, "ab")
    # One step brings several tokens (accepted draft tokens): "d" completes the stop.
    assert out.push(list(b"cdef")) == (2, "")
    assert out.is_stopped and out.text == "ab"


def test_output_text_first_token_stops() -> None:
    out = OutputText(ByteTokenizer(), ["x"])
    assert out.push([ord("x")]) == (1, "")
    assert out.is_stopped


def test_output_text_is_last_releases_the_held_tail() -> None:
    out = OutputText(ByteTokenizer(), ["xyz"])
    assert out.push(list(b"axy")) == (3, "a")
    assert out.push([ord("!")], is_last=True) == (1, "xy!")
    out = OutputText(ByteTokenizer(), ["xyz"])
    assert out.push(list(b"axy"), is_last=True) == (3, "axy")
    assert not out.is_stopped


def test_output_text_multibyte_characters() -> None:
    # "é" is two bytes: the detokenizer holds the first, the checker then sees "é" whole.
    out = OutputText(ByteTokenizer(), ["é!"])
    data = list("café!".encode())
    assert out.push(data[:4]) == (4, "caf")
    assert out.push(data[4:5]) == (1, "")  # "é": could start "é!"
    assert out.push(data[5:]) == (1, "")
    assert out.is_stopped and out.text == "caf"


def test_output_text_needs_a_tokenizer_for_stop_strings() -> None:
    with pytest.raises(ValueError, match="stop: this model has no tokenizer"):
        OutputText(None, ["x"])
    assert OutputText(None).push([1, 2], is_last=True) == (2, "")


# ------------------------------------------------------------ SamplingParams.stop


def test_sampling_params_stop_accepts_a_str_or_a_list() -> None:
    assert SamplingParams(stop="\n").stop == ("\n",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")  # type: ignore[arg-type]
    assert SamplingParams().stop == ()
    assert SamplingParams(stop=["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS).stop[0] == "x" * MAX_STOP_STRING_CHARS  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "stop",
    [
        [""],
        ["x" * (MAX_STOP_STRING_CHARS + 1)],
        ["x"] * (MAX_STOP_STRINGS + 1),
        [3],
        {"x"},
        5,
    ],
)
def test_bad_stop_strings_name_the_field(stop: object) -> None:
    with pytest.raises(ValueError, match=r"^stop: "):
        SamplingParams(stop=stop)  # type: ignore[arg-type]
