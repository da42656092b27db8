"""The four servers of `bench peers`: the command each is started with, and one running at a time.

Each serves SmolLM2-135M-Instruct under the name `smollm2` on an OpenAI-compatible HTTP port on
127.0.0.1, with the machine's cores (the ones this process may use) for its compute:

- kvservice colocated: `kvservice serve --role both --http-port P` (the environment `kvservice
  launch` gives its workers, `WORKER_ENV`);
- kvservice 1P1D: `kvservice launch --http-port P` (1 prefill + 1 decode worker + proxy);
- llama.cpp: `llama-server -m GGUF -np 16` (16 slots: the loaded level's concurrency);
- vLLM: `vllm serve HF_DIR --dtype float32` (its bfloat16 gave wrong text on this CPU), with
  its OpenMP threads bound to every core (its default on 2 cores reserves one for the front end:
  set VLLM_CPU_OMP_THREADS_BIND / VLLM_CPU_KVCACHE_SPACE to override).

`PeerServer` starts one in a session of its own (its log in a file), times it from the spawn
until `/health` and `/v1/models` both answer 200, and stops its whole process group on exit.
Both: a proxy's HTTP front lists its model before its first health check has found a decode
worker, and a request sent then gets 503 (`/health` says 503 until it serves; llama.cpp's and
vLLM's say so while their model loads).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from kvservice.client.bench.peer_install import PeerPaths
from kvservice.client.bench.peer_table import KVSERVICE_1P1D, KVSERVICE_COLOCATED, LLAMA_CPP, LOADED, VLLM
from kvservice.client.cluster import die_with_parent
from kvservice.runtime.process_env import WORKER_ENV

SERVED_MODEL_NAME = "smollm2"
HOST = "127.0.0.1"
_READY_POLL_SECONDS = 0.1  # the start-up time's resolution: a readiness probe, no synchronisation
_LOG_TAIL_BYTES = 2000


class ServerStartError(RuntimeError):
    """A server exited or stayed unready; the message ends with the tail of its log."""


@dataclass(frozen=True, slots=True)
class ServerSpec:
    """How to start one server: its argv, the environment it adds, and its HTTP port."""

    name: str
    argv: tuple[str, ...]
    port: int
    env: dict[str, str] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"


def free_port() -> int:
    """A port nothing listens on now (the OS's pick; the server binds it a moment later)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _kvservice() -> list[str]:
    """The console script users type, next to this Python; `python -m kvservice` without one."""
    script = Path(sys.executable).with_name("kvservice")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "kvservice"]


def server_spec(
    name: str,
    port: int,
    paths: PeerPaths,
    gguf: Path,
    *,
    max_model_len: int,
    num_threads: int,
    cores: list[int],
    kvservice_args: Sequence[str] = (),
) -> ServerSpec:
    """The command of server `name` on HTTP `port`; `max_model_len` covers one request's prompt + output;
    `kvservice_args`: flags added to both kvservice commands (e.g. `--kv-cache-dtype bfloat16`)."""
    if name == KVSERVICE_COLOCATED:
        argv = [
            *_kvservice(),
            "serve",
            "--role",
            "both",
            "--model",
            SERVED_MODEL_NAME,
            "--port",
            "0",
            "--http-port",
            str(port),
            *kvservice_args,
        ]
        return ServerSpec(name, tuple(argv), port, dict(WORKER_ENV))
    if name == KVSERVICE_1P1D:
        argv = [*_kvservice(), "launch", "--model", SERVED_MODEL_NAME, "--port", "0", "--http-port", str(port)]
        return ServerSpec(name, (*argv, *kvservice_args), port)
    if name == LLAMA_CPP:
        argv = [
            str(paths.llama_server),
            "-m",
            str(gguf),
            "-np",
            str(LOADED),
            "-c",
            str(LOADED * max_model_len),
            "-t",
            str(num_threads),
            "--host",
            HOST,
            "--port",
            str(port),
            "--alias",
            SERVED_MODEL_NAME,
        ]
        return ServerSpec(name, tuple(argv), port)
    if name == VLLM:
        argv = [
            str(paths.vllm),
            "serve",
            str(paths.hf_model),
            "--dtype",
            "float32",
            "--host",
            HOST,
            "--port",
            str(port),
            "--max-model-len",
            str(max_model_len),
            "--served-model-name",
            SERVED_MODEL_NAME,
        ]
        env = {
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"),  # GiB
            "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores))),
        }
        return ServerSpec(name, tuple(argv), port, env)
    raise ValueError(f"unknown server {name!r}")


class PeerServer:
    """One server process: `async with PeerServer(spec, log) as server:` starts it and waits
    until `/health` and `/v1/models` answer 200 (`startup_s` is how long that took); leaving stops it."""

    def __init__(self, spec: ServerSpec, log: Path, ready_timeout: float, grace_period: float = 30.0) -> None:
        self.spec, self.log, self.ready_timeout, self.grace_period = spec, log, ready_timeout, grace_period
        self.process: asyncio.subprocess.Process | None = None
        self.startup_s = 0.0

    async def __aenter__(self) -> PeerServer:
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        parent = os.getpid()
        with self.log.open("wb") as out:
            started = time.perf_counter()
            self.process = await asyncio.create_subprocess_exec(
                *self.spec.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                env={**os.environ, **self.spec.env},
                start_new_session=True,
                preexec_fn=lambda: die_with_parent(parent),
            )
        deadline = started + self.ready_timeout
        exited = asyncio.create_task(self.process.wait())
        try:
            async with aiohttp.ClientSession() as session:
                while not all([await _answers(session, self.spec.base_url + path) for path in _READY_PATHS]):
                    if exited.done():
                        raise ServerStartError(
                            f"exited with code {exited.result()} before it was ready; {self._log_tail()}"
                        )
                    if time.perf_counter() > deadline:
                        raise ServerStartError(f"not ready within {self.ready_timeout:.0f} s; {self._log_tail()}")
                    await asyncio.wait({exited}, timeout=_READY_POLL_SECONDS)  # woken early when it exits
            self.startup_s = time.perf_counter() - started
        finally:
            exited.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await exited

    async def stop(self) -> None:
        """SIGTERM the process group (vLLM's engine processes are in it), SIGKILL what outlives the grace period."""
        process, self.process = self.process, None
        if process is None:
            return
        group = process.pid  # start_new_session: the child leads its own group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), self.grace_period)
            deadline = time.monotonic() + self.grace_period
            while _group_alive(group) and time.monotonic() < deadline:
                await asyncio.sleep(_READY_POLL_SECONDS)  # no event tells when a group's last member exits
        except TimeoutError:
            pass
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
            await process.wait()

    def _log_tail(self) -> str:
        data = self.log.read_bytes()[-_LOG_TAIL_BYTES:].decode(errors="replace")
        return f"the end of {self.log}:\n{data}"


_READY_PATHS = ("/health", "/v1/models")


async def _answers(session: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=2.0)) as response:
            return response.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True
