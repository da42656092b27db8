"""`kvservice chat`: an interactive chat in the terminal over the gRPC API.

Each turn sends the whole conversation so far as a chat prompt; the server renders it
with the model's own chat template, and the answer streams back as it is generated.
An empty line is ignored; Ctrl-D (end of input) or Ctrl-C at the prompt quits.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import TextIO

import grpc

from kvservice.client.client import KVServiceClient
from kvservice.runtime.tls import TLSFiles, add_tls_arguments

PROMPT = "you> "


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, metavar="HOST:PORT", help="the proxy or a colocated worker")
    parser.add_argument("--system", default=None, metavar="TEXT", help="a system message that opens the conversation")
    parser.add_argument("--max-tokens", type=int, default=512, help="most tokens per answer (default: 512)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (default: off)")
    parser.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    parser.add_argument("--timeout", type=float, default=None, help="deadline of one answer in seconds")
    add_tls_arguments(parser)


def main(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(chat(args, sys.stdin, sys.stdout))
    except KeyboardInterrupt:
        print()
        return 0


async def chat(args: argparse.Namespace, stdin: TextIO, stdout: TextIO) -> int:
    """The conversation loop; returns the exit code (0 at end of input, 1 after a server error)."""
    history: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    credentials = TLSFiles.from_args(args).channel_credentials()
    async with KVServiceClient(args.target, credentials, args.auth_token) as client:
        while True:
            stdout.write(PROMPT)
            stdout.flush()
            line = await asyncio.to_thread(stdin.readline)
            if not line:  # Ctrl-D
                stdout.write("\n")
                return 0
            if not line.strip():
                continue
            history.append({"role": "user", "content": line.rstrip("\n")})
            answer = ""
            try:
                async for chunk in client.generate(
                    history,
                    timeout=args.timeout,
                    max_tokens=args.max_tokens,
                    temperature=args.temperature,
                    top_p=args.top_p,
                    seed=args.seed,
                ):
                    answer += chunk.text
                    stdout.write(chunk.text)
                    stdout.flush()
            except grpc.aio.AioRpcError as e:
                print(f"\nkvservice chat: {e.code().name}: {e.details()}", file=sys.stderr)
                return 1
            stdout.write("\n")
            history.append({"role": "assistant", "content": answer})
