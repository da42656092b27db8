"""The `kvservice` command line: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvservice",
        description="Disaggregated prefill/decode LLM serving: prefill workers stream the KV cache over gRPC to decode workers.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser("demo", help="the main job: run the tiny model and report what it did")
    from kvservice import demo as demo_module

    demo_module.add_arguments(demo)
    demo.set_defaults(run=demo_module.main)

    bench = commands.add_parser("bench", help="benchmarks (engine, transfer, serve, compare)")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    engine = bench_commands.add_parser(
        "engine", help="prefill and decode tokens/s at batch 1 and 16, side by side with transformers' generate"
    )
    from kvservice.bench import engine as bench_engine

    bench_engine.add_arguments(engine)
    engine.set_defaults(run=bench_engine.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
