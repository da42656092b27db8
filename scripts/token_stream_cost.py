"""CPU a streamed token costs on each side of the proxy's link to a decode worker.

    .venv/bin/python scripts/token_stream_cost.py [--requests 16] [--step-ms 20] [--steps 400]

A server process stands in for a decode worker: a thread (as the engine's step thread) hands
one token per request to the event loop every `--step-ms`, and the tokens go to a client
process (the proxy) either as one `Decode` call per request, a message per token, or on one
`DecodeStream`, a message per step. Prints each side's CPU per token (from /proc) for both.
Nothing here is kvservice's serving code but the wire messages: it measures gRPC's asyncio
API under the pacing of decode steps, which back-to-back messages would hide.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import threading
import time
from collections.abc import AsyncIterator

import grpc

from kvservice.v1 import kvservice_pb2 as pb
from kvservice.v1 import kvservice_pb2_grpc as pb_grpc


class _Steps:
    """A thread that hands each step's tokens to the event loop, as the engine does."""

    def __init__(self, loop: asyncio.AbstractEventLoop, num_steps: int, step_s: float) -> None:
        self.loop, self.num_steps, self.step_s = loop, num_steps, step_s

    def start(self, deliver: object) -> None:
        def run() -> None:
            for step in range(self.num_steps):
                time.sleep(self.step_s)  # the step's compute, off the event loop
                self.loop.call_soon_threadsafe(deliver, step)  # type: ignore[arg-type]
            self.loop.call_soon_threadsafe(deliver, None)  # type: ignore[arg-type]

        threading.Thread(target=run, daemon=True).start()


class _Worker(pb_grpc.WorkerServicer):
    def __init__(self, num_requests: int, num_steps: int, step_s: float) -> None:
        self.num_requests, self.num_steps, self.step_s = num_requests, num_steps, step_s
        self.queues: dict[str, asyncio.Queue[int | None]] = {}

    async def Decode(
        self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        request_id = request.request.request_id
        queue = self.queues[request_id] = asyncio.Queue()
        if len(self.queues) == self.num_requests:
            _Steps(asyncio.get_running_loop(), self.num_steps, self.step_s).start(
                lambda step: [q.put_nowait(step) for q in self.queues.values()]
            )
        while (token := await queue.get()) is not None:
            yield pb.GenerateResponse(request_id=request_id, token_ids=[token], text="abc")

    async def DecodeStream(
        self, requests: AsyncIterator[pb.DecodeStreamRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.DecodeStreamBatch]:
        await context.send_initial_metadata(())
        ids = [message.start.request.request_id async for message in requests]
        steps: asyncio.Queue[int | None] = asyncio.Queue()
        _Steps(asyncio.get_running_loop(), self.num_steps, self.step_s).start(steps.put_nowait)
        while (token := await steps.get()) is not None:
            batch = pb.DecodeStreamBatch()
            for request_id in ids:
                batch.events.add(
                    request_id=request_id,
                    response=pb.GenerateResponse(request_id=request_id, token_ids=[token], text="abc"),
                )
            yield batch


def _serve(args: argparse.Namespace, ports: mp.Queue) -> None:  # type: ignore[type-arg]
    async def main() -> None:
        server = grpc.aio.server()
        pb_grpc.add_WorkerServicer_to_server(_Worker(args.requests, args.steps, args.step_ms / 1e3), server)
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


def _cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _client(port: int, server_pid: int, args: argparse.Namespace, batched: bool) -> tuple[int, float, float]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await channel.channel_ready()
        stub = pb_grpc.WorkerStub(channel)
        client0, server0 = _cpu_s(os.getpid()), _cpu_s(server_pid)
        requests = [pb.DecodeRequest(request=pb.GenerateRequest(request_id=f"r{i}")) for i in range(args.requests)]
        if batched:
            queues = {r.request.request_id: asyncio.Queue[int | None]() for r in requests}

            async def consume(queue: asyncio.Queue[int | None]) -> int:
                count = 0
                while await queue.get() is not None:
                    count += 1
                return count

            consumers = [asyncio.create_task(consume(q)) for q in queues.values()]
            async for batch in stub.DecodeStream(iter(pb.DecodeStreamRequest(start=r) for r in requests)):
                for event in batch.events:
                    queues[event.request_id].put_nowait(event.response.token_ids[0])
            for queue in queues.values():
                queue.put_nowait(None)
            num_tokens = sum(await asyncio.gather(*consumers))
        else:

            async def one(request: pb.DecodeRequest) -> int:
                return sum([len(response.token_ids) async for response in stub.Decode(request)])

            num_tokens = sum(await asyncio.gather(*(one(r) for r in requests)))
        return num_tokens, _cpu_s(os.getpid()) - client0, _cpu_s(server_pid) - server0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16, help="requests decoding together (default: 16)")
    parser.add_argument(
        "--step-ms", type=float, default=20.0, help="time from one decode step to the next (default: 20)"
    )
    parser.add_argument("--steps", type=int, default=400, help="steps, a token per request each (default: 400)")
    args = parser.parse_args()
    for batched in (False, True, False, True):
        ports: mp.Queue = mp.Queue()  # type: ignore[type-arg]
        server = mp.Process(target=_serve, args=(args, ports), daemon=True)
        server.start()
        try:
            num_tokens, client_s, server_s = asyncio.run(_client(ports.get(timeout=30), server.pid or 0, args, batched))
        finally:
            server.terminate()
            server.join()
        how = "one DecodeStream, a message a step" if batched else "a Decode call per request, a message a token"
        print(
            f"{how:46s}: {num_tokens} tokens; proxy side {client_s / num_tokens * 1e6:5.1f} us/token, "
            f"decode side {server_s / num_tokens * 1e6:5.1f} us/token"
        )


if __name__ == "__main__":
    main()
