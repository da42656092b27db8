#!/usr/bin/env bash
# The prepared device check (issue 15): one run, under 8 minutes, one JSON of figures, each
# figure beside its target with PASS or FAIL.
#
#   scripts/device_check.sh [--device cuda|cpu] [--out PATH] [--quick] [--time-limit S] [--only STEP...]
#
# Runs the two-process PD transfer check, `bench transfer`, `bench spec` (deferred vs eager
# finalize) and `bench engine` (vs transformers) on the device (scripts/device_check.py), then
# judges every figure against its target (scripts/device_targets.py: e.g. bench_transfer.ratio
# >= 0.6, bench_spec.deferred_over_eager <= 0.85, bench_engine.*.b16.decode_ratio >= 1.5); the
# table goes to stderr. The JSON, with `verdicts`, goes to --out, else $OUT/device_check.json
# when $OUT is set, else stdout. Exit status 0 only when every step passed and, in a full run,
# every target was met (a --quick run's sizes are too small to judge: its verdicts do not count).
#
# Python: .venv's when there is one (here, after `make setup`), else python3 (the device
# machine's: CUDA torch and transformers, no package index). Every package kvservice's servers
# import (pyproject.toml's dependencies: llguidance, aiohttp, prometheus-client, grpcio, ...)
# travels as a wheel in .whl/: run scripts/device_wheels.sh here first, then on the device
# machine (carry: .whl)
#   scripts/device_check.sh --device cuda --out "$OUT/device_check.json"
# which installs those python3 lacks (or has too old) and kvservice itself under /tmp, never
# into the system, and imports every kvservice module before the first step.
set -euo pipefail

time_limit=450
out=""
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  if [[ "${args[i]}" == "--time-limit" && $((i + 1)) -lt ${#args[@]} ]]; then time_limit="${args[i + 1]}"; fi
  if [[ "${args[i]}" == "--out" && $((i + 1)) -lt ${#args[@]} ]]; then out="${args[i + 1]}"; fi
done
if [[ -n "$out" && "$out" != /* ]]; then out="$PWD/$out"; fi
cd "$(dirname "$0")/.."
repo=$PWD

if [[ -x .venv/bin/python ]]; then
  python=.venv/bin/python
else
  python=python3
  site=/tmp/kvservice-site
  # Set first: the kvservice build below runs with the setuptools installed there.
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  if [[ -d .whl ]]; then
    mapfile -t wheels < <("$python" scripts/device_deps.py select .whl)
    if [[ ${#wheels[@]} -gt 0 ]]; then
      echo "device_check.sh: installing ${#wheels[@]} wheels from .whl into $site" >&2
      "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        "${wheels[@]}"
    fi
  else
    echo "device_check.sh: no .whl/ (scripts/device_wheels.sh makes it): installing no dependencies" >&2
  fi
  "$python" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target "$site" .
  # Out of the checkout: `python -m kvservice` (the steps' workers and benchmarks) puts the working
  # directory first on sys.path, and this checkout's kvservice/ (no server/ or client/ in it)
  # would shadow the installed package.
  cd "$site"
fi

# Every module the servers and the steps import, in seconds: a missing package stops the check
# here, named, instead of failing each step minutes apart.
"$python" "$repo/scripts/device_deps.py" check

export PYTHONUNBUFFERED=1
raw=$(mktemp /tmp/device_check.XXXXXX)
trap 'rm -f "$raw"' EXIT
# The steps stop themselves at the limit; this only catches a hang in the orchestrator itself.
# The last --out wins: the raw figures go to $raw, the judged report where the caller asked.
steps_status=0
timeout --kill-after=10 "$(( ${time_limit%.*} + 30 ))" "$python" "$repo/scripts/device_check.py" "$@" --out "$raw" \
  || steps_status=$?
if [[ ! -s "$raw" ]]; then
  echo "device_check.sh: scripts/device_check.py wrote no report (exit status $steps_status)" >&2
  exit $(( steps_status ? steps_status : 1 ))
fi
"$python" "$repo/scripts/device_targets.py" "$raw" ${out:+--out "$out"}
