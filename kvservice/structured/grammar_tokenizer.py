"""Our tokenizers as llguidance sees them: every token's bytes, the EOS ids, the model's vocabulary size."""

from __future__ import annotations

from collections.abc import Sequence

import llguidance

from kvservice.loading.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer


def build_grammar_tokenizer(
    tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: Sequence[int]
) -> llguidance.LLTokenizer:
    """The llguidance tokenizer for `tokenizer`, with a mask of `vocab_size` bits (the model's logits width).

    Ids the tokenizer lacks (the model's vocabulary is often padded past it) are never allowed.
    `eos_token_ids` are the model's EOS ids: allowed wherever the grammar may end, and the only
    ones once it must. Costs ~0.2 s for a 49k vocabulary: build it once per worker.
    """
    if not eos_token_ids:
        raise ValueError("structured output needs the model's EOS token ids")
    eos = [int(t) for t in eos_token_ids]
    if isinstance(tokenizer, HFTokenizer):
        backend = tokenizer.backend
        if backend.get_vocab_size(with_added_tokens=True) > vocab_size:
            raise ValueError(
                f"the tokenizer has {backend.get_vocab_size(with_added_tokens=True)} tokens, "
                f"more than the model's {vocab_size}"
            )
        return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos)
    if isinstance(tokenizer, ByteTokenizer):
        return llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_ByteVocabulary(vocab_size, eos)), n_vocab=vocab_size, eos_token=eos
        )
    raise ValueError(f"structured output is not supported with tokenizer {type(tokenizer).__name__}")


class _ByteVocabulary:
    """What `llguidance.TokenizerWrapper` reads of `ByteTokenizer`: ids 0-255 are bytes, BOS, EOS.

    The model's extra ids (`tiny`: 320 logits, 258 tokens) become special tokens: a grammar
    matches text, never a special token, so they are always masked off.
    """

    def __init__(self, vocab_size: int, eos_token_ids: list[int]) -> None:
        if vocab_size < ByteTokenizer.VOCAB_SIZE:
            raise ValueError(f"vocab_size {vocab_size} is below the byte tokenizer's {ByteTokenizer.VOCAB_SIZE}")
        self.tokens = [bytes([i]) for i in range(256)] + [b"<s>", b"</s>"]
        self.tokens += [f"<|unused_{i}|>".encode() for i in range(ByteTokenizer.VOCAB_SIZE, vocab_size)]
        self.eos_token_id = eos_token_ids[0]
        self.bos_token_id = ByteTokenizer.BOS
        self.special_token_ids = list(range(256, vocab_size))

    def __call__(self, text: bytes) -> list[int]:
        return list(text)
