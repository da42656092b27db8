"""The OpenAI-compatible API as data: request bodies (completions and chat completions)
parsed into the generation service's protobuf requests, response bodies, usage and
error bodies built, HTTP statuses chosen. Pure: no aiohttp, no I/O,
so every rule here is tested without a server (the routes live in `openai_front`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc

from kvservice.core.logprobs import MAX_LOGPROBS
from kvservice.core.sampling_params import MAX_N, MAX_STOP_TOKEN_IDS
from kvservice.core.structured_output import StructuredOutputParams, from_response_format, from_structured_outputs
from kvservice.loading.chat_template import validate_conversation
from kvservice.server.convert import structured_output_to_proto
from kvservice.server.errors import message_for, status_for
from kvservice.structured.grammar import check_supported
from kvservice.v1 import kvservice_pb2 as pb

DEFAULT_MAX_TOKENS = 16

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
}


class OpenAIError(Exception):
    """An error answered as it is (e.g. 404 for an unknown model)."""

    def __init__(self, http_status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.http_status = http_status
        self.param = param
        self.code = code


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A `/v1/completions` or `/v1/chat/completions` body, ready for the generation service.

    `echo` (completions): the answer starts with the prompt (`prompt` is its text, or its
    token ids), and with logprobs asked for, the prompt's tokens and logprobs come first."""

    generate_request: pb.GenerateRequest
    stream: bool
    include_usage: bool
    echo: bool = False
    prompt: str | list[int] | None = None

    @property
    def wants_logprobs(self) -> bool:
        return self.generate_request.sampling_params.HasField("logprobs")


# The fields each endpoint understands. Anything else is refused with a 400 that names it:
# a parameter silently ignored (a penalty, a logit bias) would give the caller output it
# did not ask for.
_SAMPLING_FIELDS = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "stream",
    "stream_options",
    "n",
    "user",
    "structured_outputs",
}
COMPLETION_FIELDS = _SAMPLING_FIELDS | {"prompt", "best_of", "echo", "suffix", "logprobs"}
CHAT_FIELDS = _SAMPLING_FIELDS | {
    "messages",
    "max_completion_tokens",
    "tools",
    "tool_choice",
    "response_format",
    "logprobs",
    "top_logprobs",
    "add_generation_prompt",
}
# Accepted when they ask for nothing (the neutral value some clients always send).
_NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "logit_bias": ({},),
    "parallel_tool_calls": (False, True),
}


def parse_completion_request(body: Any, request_id: str, model_name: str) -> ParsedRequest:
    """A `/v1/completions` body as a `GenerateRequest`; ValueError or OpenAIError names the field."""
    body = _checked_body(body, COMPLETION_FIELDS, model_name)
    best_of = _optional(body, "best_of", int, None)
    if best_of is not None and best_of != _optional(body, "n", int, 1):
        raise ValueError("best_of: only equal to n is supported (every sequence generated is returned)")
    if body.get("suffix") is not None:
        raise ValueError("suffix: not supported")
    generate_request = pb.GenerateRequest(request_id=request_id)
    prompt = _prompt(body.get("prompt"))
    if isinstance(prompt, str):
        generate_request.text = prompt
    else:
        generate_request.token_ids.ids.extend(prompt)
    sp = generate_request.sampling_params
    _sampling_params(body, sp, _optional(body, "max_tokens", int, DEFAULT_MAX_TOKENS))
    num_logprobs = _num_logprobs(body, "logprobs")
    echo = _optional(body, "echo", bool, False)
    if echo and sp.n > 1:
        raise ValueError("echo: not supported with n > 1")
    if num_logprobs is not None:
        sp.logprobs = num_logprobs
        if echo:
            sp.prompt_logprobs = num_logprobs
    return _parsed(body, generate_request, echo=echo, prompt=prompt)


def parse_chat_request(body: Any, request_id: str, model_name: str) -> ParsedRequest:
    """A `/v1/chat/completions` body as a `GenerateRequest` with a chat prompt (rendered by
    the worker with the model's template); ValueError or OpenAIError names the field."""
    body = _checked_body(body, CHAT_FIELDS, model_name)
    if body.get("tools"):
        raise ValueError("tools: tool calling is not supported")
    if body.get("tool_choice") not in (None, "none"):
        raise ValueError("tool_choice: tool calling is not supported")
    generate_request = pb.GenerateRequest(request_id=request_id)
    for message in validate_conversation(body.get("messages")):
        generate_request.chat.messages.add(role=message["role"], content=message.get("content", ""))
    if not _optional(body, "add_generation_prompt", bool, True):
        generate_request.chat.add_generation_prompt = False
    max_tokens = body.get("max_completion_tokens")
    name = "max_completion_tokens" if max_tokens is not None else "max_tokens"
    # A chat answer ends at the end of the turn: without a limit it may run to the model's length.
    _sampling_params(body, generate_request.sampling_params, _optional(body, name, int, None))
    if body.get("response_format") is not None and body.get("structured_outputs") is not None:
        raise ValueError("response_format: set it or structured_outputs, not both")
    _structured_output(from_response_format(body.get("response_format")), generate_request.sampling_params)
    num_top = _num_logprobs(body, "top_logprobs")
    if _optional(body, "logprobs", bool, False):
        generate_request.sampling_params.logprobs = num_top or 0
    elif num_top is not None:
        raise ValueError("top_logprobs: needs logprobs: true")
    return _parsed(body, generate_request)


def _checked_body(body: Any, fields: set[str], model_name: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ValueError("request body: expected a JSON object")
    unknown = sorted(
        k for k in body if k not in fields and not (k in _NEUTRAL_VALUES and body[k] in _NEUTRAL_VALUES[k])
    )
    if unknown:
        raise OpenAIError(400, f"unsupported field(s): {', '.join(unknown)}", unknown[0], "unsupported_field")
    model = body.get("model")
    if model is not None and model != model_name:
        raise OpenAIError(
            404, f"The model `{model}` does not exist (this server serves `{model_name}`)", "model", "model_not_found"
        )
    return body


def _sampling_params(body: dict[str, Any], sp: pb.SamplingParams, max_tokens: int | None) -> None:
    if max_tokens is not None:
        sp.max_tokens = max_tokens
    n = _optional(body, "n", int, 1)
    if not 1 <= n <= MAX_N:
        raise ValueError(f"n: expected an integer in [1, {MAX_N}], got {n}")
    if n > 1:
        sp.n = n
    for name in ("temperature", "top_p"):
        if body.get(name) is not None:
            setattr(sp, name, _optional(body, name, float, 0.0))
    for name in ("seed", "top_k"):
        if body.get(name) is not None:
            setattr(sp, name, _optional(body, name, int, 0))
    sp.ignore_eos = _optional(body, "ignore_eos", bool, False)
    stop = body.get("stop")
    if isinstance(stop, str) or (isinstance(stop, list) and stop and all(isinstance(t, str) for t in stop)):
        sp.stop.extend([stop] if isinstance(stop, str) else stop)
    else:
        sp.stop_token_ids.extend(_stop_token_ids(stop, "stop"))
    sp.stop_token_ids.extend(_stop_token_ids(body.get("stop_token_ids"), "stop_token_ids"))
    _structured_output(from_structured_outputs(body.get("structured_outputs")), sp)


def _structured_output(params: StructuredOutputParams | None, sp: pb.SamplingParams) -> None:
    """A constraint checked here (a schema keyword the engine cannot enforce is a 400 naming
    it, before the request is routed) and sent on to the workers."""
    if params is None:
        return
    if sp.ignore_eos:
        raise ValueError("ignore_eos: a structured output ends where its grammar does, so it cannot ignore EOS")
    check_supported(params)
    structured_output_to_proto(params, sp.structured_output)


def _parsed(body: dict[str, Any], generate_request: pb.GenerateRequest, **shape: Any) -> ParsedRequest:
    stream = _optional(body, "stream", bool, False)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ValueError("stream_options: expected an object")
    return ParsedRequest(generate_request, stream, bool(options.get("include_usage", False)), **shape)


def _num_logprobs(body: dict[str, Any], name: str) -> int | None:
    """`logprobs` (completions) or `top_logprobs` (chat): how many most likely tokens per position."""
    value = _optional(body, name, int, None)
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise ValueError(f"{name}: expected an integer in [0, {MAX_LOGPROBS}], got {value}")
    return value


def _prompt(value: Any) -> str | list[int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one prompt
    if isinstance(value, str):
        if not value:
            raise ValueError("prompt: empty")
        return value
    if isinstance(value, list) and value and all(_is_int(t) for t in value):
        return value
    raise ValueError("prompt: expected a string or a non-empty list of token ids (one prompt per request)")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional(body: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = _is_int(value)
    else:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok:
        raise ValueError(f"{name}: expected {kind.__name__}, got {value!r}")
    return kind(value)


def _stop_token_ids(value: Any, name: str) -> list[int]:
    if value is None:
        return []
    if _is_int(value):
        return [value]
    if isinstance(value, list) and len(value) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"{name}: {len(value)} ids, at most {MAX_STOP_TOKEN_IDS} are allowed")
    if isinstance(value, list) and all(_is_int(t) for t in value):
        return value
    kinds = "a string, a list of strings, or token ids" if name == "stop" else "token ids (an int or a list of ints)"
    raise ValueError(f"{name}: expected {kinds}, got {value!r}")


def usage(result: pb.CompleteResponse) -> dict[str, Any]:
    """Token counts; `prompt_tokens_details.cached_tokens`: the prompt tokens the worker that
    prefilled found in its prefix cache (not computed for this request)."""
    completion = sum(len(sequence.token_ids) for sequence in (result.sequences or [result]))
    cached = result.num_cached_tokens if result.HasField("num_cached_tokens") else None
    return usage_of(result.num_prompt_tokens, completion, cached)


def usage_of(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int | None) -> dict[str, Any]:
    """The usage object from its counts (a stream counts as it goes, gathering nothing)."""
    body: dict[str, Any] = {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
    }
    if num_cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": num_cached_tokens}
    return body


def error_body(error: BaseException) -> tuple[int, dict[str, Any]]:
    if isinstance(error, OpenAIError):
        http_status, param, code = error.http_status, error.param, error.code
    else:
        grpc_status = status_for(error)
        http_status, param, code = HTTP_STATUS.get(grpc_status, 500), None, grpc_status.name.lower()
    kind = ERROR_TYPES.get(http_status, "invalid_request_error" if http_status < 500 else "server_error")
    message = str(error) if isinstance(error, OpenAIError) else message_for(error)
    return http_status, {"message": message, "type": kind, "param": param, "code": code}
