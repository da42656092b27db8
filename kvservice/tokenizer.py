"""Tokenizers: Hugging Face `tokenizer.json` through `tokenizers`, or the built-in byte-level one."""

from __future__ import annotations

import abc
import pathlib

# The `tiny` model's chat template: ChatML-style turns in plain text (the byte-level
# vocabulary has no special tokens for the markers). A user turn renders as
# "<|im_start|>user\nHi<|im_end|>\n"; the generation prompt is "<|im_start|>assistant\n".
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class Tokenizer(abc.ABC):
    @abc.abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with the model's special prefix (BOS) where it has one
        and `add_special_tokens` is set (a rendered chat template carries its own)."""

    @abc.abstractmethod
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`, special tokens skipped unless asked otherwise."""

    @property
    def chat_template(self) -> str | None:
        """The model's jinja2 chat template, None when it has none."""
        return None

    @property
    def bos_token(self) -> str | None:
        """The text of the BOS token, as chat templates see it; None when it has none."""
        return None

    @property
    def eos_token(self) -> str | None:
        """The text of the EOS token, as chat templates see it; None when it has none."""
        return None


class ByteTokenizer(Tokenizer):
    """Ids 0-255 are bytes; 256 is BOS, 257 EOS. The `tiny` model's tokenizer."""

    BOS = 256
    EOS = 257
    VOCAB_SIZE = 258

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [self.BOS, *text.encode("utf-8")] if add_special_tokens else list(text.encode("utf-8"))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        # BOS and EOS have no text of their own: skipped either way.
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")

    @property
    def chat_template(self) -> str | None:
        return TINY_CHAT_TEMPLATE


class HFTokenizer(Tokenizer):
    """A `tokenizer.json` loaded with the `tokenizers` library (no transformers needed)."""

    def __init__(self, path: pathlib.Path) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        self._tok = _Tokenizer.from_file(str(path))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas for streaming.

    Text is re-decoded from a few tokens back, so multi-token characters and
    byte-level pieces come out whole; a trailing U+FFFD (an incomplete character)
    is held back until the next token completes it.
    """

    _LOOKBACK = 6

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self._prefix_offset = 0  # decode from here...
        self._read_offset = 0  # ...and emit what lies past the text of [prefix, read)
        self.text = ""

    def push(self, new_token_ids: list[int]) -> str:
        """Add tokens; returns the newly completed text ("" without a tokenizer)."""
        self.token_ids.extend(new_token_ids)
        if self.tokenizer is None:
            return ""
        prefix_text = self.tokenizer.decode(self.token_ids[self._prefix_offset : self._read_offset])
        full_text = self.tokenizer.decode(self.token_ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        delta = full_text[len(prefix_text) :]
        self._read_offset = len(self.token_ids)
        self._prefix_offset = max(0, self._read_offset - self._LOOKBACK)
        # Re-anchor the prefix text at the new offsets on the next push.
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a request: whatever is still held back."""
        if self.tokenizer is None:
            return ""
        tail = self.tokenizer.decode(self.token_ids[self._prefix_offset :])
        head = self.tokenizer.decode(self.token_ids[self._prefix_offset : self._read_offset])
        delta = tail[len(head) :]
        self._read_offset = len(self.token_ids)
        self.text += delta
        return delta
