"""An OpenAI-compatible HTTP front on the proxy: `/v1/completions`, `/v1/models`, `/health`.

It runs in the proxy's event loop and sends every request down the same routing path
as the gRPC `Generate` (`ProxyService.generate`). What is supported of the OpenAI
completions API:

- `prompt`: a string or a list of token ids (one prompt per request; a list holding
  exactly one prompt is accepted too);
- `max_tokens` (default 16), `temperature`, `top_p`, `seed`, `stream`,
  `stream_options.include_usage`; `stop` as a string or a list of strings (or, as
  an extension, token ids: an int or a list of ints); vLLM's extensions `top_k`,
  `ignore_eos` and `stop_token_ids`;
- not supported (HTTP 400): `n` > 1, `best_of` > 1, `echo`, `logprobs`, `suffix`.

Every choice also carries `token_ids`, the generated ids. A client-chosen request id
travels in the `X-Request-Id` header; the response echoes it and the completion id is
`cmpl-<request id>`. Errors are OpenAI-style JSON (`{"error": {"message", "type",
"param", "code"}}`) with the HTTP status that fits the gRPC status code; an error
after a stream has started arrives as one `data: {"error": ...}` event.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from kvservice.finish_reason import finish_reason_from_proto
from kvservice.request import check_request_id
from kvservice.server.auth import BearerToken
from kvservice.server.generation import merge_into_complete, new_request_id
from kvservice.server.openai_protocol import OpenAIError, error_body, parse_completion_request, usage
from kvservice.server.proxy import ProxyService
from kvservice.v1 import kvservice_pb2 as pb

REQUEST_ID_HEADER = "X-Request-Id"
# A body is parsed on the proxy's event loop: bound it (a prompt of a model's full length
# as token ids is well under this).
MAX_BODY_BYTES = 4 << 20

class OpenAIFront:
    """The HTTP routes; `app()` builds the aiohttp application (serve it with `metrics.start_http`)."""

    def __init__(
        self, service: ProxyService, model_name: str, is_serving: Callable[[], bool], auth_token: str | None = None
    ) -> None:
        self.service = service
        self.model_name = model_name
        self.is_serving = is_serving
        self.auth_token = BearerToken(auth_token) if auth_token else None  # the proxy's --auth-token guards this API too
        self.created = int(time.time())

    def _is_authorized(self, request: web.Request) -> bool:
        return self.auth_token is None or self.auth_token.matches(request.headers.get("Authorization"))

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        return app

    async def health(self, request: web.Request) -> web.Response:
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
            parsed = parse_completion_request(body, request_id, self.model_name)
        except Exception as e:
            return error_response(e, headers)
        meta = {"id": f"cmpl-{request_id}", "object": "text_completion", "created": int(time.time()), "model": self.model_name}
        responses = self.service.responses(parsed.generate_request)
        try:
            # Everything up to the first chunk (validation, routing, the prefill) fails
            # with a proper HTTP status, before a stream is opened.
            first = await anext(responses, None)
        except Exception as e:
            await responses.aclose()
            return error_response(e, headers)
        if parsed.stream:
            return await self._stream(request, headers, meta, first, responses, parsed.include_usage)
        return await self._complete(headers, meta, first, responses)

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
        choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": finish_reason_from_proto(result.finish_reason),
                  "token_ids": list(result.token_ids)}
        return web.json_response({**meta, "choices": [choice], "usage": usage(result)}, headers=headers)

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
                choice = {"index": 0, "text": chunk.text, "logprobs": None, "finish_reason": finish_reason_from_proto(chunk.finish_reason),
                          "token_ids": list(chunk.token_ids)}
                await _send_event(response, {**meta, "choices": [choice]})
                chunk = await anext(responses, None)
            if include_usage:
                await _send_event(response, {**meta, "choices": [], "usage": usage(totals)})
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


async def _send_event(response: web.StreamResponse, data: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n")


def error_response(error: BaseException, headers: dict[str, str]) -> web.Response:
    http_status, body = error_body(error)
    return web.json_response({"error": body}, status=http_status, headers=headers)
