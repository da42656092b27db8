"""The bearer token: one check (`BearerToken`), used by a server interceptor in front of
every gRPC service but health and by the OpenAI-compatible HTTP front.

Calls without `authorization: Bearer <token>` metadata end UNAUTHENTICATED before
reaching a servicer: the client API on the proxy, and on workers Prefill, Decode,
ReleaseKV, Stats and PullKV (the proxy and decode workers send the token). Health stays
open for probes, which carry no token.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health

OPEN_PREFIX = "/" + health.SERVICE_NAME + "/"


class BearerToken:
    """`authorization: Bearer <token>`, compared in constant time."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("--auth-token: empty")
        self._expected = f"Bearer {token}".encode()

    def matches(self, presented: str | bytes | None) -> bool:
        """Whether a presented header value (gRPC metadata or HTTP header) is exactly the token."""
        if presented is None:
            return False
        if isinstance(presented, str):
            try:
                presented = presented.encode()
            except UnicodeEncodeError:  # undecodable bytes in an HTTP header: not our token
                return False
        return hmac.compare_digest(bytes(presented), self._expected)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self._token = BearerToken(token)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_PREFIX):
            return handler
        if self._is_authorized(handler_call_details.invocation_metadata or ()):
            return handler
        return _rejecting(handler)

    def _is_authorized(self, metadata: Any) -> bool:
        return self._token.matches(next((value for key, value in metadata if key == "authorization"), None))


def _rejecting(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that ends the call UNAUTHENTICATED."""

    async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "authorization: missing or wrong bearer token")

    kwargs = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny, **kwargs)
    return grpc.unary_unary_rpc_method_handler(deny, **kwargs)
