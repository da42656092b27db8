"""The tokenizer a GGUF file describes (`tokenizer.ggml.*`), built as a `tokenizers.Tokenizer`.

A GGUF carries no tokenizer.json, only the pieces: the token list, the merges, each token's
type, the special token ids and the chat template. This builds the same tokenizer that
transformers builds from those pieces (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`),
so the ids match token for token:

- `gpt2`: byte-level BPE, GPT-2's pre-tokenizer split (or the split `tokenizer.ggml.pre` names).
- `llama`: SentencePiece-style BPE over `▁`-spelled pieces with byte fallback; merges from the
  file, or recovered from the tokens' scores when the file has none.

Tokens typed CONTROL become special added tokens, USER_DEFINED ones plain added tokens, so
text like `<|im_start|>` stays one token.
"""

from __future__ import annotations

import functools
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from kvservice.config import ModelLoadError
from kvservice.loading.gguf_loader import GGUFFile
from kvservice.loading.tokenizer import HFTokenizer, TokenizerConfig

SUPPORTED_TOKENIZER_MODELS = ("gpt2", "llama")

# llama.cpp's token types (`tokenizer.ggml.token_type`).
_CONTROL = 3
_USER_DEFINED = 4

_NAMED_SPECIAL_TOKENS = ("bos", "eos", "unknown", "padding")  # tokenizer.ggml.<name>_token_id
_SPACE_PIECE = "\u2581"  # SentencePiece's ▁: a space inside a piece

# Split regexes for the `tokenizer.ggml.pre` values whose vocabularies were not learned on
# GPT-2's split; any other value keeps GPT-2's (as transformers does).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


def gguf_tokenizer(file: GGUFFile) -> HFTokenizer | None:
    """The file's tokenizer, or None when it has no token list. Unknown `tokenizer.ggml.model`: ModelLoadError."""
    tokens = file.array("tokenizer.ggml.tokens")
    if tokens is None:
        return None
    meta = file.metadata
    kind = meta.get("tokenizer.ggml.model")
    if kind not in SUPPORTED_TOKENIZER_MODELS:
        raise ModelLoadError(
            f"model {str(file.path)!r}: unsupported GGUF tokenizer model {kind!r} "
            f"(supported: {', '.join(SUPPORTED_TOKENIZER_MODELS)})"
        )
    token_types = file.array("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = file.array("tokenizer.ggml.merges")
    if kind == "gpt2":
        backend = _byte_level_bpe(tokens, merges or [], meta.get("tokenizer.ggml.pre"))
        # Byte-level BPE adds no BOS unless the file says so.
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    else:
        scores = file.array("tokenizer.ggml.scores")
        backend = _sentencepiece_bpe(tokens, merges, scores, meta)
        # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says not to.
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))

    named = {name: _token(tokens, meta.get(f"tokenizer.ggml.{name}_token_id")) for name in _NAMED_SPECIAL_TOKENS}
    named_tokens = [t for t in named.values() if t is not None]
    _add_special_tokens(backend, tokens, token_types, named_tokens, byte_level=kind == "gpt2")
    bos, eos = named["bos"], named["eos"]
    backend.post_processor = _template(backend, bos if add_bos else None, eos if add_eos else None)
    config = TokenizerConfig(
        chat_template=meta.get("tokenizer.chat_template"), bos_token=bos, eos_token=eos, add_bos_token=None
    )
    return HFTokenizer(backend, config)


def _token(tokens: list[str], token_id: Any) -> str | None:
    return None if token_id is None or not 0 <= int(token_id) < len(tokens) else tokens[int(token_id)]


@functools.cache
def _byte_chars() -> dict[int, str]:
    """GPT-2's byte alphabet: each byte as a printable character (printable Latin-1 bytes as themselves)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in kept}
    shifted = (b for b in range(256) if b not in chars)
    for offset, b in enumerate(shifted):
        chars[b] = chr(256 + offset)
    return chars


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str | None) -> BackendTokenizer:
    chars = _byte_chars()
    alphabet = set(chars.values())
    # Tokens are stored in the byte alphabet; one that is not (a mislabelled special token,
    # say) is respelled from its UTF-8 bytes, so it can still be matched.
    vocab = {t if set(t) <= alphabet else "".join(chars[b] for b in t.encode("utf-8")): i for i, t in enumerate(tokens)}
    backend = BackendTokenizer(
        models.BPE(
            vocab=vocab,
            merges=[_merge_pair(m) for m in merges],
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = _PRE_TOKENIZER_SPLITS.get(pre or "")
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(
    tokens: list[str], merges: list[str] | None, scores: list[float] | None, meta: dict[str, Any]
) -> BackendTokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    if merges is not None:
        pairs = [_merge_pair(m) for m in merges]
    elif scores is not None:
        pairs = _merges_from_scores(tokens, scores)
    else:
        raise ModelLoadError("GGUF tokenizer 'llama': neither tokenizer.ggml.merges nor tokenizer.ggml.scores")
    unk = _token(tokens, meta.get("tokenizer.ggml.unknown_token_id"))
    backend = BackendTokenizer(
        models.BPE(vocab=vocab, merges=pairs, unk_token=unk or "<unk>", fuse_unk=True, byte_fallback=True)
    )
    add_prefix_space = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_SPACE_PIECE, prepend_scheme="first" if add_prefix_space else "never", split=False
    )
    steps = [decoders.Replace(_SPACE_PIECE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merge_pair(merge: str) -> tuple[str, str]:
    left, _, right = merge.partition(" ")
    return left, right


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """A SentencePiece vocabulary's merges: every split of a token into two tokens, best score first.

    A token's score ranks the merges that make it; ties go to the longer left, then the longer
    right piece, then to token order and the pieces' ids (the order transformers derives).
    """
    ids = {t: i for i, t in enumerate(tokens)}
    ranked: list[tuple[tuple[float, int, int, int, int, int], str, str]] = []
    for index, (token, score) in enumerate(zip(tokens, scores)):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                ranked.append(((-score, -len(left), -len(right), index, ids[left], ids[right]), left, right))
    ranked.sort(key=lambda r: r[0])
    return [(left, right) for _, left, right in ranked]


def _add_special_tokens(
    backend: BackendTokenizer, tokens: list[str], token_types: list[int], named: list[str], *, byte_level: bool
) -> None:
    """CONTROL tokens (and the named BOS/EOS/UNK/PAD) as special added tokens, USER_DEFINED ones as plain ones.

    Only tokens of the vocabulary: adding any other would give it a new id past the model's
    embedding (transformers does that for a missing GPT-2 default such as `<|endoftext|>`).
    """
    alphabet = set(_byte_chars().values())
    vocab = backend.get_vocab()
    # In a byte-level vocabulary a CONTROL token outside the byte alphabet is mislabelled: keep it out.
    special = [t for t, kind in zip(tokens, token_types) if kind == _CONTROL and (not byte_level or set(t) <= alphabet)]
    special += [t for t in named if t not in special and t in vocab]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    user_defined = [t for t, kind in zip(tokens, token_types) if kind == _USER_DEFINED and t in vocab]
    if user_defined:
        backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user_defined])


def _template(backend: BackendTokenizer, bos: str | None, eos: str | None) -> processors.TemplateProcessing:
    """`bos $A eos`, with whichever of BOS and EOS the model adds (and has in its vocabulary)."""
    bos, eos = (t if t is not None and backend.token_to_id(t) is not None else None for t in (bos, eos))
    pieces = [*([f"{bos}:0"] if bos else []), "$A:0", *([f"{eos}:0"] if eos else [])]
    special = [(t, backend.token_to_id(t)) for t in (bos, eos) if t is not None]
    return processors.TemplateProcessing(single=" ".join(pieces), special_tokens=special)
