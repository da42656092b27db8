"""What a request's output must match: a JSON schema, any JSON object, a regex, a choice or a grammar.

Plain Python, validated on construction. `from_response_format` reads the OpenAI
`response_format` field, `from_structured_outputs` vLLM's `structured_outputs`; both raise
ValueError naming the field at fault (HTTP 400). Whether the grammar engine supports a schema's
features is checked later, by `kvservice.structured` (which also raises ValueError).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields

MAX_GRAMMAR_BYTES = 64 * 1024  # json_schema and grammar, as UTF-8
MAX_REGEX_CHARS = 4096
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024
# vLLM's `structured_outputs` options that change nothing here: we never fall back to another
# engine, and JSON is always written with fixed separators (no free whitespace).
_IGNORED_VLLM_OPTIONS = ("disable_fallback", "disable_any_whitespace")


@dataclass(frozen=True, slots=True)
class StructuredOutputParams:
    """Exactly one constraint on the generated text.

    `json_schema`: a JSON schema, as JSON text (stored compact, key order kept: it orders the
    output's properties). `json_object`: any JSON object. `regex`: the whole output matches it
    (Rust `regex` syntax). `choice`: the output is one of these strings. `grammar`: a Lark or
    GBNF (llama.cpp) grammar. Equal params compile to the same grammar (the compiler caches by them).
    """

    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured output: exactly one of json_schema, json_object, regex, choice, grammar must be set, got "
                f"{given or 'none'}"
            )
        if self.json_schema is not None:
            object.__setattr__(self, "json_schema", _compact_schema(self.json_schema, "json_schema"))
        if self.json_object is not False and self.json_object is not True:
            raise ValueError(f"json_object: expected a boolean, got {type(self.json_object).__name__}")
        if self.regex is not None:
            if not isinstance(self.regex, str) or not 0 < len(self.regex) <= MAX_REGEX_CHARS:
                raise ValueError(f"regex: expected a string of 1 to {MAX_REGEX_CHARS} characters")
        if self.choice is not None:
            object.__setattr__(self, "choice", _validate_choice(self.choice))
        if self.grammar is not None:
            if not isinstance(self.grammar, str) or not self.grammar.strip():
                raise ValueError("grammar: expected a non-empty string")
            _check_size(self.grammar, "grammar")


def from_response_format(response_format: object) -> StructuredOutputParams | None:
    """The OpenAI `response_format`: `{"type": "text"}` (None: unconstrained), `{"type": "json_object"}`,
    or `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`."""
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise ValueError(f"response_format: expected an object, got {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputParams(json_object=True)
    if kind != "json_schema":
        raise ValueError(f"response_format.type: expected 'text', 'json_object' or 'json_schema', got {kind!r:.80}")
    spec = response_format.get("json_schema")
    if not isinstance(spec, Mapping):
        raise ValueError("response_format.json_schema: expected an object with a 'schema'")
    schema = spec.get("schema")
    if schema is None:
        raise ValueError("response_format.json_schema.schema: required")
    field = "response_format.json_schema.schema"
    return _build(field, json_schema=_schema_text(schema, field))


def from_structured_outputs(structured_outputs: object) -> StructuredOutputParams | None:
    """vLLM's `structured_outputs`: one of `json` (a schema, as an object or JSON text), `json_object`,
    `regex`, `choice` (a list of strings), `grammar`. None, or an object with none of them set: unconstrained."""
    if structured_outputs is None:
        return None
    if not isinstance(structured_outputs, Mapping):
        raise ValueError(f"structured_outputs: expected an object, got {type(structured_outputs).__name__}")
    known = {"json", "json_object", "regex", "choice", "grammar", *_IGNORED_VLLM_OPTIONS}
    unknown = sorted(str(k) for k, v in structured_outputs.items() if k not in known and v is not None)
    if unknown:
        raise ValueError(
            f"structured_outputs.{unknown[0]}: not supported (supported: json, json_object, regex, choice, grammar)"
        )
    given = {
        k: v
        for k, v in structured_outputs.items()
        if k not in _IGNORED_VLLM_OPTIONS and v is not None and v is not False
    }
    if not given:
        return None
    if len(given) > 1:
        raise ValueError(
            f"structured_outputs: set exactly one of json, json_object, regex, choice, grammar, got {sorted(given)}"
        )
    [(key, value)] = given.items()
    field = f"structured_outputs.{key}"
    if key == "json":
        return _build(field, json_schema=_schema_text(value, field))
    if key in ("regex", "grammar") and not isinstance(value, str):
        raise ValueError(f"{field}: expected a string, got {type(value).__name__}")
    return _build(field, **{key: value})


def _build(field: str, **constraint: object) -> StructuredOutputParams:
    """The params of one constraint; an error names `field`, as the request spelt it."""
    try:
        return StructuredOutputParams(**constraint)
    except ValueError as e:
        [name] = constraint
        raise ValueError(f"{field}: {str(e).removeprefix(f'{name}: ')}") from None


def _schema_text(schema: object, field: str) -> str:
    """A schema given as an object or as JSON text -> JSON text; checked by `_compact_schema` later."""
    if isinstance(schema, str):
        return schema
    if not isinstance(schema, Mapping):
        raise ValueError(f"{field}: expected a JSON schema object, got {type(schema).__name__}")
    try:
        return json.dumps(schema, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{field}: not JSON ({e})") from None


def _compact_schema(text: object, field: str) -> str:
    if not isinstance(text, str):
        raise ValueError(f"{field}: expected JSON text, got {type(text).__name__}")
    _check_size(text, field)
    try:
        schema = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{field}: not valid JSON ({e})") from None
    if not isinstance(schema, dict):
        raise ValueError(f"{field}: a JSON schema must be a JSON object, got {type(schema).__name__}")
    try:
        return json.dumps(schema, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except ValueError as e:  # a number too large for a float (1e400) parses as inf
        raise ValueError(f"{field}: not valid JSON ({e})") from None


def _validate_choice(choice: object) -> tuple[str, ...]:
    if not isinstance(choice, (list, tuple)) or not 0 < len(choice) <= MAX_CHOICES:
        raise ValueError(f"choice: expected 1 to {MAX_CHOICES} strings")
    for c in choice:
        if not isinstance(c, str) or not 0 < len(c) <= MAX_CHOICE_CHARS:
            raise ValueError(
                f"choice: each choice must be a string of 1 to {MAX_CHOICE_CHARS} characters, got {c!r:.80}"
            )
    return tuple(choice)


def _check_size(text: str, field: str) -> None:
    if len(text.encode("utf-8", errors="surrogatepass")) > MAX_GRAMMAR_BYTES:
        raise ValueError(f"{field}: at most {MAX_GRAMMAR_BYTES // 1024} KiB")
