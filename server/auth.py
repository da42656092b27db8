"""The bearer token: a server interceptor in front of every service but health.

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


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("--auth-token: empty")
        self._expected = f"Bearer {token}".encode()

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
        presented = next((value for key, value in metadata if key == "authorization"), None)
        if presented is None:
            return False
        presented_bytes = presented.encode() if isinstance(presented, str) else bytes(presented)
        return hmac.compare_digest(presented_bytes, self._expected)


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
