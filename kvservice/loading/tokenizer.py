"""Tokenizers: a `tokenizers.Tokenizer` (a `tokenizer.json`, or built from GGUF metadata), or the byte-level one."""

from __future__ import annotations

import abc
import json
import os
import pathlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import tokenizers

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
    """Text to token ids and back, plus what a chat template needs (its text, the special tokens)."""

    @abc.abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, the model's special prefix (BOS) where it adds one.

        A rendered chat template already holds its special tokens: encode it with `add_special_tokens=False`.
        """

    @abc.abstractmethod
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`; special tokens left out unless `skip_special_tokens` is False."""

    @property
    def chat_template(self) -> str | None:
        """The model's Jinja chat template, or None when it has none."""
        return None

    @property
    def bos_token(self) -> str | None:
        """BOS as text (`<s>`, `<|im_start|>`), as templates write it; None when the model has none."""
        return None

    @property
    def eos_token(self) -> str | None:
        """EOS as text, as templates write it; None when the model has none."""
        return None


class ByteTokenizer(Tokenizer):
    """Ids 0-255 are bytes; 256 is BOS, 257 EOS. The `tiny` model's tokenizer."""

    BOS = 256
    EOS = 257
    VOCAB_SIZE = 258

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        prefix = [self.BOS] if add_special_tokens else []
        return [*prefix, *text.encode("utf-8")]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        # BOS and EOS have no text: skipped or not, they render as nothing.
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")

    @property
    def chat_template(self) -> str | None:
        return TINY_CHAT_TEMPLATE


@dataclass(frozen=True, slots=True)
class TokenizerConfig:
    """What `tokenizer_config.json` (and `chat_template.jinja`) add to a `tokenizer.json`."""

    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    add_bos_token: bool | None = None  # None: whatever the tokenizer's post-processor does

    @classmethod
    def from_dir(cls, path: pathlib.Path) -> TokenizerConfig:
        """Read `path`/tokenizer_config.json; `chat_template.jinja` beside it wins over its template."""
        config_file = path / "tokenizer_config.json"
        raw: dict[str, Any] = json.loads(config_file.read_text()) if config_file.is_file() else {}
        template_file = path / "chat_template.jinja"
        template = template_file.read_text() if template_file.is_file() else _default_template(raw.get("chat_template"))
        add_bos = raw.get("add_bos_token")
        return cls(
            chat_template=template,
            bos_token=_token_text(raw.get("bos_token")),
            eos_token=_token_text(raw.get("eos_token")),
            add_bos_token=None if add_bos is None else bool(add_bos),
        )


def _default_template(value: str | list[dict[str, str]] | None) -> str | None:
    """A template, or the one named "default" in a list of named templates."""
    if isinstance(value, list):
        return next((t["template"] for t in value if t.get("name") == "default"), None)
    return value


def _token_text(value: str | dict[str, Any] | None) -> str | None:
    """A special token as text: tokenizer_config.json spells it as a string or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


class HFTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer` (no transformers needed).

    `source` is a `tokenizer.json` path (its directory's `tokenizer_config.json` gives the chat
    template and special tokens) or a tokenizer built in code (GGUF), with its `config`.
    """

    def __init__(
        self, source: str | os.PathLike[str] | tokenizers.Tokenizer, config: TokenizerConfig | None = None
    ) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        if isinstance(source, _Tokenizer):
            self._tok = source
            self.config = config or TokenizerConfig()
        else:
            path = pathlib.Path(source)
            self._tok = _Tokenizer.from_file(str(path))
            self.config = config or TokenizerConfig.from_dir(path.parent)
        bos = self.config.bos_token
        self._bos_token_id = None if bos is None else self._tok.token_to_id(bos)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying `tokenizers.Tokenizer`."""
        return self._tok

    @property
    def chat_template(self) -> str | None:
        return self.config.chat_template

    @property
    def bos_token(self) -> str | None:
        return self.config.bos_token

    @property
    def eos_token(self) -> str | None:
        return self.config.eos_token

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        token_ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        add_bos, bos_id = self.config.add_bos_token, self._bos_token_id
        if not add_special_tokens or add_bos is None or bos_id is None:
            return token_ids
        # tokenizer_config.json's add_bos_token overrides the post-processor, as in transformers.
        plain = self._tok.encode(text, add_special_tokens=False).ids
        has_added_bos = len(token_ids) > len(plain) and token_ids[0] == bos_id
        if add_bos and not has_added_bos:
            return [bos_id, *token_ids]
        if not add_bos and has_added_bos:
            return token_ids[1:]
        return token_ids

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
