"""An OpenAI-compatible HTTP front on the proxy: `/v1/completions`, `/v1/models`, `/health`.

It runs in the proxy's event loop and sends every request down the same routing path
as the gRPC `Generate` (`ProxyService.generate`). What is supported of the OpenAI
completions API:

- `prompt`: a string or a list of token ids (one prompt per request; a list holding
  exactly one prompt is accepted too);
- `max_tokens` (default 16), `temperature`, `top_p`, `seed`, `stream`,
  `stream_options.include_usage`; `stop` takes token ids only (an int or a list of
  ints; stop strings are refused); vLLM's extensions `top_k`, `ignore_eos` and
  `stop_token_ids`;
- not supported (HTTP 400): `n` > 1, `best_of` > 1, `echo`, `logprobs`, `suffix`.

Every choice also carries `token_ids`, the generated ids. A client-chosen request id
travels in the `X-Request-Id` header; the response echoes it and the completion id is
`cmpl-<request id>`. Errors are OpenAI-style JSON (`{"error": {"message", "type",
"param", "code"}}`) with the HTTP status that fits the gRPC status code; an error
after a stream has started arrives as one `data: {"error": ...}` event.
"""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from aiohttp import web

from kvservice.request import check_request_id
from kvservice.sampling_params import MAX_STOP_TOKEN_IDS
from kvservice.server.generation import merge_into_complete
from kvservice.server.errors import message_for, status_for
from kvservice.server.generation import new_request_id
from kvservice.server.proxy import ProxyService
from kvservice.v1 import kvservice_pb2 as pb

REQUEST_ID_HEADER = "X-Request-Id"
# A body is parsed on the proxy's event loop: bound it (a prompt of a model's full length
# as token ids is well under this).
MAX_BODY_BYTES = 4 << 20

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
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 429: "rate_limit_error"}
FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}


class OpenAIError(Exception):
    """An error answered as it is (e.g. 404 for an unknown model)."""

    def __init__(self, http_status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.http_status = http_status
        self.param = param
        self.code = code


class OpenAIFront:
    """The HTTP routes; `app()` builds the aiohttp application (serve it with `metrics.start_http`)."""

    def __init__(
        self, service: ProxyService, model_name: str, is_serving: Callable[[], bool], auth_token: str | None = None
    ) -> None:
        self.service = service
        self.model_name = model_name
        self.is_serving = is_serving
        self.auth_token = auth_token  # the proxy's --auth-token guards this API too
        self.created = int(time.time())
        self.is_draining = False

    def start_draining(self) -> None:
        """The proxy is stopping: /health says so and new completions are refused (503)."""
        self.is_draining = True

    def _is_authorized(self, request: web.Request) -> bool:
        if not self.auth_token:
            return True
        # aiohttp keeps bytes that are not UTF-8 as surrogates: compare the raw bytes.
        given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        return hmac.compare_digest(given, f"Bearer {self.auth_token}".encode())

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        return app

    async def health(self, request: web.Request) -> web.Response:
        if self.is_draining:
            return web.json_response({"status": "unavailable", "detail": "shutting down"}, status=503)
        if self.is_serving():
            return web.json_response({"status": "ok"})
        return web.json_response({"status": "unavailable", "detail": "no healthy decode worker"}, status=503)

    async def models(self, request: web.Request) -> web.Response:
        if not self._is_authorized(request):
            return _unauthorized()
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "kvservice"}
        ]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        if not self._is_authorized(request):
            return _unauthorized()
        if self.is_draining:
            return error_response(OpenAIError(503, "the server is shutting down; retry on another"), {})
        request_id = request.headers.get(REQUEST_ID_HEADER) or new_request_id()
        try:
            check_request_id(request_id, REQUEST_ID_HEADER)
        except ValueError as e:
            return error_response(e, {})
        headers = {REQUEST_ID_HEADER: request_id}
        try:
            try:
                body = await request.json()
            except json.JSONDecodeError as e:
                raise ValueError(f"request body: not JSON ({e})") from None
            except web.HTTPRequestEntityTooLarge:
                raise OpenAIError(413, f"request body: larger than {MAX_BODY_BYTES} bytes") from None
            generate_request, stream, include_usage = self._parse(body, request_id)
        except Exception as e:
            return error_response(e, headers)
        meta = {"id": f"cmpl-{request_id}", "object": "text_completion", "created": int(time.time()), "model": self.model_name}
        responses = self.service.responses(generate_request)
        try:
            # Everything up to the first chunk (validation, routing, the prefill) fails
            # with a proper HTTP status, before a stream is opened.
            first = await anext(responses, None)
        except BaseException as e:  # cancelled too (the client hung up): close the request first
            await responses.aclose()
            if not isinstance(e, Exception):
                raise
            return error_response(e, headers)
        if stream:
            return await self._stream(request, headers, meta, first, responses, include_usage)
        return await self._complete(headers, meta, first, responses)

    def _parse(self, body: Any, request_id: str) -> tuple[pb.GenerateRequest, bool, bool]:
        if not isinstance(body, dict):
            raise ValueError("request body: expected a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise OpenAIError(404, f"The model `{model}` does not exist (this server serves `{self.model_name}`)", "model", "model_not_found")
        for name, allowed in (("n", 1), ("best_of", 1)):
            if body.get(name) not in (None, allowed):
                raise ValueError(f"{name}: only {allowed} is supported")
        for name in ("echo", "suffix", "logprobs"):
            if body.get(name) not in (None, False):
                raise ValueError(f"{name}: not supported")
        generate_request = pb.GenerateRequest(request_id=request_id)
        prompt = _prompt(body.get("prompt"))
        if isinstance(prompt, str):
            generate_request.text = prompt
        else:
            generate_request.token_ids.ids.extend(prompt)
        sp = generate_request.sampling_params
        sp.max_tokens = _optional(body, "max_tokens", int, 16)
        for name in ("temperature", "top_p"):
            if body.get(name) is not None:
                setattr(sp, name, _optional(body, name, float, 0.0))
        for name in ("seed", "top_k"):
            if body.get(name) is not None:
                setattr(sp, name, _optional(body, name, int, 0))
        sp.ignore_eos = _optional(body, "ignore_eos", bool, False)
        sp.stop_token_ids.extend(_stop_token_ids(body.get("stop"), "stop"))
        sp.stop_token_ids.extend(_stop_token_ids(body.get("stop_token_ids"), "stop_token_ids"))
        stream = _optional(body, "stream", bool, False)
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise ValueError("stream_options: expected an object")
        return generate_request, stream, bool(options.get("include_usage", False))

    async def _complete(
        self, headers: dict[str, str], meta: dict[str, Any], first: pb.GenerateResponse | None, responses: AsyncIterator[pb.GenerateResponse]
    ) -> web.Response:
        result = pb.CompleteResponse()
        try:
            chunk = first
            while chunk is not None:
                merge_into_complete(result, chunk)
                chunk = await anext(responses, None)
        except Exception as e:
            return error_response(e, headers)
        finally:
            await responses.aclose()
        choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": FINISH_REASONS.get(result.finish_reason),
                  "token_ids": list(result.token_ids)}
        return web.json_response({**meta, "choices": [choice], "usage": _usage(result)}, headers=headers)

    async def _stream(
        self, request: web.Request, headers: dict[str, str], meta: dict[str, Any], first: pb.GenerateResponse | None,
        responses: AsyncIterator[pb.GenerateResponse], include_usage: bool,
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        totals = pb.CompleteResponse()
        try:
            chunk = first
            while chunk is not None:
                merge_into_complete(totals, chunk)
                choice = {"index": 0, "text": chunk.text, "logprobs": None, "finish_reason": FINISH_REASONS.get(chunk.finish_reason),
                          "token_ids": list(chunk.token_ids)}
                await _send_event(response, {**meta, "choices": [choice]})
                chunk = await anext(responses, None)
            if include_usage:
                await _send_event(response, {**meta, "choices": [], "usage": _usage(totals)})
        except ConnectionError:
            raise  # the client went away (closing `responses` below cancels the request)
        except Exception as e:
            await _send_event(response, {"error": error_body(e)[1]})
        finally:
            await responses.aclose()
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


# ---------------------------------------------------------------- helpers


def _unauthorized() -> web.Response:
    body = {"error": {"message": "missing or wrong bearer token", "type": "invalid_request_error",
                      "param": None, "code": "invalid_api_key"}}
    return web.json_response(body, status=401)


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
    raise ValueError(f"{name}: only token ids are supported (an int or a list of ints), got {value!r}")


def _usage(result: pb.CompleteResponse) -> dict[str, int]:
    completion = len(result.token_ids)
    return {"prompt_tokens": result.num_prompt_tokens, "completion_tokens": completion,
            "total_tokens": result.num_prompt_tokens + completion}


async def _send_event(response: web.StreamResponse, data: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n")


def error_body(error: BaseException) -> tuple[int, dict[str, Any]]:
    if isinstance(error, OpenAIError):
        http_status, param, code = error.http_status, error.param, error.code
    else:
        grpc_status = status_for(error)
        http_status, param, code = HTTP_STATUS.get(grpc_status, 500), None, grpc_status.name.lower()
    kind = ERROR_TYPES.get(http_status, "invalid_request_error" if http_status < 500 else "server_error")
    message = str(error) if isinstance(error, OpenAIError) else message_for(error)
    return http_status, {"message": message, "type": kind, "param": param, "code": code}


def error_response(error: BaseException, headers: dict[str, str]) -> web.Response:
    http_status, body = error_body(error)
    return web.json_response({"error": body}, status=http_status, headers=headers)
