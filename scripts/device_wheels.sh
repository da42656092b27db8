#!/usr/bin/env bash
# Fetch, on this machine, the wheels of every package kvservice's servers and the device check
# import, for the device machine's python3 (3.12, CUDA torch, transformers, no package index),
# into .whl/ (git-ignored through .git/info/exclude; the device tool carries it: `carry:
# [".whl"]`). The list is pyproject.toml's runtime dependencies and what they depend on, torch's
# excepted (scripts/device_deps.py pins): llguidance, aiohttp, prometheus-client and the rest.
# The versions are this venv's, so both sides run what the tests ran here; on the device,
# scripts/device_check.sh installs only those its python3 lacks or has too old.
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude)
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
python=${PYTHON:-.venv/bin/python}
mapfile -t pins < <("$python" scripts/device_deps.py pins)
[[ ${#pins[@]} -gt 0 ]] || { echo "device_wheels.sh: scripts/device_deps.py pins listed nothing" >&2; exit 1; }
rm -rf .whl
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl "${pins[@]}"
ls .whl
# The device tool carries at most 64 MiB in all.
du -sh .whl
