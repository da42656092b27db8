"""An OpenAI-compatible HTTP front: `/v1/completions`, `/v1/chat/completions`, `/v1/models`,
`/tokenize`, `/detokenize`, `/version`, `/health`.

It runs in the event loop of the server that hosts it (the proxy, or a colocated worker
with `--http-port`) and sends every request down the same path as the gRPC `Generate`
(its `StreamingGenerationService.responses`). What is supported:

- completions: `prompt` as a string or a list of token ids (one prompt per request);
  chat completions: `messages` (system, user, assistant; string content or a list of text
  parts), rendered by the worker with the model's own chat template;
- `max_tokens` (completions default 16; chat: `max_tokens` or `max_completion_tokens`,
  default up to the end of the turn), `temperature`, `top_p`, `seed`, `stream`,
  `stream_options.include_usage`, `stop` (strings, or token ids as an extension), and
  vLLM's `top_k`, `ignore_eos`, `stop_token_ids`;
- logprobs (the log-softmax of the raw logits): completions `logprobs: K` (with `echo`,
  the prompt's tokens and logprobs first), chat `logprobs: true` with `top_logprobs: K`;
  K at most 20, streamed with each token;
- `usage.prompt_tokens_details.cached_tokens`: the prompt tokens found in the prefix cache;
- structured output: chat `response_format` (`json_object`, `json_schema`) and vLLM's
  `structured_outputs` (`json`, `json_object`, `regex`, `choice`, `grammar`) on both; a
  schema feature the engine cannot enforce is a 400 naming it;
- `n` sequences (best_of, if given, must equal n), one choice each; the prompt is
  computed once and its KV travels once;
- refused with 400, naming the field: `suffix`, `echo` with n > 1, tools, and any field
  the front does not know (a penalty or a logit bias is not silently ignored).

Streams send one event per engine step (a token, or the accepted tokens of a
speculative step); a chat stream's first event carries the role, then content deltas,
then the finish reason. Completion choices also carry `token_ids`. A client-chosen
request id travels in the `X-Request-Id` header; the response echoes it. Errors are
OpenAI-style JSON with the HTTP status that fits the gRPC status code; an error after a
stream has started arrives as one `data: {"error": ...}` event.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

import kvservice
from kvservice.core.request import check_request_id
from kvservice.loading.tokenizer import Tokenizer
from kvservice.runtime.finish_reason import finish_reason_from_proto
from kvservice.server.auth import BearerToken
from kvservice.server.generation import CompleteResponses, StreamingGenerationService, new_request_id
from kvservice.server.openai_logprobs import CompletionLogprobs, TokenTexts, chat_logprobs
from kvservice.server.openai_protocol import (
    OpenAIError,
    ParsedRequest,
    error_body,
    parse_chat_request,
    parse_completion_request,
    usage,
    usage_of,
)
from kvservice.v1 import kvservice_pb2 as pb

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"
# A body is parsed on the server's event loop: bound it (a prompt of a model's full length
# as token ids is well under this).
MAX_BODY_BYTES = 4 << 20
MAX_TOKENIZE_CHARS = 1 << 20


class OpenAIFront:
    """The HTTP routes; `app()` builds the aiohttp application (serve it with `metrics.start_http`)."""

    def __init__(
        self,
        service: StreamingGenerationService,
        model_name: str,
        is_serving: Callable[[], bool],
        auth_token: str | None = None,
        tokenizer: Tokenizer | None = None,
        max_model_len: int | None = None,
    ) -> None:
        self.service = service
        self.model_name = model_name
        self.is_serving = is_serving
        self.auth_token = BearerToken(auth_token) if auth_token else None  # --auth-token guards this API too
        self.tokenizer = tokenizer  # for /tokenize, /detokenize and the tokens of logprobs
        self.token_texts = TokenTexts(tokenizer)
        self.max_model_len = max_model_len
        self.created = int(time.time())
        self.is_draining = False

    def start_draining(self) -> None:
        """The proxy is stopping: /health says so and new completions are refused (503)."""
        self.is_draining = True

    def _is_authorized(self, request: web.Request) -> bool:
        return self.auth_token is None or self.auth_token.matches(request.headers.get("Authorization"))

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_get("/health", self.health)
        app.router.add_get("/version", self.version)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        return app

    async def health(self, request: web.Request) -> web.Response:
        if self.is_draining:
            return web.json_response({"status": "unavailable", "detail": "shutting down"}, status=503)
        if self.is_serving():
            return web.json_response({"status": "ok"})
        return web.json_response({"status": "unavailable", "detail": "not serving"}, status=503)

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": kvservice.__version__})

    async def models(self, request: web.Request) -> web.Response:
        if not self._is_authorized(request):
            return _unauthorized()
        model = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "kvservice",
            "root": self.model_name,
            "max_model_len": self.max_model_len,
        }
        return web.json_response({"object": "list", "data": [model]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, parse_completion_request, is_chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, parse_chat_request, is_chat=True)

    async def tokenize(self, request: web.Request) -> web.Response:
        def run(body: dict[str, Any], tokenizer: Tokenizer) -> dict[str, Any]:
            text = body.get("prompt")
            if not isinstance(text, str) or len(text) > MAX_TOKENIZE_CHARS:
                raise ValueError(f"prompt: expected a string of at most {MAX_TOKENIZE_CHARS} characters")
            add_special_tokens = body.get("add_special_tokens", True)
            if not isinstance(add_special_tokens, bool):
                raise ValueError("add_special_tokens: expected a boolean")
            tokens = tokenizer.encode(text, add_special_tokens=add_special_tokens)
            return {"tokens": tokens, "count": len(tokens), "max_model_len": self.max_model_len}

        return await self._tokenizer_route(request, run)

    async def detokenize(self, request: web.Request) -> web.Response:
        def run(body: dict[str, Any], tokenizer: Tokenizer) -> dict[str, Any]:
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens
            ):
                raise ValueError("tokens: expected a list of token ids")
            return {"prompt": tokenizer.decode(tokens)}

        return await self._tokenizer_route(request, run)

    # ------------------------------------------------------------ internals

    async def _tokenizer_route(
        self, request: web.Request, run: Callable[[dict[str, Any], Tokenizer], dict[str, Any]]
    ) -> web.Response:
        if not self._is_authorized(request):
            return _unauthorized()
        try:
            if self.tokenizer is None:
                raise OpenAIError(501, "this server has no tokenizer (start the proxy with --model)")
            body = await _json_body(request)
            if not isinstance(body, dict):
                raise ValueError("request body: expected a JSON object")
            return web.json_response(run(body, self.tokenizer))
        except Exception as e:
            return error_response(e, {})

    async def _serve(
        self, request: web.Request, parse: Callable[[Any, str, str], ParsedRequest], is_chat: bool
    ) -> web.StreamResponse:
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
            parsed = parse(await _json_body(request), request_id, self.model_name)
            if parsed.echo and not isinstance(parsed.prompt, str) and self.tokenizer is None:
                raise OpenAIError(
                    400, "echo: a prompt of token ids needs a tokenizer here (start the proxy with --model)", "echo"
                )
        except Exception as e:
            return error_response(e, headers)
        kind = _ChatShape(parsed, self.token_texts) if is_chat else _CompletionShape(parsed, self.token_texts)
        meta = {"id": f"{kind.id_prefix}{request_id}", "created": int(time.time()), "model": self.model_name}
        responses = self.service.responses(parsed.generate_request)
        try:
            # Everything up to the first chunk (validation, routing, the prefill) fails
            # with a proper HTTP status, before a stream is opened.
            first = await anext(responses, None)
        except BaseException as e:  # cancelled too (the client hung up): close the request first
            await responses.aclose()
            if not isinstance(e, Exception):
                raise
            return error_response(e, headers)
        if parsed.stream:
            return await self._stream(request, headers, meta, kind, first, responses, parsed.include_usage)
        return await self._complete(headers, meta, kind, first, responses)

    async def _complete(
        self,
        headers: dict[str, str],
        meta: dict[str, Any],
        kind: _Shape,
        first: pb.GenerateResponse | None,
        responses: AsyncIterator[pb.GenerateResponse],
    ) -> web.Response:
        gathered = CompleteResponses()
        try:
            chunk = first
            while chunk is not None:
                gathered.add(chunk)
                chunk = await anext(responses, None)
        except Exception as e:
            return error_response(e, headers)
        finally:
            await responses.aclose()
        choices = [kind.whole_choice(gathered.sequences[i]) for i in sorted(gathered.sequences)]
        body = {**meta, "object": kind.object_name, "choices": choices, "usage": usage(gathered.result())}
        return web.json_response(body, headers=headers)

    async def _stream(
        self,
        request: web.Request,
        headers: dict[str, str],
        meta: dict[str, Any],
        kind: _Shape,
        first: pb.GenerateResponse | None,
        responses: AsyncIterator[pb.GenerateResponse],
        include_usage: bool,
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        meta = {**meta, "object": kind.chunk_object_name}
        events = _ChunkEvents(meta)
        counts = _UsageCounts()
        try:
            for opening in kind.opening_choices():
                await response.write(events.of(opening))
            chunk = first
            while chunk is not None:  # one event per chunk: an engine step's tokens, or those the stream was behind on
                counts.add(chunk)
                await response.write(events.of(kind.delta_choice(chunk)))
                chunk = await anext(responses, None)
            if include_usage:
                await _send_event(response, {**meta, "choices": [], "usage": counts.usage()})
        except ConnectionError:  # the client went away: closing `responses` cancels the request
            logger.info("%s: the client closed its stream", meta.get("id"))
            return response
        except Exception as e:
            await _send_event(response, {"error": error_body(e)[1]})
        finally:
            await responses.aclose()
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


Chunk = pb.GenerateResponse | pb.CompleteResponse


class _ChunkEvents:
    """A stream's chunk events, `data: {<meta>,"choices":[<choice>]}`: the part every chunk
    shares is encoded once, so each chunk encodes only its own choice."""

    def __init__(self, meta: dict[str, Any]) -> None:
        shared = json.dumps({**meta, "choices": []}, separators=(",", ":"))
        self._head = b"data: " + shared[: -len("]}")].encode()

    def of(self, choice: dict[str, Any]) -> bytes:
        return self._head + json.dumps(choice, separators=(",", ":")).encode() + b"]}\n\n"


class _UsageCounts:
    """A stream's token counts for its usage event, counted chunk by chunk."""

    def __init__(self) -> None:
        self.num_prompt_tokens = 0
        self.num_completion_tokens = 0
        self.num_cached_tokens: int | None = None

    def add(self, chunk: pb.GenerateResponse) -> None:
        self.num_completion_tokens += len(chunk.token_ids)
        self.num_prompt_tokens = chunk.num_prompt_tokens or self.num_prompt_tokens
        if self.num_cached_tokens is None and chunk.HasField("num_cached_tokens"):
            self.num_cached_tokens = chunk.num_cached_tokens

    def usage(self) -> dict[str, Any]:
        return usage_of(self.num_prompt_tokens, self.num_completion_tokens, self.num_cached_tokens)


class _Shape:
    """How one endpoint's response objects look; the two below differ only here. One per
    request: a stream's choices are built chunk by chunk."""

    id_prefix = ""
    object_name = ""
    chunk_object_name = ""

    def __init__(self, parsed: ParsedRequest, texts: TokenTexts) -> None:
        self.parsed = parsed
        self.texts = texts
        sp = parsed.generate_request.sampling_params
        self.num_sequences = sp.n if sp.HasField("n") else 1

    def opening_choices(self) -> list[dict[str, Any]]:
        return []

    def whole_choice(self, result: pb.CompleteResponse) -> dict[str, Any]:
        raise NotImplementedError

    def delta_choice(self, chunk: pb.GenerateResponse) -> dict[str, Any]:
        raise NotImplementedError


class _CompletionShape(_Shape):
    id_prefix, object_name, chunk_object_name = "cmpl-", "text_completion", "text_completion"

    def __init__(self, parsed: ParsedRequest, texts: TokenTexts) -> None:
        super().__init__(parsed, texts)
        self.logprobs = [CompletionLogprobs(texts) for _ in range(self.num_sequences)]  # text offsets run per sequence
        self.is_echo_pending = parsed.echo  # echo goes with one sequence only

    def whole_choice(self, result: pb.CompleteResponse) -> dict[str, Any]:
        return self._choice(result)

    def delta_choice(self, chunk: pb.GenerateResponse) -> dict[str, Any]:
        return self._choice(chunk)

    def _choice(self, chunk: Chunk) -> dict[str, Any]:
        text, token_ids = chunk.text, list(chunk.token_ids)
        logprob_ids: list[int] = []
        logprobs: list[pb.Logprobs | None] = []
        if self.is_echo_pending and (token_ids or chunk.finish_reason):
            self.is_echo_pending = False
            text = self._prompt_text() + text
            # The prompt's first token has no logprob (nothing comes before it).
            logprob_ids, logprobs = list(chunk.prompt_token_ids), [None, *chunk.prompt_logprobs]
        if self.parsed.wants_logprobs:
            logprob_ids += token_ids
            logprobs += chunk.logprobs
        body = self.logprobs[chunk.index].build(logprob_ids, logprobs) if self.parsed.wants_logprobs else None
        finish_reason = finish_reason_from_proto(chunk.finish_reason)
        return {
            "index": chunk.index,
            "text": text,
            "logprobs": body,
            "finish_reason": finish_reason,
            "token_ids": token_ids,
        }

    def _prompt_text(self) -> str:
        prompt = self.parsed.prompt
        if isinstance(prompt, str) or prompt is None:
            return prompt or ""
        if self.texts.tokenizer is None:
            return ""  # refused when parsed: see OpenAIFront._serve
        return self.texts.tokenizer.decode(prompt, skip_special_tokens=False)


class _ChatShape(_Shape):
    id_prefix, object_name, chunk_object_name = "chatcmpl-", "chat.completion", "chat.completion.chunk"

    def opening_choices(self) -> list[dict[str, Any]]:
        return [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for i in range(self.num_sequences)
        ]

    def whole_choice(self, result: pb.CompleteResponse) -> dict[str, Any]:
        message = {"role": "assistant", "content": result.text}
        return {"index": result.index, "message": message, **self._rest(result)}

    def delta_choice(self, chunk: pb.GenerateResponse) -> dict[str, Any]:
        delta = {"content": chunk.text} if chunk.text else {}
        return {"index": chunk.index, "delta": delta, **self._rest(chunk)}

    def _rest(self, chunk: Chunk) -> dict[str, Any]:
        logprobs = chat_logprobs(self.texts, list(chunk.logprobs)) if self.parsed.wants_logprobs else None
        return {
            "logprobs": logprobs,
            "finish_reason": finish_reason_from_proto(chunk.finish_reason),
            "token_ids": list(chunk.token_ids),
        }


# ---------------------------------------------------------------- helpers


async def _json_body(request: web.Request) -> Any:
    try:
        return await request.json()
    except json.JSONDecodeError as e:
        raise ValueError(f"request body: not JSON ({e})") from None
    except web.HTTPRequestEntityTooLarge:
        raise OpenAIError(413, f"request body: larger than {MAX_BODY_BYTES} bytes") from None


def _unauthorized() -> web.Response:
    body = {
        "error": {
            "message": "missing or wrong bearer token",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
    return web.json_response(body, status=401)


async def _send_event(response: web.StreamResponse, data: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n")


def error_response(error: BaseException, headers: dict[str, str]) -> web.Response:
    http_status, body = error_body(error)
    return web.json_response({"error": body}, status=http_status, headers=headers)
