#!/usr/bin/env bash
# Fetch, on this machine, the wheels that the device machine's python3 (3.12, CUDA torch,
# grpcio, protobuf, transformers) lacks for scripts/device_check.sh, into .whl/ (git-ignored
# through .git/info/exclude; the device tool carries it: `carry: [".whl"]`). The versions are
# this venv's, so both sides run what the tests ran here; grpcio and protobuf come too, since
# the committed stubs and the health/reflection services need versions at least these.
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude)
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
python=${PYTHON:-.venv/bin/python}
names=(gguf zlib-ng grpcio grpcio-health-checking grpcio-reflection protobuf)
pins=()
for name in "${names[@]}"; do
  pins+=("$name==$("$python" -c "import importlib.metadata as m; print(m.version('$name'))")")
done
rm -rf .whl
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${pins[@]}"
ls .whl
