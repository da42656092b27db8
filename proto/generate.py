"""Generate the Python gRPC stubs from proto/ (the one command: `make proto`).

Compiled with `-I proto`, so `proto/kvservice/v1/x.proto` becomes the module
`kvservice.v1.x_pb2` and the stubs' imports are right as generated.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from grpc_tools import protoc

PROTO_ROOT = pathlib.Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Compile every .proto under proto/ into out_dir; returns the generated files."""
    protos = sorted(PROTO_ROOT.rglob("*.proto"))
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(p) for p in protos),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    return [out_dir / name for name in expected_outputs(protos)]


def expected_outputs(protos: list[pathlib.Path]) -> list[pathlib.Path]:
    """The stub files protoc writes for these protos, relative to the output root."""
    outputs = []
    for proto in protos:
        stem = proto.relative_to(PROTO_ROOT).with_suffix("")
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            outputs.append(stem.with_name(stem.name + suffix))
    return outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, default=REPO_ROOT, help="output root (default: the repo)")
    args = parser.parse_args()
    for path in generate(args.out):
        print(path.relative_to(args.out))


if __name__ == "__main__":
    sys.exit(main())
