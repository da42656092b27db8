"""KV transfer over gRPC in one process: a prefill engine serving PullKV, a decode engine pulling.

Both engines are plain `LLMEngine`s on the `tiny` model, stepped in worker threads
(`asyncio.to_thread`) while the PullKV server runs on the test's event loop and the
decode connector pulls on its own transfer loop. Stepping them by hand lets the tests
look at both KV caches between steps. Waits are on events (a load finished, staging was
released), each with a deadline that is only reached when something is broken.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import secrets
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
import pytest
import torch

from kvservice.config import EngineConfig
from kvservice.connector import wire
from kvservice.connector.decode_connector import REMOTE_ADDRESS, DecodeKVConnector
from kvservice.connector.transfer_stats import TransferStats
from kvservice.connector.kv_puller import LoadSpec, pull_kv
from kvservice.connector.kv_transfer_service import KVTransferService
from kvservice.connector.prefill_connector import TRANSFER_TOKEN, PrefillKVConnector
from kvservice.connector.staging import StagingPool
from kvservice.connector.transfer_registry import StagedTransfer, TransferRegistry
from kvservice.engine import LLMEngine, RequestOutput
from kvservice.kv_cache import KVCacheLayout, allocate_kv_caches
from kvservice.llm import LLM
from kvservice.model_loader import TINY_CONFIG
from kvservice.sampling_params import SamplingParams
from kvservice.v1 import kvservice_pb2 as pb

pytestmark = pytest.mark.timeout(120)

BLOCK_SIZE = 8
NUM_BLOCKS = 64
MAX_MODEL_LEN = 256
# The prefill engine runs prompts in chunks of 16 tokens: long prompts stage over several steps.
PREFILL_CONFIG = EngineConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=16)
DECODE_CONFIG = EngineConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN)
LAYOUT = KVCacheLayout.for_model(TINY_CONFIG, BLOCK_SIZE, torch.float32)
STAGING_BYTES = 48 * LAYOUT.bytes_per_block
MAX_TOKENS = 6
DECODE_PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# What a prefill server runs: the client's params, one token.
PREFILL_PARAMS = dataclasses.replace(DECODE_PARAMS, max_tokens=1)
# Lengths cover: under one block, exactly one, several with a partial last block, several full.
PROMPT_LENGTHS = [3, 8, 13, 21, 30, 5, 16, 27]
WAIT = 20.0  # deadline of any wait here; only reached when something is broken
MAX_STEPS = 500  # far more than any test needs: an engine that never drains fails fast
REGISTRATION_TIMEOUT = 30.0  # longer than WAIT: a pull that waits it out fails the test


def make_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(length)]


PROMPTS = [make_prompt(n, seed) for seed, n in enumerate(PROMPT_LENGTHS)]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    """Greedy tokens of every prompt from one colocated engine (no connector, no transfer)."""
    llm = LLM("tiny", block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN)
    outputs = llm.generate(PROMPTS, DECODE_PARAMS)
    assert all(len(o.token_ids) == MAX_TOKENS for o in outputs)
    return [o.token_ids for o in outputs]


# ---------------------------------------------------------------- the prefill/decode pair


class ObservedRegistry(TransferRegistry):
    """Tells the test when a pull reaches the prefill side and when it claims its transfer."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.pull_arrived = asyncio.Event()
        self.pull_started = asyncio.Event()

    async def wait_registered(self, request_id: str, token: bytes, timeout: float) -> StagedTransfer:
        self.pull_arrived.set()
        return await super().wait_registered(request_id, token, timeout)

    def start_pull(self, transfer: StagedTransfer, token: bytes) -> asyncio.Event:
        changed = super().start_pull(transfer, token)
        self.pull_started.set()
        return changed


@dataclass
class Pair:
    prefill: LLMEngine
    decode: LLMEngine
    registry: ObservedRegistry
    decode_connector: DecodeKVConnector
    address: str
    load_done: asyncio.Event
    released: set[str] = field(default_factory=set)
    release_event: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, request_id: str, prompt: list[int], token: bytes | None = None) -> bytes:
        """What the prefill and decode servers do for one request: register, then add on both."""
        token = token or secrets.token_bytes(16)
        self.registry.register(request_id, token, len(prompt))
        self.prefill.add_request(prompt, PREFILL_PARAMS, request_id, {TRANSFER_TOKEN: token})
        self.add_decode(request_id, prompt, self.address, token)
        return token

    def add_decode(self, request_id: str, prompt: list[int], address: str, token: bytes) -> None:
        self.decode.add_request(prompt, DECODE_PARAMS, request_id, {REMOTE_ADDRESS: address, TRANSFER_TOKEN: token})

    async def wait_released(self, request_ids: set[str]) -> None:
        """Until staging of every one of `request_ids` went back to the pool."""
        while not request_ids <= self.released:
            self.release_event.clear()
            await asyncio.wait_for(self.release_event.wait(), WAIT)

    def assert_everything_free(self) -> None:
        for engine in (self.prefill, self.decode):
            assert engine.num_free_blocks == engine.num_blocks
            assert engine.scheduler.kv.block_tables == {}
        assert self.registry.pool.bytes_in_use == 0
        assert self.registry.num_transfers == 0


@contextlib.asynccontextmanager
async def pd_pair(kv_load_failure_policy: str = "recompute", registration_timeout: float = REGISTRATION_TIMEOUT) -> AsyncIterator[Pair]:
    loop = asyncio.get_running_loop()
    registry = ObservedRegistry(StagingPool(STAGING_BYTES), LAYOUT)
    # Two blocks per chunk: multi-block prompts stream as several chunks per layer.
    prefill_connector = PrefillKVConnector(registry, chunk_bytes=2 * LAYOUT.bytes_per_block_per_layer)
    load_done = asyncio.Event()
    decode_connector = DecodeKVConnector(LAYOUT, transfer_timeout=WAIT, on_load_done=lambda: loop.call_soon_threadsafe(load_done.set))
    prefill = LLMEngine("tiny", PREFILL_CONFIG, prefill_connector)
    decode = LLMEngine("tiny", dataclasses.replace(DECODE_CONFIG, kv_load_failure_policy=kv_load_failure_policy), decode_connector)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((KVTransferService(registry, registration_timeout).handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    pair = Pair(prefill, decode, registry, decode_connector, f"127.0.0.1:{port}", load_done)

    def on_release(request_id: str) -> None:
        pair.released.add(request_id)
        pair.release_event.set()

    registry.on_release = lambda transfer: loop.call_soon_threadsafe(on_release, transfer.request_id)
    try:
        yield pair
    finally:
        await asyncio.to_thread(decode_connector.shutdown)
        prefill_connector.shutdown()
        await server.stop(None)


async def drive_prefill(pair: Pair, on_finished: Callable[[str], None] | None = None) -> dict[str, RequestOutput]:
    """Step the prefill engine until it has nothing left (its blocks freed after the saves)."""
    engine = pair.prefill
    finished: dict[str, RequestOutput] = {}
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            return finished
        for out in await asyncio.to_thread(engine.step):
            if out.finished:
                finished[out.request_id] = out
                if on_finished is not None:
                    # Between steps, and before the step that frees the request's blocks.
                    on_finished(out.request_id)
    raise AssertionError(f"prefill engine not drained after {MAX_STEPS} steps (blocks held: {engine.scheduler.kv.block_tables})")


async def drive_decode(pair: Pair, on_loaded: Callable[[RequestOutput], None] | None = None) -> dict[str, RequestOutput]:
    """Step the decode engine until it has nothing left; when a step can only wait for
    remote KV and changed nothing, wait for the connector's load-done event."""
    engine = pair.decode
    sched = engine.scheduler
    finished: dict[str, RequestOutput] = {}

    def state() -> tuple[object, ...]:
        return frozenset(sched.waiting_for_remote_kv), frozenset(sched.pending_free), len(sched.waiting), len(sched.running)

    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            return finished
        pair.load_done.clear()
        before = state()
        outputs = await asyncio.to_thread(engine.step)
        for out in outputs:
            if on_loaded is not None and len(out.token_ids) == 1:
                on_loaded(out)
            if out.finished:
                finished[out.request_id] = out
        idle = not sched.waiting and not sched.running and engine.has_unfinished_requests()
        if idle and not outputs and state() == before:
            # A load that completes after this step's get_finished sets the event after the clear.
            await asyncio.wait_for(pair.load_done.wait(), WAIT)
    raise AssertionError(f"decode engine not drained after {MAX_STEPS} steps (blocks held: {engine.scheduler.kv.block_tables})")


def prompt_blocks(engine: LLMEngine, request_id: str, num_tokens: int) -> list[torch.Tensor]:
    """Per layer, a copy of the request's prompt blocks: [2, n, block_size, kv_heads, head_dim]."""
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    block_ids = engine.scheduler.kv.block_tables[request_id][:num_blocks]
    assert len(block_ids) == num_blocks
    index = torch.tensor(block_ids)
    return [cache.index_select(1, index).clone() for cache in engine.kv_caches]


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int32)  # float32 KV: compare bit patterns, not values


def dead_address() -> str:
    """An address where nothing listens (a port the OS just handed out and took back)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"127.0.0.1:{port}"


# ---------------------------------------------------------------- correctness


async def test_concurrent_transfers_equal_a_single_engine_and_blocks_are_bit_identical(reference: list[list[int]]) -> None:
    prefill_kv: dict[str, list[torch.Tensor]] = {}
    decode_kv: dict[str, list[torch.Tensor]] = {}
    lengths = {f"req-{i}": len(p) for i, p in enumerate(PROMPTS)}
    async with pd_pair() as pair:
        for i, prompt in enumerate(PROMPTS):  # all 8 transfers at once
            pair.add(f"req-{i}", prompt)

        def on_prefill_finished(request_id: str) -> None:
            prefill_kv[request_id] = prompt_blocks(pair.prefill, request_id, lengths[request_id])

        def on_decode_loaded(out: RequestOutput) -> None:
            # The load just completed; nothing has run on these blocks yet.
            decode_kv[out.request_id] = prompt_blocks(pair.decode, out.request_id, lengths[out.request_id])

        prefill_out, decode_out = await asyncio.gather(
            drive_prefill(pair, on_prefill_finished), drive_decode(pair, on_decode_loaded)
        )
        await pair.wait_released(set(lengths))
        stats = pair.decode_connector.stats
        assert (stats.num_transfers, stats.num_failed_transfers) == (len(PROMPTS), 0), "a pull failed: output came from a recompute"
        pair.assert_everything_free()

    assert set(prefill_kv) == set(decode_kv) == set(lengths)
    for i in range(len(PROMPTS)):
        rid = f"req-{i}"
        assert decode_out[rid].error is None
        assert decode_out[rid].token_ids == reference[i], f"{rid} ({lengths[rid]} tokens)"
        assert prefill_out[rid].token_ids == reference[i][:1]
        for layer, (sent, received) in enumerate(zip(prefill_kv[rid], decode_kv[rid])):
            assert sent.any(), f"{rid} layer {layer}: the prefill wrote no KV"
            assert torch.equal(bits(sent), bits(received)), f"{rid} layer {layer}: pulled KV differs"


async def test_pull_with_a_wrong_token_is_refused_and_the_transfer_stays_pullable(reference: list[list[int]]) -> None:
    prompt = PROMPTS[4]  # 30 tokens, 4 blocks
    async with pd_pair() as pair:
        token = secrets.token_bytes(16)
        pair.registry.register("r", token, len(prompt))
        pair.prefill.add_request(prompt, PREFILL_PARAMS, "r", {TRANSFER_TOKEN: token})
        await drive_prefill(pair)  # staged and complete

        caches = allocate_kv_caches(LAYOUT, 8, torch.device("cpu"))
        for cache in caches:
            cache.normal_()
        before = [c.clone() for c in caches]
        spec = LoadSpec("r", pair.address, b"not-the-token", block_ids=[7, 1, 3, 5], num_tokens=len(prompt))
        async with grpc.aio.insecure_channel(pair.address) as channel:
            result = await pull_kv(channel, spec, caches, LAYOUT, WAIT, TransferStats())
        assert result.first_token_id is None
        assert result.error is not None and "PERMISSION_DENIED" in result.error
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(before, caches))
        assert pair.registry.pool.bytes_in_use > 0  # still staged

        # The decode worker holding the right token still gets it, and the right output.
        pair.add_decode("r", prompt, pair.address, token)
        out = await drive_decode(pair)
        assert out["r"].token_ids == reference[4]
        assert pair.decode_connector.stats.num_failed_transfers == 0
        await pair.wait_released({"r"})
        pair.assert_everything_free()


@pytest.mark.parametrize("source", ["unknown_request", "dead_address"])
async def test_failed_load_is_recomputed_by_default(source: str, reference: list[list[int]]) -> None:
    prompt = PROMPTS[3]  # 21 tokens, 3 blocks
    async with pd_pair(registration_timeout=0.5) as pair:
        address = pair.address if source == "unknown_request" else dead_address()
        pair.add_decode("never-prefilled", prompt, address, b"token")
        out = await drive_decode(pair)
        assert pair.decode_connector.stats.num_failed_transfers == 1  # the load did fail
        assert out["never-prefilled"].error is None
        assert out["never-prefilled"].token_ids == reference[3]
        pair.assert_everything_free()


@pytest.mark.parametrize("source", ["unknown_request", "dead_address"])
async def test_failed_load_with_policy_fail_ends_the_request_with_an_error(source: str) -> None:
    prompt = PROMPTS[3]
    async with pd_pair("fail", registration_timeout=0.5) as pair:
        address = pair.address if source == "unknown_request" else dead_address()
        pair.add_decode("never-prefilled", prompt, address, b"token")
        out = (await drive_decode(pair))["never-prefilled"]
        assert out.finish_reason == "error" and out.token_ids == []
        assert out.error is not None and "kv_load_failure_policy=fail" in out.error
        pair.assert_everything_free()


async def test_aborting_a_decode_request_while_its_pull_waits_frees_everything() -> None:
    """The pull waits for a prefill that never registers; the abort cancels it long before its deadline."""
    prompt = PROMPTS[2]
    async with pd_pair() as pair:
        pair.add_decode("orphan", prompt, pair.address, b"token")
        pair.decode.step()  # blocks allocated, the pull started
        assert "orphan" in pair.decode.scheduler.waiting_for_remote_kv
        assert pair.decode.num_free_blocks < pair.decode.num_blocks
        assert pair.decode.abort_request("orphan")
        out = await drive_decode(pair)  # fails after WAIT (< the registration timeout) if the pull is not cancelled
        assert out["orphan"].finish_reason == "abort"
        pair.assert_everything_free()


async def test_pull_that_arrives_before_the_prefill_registers_waits_for_it(reference: list[list[int]]) -> None:
    prompt = PROMPTS[4]
    async with pd_pair() as pair:
        token = secrets.token_bytes(16)
        pair.add_decode("r", prompt, pair.address, token)
        decoding = asyncio.ensure_future(drive_decode(pair))
        await asyncio.wait_for(pair.registry.pull_arrived.wait(), WAIT)
        assert pair.registry.get("r") is None  # the decode side is first
        # Now the prefill request reaches its worker.
        pair.registry.register("r", token, len(prompt))
        pair.prefill.add_request(prompt, PREFILL_PARAMS, "r", {TRANSFER_TOKEN: token})
        await drive_prefill(pair)
        out = await asyncio.wait_for(decoding, WAIT)
        assert out["r"].token_ids == reference[4]
        assert pair.decode_connector.stats.num_failed_transfers == 0
        await pair.wait_released({"r"})
        pair.assert_everything_free()


async def test_prefill_aborted_mid_transfer_is_recomputed_on_the_decode_side(reference: list[list[int]]) -> None:
    prompt = PROMPTS[4]  # 30 tokens: two prefill steps of 16
    async with pd_pair() as pair:
        pair.add("r", prompt)
        decoding = asyncio.ensure_future(drive_decode(pair))
        await asyncio.wait_for(pair.registry.pull_started.wait(), WAIT)
        await asyncio.to_thread(pair.prefill.step)  # the first 16 tokens: 2 blocks staged per layer
        assert pair.registry.get("r").chunks  # type: ignore[union-attr]
        assert pair.prefill.abort_request("r")
        prefill_out = await drive_prefill(pair)
        assert prefill_out["r"].finish_reason == "abort"
        out = await asyncio.wait_for(decoding, WAIT)
        assert pair.decode_connector.stats.num_failed_transfers == 1
        assert out["r"].error is None and out["r"].token_ids == reference[4]
        await pair.wait_released({"r"})
        pair.assert_everything_free()


async def test_decode_aborted_mid_transfer_frees_blocks_and_staging() -> None:
    prompt = PROMPTS[4]
    async with pd_pair() as pair:
        pair.add("r", prompt)
        pair.decode.step()  # allocates the blocks and starts the pull
        await asyncio.wait_for(pair.registry.pull_started.wait(), WAIT)
        await asyncio.to_thread(pair.prefill.step)  # part of the prompt is staged and streaming
        assert pair.decode.abort_request("r")
        decode_out, _ = await asyncio.gather(drive_decode(pair), drive_prefill(pair))
        assert decode_out["r"].finish_reason == "abort"
        await pair.wait_released({"r"})
        pair.assert_everything_free()


async def test_remote_first_token_alone_can_finish_the_request(reference: list[list[int]]) -> None:
    prompt = PROMPTS[1]
    async with pd_pair() as pair:
        token = secrets.token_bytes(16)
        pair.registry.register("r", token, len(prompt))
        pair.prefill.add_request(prompt, PREFILL_PARAMS, "r", {TRANSFER_TOKEN: token})
        one_token = dataclasses.replace(DECODE_PARAMS, max_tokens=1)
        pair.decode.add_request(prompt, one_token, "r", {REMOTE_ADDRESS: pair.address, TRANSFER_TOKEN: token})
        _, out = await asyncio.gather(drive_prefill(pair), drive_decode(pair))
        assert out["r"].token_ids == reference[1][:1] and out["r"].finish_reason == "length"
        await pair.wait_released({"r"})
        pair.assert_everything_free()


async def test_pull_with_a_different_kv_layout_is_refused() -> None:
    prompt = PROMPTS[0]
    other = dataclasses.replace(LAYOUT, block_size=4)
    async with pd_pair() as pair:
        token = secrets.token_bytes(16)
        pair.registry.register("r", token, len(prompt))
        caches = allocate_kv_caches(other, 4, torch.device("cpu"))
        spec = LoadSpec("r", pair.address, token, block_ids=[0], num_tokens=len(prompt))
        async with grpc.aio.insecure_channel(pair.address) as channel:
            result = await pull_kv(channel, spec, caches, other, WAIT, TransferStats())
        assert result.error is not None and "FAILED_PRECONDITION" in result.error and "block_size" in result.error
        assert not any(bool(c.any()) for c in caches)
        assert pair.registry.get("r") is not None  # untouched: its own decode worker can still pull it
        pair.registry.fail("r", "test over")
        pair.assert_everything_free()


# ---------------------------------------------------------------- malformed chunks

SMALL = KVCacheLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
LOCAL_BLOCKS = [5, 2]  # the decode side's blocks for the 2-block transfer
FIRST_TOKEN = 9


def good_payload(layer: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + layer)
    return torch.randn(SMALL.blocks_shape(2), generator=gen)


def chunk_frame(request_id: str, layer: int = 0, **overrides: object) -> bytes:
    kwargs: dict[str, object] = dict(
        request_id=request_id,
        layer=layer,
        first_block=0,
        num_blocks=2,
        dtype="float32",
        shape=SMALL.blocks_shape(2),
        payload=wire.tensor_bytes(good_payload(layer)),
    )
    kwargs.update(overrides)
    return wire.encode_chunk(**kwargs)  # type: ignore[arg-type]


def done_frame(request_id: str, num_chunks: int) -> bytes:
    return wire.encode_done(request_id=request_id, first_token_id=FIRST_TOKEN, num_chunks=num_chunks, num_bytes=0, num_tokens=7)


# case -> (the frames the fake prefill sends: one bad chunk, then a done frame; the field the error must name)
MALFORMED: dict[str, tuple[Callable[[str], list[bytes]], str]] = {
    "shape": (lambda rid: [chunk_frame(rid, shape=(2, 2, 4, 2, 4)), done_frame(rid, 1)], "header.shape"),
    "dtype": (lambda rid: [chunk_frame(rid, dtype="float16"), done_frame(rid, 1)], "header.dtype"),
    "block_range": (lambda rid: [chunk_frame(rid, first_block=1), done_frame(rid, 1)], "header.first_block"),
    "checksum": (lambda rid: [chunk_frame(rid, crc32=0x1234), done_frame(rid, 1)], "header.crc32"),
    "request_id": (lambda rid: [chunk_frame("someone-else"), done_frame(rid, 1)], "header.request_id"),
    "layer": (lambda rid: [chunk_frame(rid, layer=SMALL.num_layers), done_frame(rid, 1)], "header.layer"),
    "short_payload": (
        lambda rid: [
            chunk_frame(rid, payload=wire.tensor_bytes(good_payload(0))[: SMALL.bytes_per_block_per_layer]),
            done_frame(rid, 1),
        ],
        "header.num_bytes",
    ),
    "done_before_any_chunk": (lambda rid: [done_frame(rid, 0)], "done: layer 0 is missing blocks"),
}


def tiny_frames(rid: str, num_tokens: int, first_token_id: int) -> list[bytes]:
    """A well-formed transfer in the tiny model's layout (all-zero KV) with the given first token."""
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    payload = wire.tensor_bytes(torch.zeros(LAYOUT.blocks_shape(num_blocks)))
    frames = [
        wire.encode_chunk(
            request_id=rid, layer=layer, first_block=0, num_blocks=num_blocks, dtype="float32",
            shape=LAYOUT.blocks_shape(num_blocks), payload=payload,
        )
        for layer in range(LAYOUT.num_layers)
    ]
    done = wire.encode_done(
        request_id=rid, first_token_id=first_token_id, num_chunks=LAYOUT.num_layers, num_bytes=0, num_tokens=num_tokens
    )
    return [*frames, done]


def fake_frames(request: pb.PullKVRequest) -> list[bytes]:
    rid = request.request_id
    if rid == "out-of-vocab-first-token":
        return tiny_frames(rid, len(PROMPTS[1]), first_token_id=TINY_CONFIG.vocab_size + 1000)
    if rid == "well-formed":
        return [chunk_frame(rid, layer) for layer in range(SMALL.num_layers)] + [done_frame(rid, SMALL.num_layers)]
    make_frames, _ = MALFORMED[rid]
    return make_frames(rid)


@pytest.fixture
async def fake_prefill() -> AsyncIterator[str]:
    """A PullKV server that sends whatever `fake_frames` builds, bytes as they are."""

    async def pull_kv_handler(request_bytes: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        for frame in fake_frames(pb.PullKVRequest.FromString(request_bytes)):
            yield frame

    handler = grpc.method_handlers_generic_handler(
        "kvservice.v1.KVTransfer", {"PullKV": grpc.unary_stream_rpc_method_handler(pull_kv_handler)}
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


async def pull_from(address: str, request_id: str) -> tuple[object, list[torch.Tensor], list[torch.Tensor]]:
    caches = allocate_kv_caches(SMALL, 8, torch.device("cpu"))
    for cache in caches:
        cache.normal_()
    before = [c.clone() for c in caches]
    spec = LoadSpec(request_id, address, b"token", block_ids=LOCAL_BLOCKS, num_tokens=7)
    async with grpc.aio.insecure_channel(address) as channel:
        result = await pull_kv(channel, spec, caches, SMALL, WAIT, TransferStats())
    return result, before, caches


async def test_fake_prefill_well_formed_stream_is_accepted(fake_prefill: str) -> None:
    """The control for the malformed cases: the same frames, unbroken, land in the right blocks."""
    result, before, caches = await pull_from(fake_prefill, "well-formed")
    assert result.error is None and result.first_token_id == FIRST_TOKEN  # type: ignore[attr-defined]
    others = [b for b in range(8) if b not in LOCAL_BLOCKS]
    for layer in range(SMALL.num_layers):
        assert torch.equal(caches[layer][:, LOCAL_BLOCKS], good_payload(layer))
        assert torch.equal(caches[layer][:, others], before[layer][:, others])


@pytest.mark.parametrize("case", sorted(MALFORMED))
async def test_malformed_chunk_is_rejected_without_touching_the_cache(case: str, fake_prefill: str) -> None:
    result, before, caches = await pull_from(fake_prefill, case)
    _, field_name = MALFORMED[case]
    assert result.first_token_id is None  # type: ignore[attr-defined]
    error = result.error  # type: ignore[attr-defined]
    assert error is not None and "rejected a chunk" in error and field_name in error, error
    assert fake_prefill in error  # names the peer
    for layer in range(SMALL.num_layers):
        assert torch.equal(bits(caches[layer]), bits(before[layer])), f"layer {layer} was written"


async def test_first_token_outside_the_vocabulary_is_a_failed_load(fake_prefill: str, reference: list[list[int]]) -> None:
    """A peer's done frame names a token the model does not have: the decode engine must treat
    the load as failed (and recompute), never feed the id to the model or to the client."""
    async with pd_pair() as pair:
        pair.add_decode("out-of-vocab-first-token", PROMPTS[1], fake_prefill, b"token")
        out = (await drive_decode(pair))["out-of-vocab-first-token"]
        assert all(0 <= t < TINY_CONFIG.vocab_size for t in out.token_ids), out.token_ids
        assert out.error is None and out.token_ids == reference[1]
        pair.assert_everything_free()


# ---------------------------------------------------------------- per-peer pull slots


class _Peer:
    """A fake prefill worker: its PullKV either never answers (black-holed) or ends at once
    NOT_FOUND (healthy, but the transfer is gone: the decode side recomputes)."""

    def __init__(self, is_black_hole: bool) -> None:
        self.is_black_hole = is_black_hole
        self.num_pulls = 0
        self.pulled = asyncio.Event()
        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "kvservice.v1.KVTransfer", {"PullKV": grpc.unary_stream_rpc_method_handler(self.pull)}
        )])
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"

    async def pull(self, request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        self.num_pulls += 1
        self.pulled.set()
        if self.is_black_hole:
            await asyncio.Event().wait()
        await context.abort(grpc.StatusCode.NOT_FOUND, "no such transfer")
        yield b""


async def test_a_dead_peer_holds_up_neither_other_peers_nor_its_own_deadlines() -> None:
    """One pull slot per peer, all held by a black-holed prefill worker: a pull from a
    healthy one starts at once, and a second pull from the dead one ends at its own
    deadline, counted from its start (the wait for the slot included)."""
    from kvservice.async_engine import AsyncLLMEngine  # the engine thread drives the loads

    timeout = 3.0
    dead, healthy = _Peer(is_black_hole=True), _Peer(is_black_hole=False)
    await dead.server.start()
    await healthy.server.start()
    connector = DecodeKVConnector(LAYOUT, transfer_timeout=timeout, max_concurrent_pulls=1)
    engine = AsyncLLMEngine(LLMEngine("tiny", DECODE_CONFIG, connector))
    connector.on_load_done = engine.wake
    engine.start()

    async def finish(request_id: str, peer: _Peer) -> float:
        started = loop.time()
        kv = {REMOTE_ADDRESS: peer.address, TRANSFER_TOKEN: secrets.token_bytes(16)}
        async for out in engine.generate(PROMPTS[2], DECODE_PARAMS, request_id, kv):
            if out.finished:
                assert len(out.token_ids) == MAX_TOKENS  # recomputed after the failed load
        return loop.time() - started

    loop = asyncio.get_running_loop()
    try:
        first_dead = asyncio.create_task(finish("dead-1", dead))
        await asyncio.wait_for(dead.pulled.wait(), WAIT)  # it holds the dead peer's only slot
        second_dead = asyncio.create_task(finish("dead-2", dead))
        assert await asyncio.wait_for(finish("healthy", healthy), WAIT) < timeout / 2
        assert healthy.num_pulls == 1
        await asyncio.wait_for(first_dead, WAIT)
        # It waited for the slot until the first gave it up, then had what was left.
        assert await asyncio.wait_for(second_dead, WAIT) < timeout * 1.5
    finally:
        await engine.stop()
        connector.shutdown()
        await dead.server.stop(None)
        await healthy.server.stop(None)
