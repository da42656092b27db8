"""What the device machine's python3 needs to run kvservice's servers and the device check.

That machine has python3 (3.12) with CUDA torch and transformers, and reaches no package index:
the other packages travel as wheels in .whl/ (scripts/device_wheels.sh fetches them here, and
scripts/device_check.sh installs them there).

- `pins` (here, in .venv): `name==version` of every distribution that kvservice's runtime
  dependencies (pyproject.toml's `[project] dependencies`) and its build (setuptools) need, their
  dependencies included, for Python 3.12; torch's excepted (the device has its CUDA build).
- `select WHEEL_DIR` (on the device): the wheels to install, one path a line: those whose
  distribution python3 lacks, or has at a version kvservice's own requirement refuses (the
  committed stubs need protobuf >= 5.27). What it has and accepts stays: its numpy and
  tokenizers are the ones its torch and transformers run with.
- `check` (on the device, after the install): import every kvservice module (the servers, the
  engine, the benchmarks the check runs); exit 1 naming each one that fails and why, before a
  step has started.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import pathlib
import pkgutil
import re
import sys
import tomllib

try:
    from packaging.requirements import Requirement
    from packaging.utils import parse_wheel_filename
except ImportError:  # pip always carries it
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    from pip._vendor.packaging.utils import parse_wheel_filename  # type: ignore[no-redef]

REPO = pathlib.Path(__file__).resolve().parent.parent
# The device machine's Python: markers are evaluated for it, not for this one.
DEVICE_MARKER_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "extra": ""}
ON_THE_DEVICE = frozenset({"torch"})  # its CUDA build, with what it depends on
# Modules that need an optional extra, not the runtime dependencies: `check` leaves them out.
OPTIONAL_MODULES = {"kvservice.client.bench.plots": "matplotlib, the [bench] extra"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def device_requirements(pyproject: pathlib.Path = REPO / "pyproject.toml") -> list[Requirement]:
    """kvservice's runtime requirements that apply on the device, and its build requirements
    (setuptools: the device builds kvservice from this checkout, without build isolation)."""
    project = tomllib.loads(pyproject.read_text())
    texts = [*project["project"]["dependencies"], *project["build-system"]["requires"]]
    requirements = [Requirement(t) for t in texts]
    return [r for r in requirements if r.marker is None or r.marker.evaluate(DEVICE_MARKER_ENV)]


def pins() -> list[str]:
    """`name==version` (this environment's versions) of the device requirements' closure."""
    found: dict[str, str] = {}
    pending = [r.name for r in device_requirements() if canonical(r.name) not in ON_THE_DEVICE]
    while pending:
        name = canonical(pending.pop())
        if name in found or name in ON_THE_DEVICE:
            continue
        distribution = importlib.metadata.distribution(name)
        found[name] = distribution.version
        for text in distribution.requires or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate(DEVICE_MARKER_ENV):
                pending.append(requirement.name)
    return [f"{name}=={version}" for name, version in sorted(found.items())]


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def select(wheel_dir: pathlib.Path) -> list[pathlib.Path]:
    """The wheels in `wheel_dir` whose distribution this Python lacks or has at a version that
    kvservice's requirement on it refuses."""
    required = {canonical(r.name): r for r in device_requirements()}
    chosen = []
    for wheel in sorted(wheel_dir.glob("*.whl")):
        name = canonical(parse_wheel_filename(wheel.name)[0])
        version = installed_version(name)
        requirement = required.get(name)
        if version is None or (requirement is not None and not requirement.specifier.contains(version, True)):
            chosen.append(wheel)
    return chosen


def check() -> list[str]:
    """Import every kvservice module but the optional ones; one line per module that fails."""
    import kvservice

    failures = []

    def unreadable(package: str) -> None:
        failures.append(f"{package}: the package does not import")

    for module in pkgutil.walk_packages(kvservice.__path__, "kvservice.", onerror=unreadable):
        if module.name.endswith(".__main__") or module.name in OPTIONAL_MODULES:
            continue
        try:
            importlib.import_module(module.name)
        except Exception as e:  # ImportError, or what a missing package's stand-in raises
            failures.append(f"{module.name}: {type(e).__name__}: {e}")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("pins", help="name==version of what the device needs, from this environment")
    chosen = commands.add_parser("select", help="the wheels this Python needs installed")
    chosen.add_argument("wheel_dir", type=pathlib.Path)
    commands.add_parser("check", help="import every kvservice module; exit 1 naming those that fail")
    args = parser.parse_args()
    if args.command == "pins":
        for pin in pins():
            print(pin)
    elif args.command == "select":
        for wheel in select(args.wheel_dir):
            print(wheel)
    else:
        failures = check()
        if failures:
            print("missing imports for kvservice on this Python:", *failures, sep="\n  ", file=sys.stderr)
            return 1
        print("every kvservice module imports", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
