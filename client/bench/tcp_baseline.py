"""The raw TCP baseline of `kvservice bench transfer`: a tensor's bytes over loopback.

Two spawned processes: a receiver binds 127.0.0.1 port 0 and reports the port through a
pipe; a sender `sendall`s a source tensor's bytes in fixed chunks; the receiver
`recv_into`s them straight into a preallocated destination tensor. Time runs on the
receiver from the first byte to the last. Both sides checksum their tensor (outside the
timed part) so a run that delivered garbage fails instead of reporting a number.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import resource
import socket
import time
import zlib
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

MiB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class TransferResult:
    """One measured transfer; `gb_per_s` is decimal GB (1e9 bytes) per second."""

    num_bytes: int
    seconds: float
    gb_per_s: float
    sender_peak_rss_bytes: int
    receiver_peak_rss_bytes: int


def pin(process: mp.process.BaseProcess, core: int | None) -> None:
    """Pin a started child process to one core (the two ends of a transfer on different cores)."""
    if core is not None and process.pid is not None:
        os.sched_setaffinity(process.pid, {core})


def peak_rss_bytes() -> int:
    """This process's own peak RSS (VmHWM). Not getrusage's ru_maxrss: Linux carries that
    over from the parent at fork, so a child spawned by a big parent reports the parent's."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` (all its threads), from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # past the command name, which may hold spaces
    # Fields 14 and 15 of stat (utime, stime) are the 12th and 13th after the name.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _byte_view(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _receiver(conn: Connection, num_bytes: int, chunk_bytes: int, num_threads: int, timeout_s: float) -> None:
    try:
        torch.set_num_threads(num_threads)
        dst = torch.zeros(num_bytes, dtype=torch.uint8)  # zeroed: pages faulted in before timing
        view = _byte_view(dst)
        with socket.create_server(("127.0.0.1", 0)) as server:
            server.settimeout(timeout_s)
            conn.send(("port", server.getsockname()[1]))
            sock, _ = server.accept()
        with sock:
            sock.settimeout(timeout_s)
            received = sock.recv_into(view[:chunk_bytes])
            start = time.perf_counter()  # the first byte has arrived
            while 0 < received < num_bytes:
                n = sock.recv_into(view[received : received + chunk_bytes])
                if n == 0:
                    break
                received += n
            seconds = time.perf_counter() - start
        if received != num_bytes:
            raise ConnectionError(f"received {received} of {num_bytes} bytes")
        conn.send(("done", seconds, zlib.crc32(view), peak_rss_bytes()))
    except BaseException as exc:
        conn.send(("error", f"receiver: {exc!r}"))
        raise


def _sender(
    conn: Connection,
    port: int,
    num_bytes: int,
    chunk_bytes: int,
    num_threads: int,
    timeout_s: float,
    seed: int,
) -> None:
    try:
        torch.set_num_threads(num_threads)
        gen = torch.Generator().manual_seed(seed)
        src = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=gen)
        view = _byte_view(src)
        checksum = zlib.crc32(view)
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
            for offset in range(0, num_bytes, chunk_bytes):
                sock.sendall(view[offset : offset + chunk_bytes])
            sock.shutdown(socket.SHUT_WR)
            sock.recv(1)  # wait for the receiver to close: every byte was read
        conn.send(("done", checksum, peak_rss_bytes()))
    except BaseException as exc:
        conn.send(("error", f"sender: {exc!r}"))
        raise


def expect_reply(conn: Connection, timeout_s: float, what: str, baseline: str = "tcp baseline") -> tuple[Any, ...]:
    """A baseline child's next ("tag", *values) message, its values; its ("error", text) raised."""
    if not conn.poll(timeout_s):
        raise TimeoutError(f"{baseline}: no {what} within {timeout_s} s")
    message = conn.recv()
    if message[0] == "error":
        raise RuntimeError(f"{baseline} failed in the {message[1]}")
    return message[1:]


def close_children(conns: list[Connection], processes: list[mp.process.BaseProcess | None]) -> None:
    """Close the pipes, then reap each started child: 5 s to exit, then SIGKILL."""
    for conn in conns:
        conn.close()
    for process in processes:
        if process is not None and process.pid is not None:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()


def tcp_transfer(
    num_bytes: int,
    *,
    chunk_bytes: int = MiB,
    num_threads: int = 1,
    timeout_s: float = 120.0,
    seed: int = 0,
    cores: tuple[int, int] | None = None,
) -> TransferResult:
    """Ship `num_bytes` of a source tensor to a destination tensor in another process.

    Raises RuntimeError when the destination's checksum differs from the source's and
    TimeoutError when a side does not report within `timeout_s`. `num_threads` is each
    process's torch thread count (1 by default: spinning OpenMP threads starve I/O).
    `cores`: pin the sender to the first core and the receiver to the second.
    """
    if num_bytes <= 0 or chunk_bytes <= 0:
        raise ValueError(f"num_bytes and chunk_bytes must be positive: {num_bytes}, {chunk_bytes}")
    ctx = mp.get_context("spawn")
    recv_conn, recv_child = ctx.Pipe(duplex=False)
    send_conn, send_child = ctx.Pipe(duplex=False)
    receiver = ctx.Process(
        target=_receiver,
        args=(recv_child, num_bytes, chunk_bytes, num_threads, timeout_s),
        daemon=True,
    )
    sender: mp.process.BaseProcess | None = None
    try:
        receiver.start()
        pin(receiver, cores[1] if cores else None)
        (port,) = expect_reply(recv_conn, timeout_s, "port from the receiver")
        sender = ctx.Process(
            target=_sender,
            args=(send_child, port, num_bytes, chunk_bytes, num_threads, timeout_s, seed),
            daemon=True,
        )
        sender.start()
        pin(sender, cores[0] if cores else None)
        seconds, received_crc, receiver_rss = expect_reply(recv_conn, timeout_s, "receiver's result")
        sent_crc, sender_rss = expect_reply(send_conn, timeout_s, "result from the sender")
    finally:
        close_children([recv_conn, recv_child, send_conn, send_child], [receiver, sender])
    if received_crc != sent_crc:
        raise RuntimeError(f"tcp baseline: destination crc32 {received_crc:#010x} != source {sent_crc:#010x}")
    return TransferResult(
        num_bytes=num_bytes,
        seconds=seconds,
        gb_per_s=num_bytes / seconds / 1e9,
        sender_peak_rss_bytes=sender_rss,
        receiver_peak_rss_bytes=receiver_rss,
    )
