"""Grammars from `StructuredOutputParams`: checked, compiled once per params, a matcher per request.

Lifecycle, in call order:
1. The OpenAI front calls `check_supported(params)` (no tokenizer, no torch): a schema feature the
   engine cannot enforce raises ValueError naming it, before the request is routed (HTTP 400).
2. The decode worker builds one `GrammarCompiler` per model at start (tokenizer, logits width, EOS ids).
3. Per request, `compiler.matcher(params)`: the grammar is compiled on first use and cached by params;
   the matcher is a cheap copy of the compiled one (~5 us).
4. Per step, the runner fills each matcher's mask row, applies the masks to the logits
   (`kvservice.structured.bitmask`), samples, and calls `matcher.accept_token(token_id)`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass

import llguidance

from kvservice.core.structured_output import StructuredOutputParams
from kvservice.loading.tokenizer import Tokenizer
from kvservice.structured.grammar_tokenizer import build_grammar_tokenizer
from kvservice.structured.matcher import GrammarMatcher

# JSON is written with json.dumps' separators and no other whitespace: free whitespace lets a
# model pad forever, and these are the separators models have seen most. `overrides` win over a
# schema's own "x-guidance" options, so no schema can turn on `lenient` (ignoring keywords it
# cannot enforce) or `coerce_one_of` (oneOf read as anyOf): either would let invalid output through.
_JSON_OPTIONS: llguidance.JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": False,
    "coerce_one_of": False,
}
# Short errors: the verbose ones quote the parser state and the whole grammar.
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)
_MAX_ERROR_CHARS = 500
DEFAULT_CACHE_SIZE = 256


def grammar_definition(params: StructuredOutputParams) -> str:
    """The llguidance grammar for `params` (not yet checked: see `check_supported`)."""
    if params.json_schema is not None:
        return llguidance.LLMatcher.grammar_from_json_schema(params.json_schema, overrides=_JSON_OPTIONS)
    if params.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema('{"type":"object"}', overrides=_JSON_OPTIONS)
    if params.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        # A JSON string literal is a Lark string literal (escapes included).
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
    assert params.grammar is not None  # StructuredOutputParams holds exactly one constraint
    return llguidance.grammar_from("grammar", params.grammar)  # Lark, or GBNF converted to Lark


def field_of(params: StructuredOutputParams) -> str:
    """The name of the constraint `params` holds, as errors spell it."""
    for name in ("json_schema", "regex", "choice", "grammar"):
        if getattr(params, name) is not None:
            return name
    return "json_object"


@functools.lru_cache(maxsize=DEFAULT_CACHE_SIZE)
def check_supported(params: StructuredOutputParams) -> None:
    """Raise ValueError, naming the field and the feature, if the engine cannot enforce `params`.

    Tokenizer-free and torch-free (the proxy's front calls it). Cost: well under a millisecond for
    ordinary schemas; for a schema near the 64 KiB limit, call it off the event loop.
    """
    field = field_of(params)
    try:
        definition = grammar_definition(params)
    except ValueError as e:  # a GBNF grammar that does not convert
        raise ValueError(f"{field}: {_short(str(e))}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(definition, None, limits=_LIMITS)
    if is_error:
        raise ValueError(f"{field}: unsupported or invalid: {_short(messages[0])}")


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    """One params' grammar, compiled for one tokenizer; its matchers are copies of `_template`."""

    params: StructuredOutputParams
    _template: llguidance.LLMatcher


class GrammarCompiler:
    """Compiles grammars for one tokenizer and one logits width; build one per worker (~0.2 s).

    Thread-safe: `compile` and `matcher` may be called from any thread (llguidance drops the GIL
    while it builds a grammar). A params compiled twice at once is compiled twice, harmlessly.
    """

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self._tokenizer = build_grammar_tokenizer(tokenizer, vocab_size, self.eos_token_ids)
        self._compile = functools.lru_cache(maxsize=cache_size)(self._compile_uncached)

    def compile(self, params: StructuredOutputParams) -> CompiledGrammar:
        """The compiled grammar of `params` (LRU-cached by params); ValueError naming the field and
        the feature if the engine cannot enforce it, or if it matches nothing."""
        return self._compile(params)

    def matcher(self, params: StructuredOutputParams) -> GrammarMatcher:
        """A fresh matcher for one request, at the grammar's start."""
        return GrammarMatcher(self.compile(params)._template.deep_copy(), self.vocab_size)

    def _compile_uncached(self, params: StructuredOutputParams) -> CompiledGrammar:
        check_supported(params)
        field = field_of(params)
        template = llguidance.LLMatcher(self._tokenizer, grammar_definition(params), log_level=0, limits=_LIMITS)
        if template.is_error():
            raise ValueError(f"{field}: unsupported or invalid: {_short(template.get_error())}")
        # The first mask builds the lexer's start states: computed once here, every copy shares them.
        first_mask = template.compute_bitmask()
        if template.is_error() or not any(first_mask):
            raise ValueError(f"{field}: no output can match it")
        return CompiledGrammar(params, template)


def _short(message: str) -> str:
    """One line (it becomes an HTTP 400's message), at most _MAX_ERROR_CHARS."""
    message = " ".join(message.split())
    return message if len(message) <= _MAX_ERROR_CHARS else message[:_MAX_ERROR_CHARS] + "..."
