"""The in-process prefill/decode pair the connector tests share: two `LLMEngine`s on the
`tiny` model with their connectors, a PullKV server on the test's event loop, and the
helpers that step them by hand so a test can look at both KV caches between steps."""

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
from kvservice.connector.base import REMOTE_ADDRESS, TRANSFER_TOKEN
from kvservice.connector.decode_connector import DecodeKVConnector
from kvservice.connector.kv_transfer_service import KVTransferService
from kvservice.connector.offload_tier import OffloadTier
from kvservice.connector.prefill_connector import PrefillKVConnector
from kvservice.connector.staging import StagingPool
from kvservice.connector.transfer_registry import StagedTransfer, TransferRegistry
from kvservice.core.kv_cache_manager import cdiv
from kvservice.core.sampling_params import SamplingParams
from kvservice.engine.engine import LLMEngine, RequestOutput
from kvservice.engine.engine_builder import build_engine, kv_transfer_layout
from kvservice.engine.llm import LLM
from kvservice.loading.model_files import TINY_CONFIG
from kvservice.model.kv_cache import KVCacheLayout

BLOCK_SIZE = 8
NUM_BLOCKS = 64
MAX_MODEL_LEN = 256
# The prefill engine runs prompts in chunks of 16 tokens: long prompts stage over several steps.
PREFILL_CONFIG = EngineConfig(
    block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=16
)
DECODE_CONFIG = EngineConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN)
LAYOUT = KVCacheLayout.for_model(TINY_CONFIG, BLOCK_SIZE, torch.float32)
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
        self.first_blocks: dict[str, int] = {}  # per request: the first block its pull asked for

    async def wait_registered(self, request_id: str, token: bytes, timeout: float) -> StagedTransfer:
        self.pull_arrived.set()
        return await super().wait_registered(request_id, token, timeout)

    def start_pull(self, transfer: StagedTransfer, token: bytes, first_block: int = 0) -> asyncio.Event:
        changed = super().start_pull(transfer, token, first_block)
        self.first_blocks[transfer.request_id] = first_block
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
    server: grpc.aio.Server  # the prefill side's PullKV server (stop it: the prefill worker died)
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
            assert engine.core.scheduler.kv.block_tables == {}
        assert self.registry.pool.bytes_in_use == 0
        assert self.registry.num_transfers == 0


def with_draft(config: EngineConfig, draft_model: str | None) -> EngineConfig:
    """`config` with a speculative draft model (3 tokens a step), or as it is for None."""
    if draft_model is None:
        return config
    return dataclasses.replace(config, draft_model=draft_model, num_speculative_tokens=3)


@contextlib.asynccontextmanager
async def pd_pair(
    kv_load_failure_policy: str = "recompute",
    registration_timeout: float = REGISTRATION_TIMEOUT,
    use_shared_memory: bool = False,
    prefill_draft: str | None = None,
    decode_draft: str | None = None,
    service: type[KVTransferService] = KVTransferService,
    kv_cache_dtypes: tuple[str, str] = ("auto", "auto"),
    decode_num_blocks: int = NUM_BLOCKS,
    decode_tier: OffloadTier | None = None,
) -> AsyncIterator[Pair]:
    """A prefill and a decode engine over a real PullKV server; `use_shared_memory`: the
    decode side offers the same-host segment (--kv-transfer-shm); `prefill_draft`,
    `decode_draft`: each side's speculative draft model (its KV travels where they match);
    `service`: the PullKV service the prefill side runs (a test's faulty one); `kv_cache_dtypes`: the
    prefill and the decode side's --kv-cache-dtype; `decode_num_blocks`, `decode_tier`: the decode
    side's KV cache size and offload tier."""
    loop = asyncio.get_running_loop()
    prefill_config = with_draft(dataclasses.replace(PREFILL_CONFIG, kv_cache_dtype=kv_cache_dtypes[0]), prefill_draft)
    decode_config = with_draft(
        dataclasses.replace(
            DECODE_CONFIG,
            kv_load_failure_policy=kv_load_failure_policy,
            kv_cache_dtype=kv_cache_dtypes[1],
            num_blocks=decode_num_blocks,
        ),
        decode_draft,
    )
    prefill_layout = kv_transfer_layout("tiny", prefill_config)
    registry = ObservedRegistry(StagingPool(48 * prefill_layout.bytes_per_block), prefill_layout)
    # Two blocks per chunk: multi-block prompts stream as several chunks per layer.
    prefill_connector = PrefillKVConnector(registry, chunk_bytes=2 * LAYOUT.bytes_per_block_per_layer)
    load_done = asyncio.Event()
    decode_connector = DecodeKVConnector(
        kv_transfer_layout("tiny", decode_config),
        transfer_timeout=WAIT,
        on_load_done=lambda: loop.call_soon_threadsafe(load_done.set),
        use_shared_memory=use_shared_memory,
    )
    prefill = build_engine("tiny", prefill_config, prefill_connector)
    decode = build_engine("tiny", decode_config, decode_connector, kv_tier=decode_tier)
    if decode_tier is not None:  # a read back from the tier wakes drive_decode as a pull's end does
        decode_tier.on_load_done = lambda: loop.call_soon_threadsafe(load_done.set)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((service(registry, registration_timeout).handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    pair = Pair(prefill, decode, registry, decode_connector, f"127.0.0.1:{port}", load_done, server)

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
    raise AssertionError(
        f"prefill engine not drained after {MAX_STEPS} steps (blocks held: {engine.core.scheduler.kv.block_tables})"
    )


async def drive_decode(
    pair: Pair, on_loaded: Callable[[RequestOutput], None] | None = None
) -> dict[str, RequestOutput]:
    """Step the decode engine until it has nothing left; when a step can only wait for
    remote KV and changed nothing, wait for the connector's load-done event."""
    engine = pair.decode
    sched = engine.core.scheduler
    finished: dict[str, RequestOutput] = {}

    def state() -> tuple[object, ...]:
        return (
            frozenset(sched.waiting_for_remote_kv),
            frozenset(sched.pending_free),
            len(sched.waiting),
            len(sched.running),
        )

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
    raise AssertionError(
        f"decode engine not drained after {MAX_STEPS} steps (blocks held: {engine.core.scheduler.kv.block_tables})"
    )


def prompt_blocks(engine: LLMEngine, request_id: str, num_tokens: int) -> list[torch.Tensor]:
    """Per layer, a copy of the request's prompt blocks: [2, n, block_size, kv_heads, head_dim]."""
    num_blocks = cdiv(num_tokens, BLOCK_SIZE)
    block_ids = engine.core.scheduler.kv.block_tables[request_id][:num_blocks]
    assert len(block_ids) == num_blocks
    index = torch.tensor(block_ids)
    return [cache.index_select(1, index).clone() for cache in engine.core.kv_caches]


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int32)  # float32 KV: compare bit patterns, not values


def dead_address() -> str:
    """An address where nothing listens (a port the OS just handed out and took back)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"127.0.0.1:{port}"


class Relay:
    """A TCP relay on 127.0.0.1 in front of `target` (HOST:PORT): the decode side dials `address`;
    `cut()` resets every connection through it, as a dropped stream does."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.address = ""
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._is_closing = False

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)  # owned: `close` resets its connections and awaits it
        try:
            host, port = self.target.rsplit(":", 1)
            upstream_reader, upstream_writer = await asyncio.open_connection(host, int(port))
            self._writers += [writer, upstream_writer]
            if self._is_closing:
                self.cut()
            await asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer), return_exceptions=True)
        except OSError:
            pass  # the target is gone: the client sees its connection reset
        finally:
            self._tasks.discard(task)
            writer.transport.abort()

    def cut(self) -> None:
        """Reset every connection now (RST, no FIN): both ends see the stream die."""
        for writer in self._writers:
            writer.transport.abort()
        self._writers.clear()

    async def close(self) -> None:
        """Stop accepting, reset every connection, and wait for the relaying tasks to end."""
        self._is_closing = True
        if self._server is not None:
            self._server.close()
        self.cut()  # every pipe then reads EOF and ends
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(1 << 16):
        writer.write(data)
        await writer.drain()
    writer.transport.abort()


@contextlib.asynccontextmanager
async def relay(target: str) -> AsyncIterator[Relay]:
    """A started Relay in front of `target`, closed at the end."""
    r = Relay(target)
    await r.start()
    try:
        yield r
    finally:
        await r.close()
