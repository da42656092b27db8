"""Chat templates: a conversation rendered into a prompt by the model's own jinja2 template.

Rendering matches transformers' `apply_chat_template(..., tokenize=False)`: the same
sandboxed environment (ImmutableSandboxedEnvironment, `trim_blocks`, `lstrip_blocks`,
loop controls), the same helpers (`raise_exception`, `strftime_now`, a `tojson` filter
that does not escape HTML), and the same variables (`messages`, `add_generation_prompt`,
`bos_token`, `eos_token`, `tools`, `documents`, plus any extra keyword). Templates come
with model files and are untrusted: the sandbox keeps them from reaching Python internals.

A message's content is a string or a list of text parts (OpenAI's
`[{"type": "text", "text": ...}]`); parts are joined with newlines before the template
sees them, as vLLM does for templates that expect string content.

Every failure is a ValueError naming the field (the servers map it to INVALID_ARGUMENT).
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import jinja2
import jinja2.ext
import jinja2.sandbox

from kvservice.loading.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A conversation as a prompt: rendered with the model's chat template where it is
    encoded (the worker that runs it), so every worker of one request gets the same ids."""

    messages: Sequence[Mapping[str, Any]]
    add_generation_prompt: bool = True


@dataclass(frozen=True, slots=True)
class ResumedPrompt:
    """A prompt whose first generated tokens came from elsewhere (a migrated stream): the
    engine appends `token_ids` to the prompt's own and generates what follows them."""

    prompt: str | list[int] | ChatPrompt
    token_ids: list[int]


# What a request's prompt may be: text, token ids, a conversation, or one of those resumed.
Prompt: TypeAlias = str | list[int] | ChatPrompt | ResumedPrompt

# Roles are free-form (templates decide what they accept), but bounded like any input.
MAX_ROLE_CHARS = 64


class ChatTemplateError(ValueError):
    """The chat template failed to compile or render, or it raised on purpose (`raise_exception`)."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Jinja's own `tojson` escapes <, > and & for HTML; templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


@functools.lru_cache(maxsize=32)
def compile_chat_template(source: str) -> jinja2.Template:
    """The compiled template, cached per template string (a server renders the same one for every request)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat_template: the chat template does not compile: {e}") from None


def validate_conversation(conversation: object) -> list[dict[str, Any]]:
    """A copy of `conversation` as plain data the template can read, text parts joined.

    Each message needs `role` (a string) and `content` (a string, a list of text parts,
    or None/absent as on an assistant turn with tool calls). Other keys (`name`,
    `tool_calls`, ...) pass through if they are plain JSON data."""
    if isinstance(conversation, (str, bytes)) or not isinstance(conversation, Sequence):
        raise ValueError(f"messages: expected a list of messages, got {type(conversation).__name__}")
    if not conversation:
        raise ValueError("messages: empty conversation")
    messages = []
    for i, message in enumerate(conversation):
        field = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise ValueError(f"{field}: expected an object with role and content, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not 0 < len(role) <= MAX_ROLE_CHARS:
            raise ValueError(f"{field}.role: expected a string of 1 to {MAX_ROLE_CHARS} characters, got {role!r:.80}")
        plain = {str(key): _plain(value, f"{field}.{key}") for key, value in message.items() if value is not None}
        if message.get("content") is not None:
            plain["content"] = _content_text(message["content"], f"{field}.content")
        messages.append(plain)
    return messages


def _content_text(content: object, field: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, (bytes, Mapping)) or not isinstance(content, Sequence):
        raise ValueError(f"{field}: expected a string or a list of text parts, got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, Mapping) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ValueError(f"{field}[{j}].type: only text parts are supported, got {kind!r}")
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"{field}[{j}].text: expected a string, got {type(text).__name__}")
        texts.append(text)
    return "\n".join(texts)


def _plain(value: object, field: str) -> Any:
    """JSON data rebuilt from its base types: nothing with extra methods reaches the sandbox."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v, f"{field}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{field}[{i}]") for i, v in enumerate(value)]
    raise ValueError(f"{field}: expected JSON data, got {type(value).__name__}")


def render_chat_template(
    tokenizer: Tokenizer | None,
    conversation: object,
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    **template_kwargs: Any,
) -> str:
    """The prompt text of `conversation` under `chat_template`, or the tokenizer's own template."""
    template = chat_template if chat_template is not None else (tokenizer.chat_template if tokenizer else None)
    if template is None:
        raise ValueError("chat_template: the model has no chat template; pass one (chat_template=...)")
    messages = validate_conversation(conversation)
    compiled = compile_chat_template(template)
    variables = {
        "bos_token": tokenizer.bos_token if tokenizer is not None else None,
        "eos_token": tokenizer.eos_token if tokenizer is not None else None,
        **{k: _plain(v, k) for k, v in template_kwargs.items()},
        "messages": messages,
        "add_generation_prompt": add_generation_prompt,
        "tools": _plain(tools, "tools"),
        "documents": _plain(documents, "documents"),
    }
    try:
        return compiled.render(**variables)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat_template: the chat template refused the conversation: {e}") from None
    except Exception as e:  # a template's own bug (e.g. str + None) is still the template's error
        raise ChatTemplateError(f"chat_template: rendering the chat template failed: {type(e).__name__}: {e}") from None


def apply_chat_template(
    tokenizer: Tokenizer | None,
    conversation: object,
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    **template_kwargs: Any,
) -> list[int]:
    """The prompt token ids of `conversation`: the rendered text tokenized without
    special tokens, since the template writes its own BOS (no second one)."""
    if tokenizer is None:
        raise ValueError("messages: this model has no tokenizer; chat needs one")
    text = render_chat_template(tokenizer, conversation, add_generation_prompt, chat_template, **template_kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


def encode_prompt(tokenizer: Tokenizer | None, prompt: Prompt) -> list[int]:
    """A prompt's token ids, exactly as a worker computes them: text tokenized with special
    tokens, a conversation rendered with the model's chat template, token ids as given. The
    proxy hashes what this returns, so it must stay the one definition."""
    if isinstance(prompt, ResumedPrompt):
        return encode_prompt(tokenizer, prompt.prompt) + [int(t) for t in prompt.token_ids]
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer.json; pass token ids")
        return tokenizer.encode(prompt)
    if isinstance(prompt, ChatPrompt):
        return apply_chat_template(tokenizer, prompt.messages, prompt.add_generation_prompt)
    return [int(t) for t in prompt]
