"""Hostile input: random client-API requests and KV pulls against live servers, random chunk headers.

One colocated worker and one prefill worker (tiny model) serve the whole module. Every
request ends with a clean status code, the servers stay SERVING, and a well-formed
request running alongside the fuzz gets the same output as it does alone.
"""

from __future__ import annotations

import asyncio
import math
import sys
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvservice.client.client import KVServiceClient
from kvservice.client.cluster import LocalCluster
from kvservice.connector import wire
from kvservice.connector.kv_transfer_service import PULL_KV_METHOD
from kvservice.loading.model_files import load_model_config
from kvservice.loading.model_loader import resolve_dtype
from kvservice.model.kv_cache import KVCacheLayout
from kvservice.runtime.grpc_options import GRPC_OPTIONS, MAX_MESSAGE_BYTES
from kvservice.v1 import kvservice_pb2 as pb
from kvservice.v1 import kvservice_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(120)

BLOCK_SIZE = 16
NUM_BLOCKS = 32
VOCAB_SIZE = load_model_config("tiny").vocab_size
WORKER_ARGS = [
    "--num-blocks",
    str(NUM_BLOCKS),
    "--block-size",
    str(BLOCK_SIZE),
    "--max-num-seqs",
    "8",
    "--num-threads",
    "1",
    "--grace-period",
    "1",
]
CLEAN_CODES = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.OUT_OF_RANGE,
}
FUZZ = settings(deadline=None, database=None, suppress_health_check=list(HealthCheck))
REFERENCE_PROMPT = [11, 22, 33, 44, 55, 66, 77]
TINY_CONFIG = load_model_config("tiny")
LAYOUT = KVCacheLayout.for_model(TINY_CONFIG, BLOCK_SIZE, resolve_dtype("auto", TINY_CONFIG))


class Servers:
    """A colocated worker and a prefill worker on an event loop of this module's own (hypothesis is synchronous)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        # grpc.aio calls are created outside the loop (hypothesis is synchronous) and look
        # the loop up: make it this thread's current loop, whatever earlier tests left.
        asyncio.set_event_loop(self.loop)
        self.colocated = LocalCluster("tiny", colocated=True, worker_args=WORKER_ARGS, grace_period=1)
        # Only its start_child and stop are used: a prefill worker alone, no proxy.
        self.prefill = LocalCluster("tiny", worker_args=WORKER_ARGS, grace_period=1)
        self.client: KVServiceClient | None = None
        self.prefill_channel: grpc.aio.Channel | None = None

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    s = Servers()
    try:
        s.run(s.colocated.start())
        prefill_cmd = [sys.executable, "-m", "kvservice", "serve", "--model", "tiny", "--role", "prefill", *WORKER_ARGS]
        s.run(s.prefill.start_child("prefill-0", prefill_cmd, None))

        async def connect() -> None:  # channels belong to the loop they are made on
            s.client = KVServiceClient(s.colocated.address)
            s.prefill_channel = grpc.aio.insecure_channel(s.prefill.prefill_addresses[0], options=GRPC_OPTIONS)

        s.run(connect())
        yield s
    finally:
        for closing in (getattr(s, "client", None), getattr(s, "prefill_channel", None)):
            if closing is not None:
                s.run(closing.close())
        s.run(s.prefill.stop())
        s.run(s.colocated.stop())
        s.loop.close()
        asyncio.set_event_loop(None)


async def _code(call: Any) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


async def _reference(client: KVServiceClient) -> list[int]:
    completion = await client.complete(REFERENCE_PROMPT, timeout=60, max_tokens=48, temperature=0, ignore_eos=True)
    return completion.token_ids


# ---------------------------------------------------------------- the client API

FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32), st.sampled_from([0.0, -0.0, 1.0, 1e-45, -1e-45, 2.0])
)
INT32 = st.one_of(st.integers(-(2**31), 2**31 - 1), st.integers(-2, 4))
TOKEN_IDS = st.lists(st.one_of(st.integers(0, VOCAB_SIZE - 1), st.integers(-(2**31), 2**31 - 1)), max_size=40)


@st.composite
def wellformed_requests(draw: st.DrawFn) -> pb.GenerateRequest:
    sp = pb.SamplingParams(
        temperature=draw(st.one_of(st.just(0.0), st.floats(0.0009765625, 5.0, width=32))),
        top_p=draw(st.floats(0.0009765625, 1.0, width=32)),
        top_k=draw(st.one_of(st.just(-1), st.integers(1, 2**31 - 1))),
        max_tokens=draw(st.integers(1, 3)),
        seed=draw(st.integers(-(2**63), 2**63 - 1)),
        ignore_eos=draw(st.booleans()),
    )
    sp.stop_token_ids.extend(draw(st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=3)))  # inside the vocabulary
    request = pb.GenerateRequest(sampling_params=sp)
    if draw(st.booleans()):
        request.text = draw(st.text(min_size=1, max_size=40))
    else:
        request.token_ids.ids.extend(draw(st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=40)))
    return request


@st.composite
def hostile_requests(draw: st.DrawFn) -> pb.GenerateRequest:
    sp = pb.SamplingParams(ignore_eos=draw(st.booleans()))
    for name, values in (
        ("temperature", FLOATS),
        ("top_p", FLOATS),
        ("top_k", INT32),
        ("seed", st.integers(-(2**63), 2**63 - 1)),
    ):
        if draw(st.booleans()):
            setattr(sp, name, draw(values))
    # Valid lengths stay short (the fuzz is about input, not decoding); invalid ones go far.
    if draw(st.booleans()):
        sp.max_tokens = draw(st.one_of(st.integers(1, 3), st.integers(-(2**31), 0), st.integers(5000, 2**31 - 1)))
    else:
        sp.max_tokens = 2
    sp.stop_token_ids.extend(draw(st.lists(INT32, max_size=4)))
    request = pb.GenerateRequest(request_id=draw(st.one_of(st.just(""), st.text(max_size=20))), sampling_params=sp)
    kind = draw(st.sampled_from(["text", "token_ids", "huge_token_ids", "none"]))
    if kind == "text":
        request.text = draw(st.text(max_size=60))
    elif kind == "token_ids":
        request.token_ids.ids.extend(draw(TOKEN_IDS))
    elif kind == "huge_token_ids":
        request.token_ids.ids.extend([1] * draw(st.sampled_from([NUM_BLOCKS * BLOCK_SIZE, 5000, 200_000])))
    return request


def test_fuzzed_generate_requests_get_clean_codes_and_leave_the_server_serving(servers: Servers) -> None:
    client = servers.client
    expected = servers.run(_reference(client))
    alongside = servers.loop.create_task(_reference(client))
    seen: set[grpc.StatusCode] = set()

    @settings(FUZZ, max_examples=300)
    @given(wellformed=st.booleans(), data=st.data(), streaming=st.booleans())
    def fuzz(wellformed: bool, data: st.DataObject, streaming: bool) -> None:
        request = data.draw(wellformed_requests() if wellformed else hostile_requests())
        stub = pb_grpc.GenerationStub(client.channel)
        if streaming:

            async def drain() -> None:
                async for _ in stub.Generate(request, timeout=30):
                    pass

            code = servers.run(_code(drain()))
        else:
            code = servers.run(_code(stub.Complete(request, timeout=30)))
        assert code in CLEAN_CODES, (code, request)
        if wellformed:
            assert code is grpc.StatusCode.OK, request
        seen.add(code)
        sp = request.sampling_params
        if sp.HasField("temperature") and not math.isfinite(sp.temperature):
            assert code is grpc.StatusCode.INVALID_ARGUMENT

    fuzz()
    assert servers.run(alongside) == expected
    assert {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT} <= seen
    assert servers.run(client.health()) == "SERVING"
    assert servers.run(_reference(client)) == expected


@pytest.mark.parametrize(
    "field,value",
    [("temperature", math.nan), ("temperature", math.inf), ("temperature", -1.0), ("top_p", math.nan), ("top_p", 1.5)],
)
def test_non_finite_or_out_of_range_params_name_the_field(servers: Servers, field: str, value: float) -> None:
    request = pb.GenerateRequest(text="hi", sampling_params=pb.SamplingParams(max_tokens=2, **{field: value}))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        servers.run(pb_grpc.GenerationStub(servers.client.channel).Complete(request, timeout=10))
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert f"sampling_params.{field}" in (caught.value.details() or "")


def test_message_over_the_server_maximum_is_refused(servers: Servers) -> None:
    request = pb.GenerateRequest(text="x" * (MAX_MESSAGE_BYTES + 1024), sampling_params=pb.SamplingParams(max_tokens=1))
    code = servers.run(_code(pb_grpc.GenerationStub(servers.client.channel).Complete(request, timeout=30)))
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert servers.run(servers.client.health()) == "SERVING"


# ---------------------------------------------------------------- KV pulls against a prefill worker


@st.composite
def pull_requests(draw: st.DrawFn) -> pb.PullKVRequest:
    def either(right: Any, wrong: st.SearchStrategy[Any]) -> Any:
        return draw(st.one_of(st.just(right), wrong))

    u32 = st.integers(0, 2**32 - 1)
    return pb.PullKVRequest(
        request_id=draw(st.one_of(st.just(""), st.text(max_size=30))),
        transfer_token=draw(st.binary(max_size=40)),
        num_layers=either(LAYOUT.num_layers, u32),
        block_size=either(LAYOUT.block_size, u32),
        num_kv_heads=either(LAYOUT.num_kv_heads, u32),
        head_dim=either(LAYOUT.head_dim, u32),
        dtype=either(wire.dtype_name(LAYOUT.dtype), st.text(max_size=10)),
    )


def test_fuzzed_pulls_never_get_data(servers: Servers) -> None:
    pull = servers.prefill_channel.unary_stream(
        PULL_KV_METHOD, request_serializer=pb.PullKVRequest.SerializeToString, response_deserializer=None
    )
    refused = {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    }

    async def frames_and_code(request: pb.PullKVRequest) -> tuple[int, grpc.StatusCode]:
        num_frames = 0
        try:
            # Unknown ids wait for a registration that never comes: a short deadline ends them.
            async for _ in pull(request, timeout=0.2):
                num_frames += 1
        except grpc.aio.AioRpcError as e:
            return num_frames, e.code()
        return num_frames, grpc.StatusCode.OK

    @settings(FUZZ, max_examples=60)
    @given(request=pull_requests())
    def fuzz(request: pb.PullKVRequest) -> None:
        num_frames, code = servers.run(frames_and_code(request))
        assert num_frames == 0 and code in refused, (code, request)

    fuzz()

    async def worker_health() -> int:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        reply = await health_pb2_grpc.HealthStub(servers.prefill_channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
        return reply.status

    assert servers.run(worker_health()) == 1  # SERVING


# ---------------------------------------------------------------- chunk headers on the decode side


@settings(FUZZ, max_examples=500)
@given(
    layer=st.integers(0, 2**32 - 1),
    first_block=st.integers(0, 2**32 - 1),
    num_blocks=st.integers(0, 2**32 - 1),
    shape=st.lists(st.one_of(st.integers(0, 2**32 - 1), st.sampled_from(LAYOUT.blocks_shape(2))), max_size=7),
    num_payload_blocks=st.integers(0, 4),
    request_id=st.sampled_from(["req-1", "req-2", ""]),
    num_blocks_in_transfer=st.integers(1, 12),
)
def test_fuzzed_chunk_headers_validate_only_inside_their_transfer(
    layer: int,
    first_block: int,
    num_blocks: int,
    shape: list[int],
    num_payload_blocks: int,
    request_id: str,
    num_blocks_in_transfer: int,
) -> None:
    payload = (
        torch.zeros(LAYOUT.blocks_shape(num_payload_blocks), dtype=LAYOUT.dtype)
        if num_payload_blocks
        else torch.zeros(0)
    )
    frame = wire.encode_chunk(
        request_id=request_id,
        layer=layer,
        first_block=first_block,
        num_blocks=num_blocks,
        dtype=wire.dtype_name(LAYOUT.dtype),
        shape=shape,
        payload=wire.tensor_bytes(payload),
    )
    decoded = wire.decode_frame(frame)
    assert decoded.header is not None
    try:
        wire.validate_chunk(decoded.header, decoded.payload, LAYOUT, "req-1", num_blocks_in_transfer)
    except wire.KVChunkError:
        return
    # Accepted: it is this transfer's, and it writes only inside its blocks and layers.
    assert request_id == "req-1"
    assert 0 <= layer < LAYOUT.num_layers
    assert 1 <= num_blocks and first_block + num_blocks <= num_blocks_in_transfer
    assert wire.payload_view(decoded.payload, LAYOUT, num_blocks).numel() == math.prod(LAYOUT.blocks_shape(num_blocks))
