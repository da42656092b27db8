"""The committed gRPC stubs are exactly what `make proto` generates from proto/."""

from __future__ import annotations

import pathlib
import types

from conftest import REPO, load_repo_module


def _generator() -> types.ModuleType:
    return load_repo_module("proto/generate.py", "proto_generate")


def test_committed_stubs_are_fresh(tmp_path: pathlib.Path) -> None:
    generated = _generator().generate(tmp_path)
    assert generated, "no stubs generated"
    for path in generated:
        relative = path.relative_to(tmp_path)
        committed = REPO / relative
        assert committed.is_file(), f"{relative} is not committed; run `make proto`"
        assert committed.read_text() == path.read_text(), f"{relative} is stale; run `make proto`"


def test_stub_imports_follow_the_proto_layout() -> None:
    grpc_stub = (REPO / "kvservice" / "v1" / "kvservice_pb2_grpc.py").read_text()
    assert "from kvservice.v1 import kvservice_pb2" in grpc_stub
