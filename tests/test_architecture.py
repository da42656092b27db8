"""The project's layout (docs/architecture.md) and the library's rooms, checked on grimp's import graph.

`server/` and `client/` install as `kvservice.server` and `kvservice.client`; grimp reads
a package from one directory, so the test assembles that package tree in a temporary
directory (copies of the three source folders) and builds the graph there, in a
subprocess so the real package stays the one imported here.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROCESSES = ("kvservice.server", "kvservice.client")
COMPOSITION_ROOT = "kvservice.cli"  # the one entry point: it imports every command lazily

_GRAPH_SCRIPT = """
import json
import grimp
graph = grimp.build_graph("kvservice", include_external_packages=True)
modules = [m for m in graph.modules if m.startswith("kvservice")]
print(json.dumps({m: sorted(graph.find_modules_directly_imported_by(m)) for m in modules}))
"""

# The library's rooms (subpackages, plus the shared top-level `config`) and the rooms each may
# import. Lower rooms never import higher ones, so the package graph is a DAG:
#   core <- model <- connector <- worker <- engine, with loading (-> model) beside the model
#   and runtime (flags, TLS, process env, thread names) beside everything; structured (grammars) beside the engine.
ROOMS: dict[str, set[str]] = {
    "config": set(),
    "v1": set(),  # generated gRPC stubs
    "core": set(),
    "runtime": {"config", "v1"},
    "model": {"config", "core"},
    "loading": {"config", "model"},
    "connector": {"config", "core", "model", "runtime", "v1"},
    "worker": {"config", "core", "model", "connector", "structured"},
    "engine": {"config", "core", "model", "worker", "loading", "connector", "structured", "runtime"},
    # Grammars for structured output: params from core, tokenizers from loading (and torch for the masks).
    "structured": {"core", "loading"},
}
# What the worker and the engine may know of the connector room: the contract, never a transport.
CONNECTOR_CONTRACT = {"kvservice.connector", "kvservice.connector.base", "kvservice.connector.lifecycle"}
# Plain-Python bookkeeping: fast to test, no tensors, no RPC.
CORE_FORBIDDEN = ("torch", "numpy", "grpc", "google")
# The engine's own bookkeeping (scheduling, its collaborators, request outputs): plain Python too.
TORCH_FREE_ENGINE_MODULES = (
    "kvservice.engine.scheduler",
    "kvservice.engine.remote_kv_loads",
    "kvservice.engine.prompt_lane_path",
    "kvservice.engine.tier_loads",
    "kvservice.engine.prefix_reuse",
    "kvservice.engine.output_processor",
    "kvservice.engine.step_budget",
)
# Function size and complexity, not module length, bound a unit: a function fits on a screen and
# a reader can follow its paths. Ruff's defaults, selected in pyproject.toml: McCabe complexity
# (C901) at most 10, at most 12 branches (PLR0912) and 50 statements (PLR0915) per function.
SIZE_RULES = "C901,PLR0912,PLR0915"


@pytest.fixture(scope="module")
def graph(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """Module -> the modules it imports directly (kvservice's own only)."""
    tmp = tmp_path_factory.mktemp("graph")
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "kvservice", tmp / "kvservice", ignore=ignore)
    shutil.copytree(ROOT / "server", tmp / "kvservice" / "server", ignore=ignore)
    shutil.copytree(ROOT / "client", tmp / "kvservice" / "client", ignore=ignore)
    out = subprocess.run(
        [sys.executable, "-c", _GRAPH_SCRIPT],
        cwd=tmp,
        env={"PYTHONPATH": str(tmp)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out)


def _library(graph: dict[str, list[str]]) -> dict[str, list[str]]:
    """The library's modules and the library modules each imports."""
    return {
        m: [i for i in imports if _package_of(i) == "kvservice" and i.startswith("kvservice")]
        for m, imports in graph.items()
        if _package_of(m) == "kvservice"
    }


def _room_of(module: str) -> str | None:
    """`kvservice.engine.scheduler` -> "engine"; None for the package's top-level files (cli, __init__)."""
    parts = module.split(".")
    if len(parts) < 2 or parts[1] in ("cli", "__main__"):
        return None
    return parts[1]


def _package_of(module: str) -> str:
    for package in PROCESSES:
        if module == package or module.startswith(package + "."):
            return package
    return "kvservice"


def test_server_and_client_do_not_import_each_other(graph: dict[str, list[str]]) -> None:
    crossing = [
        (module, imported)
        for module, imports in graph.items()
        for imported in imports
        if {_package_of(module), _package_of(imported)} == set(PROCESSES)
    ]
    assert not crossing, crossing


def test_the_library_imports_neither_server_nor_client(graph: dict[str, list[str]]) -> None:
    upward = [
        (module, imported)
        for module, imports in graph.items()
        for imported in imports
        if _package_of(module) == "kvservice" and module != COMPOSITION_ROOT and _package_of(imported) != "kvservice"
    ]
    assert not upward, upward


def test_no_import_cycles_in_the_library(graph: dict[str, list[str]]) -> None:
    """`TYPE_CHECKING` imports count too: an annotation-only circle still ties two modules together."""
    library = _library(graph)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for imported in library.get(module, []):
            if state.get(imported) == 1:
                return path[path.index(imported) :] + [imported]
            if imported not in state and (cycle := visit(imported)) is not None:
                return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(library):
        if module not in state and (cycle := visit(module)) is not None:
            pytest.fail("import cycle: " + " -> ".join(cycle))


def test_the_scheduler_and_the_connector_contract_do_not_import_each_other(graph: dict[str, list[str]]) -> None:
    assert "kvservice.engine.scheduler" not in graph["kvservice.connector.base"]
    assert "kvservice.connector.base" in graph["kvservice.engine.scheduler"]  # the scheduler drives the connector


def test_every_library_module_lives_in_a_room(graph: dict[str, list[str]]) -> None:
    """Only the entry points and the shared config sit on the library's top floor."""
    top_floor = {path.name for path in (ROOT / "kvservice").glob("*.py")}
    assert top_floor == {"__init__.py", "__main__.py", "cli.py", "config.py"}, top_floor
    rooms = {_room_of(m) for m in _library(graph)} - {None}
    assert rooms == set(ROOMS), rooms ^ set(ROOMS)


def test_rooms_import_only_the_rooms_below_them(graph: dict[str, list[str]]) -> None:
    """TYPE_CHECKING imports count: an annotation still ties one room to another."""
    wrong = [
        (module, imported)
        for module, imports in _library(graph).items()
        for imported in imports
        if (room := _room_of(module)) is not None
        and (target := _room_of(imported)) not in (None, room)
        and target not in ROOMS[room]
    ]
    assert not wrong, wrong


def test_the_worker_and_engine_know_only_the_connector_contract(graph: dict[str, list[str]]) -> None:
    implementations = [
        (module, imported)
        for module, imports in _library(graph).items()
        for imported in imports
        if _room_of(module) in ("worker", "engine")
        and _room_of(imported) == "connector"
        and imported not in CONNECTOR_CONTRACT
    ]
    assert not implementations, implementations
    assert "kvservice.connector.base" in graph["kvservice.engine.engine"]  # the check above has something to check


def test_the_model_knows_no_connector(graph: dict[str, list[str]]) -> None:
    """The forward calls two per-layer hooks (`LayerKVHooks`); it imports nothing of the connector room."""
    assert not [i for i in graph["kvservice.model.model"] if _room_of(i) == "connector"]


def test_core_bookkeeping_imports_no_torch_and_no_grpc(graph: dict[str, list[str]]) -> None:
    heavy = [
        (m, i)
        for m, imports in graph.items()
        if _room_of(m) == "core"
        for i in imports
        if i.split(".")[0] in CORE_FORBIDDEN
    ]
    assert not heavy, heavy
    assert "torch" in graph["kvservice.model.model"]  # external imports are in the graph at all


def test_the_engines_bookkeeping_imports_no_torch(graph: dict[str, list[str]]) -> None:
    heavy = [(m, i) for m in TORCH_FREE_ENGINE_MODULES for i in graph[m] if i.split(".")[0] in CORE_FORBIDDEN]
    assert not heavy, heavy


def test_the_prompt_lane_is_a_scheduler_path_not_a_connector(graph: dict[str, list[str]]) -> None:
    """A colocated worker's lane reaches the scheduler directly, so a real connector may sit beside it."""
    assert not [i for i in graph["kvservice.worker.prompt_lane"] if _room_of(i) == "connector"]
    assert "kvservice.engine.prompt_lane_path" in graph["kvservice.engine.scheduler"]


def test_functions_stay_small_and_simple() -> None:
    """Every function in the repo within ruff's size and complexity limits (the generated stubs are excluded)."""
    lint = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]
    assert set(SIZE_RULES.split(",")) <= set(lint["select"]), "pyproject.toml must select the size rules"
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--select", SIZE_RULES, "--output-format", "concise", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
