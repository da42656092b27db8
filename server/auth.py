"""Who may call a server: the bearer token and, under mutual TLS, the peer's certificate.

`BearerToken` is one check, used by a server interceptor in front of every gRPC service
but health and by the OpenAI-compatible HTTP front. Calls without `authorization: Bearer
<token>` metadata end UNAUTHENTICATED before reaching a servicer: the client API on the
proxy, and on workers Prefill, Decode, DecodeStream, ReleaseKV, Stats, SubscribeKVEvents and
PullKV (the proxy and decode workers send the token). `PeerNameInterceptor` (a worker's
`--worker-peer-names`) lets through only callers whose client certificate names a worker
identity (its subject CN or a subject alternative name): a client certificate is not a
worker, and gets PERMISSION_DENIED. Health stays open for probes, which carry neither.
"""

from __future__ import annotations

import contextlib
import hmac
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import grpc
from grpc_health.v1 import health

OPEN_PREFIX = "/" + health.SERVICE_NAME + "/"
# A check run in the call before its handler: it aborts the call, or returns to let it through.
CallCheck = Callable[[grpc.aio.ServicerContext], Awaitable[None]]
# The certificate fields a peer name may match (grpc's auth context keys).
PEER_NAME_PROPERTIES = ("x509_common_name", "x509_subject_alternative_name")


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


class _GuardInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every RPC's handler but health's in `_guard`."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_PREFIX):
            return handler
        return self._guard(handler, handler_call_details)

    def _guard(self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        raise NotImplementedError


class BearerTokenInterceptor(_GuardInterceptor):
    def __init__(self, token: str) -> None:
        self._token = BearerToken(token)

    def _guard(self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        if self._is_authorized(details.invocation_metadata or ()):
            return handler
        return _checked(handler, _deny_unauthenticated)

    def _is_authorized(self, metadata: Any) -> bool:
        return self._token.matches(next((value for key, value in metadata if key == "authorization"), None))


class PeerNameInterceptor(_GuardInterceptor):
    """Every RPC but health only for peers whose client certificate names one of `names`
    (mutual TLS; the subject CN or a subject alternative name); others get PERMISSION_DENIED."""

    def __init__(self, names: Iterable[str]) -> None:
        self._names = frozenset(name.encode() for name in names)

    def _guard(self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        return _checked(handler, self._check_peer)

    async def _check_peer(self, context: grpc.aio.ServicerContext) -> None:
        auth = context.auth_context()
        presented = [name for key in PEER_NAME_PROPERTIES for name in auth.get(key, ())]
        if self._names.isdisjoint(presented):
            shown = ", ".join(name.decode(errors="replace")[:64] for name in presented[:4]) or "no certificate"
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"peer certificate ({shown}) is not one of this worker's --worker-peer-names",
            )


async def _deny_unauthenticated(context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "authorization: missing or wrong bearer token")


def _checked(handler: grpc.RpcMethodHandler, check: CallCheck) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that runs `check` first, then `handler`'s behaviour."""
    kwargs = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_streaming(handler.stream_stream, check), **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_unary(handler.stream_unary, check), **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_streaming(handler.unary_stream, check), **kwargs)
    return grpc.unary_unary_rpc_method_handler(_unary(handler.unary_unary, check), **kwargs)


def _unary(
    behaviour: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]], check: CallCheck
) -> Callable[..., Awaitable[Any]]:
    async def checked(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await check(context)
        return await behaviour(request, context)

    return checked


def _streaming(
    behaviour: Callable[[Any, grpc.aio.ServicerContext], Any], check: CallCheck
) -> Callable[..., AsyncIterator[Any]]:
    """A response stream behind `check`; `behaviour` yields its responses or writes them itself."""

    async def checked(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await check(context)
        responses = behaviour(request, context)
        if inspect.isasyncgen(responses):
            async with contextlib.aclosing(responses):  # its `finally` runs when this stream ends
                async for response in responses:
                    yield response
        else:
            await responses

    return checked
