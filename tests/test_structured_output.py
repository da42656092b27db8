"""Structured output: params from the OpenAI and vLLM fields, grammars compiled with llguidance,
and constrained greedy decoding over random logits whose text always parses and validates."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jsonschema
import pytest
import torch

from kvservice.core.structured_output import (
    MAX_CHOICES,
    MAX_GRAMMAR_BYTES,
    StructuredOutputParams,
    from_response_format,
    from_structured_outputs,
)
from kvservice.loading.model_files import SMOLLM2_MODEL, TINY_CONFIG, load_model_config, load_tokenizer
from kvservice.loading.tokenizer import ByteTokenizer, Tokenizer
from kvservice.structured.bitmask import allocate_token_bitmask, apply_token_bitmask
from kvservice.structured.grammar import GrammarCompiler, check_supported
from kvservice.structured.matcher import GrammarMatcher, fill_next_token_bitmasks

_SHORT = {"type": "string", "maxLength": 12}


def _object(properties: dict[str, object], **extra: object) -> dict[str, object]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
        **extra,
    }


SCHEMAS: dict[str, dict[str, object]] = {
    "nested objects": _object(
        {"name": _SHORT, "address": _object({"city": _SHORT, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})}
    ),
    "array with min/maxItems": _object(
        {
            "scores": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 100},
                "minItems": 2,
                "maxItems": 4,
            }
        }
    ),
    "enums": _object({"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, None, "XL"]}}),
    "number ranges": _object(
        {
            "ratio": {"type": "number", "minimum": -1.5, "maximum": 2.25},
            "count": {"type": "integer", "exclusiveMinimum": 0, "maximum": 50},
        }
    ),
    "booleans and null": _object(
        {"ok": {"type": "boolean"}, "missing": {"type": "null"}, "maybe": {"type": ["boolean", "null"]}}
    ),
    "array of objects": _object(
        {
            "items": {
                "type": "array",
                "items": _object({"id": {"type": "integer", "minimum": 1, "maximum": 999}, "tag": _SHORT}),
                "maxItems": 3,
            }
        }
    ),
    "const and anyOf": _object(
        {
            "version": {"const": 2},
            "value": {"anyOf": [{"type": "integer", "maximum": 9}, {"type": "string", "maxLength": 4}]},
        }
    ),
    "$defs and $ref": {
        "$defs": {"point": _object({"x": {"type": "integer"}, "y": {"type": "integer"}})},
        **_object({"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}}),
    },
    "recursive tree": {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "v": {"type": "integer"},
                    "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
                },
                "required": ["v"],
                "additionalProperties": False,
            }
        },
        "$ref": "#/$defs/node",
    },
    "optional properties": {
        "type": "object",
        "properties": {"a": _SHORT, "b": {"type": "integer"}},
        "required": ["a"],
        "additionalProperties": False,
    },
    "formats and patterns": _object(
        {"day": {"type": "string", "format": "date"}, "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}}
    ),
    "prefixItems tuple": _object(
        {
            "pair": {
                "type": "array",
                "prefixItems": [{"type": "integer"}, {"type": "boolean"}],
                "items": False,
                "minItems": 2,
            }
        }
    ),
    "multipleOf": _object(
        {
            "n": {"type": "integer", "multipleOf": 7, "minimum": 0, "maximum": 1000},
            "x": {"type": "number", "multipleOf": 0.25, "minimum": 0, "maximum": 10},
        }
    ),
}

UNSUPPORTED: dict[str, dict[str, object]] = {
    "uniqueItems": {"type": "array", "uniqueItems": True},
    "not": {"not": {"type": "string"}},
    "if": {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}},
    "contains": {"type": "array", "contains": {"type": "integer"}},
    "propertyNames": {"type": "object", "propertyNames": {"pattern": "^a"}},
    "dependentRequired": {"type": "object", "dependentRequired": {"a": ["b"]}},
    "unevaluatedProperties": {"type": "object", "unevaluatedProperties": False},
    "oneOf": {"oneOf": [{"type": "integer"}, {"type": "number"}]},  # overlapping branches
    "min/maxProperties": {
        "type": "object",
        "properties": {"a": {"type": "string"}},
        "minProperties": 1,
    },  # unless all are required
    "https://example.com/x.json": {"$ref": "https://example.com/x.json"},  # never fetched
    "look-around": {"type": "string", "pattern": "(?=a)abc"},
    "bogus-format": {"type": "string", "format": "bogus-format"},
}


@pytest.fixture(scope="module")
def smollm2() -> tuple[Tokenizer, GrammarCompiler]:
    tokenizer = load_tokenizer(SMOLLM2_MODEL)
    config = load_model_config(SMOLLM2_MODEL)
    assert tokenizer is not None
    return tokenizer, GrammarCompiler(tokenizer, config.vocab_size, config.eos_token_ids)


def _generate(
    compiler: GrammarCompiler, params: StructuredOutputParams, seed: int, max_tokens: int = 1000
) -> tuple[list[int], GrammarMatcher]:
    """Greedy over random logits: mask -> argmax -> accept, until the grammar terminates (EOS not returned)."""
    generator = torch.Generator().manual_seed(seed)
    matcher = compiler.matcher(params)
    bitmask = allocate_token_bitmask(1, compiler.vocab_size)
    token_ids: list[int] = []
    for _ in range(max_tokens):
        matcher.fill_next_token_bitmask(bitmask, 0)
        logits = torch.randn(1, compiler.vocab_size, generator=generator)
        apply_token_bitmask(logits, bitmask)
        token_id = int(logits.argmax())
        assert matcher.accept_token(token_id), matcher.error
        if token_id in compiler.eos_token_ids or matcher.is_terminated():
            if token_id not in compiler.eos_token_ids:
                token_ids.append(token_id)
            return token_ids, matcher
        token_ids.append(token_id)
    pytest.fail(f"no termination in {max_tokens} tokens: {token_ids[:50]}")


def _allowed(bitmask: torch.Tensor, row: int, vocab_size: int) -> set[int]:
    return {t for t in range(vocab_size) if (int(bitmask[row, t // 32]) >> (t % 32)) & 1}


# --- params --------------------------------------------------------------------------------------


def test_params_hold_exactly_one_constraint() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputParams(regex="a", choice=("a",))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputParams(json_object=True, json_schema="{}")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"json_schema": "{not json"}, "json_schema"),
        ({"json_schema": "[1, 2]"}, "json_schema"),
        ({"json_schema": '{"maximum": 1e400}'}, "json_schema"),
        ({"json_schema": '{"description": "' + "x" * MAX_GRAMMAR_BYTES + '"}'}, "json_schema"),
        ({"regex": ""}, "regex"),
        ({"regex": "a" * 5000}, "regex"),
        ({"choice": ()}, "choice"),
        ({"choice": ("a", "")}, "choice"),
        ({"choice": tuple(str(i) for i in range(MAX_CHOICES + 1))}, "choice"),
        ({"choice": ("a", 1)}, "choice"),
        ({"grammar": "  "}, "grammar"),
        ({"grammar": "x" * (MAX_GRAMMAR_BYTES + 1)}, "grammar"),
        ({"json_object": "yes"}, "json_object"),
    ],
)
def test_bad_params_name_their_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        StructuredOutputParams(**kwargs)  # type: ignore[arg-type]


def test_a_schema_is_stored_compact_with_its_key_order_kept() -> None:
    params = StructuredOutputParams(json_schema='{"type": "object",\n "properties": {"b": {}, "a": {}}}')
    assert params.json_schema == '{"type":"object","properties":{"b":{},"a":{}}}'
    assert params == StructuredOutputParams(
        json_schema='{"type":"object","properties":{"b":{},"a":{}}}'
    )  # one cache entry
    assert StructuredOutputParams(choice=["x", "y"]).choice == ("x", "y")  # type: ignore[arg-type]


def test_openai_response_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert from_response_format(None) is None
    assert from_response_format({"type": "text"}) is None
    assert from_response_format({"type": "json_object"}) == StructuredOutputParams(json_object=True)
    params = from_response_format(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    )
    assert params is not None and json.loads(params.json_schema or "") == schema
    for bad, field in [
        ("json", "response_format"),
        ({"type": "structural_tag"}, "response_format.type"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"schema": [1]}}, "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"schema": "{bad"}}, "response_format.json_schema.schema"),
    ]:
        with pytest.raises(ValueError, match=f"^{re.escape(field)}:"):
            from_response_format(bad)


def test_vllm_structured_outputs() -> None:
    assert from_structured_outputs(None) is None
    assert from_structured_outputs({"json": None, "regex": None, "disable_any_whitespace": True}) is None
    assert from_structured_outputs({"regex": "[a-z]+", "disable_fallback": True}) == StructuredOutputParams(
        regex="[a-z]+"
    )
    assert from_structured_outputs({"choice": ["a", "b"]}) == StructuredOutputParams(choice=("a", "b"))
    assert from_structured_outputs({"json": {"type": "object"}}) == from_structured_outputs(
        {"json": '{"type": "object"}'}
    )
    assert from_structured_outputs({"json_object": True}) == StructuredOutputParams(json_object=True)
    assert from_structured_outputs({"grammar": 'root ::= "a"'}) == StructuredOutputParams(grammar='root ::= "a"')
    for bad, field in [
        ([1], "structured_outputs"),
        ({"regex": "a", "choice": ["a"]}, "structured_outputs"),
        ({"structural_tag": "{}"}, "structured_outputs.structural_tag"),
        ({"choice": "ab"}, "structured_outputs.choice"),
        ({"choice": []}, "structured_outputs.choice"),
        ({"regex": 3}, "structured_outputs.regex"),
        ({"json": 3}, "structured_outputs.json"),
        ({"json": "{bad"}, "structured_outputs.json"),
    ]:
        with pytest.raises(ValueError, match=f"^{re.escape(field)}:"):
            from_structured_outputs(bad)


# --- grammars ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_constrained_greedy_output_validates_against_the_schema(
    smollm2: tuple[Tokenizer, GrammarCompiler], name: str
) -> None:
    tokenizer, compiler = smollm2
    schema = SCHEMAS[name]
    params = StructuredOutputParams(json_schema=json.dumps(schema))
    for seed in range(3):
        token_ids, _ = _generate(compiler, params, seed)
        text = tokenizer.decode(token_ids)
        jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


def test_json_object_mode_yields_a_json_object(smollm2: tuple[Tokenizer, GrammarCompiler]) -> None:
    tokenizer, compiler = smollm2
    for seed in (0, 1, 5):  # random logits write long keys: seeds that close within 1,000 tokens
        token_ids, _ = _generate(compiler, StructuredOutputParams(json_object=True), seed)
        assert isinstance(json.loads(tokenizer.decode(token_ids)), dict)


@pytest.mark.parametrize(
    "regex", [r"[0-9]{3}-[a-z]{2,5}", r"^(on|off)$", r"(yes|no), (red|green|blue)!", r"[A-Z][a-z]{1,6} \d{1,2}(\.\d)?"]
)
def test_regex_mode_matches_the_whole_output(smollm2: tuple[Tokenizer, GrammarCompiler], regex: str) -> None:
    tokenizer, compiler = smollm2
    for seed in range(3):
        token_ids, _ = _generate(compiler, StructuredOutputParams(regex=regex), seed)
        assert re.fullmatch(regex, tokenizer.decode(token_ids)), tokenizer.decode(token_ids)


def test_choice_mode_yields_one_choice(smollm2: tuple[Tokenizer, GrammarCompiler]) -> None:
    tokenizer, compiler = smollm2
    choices = ("positive", "negative", 'say "hi"', "naïve \\ path")
    seen = {tokenizer.decode(_generate(compiler, StructuredOutputParams(choice=choices), seed)[0]) for seed in range(8)}
    assert seen <= set(choices) and len(seen) > 1, seen


@pytest.mark.parametrize(
    ("grammar", "pattern"),
    [
        ('root ::= "(" [0-9]+ ("+" [0-9]+)* ")"', r"\([0-9]+(\+[0-9]+)*\)"),  # GBNF (llama.cpp)
        ('start: "SELECT " COL " FROM t"\nCOL: /[a-z]{1,8}/', r"SELECT [a-z]{1,8} FROM t"),  # Lark
    ],
)
def test_grammar_mode_follows_the_grammar(
    smollm2: tuple[Tokenizer, GrammarCompiler], grammar: str, pattern: str
) -> None:
    tokenizer, compiler = smollm2
    for seed in range(3):
        text = tokenizer.decode(_generate(compiler, StructuredOutputParams(grammar=grammar), seed)[0])
        assert re.fullmatch(pattern, text), text


@pytest.mark.parametrize("feature", list(UNSUPPORTED))
def test_unsupported_schema_features_are_refused_by_name(
    smollm2: tuple[Tokenizer, GrammarCompiler], feature: str
) -> None:
    params = StructuredOutputParams(json_schema=json.dumps(UNSUPPORTED[feature]))
    with pytest.raises(ValueError, match=f"^json_schema: .*{re.escape(feature)}"):
        check_supported(params)  # the front's check: no tokenizer
    with pytest.raises(ValueError, match=f"^json_schema: .*{re.escape(feature)}"):
        smollm2[1].compile(params)


def test_a_schema_cannot_turn_on_lenient_mode() -> None:
    """llguidance reads options from "x-guidance"; lenient would ignore keywords it cannot enforce."""
    schema = {"type": "array", "uniqueItems": True, "x-guidance": {"lenient": True, "coerce_one_of": True}}
    with pytest.raises(ValueError, match="uniqueItems"):
        check_supported(StructuredOutputParams(json_schema=json.dumps(schema)))


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (StructuredOutputParams(regex="(a"), "^regex: .*unclosed group"),
        (StructuredOutputParams(regex=r"[^\s\S]"), "^regex: no output can match it"),
        (StructuredOutputParams(grammar="start: foo"), '^grammar: .*unknown name: "foo"'),
        (StructuredOutputParams(grammar="root ::= foo"), "^grammar: .*'foo' not found"),
        (StructuredOutputParams(json_schema='{"type": "strin"}'), "^json_schema: .*strin"),
    ],
)
def test_invalid_grammars_are_refused(
    smollm2: tuple[Tokenizer, GrammarCompiler], params: StructuredOutputParams, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        smollm2[1].compile(params)


def test_compiled_grammars_are_cached_and_matchers_independent(smollm2: tuple[Tokenizer, GrammarCompiler]) -> None:
    tokenizer, compiler = smollm2
    params = StructuredOutputParams(regex="[0-9]{2}")
    assert compiler.compile(params) is compiler.compile(StructuredOutputParams(regex="[0-9]{2}"))
    first, second = compiler.matcher(params), compiler.matcher(params)
    [digit] = tokenizer.encode("7", add_special_tokens=False)
    assert first.accept_token(digit) and first.accept_token(digit) and first.is_terminated()
    assert not second.is_terminated()
    assert not second.accept_token(tokenizer.encode("a", add_special_tokens=False)[0])
    assert second.error and not second.is_terminated()


def test_a_terminated_grammar_allows_only_eos(smollm2: tuple[Tokenizer, GrammarCompiler]) -> None:
    tokenizer, compiler = smollm2
    matcher = compiler.matcher(StructuredOutputParams(json_schema=json.dumps(_object({"a": {"type": "boolean"}}))))
    bitmask = allocate_token_bitmask(1, compiler.vocab_size)
    for token_id in tokenizer.encode('{"a": true}', add_special_tokens=False):
        assert matcher.accept_token(token_id)
    assert matcher.is_terminated()
    matcher.fill_next_token_bitmask(bitmask, 0)
    assert _allowed(bitmask, 0, compiler.vocab_size) == set(compiler.eos_token_ids)


def test_rollback_restores_the_mask(smollm2: tuple[Tokenizer, GrammarCompiler]) -> None:
    tokenizer, compiler = smollm2
    matcher = compiler.matcher(StructuredOutputParams(choice=("apple pie", "banana")))
    bitmask = allocate_token_bitmask(2, compiler.vocab_size)
    matcher.fill_next_token_bitmask(bitmask, 0)
    assert matcher.accept_token(tokenizer.encode("apple", add_special_tokens=False)[0])
    matcher.rollback(1)
    matcher.fill_next_token_bitmask(bitmask, 1)
    assert torch.equal(bitmask[0], bitmask[1])


def test_batched_fill_equals_one_by_one(smollm2: tuple[Tokenizer, GrammarCompiler]) -> None:
    _, compiler = smollm2
    matchers = [
        compiler.matcher(StructuredOutputParams(json_schema=json.dumps(SCHEMAS[name]))) for name in list(SCHEMAS)[:4]
    ]
    matchers.append(compiler.matcher(StructuredOutputParams(regex="[a-c]+")))
    batched, single = allocate_token_bitmask(8, compiler.vocab_size), allocate_token_bitmask(8, compiler.vocab_size)
    rows = [(m, 7 - i) for i, m in enumerate(matchers)]
    fill_next_token_bitmasks(rows, batched)
    for matcher, row in rows:
        matcher.fill_next_token_bitmask(single, row)
    assert torch.equal(batched, single)
    assert (batched[:3] == -1).all()  # rows no matcher owns keep every token allowed


def test_fill_refuses_a_bitmask_of_the_wrong_shape(smollm2: tuple[Tokenizer, GrammarCompiler]) -> None:
    matcher = smollm2[1].matcher(StructuredOutputParams(regex="a"))
    with pytest.raises(ValueError, match="words per row"):
        matcher.fill_next_token_bitmask(allocate_token_bitmask(1, 1000), 0)
    with pytest.raises(ValueError, match="int32"):
        matcher.fill_next_token_bitmask(torch.zeros(1, 1536), 0)
    with pytest.raises(IndexError):
        matcher.fill_next_token_bitmask(allocate_token_bitmask(1, smollm2[1].vocab_size), 1)


def test_a_padded_model_vocabulary_masks_the_padding(smollm2: tuple[Tokenizer, GrammarCompiler]) -> None:
    tokenizer, compiler = smollm2
    padded = GrammarCompiler(tokenizer, compiler.vocab_size + 64, compiler.eos_token_ids)
    matcher = padded.matcher(StructuredOutputParams(json_object=True))
    bitmask = allocate_token_bitmask(1, padded.vocab_size)
    matcher.fill_next_token_bitmask(bitmask, 0)
    allowed = _allowed(bitmask, 0, padded.vocab_size)
    assert allowed and max(allowed) < compiler.vocab_size


# --- the tiny model's byte tokenizer -------------------------------------------------------------


def test_byte_tokenizer_with_a_larger_model_vocabulary() -> None:
    vocab_size = TINY_CONFIG.vocab_size
    assert vocab_size > ByteTokenizer.VOCAB_SIZE  # the case under test: ids no token has
    tokenizer = ByteTokenizer()
    compiler = GrammarCompiler(tokenizer, vocab_size, TINY_CONFIG.eos_token_ids)
    schema = SCHEMAS["nested objects"]
    for seed in range(3):
        generator = torch.Generator().manual_seed(seed)
        matcher = compiler.matcher(StructuredOutputParams(json_schema=json.dumps(schema)))
        bitmask = allocate_token_bitmask(1, vocab_size)
        token_ids: list[int] = []
        while not matcher.is_terminated():
            matcher.fill_next_token_bitmask(bitmask, 0)
            logits = torch.randn(1, vocab_size, generator=generator)
            logits[0, ByteTokenizer.VOCAB_SIZE :] = 100.0  # the padding would win every argmax
            apply_token_bitmask(logits, bitmask)
            assert torch.isneginf(logits[0, ByteTokenizer.VOCAB_SIZE :]).all()
            token_ids.append(int(logits.argmax()))
            assert matcher.accept_token(token_ids[-1]), matcher.error
            assert len(token_ids) < 500
        jsonschema.validate(json.loads(tokenizer.decode(token_ids)), schema)


def test_structured_output_needs_a_tokenizer() -> None:
    with pytest.raises(ValueError, match="tokenizer"):
        GrammarCompiler(None, 320, (257,))


# --- masks ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])  # the CPU fast path, the general one
def test_apply_token_bitmask_masks_only_the_given_rows(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    vocab_size = 100  # not a multiple of 32: the last word's high bits are ignored
    logits = torch.randn(4, vocab_size, generator=generator).to(dtype)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, 4), dtype=torch.int32, generator=generator)
    expected = logits.clone()
    for row in (1, 3):
        for t in range(vocab_size):
            if not (int(bitmask[row, t // 32]) >> (t % 32)) & 1:
                expected[row, t] = float("-inf")
    apply_token_bitmask(logits, bitmask, rows=[1, 3])
    assert torch.equal(logits, expected)
    apply_token_bitmask(logits, bitmask, rows=[])
    assert torch.equal(logits, expected)
    everything = torch.randn(4, vocab_size, generator=generator).to(dtype)
    before = everything.clone()
    apply_token_bitmask(everything, allocate_token_bitmask(4, vocab_size))
    assert torch.equal(everything, before)  # a fresh bitmask allows every token
    apply_token_bitmask(everything, bitmask)
    assert torch.equal(everything.isneginf()[1], expected.isneginf()[1]) and not everything.isnan().any()


def test_the_front_check_imports_no_torch() -> None:
    """The proxy validates requests without loading torch (it never does)."""
    code = (
        "import sys, kvservice.structured.grammar as g, kvservice.core.structured_output as s;"
        "g.check_supported(s.StructuredOutputParams(regex='a+')); assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
