"""The layout of DESIGN.md, checked on grimp's import graph of the installed package.

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

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROCESSES = ("kvservice.server", "kvservice.client")
COMPOSITION_ROOT = "kvservice.cli"  # the one entry point: it imports every command lazily

_GRAPH_SCRIPT = """
import json
import grimp
graph = grimp.build_graph("kvservice")
print(json.dumps({m: sorted(graph.find_modules_directly_imported_by(m)) for m in graph.modules}))
"""


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
        cwd=tmp, env={"PYTHONPATH": str(tmp)}, capture_output=True, text=True, check=True,
    ).stdout
    return json.loads(out)


def _package_of(module: str) -> str:
    for package in PROCESSES:
        if module == package or module.startswith(package + "."):
            return package
    return "kvservice"


def test_server_and_client_do_not_import_each_other(graph: dict[str, list[str]]) -> None:
    crossing = [
        (module, imported) for module, imports in graph.items() for imported in imports
        if {_package_of(module), _package_of(imported)} == set(PROCESSES)
    ]
    assert not crossing, crossing


def test_the_library_imports_neither_server_nor_client(graph: dict[str, list[str]]) -> None:
    upward = [
        (module, imported) for module, imports in graph.items() for imported in imports
        if _package_of(module) == "kvservice" and module != COMPOSITION_ROOT and _package_of(imported) != "kvservice"
    ]
    assert not upward, upward


def test_no_import_cycles_in_the_library(graph: dict[str, list[str]]) -> None:
    """`TYPE_CHECKING` imports count too: an annotation-only circle still ties two modules together."""
    library = {m: [i for i in imports if _package_of(i) == "kvservice"] for m, imports in graph.items() if _package_of(m) == "kvservice"}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for imported in library.get(module, []):
            if state.get(imported) == 1:
                return path[path.index(imported):] + [imported]
            if imported not in state and (cycle := visit(imported)) is not None:
                return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(library):
        if module not in state and (cycle := visit(module)) is not None:
            pytest.fail("import cycle: " + " -> ".join(cycle))


def test_the_scheduler_and_the_connector_contract_do_not_import_each_other(graph: dict[str, list[str]]) -> None:
    assert "kvservice.scheduler" not in graph["kvservice.connector.base"]
    assert "kvservice.connector.base" in graph["kvservice.scheduler"]  # the scheduler drives the connector
