"""Where `bench serve` sends its requests: kvservice's gRPC API, or an OpenAI-compatible HTTP server.

A `Backend` is an async context manager that waits for its server, sends one
`SampledRequest` and returns its `RequestRecord` (through `record_stream`, so every backend
times tokens the same way), and reads the servers' KV transfer and prefix-cache counters where it can: the gRPC
`Stats` RPC, which an HTTP server (kvservice's front, vLLM, SGLang) does not have.
"""

from __future__ import annotations

import abc
import argparse
import asyncio
import os
import ssl
import time

import aiohttp
import grpc

from kvservice.client.bench.metrics import RequestRecord
from kvservice.client.bench.openai_stream import ENDPOINTS, record_openai_request, request_body
from kvservice.client.bench.record import record_grpc_request
from kvservice.client.bench.server_stats import ServerCounters
from kvservice.client.bench.workload import SampledRequest
from kvservice.client.client import KVServiceClient
from kvservice.runtime.tls import TLSFiles, add_tls_arguments

GRPC = "grpc"
OPENAI_API_KEY_ENV = "OPENAI_API_KEY"
BACKENDS = (GRPC, *ENDPOINTS)
_HEALTH_POLL_SECONDS = 0.2  # HTTP has no health watch: a readiness probe, not synchronisation


class Backend(abc.ABC):
    """One server under load; `name` is the `--backend` value, `address` where it listens."""

    name: str
    address: str

    async def __aenter__(self) -> Backend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @abc.abstractmethod
    async def close(self) -> None: ...

    @abc.abstractmethod
    async def wait_until_ready(self, timeout: float) -> None:
        """Return once the server takes requests; raise TimeoutError after `timeout` seconds."""

    @abc.abstractmethod
    async def send(self, request: SampledRequest, request_id: str, timeout: float | None) -> RequestRecord:
        """One greedy streamed request that generates `request.expected_output_len` tokens (EOS ignored)."""

    @abc.abstractmethod
    async def server_counters(self) -> ServerCounters | None:
        """The servers' KV transfer and prefix-cache counters now; None where the backend cannot read them."""


class GrpcBackend(Backend):
    """kvservice's gRPC `Generate` (the proxy or a colocated worker); `Stats` gives the KV figures."""

    name = GRPC

    def __init__(
        self, target: str, credentials: grpc.ChannelCredentials | None = None, bearer_token: str | None = None
    ) -> None:
        self.address = target
        self.client = KVServiceClient(target, credentials, bearer_token)

    async def close(self) -> None:
        await self.client.close()

    async def wait_until_ready(self, timeout: float) -> None:
        await self.client.wait_until_serving(timeout)

    async def send(self, request: SampledRequest, request_id: str, timeout: float | None) -> RequestRecord:
        prompt = request.prompt_token_ids if request.prompt_token_ids is not None else request.prompt
        assert prompt is not None
        return await record_grpc_request(
            self.client,
            prompt,
            request_id,
            max_tokens=request.expected_output_len,
            prompt_len=request.prompt_len,
            timeout=timeout,
        )

    async def server_counters(self) -> ServerCounters | None:
        return ServerCounters.from_stats(await self.client.stats())


class OpenAIBackend(Backend):
    """`/v1/completions` (`openai`) or `/v1/chat/completions` (`openai-chat`) over HTTP(S), streamed.

    `base_url` is the server's root (`http://HOST:PORT`; a trailing `/v1` is dropped). `model`
    may be set after `wait_until_ready` from `served_models()`. With `stats_target` (a kvservice
    proxy's gRPC address) the KV figures come from its `Stats`; without, there are none.
    """

    def __init__(
        self,
        name: str,
        base_url: str,
        model: str | None = None,
        *,
        api_key: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        max_connections: int | None = None,
        stats_target: str | None = None,
        stats_credentials: grpc.ChannelCredentials | None = None,
        keep_alive: bool = True,
    ) -> None:
        if name not in ENDPOINTS:
            raise ValueError(f"backend must be one of {', '.join(ENDPOINTS)}, got {name!r}")
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url must start with http:// or https://, got {base_url!r}")
        self.name = name
        self.address = base_url.rstrip("/").removesuffix("/v1")
        self.model = model
        self.api_key = api_key
        # aiohttp's default pool holds 100 connections: it would cap concurrency unseen. Without
        # keep_alive every request has its own connection: a server that closes kept-alive
        # connections after a few requests (llama.cpp's HTTP library) then fails none.
        connector = aiohttp.TCPConnector(
            limit=max_connections or 0,
            ssl=ssl_context if ssl_context is not None else True,
            force_close=not keep_alive,
        )
        self.session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))
        self.stats_client = KVServiceClient(stats_target, stats_credentials) if stats_target else None

    async def close(self) -> None:
        await self.session.close()
        if self.stats_client is not None:
            await self.stats_client.close()

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    async def wait_until_ready(self, timeout: float) -> None:
        """`/health` answers 200 (a server without that route: `/v1/models` answers 200)."""
        deadline = time.monotonic() + timeout
        paths = ["/health", "/v1/models"]
        last = "no answer"
        while time.monotonic() < deadline:
            try:
                async with self.session.get(
                    self.address + paths[0], headers=self._headers(), timeout=aiohttp.ClientTimeout(total=2.0)
                ) as response:
                    if response.status == 200:
                        break
                    if response.status == 404 and len(paths) > 1:
                        paths.pop(0)
                        continue
                    last = f"HTTP {response.status} from {paths[0]}"
            except (aiohttp.ClientError, TimeoutError) as e:
                last = f"{type(e).__name__}: {e}"
            await asyncio.sleep(_HEALTH_POLL_SECONDS)
        else:
            raise TimeoutError(f"{self.address} was not ready within {timeout:.0f} s ({last})")
        if self.stats_client is not None:
            await self.stats_client.wait_until_serving(max(1.0, deadline - time.monotonic()))

    async def served_models(self) -> list[str]:
        """The model ids `/v1/models` lists, in its order."""
        async with self.session.get(self.address + "/v1/models", headers=self._headers()) as response:
            if response.status != 200:
                raise ValueError(f"{self.address}/v1/models: HTTP {response.status}: {(await response.text())[:200]}")
            body = await response.json()
        data = body.get("data") if isinstance(body, dict) else None
        if not isinstance(data, list):
            raise ValueError(f"{self.address}/v1/models: no 'data' list in {str(body)[:200]}")
        return [str(entry["id"]) for entry in data if isinstance(entry, dict) and "id" in entry]

    async def send(self, request: SampledRequest, request_id: str, timeout: float | None) -> RequestRecord:
        assert self.model is not None, "the model is set before requests are sent"
        prompt = request.prompt_token_ids if request.prompt_token_ids is not None else request.prompt
        assert prompt is not None
        body = request_body(self.name, self.model, prompt, request.expected_output_len)
        return await record_openai_request(
            self.session,
            self.address + ENDPOINTS[self.name],
            body,
            request_id,
            prompt_len=request.prompt_len,
            api_key=self.api_key,
            timeout=timeout,
        )

    async def server_counters(self) -> ServerCounters | None:
        if self.stats_client is None:
            return None
        return ServerCounters.from_stats(await self.stats_client.stats())


# ---------------------------------------------------------------- the flags


def add_backend_arguments(parser: argparse.ArgumentParser) -> None:
    """Which server and how to reach it (`bench serve`), the TLS flags included."""
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default=GRPC,
        help="grpc: kvservice's gRPC API (--target); openai: streamed /v1/completions, "
        "openai-chat: streamed /v1/chat/completions (--base-url) (default: grpc)",
    )
    parser.add_argument("--target", metavar="HOST:PORT", help="grpc: the proxy, or a colocated (--role both) worker")
    parser.add_argument(
        "--base-url",
        metavar="URL",
        help="openai, openai-chat: the server's root, e.g. http://127.0.0.1:8080 "
        "(kvservice's HTTP front, vLLM, SGLang)",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="the model name: sent in HTTP requests, and in the result file's name "
        "(default: HTTP: the first /v1/models lists; grpc: kvservice)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get(OPENAI_API_KEY_ENV),
        metavar="KEY",
        help=f"HTTP backends: the bearer token (default: ${OPENAI_API_KEY_ENV})",
    )
    parser.add_argument(
        "--stats-target",
        metavar="HOST:PORT",
        help="HTTP backends: a kvservice proxy's gRPC address to read the KV transfer figures from "
        "(default: none; HTTP has no Stats)",
    )
    add_tls_arguments(parser)


def _client_ssl_context(tls: TLSFiles) -> ssl.SSLContext | None:
    """HTTPS with --tls-ca (verify the server by it) and --tls-cert/--tls-key (present them); None: the defaults."""
    if not tls.is_enabled:
        return None
    context = ssl.create_default_context(cafile=tls.ca)
    if tls.cert is not None and tls.key is not None:
        context.load_cert_chain(tls.cert, tls.key)
    return context


def backend_from_args(args: argparse.Namespace) -> Backend:
    """The backend `add_backend_arguments` (and the TLS flags) describe, not yet entered."""
    tls = TLSFiles.from_args(args)
    if args.backend == GRPC:
        return GrpcBackend(args.target, tls.channel_credentials(), args.auth_token)
    return OpenAIBackend(
        args.backend,
        args.base_url,
        args.model,
        api_key=args.api_key,
        ssl_context=_client_ssl_context(tls),
        max_connections=args.max_concurrency,
        stats_target=args.stats_target,
        stats_credentials=tls.channel_credentials(),
    )
