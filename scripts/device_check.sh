#!/usr/bin/env bash
# The prepared device check (issue 15): one run, under 8 minutes, one JSON of figures.
#
#   scripts/device_check.sh [--device cuda|cpu] [--out PATH] [--quick] [--time-limit S] [--only STEP...]
#
# Runs the two-process PD transfer check, `bench transfer`, `bench spec` (deferred vs eager
# finalize) and `bench engine` (vs transformers) on the device; see scripts/device_check.py.
# The JSON goes to --out, else $OUT/device_check.json when $OUT is set, else stdout; the exit
# status is 0 only when every step passed (a failed step is in the JSON with its error).
#
# Python: .venv's when there is one (here, after `make setup`), else python3 (the device
# machine's, which has CUDA torch). The packages python3 lacks travel as wheels in .whl/:
# run scripts/device_wheels.sh here first, then on the device machine (carry: .whl)
#   scripts/device_check.sh --device cuda --out "$OUT/device_check.json"
# which installs them and kvservice itself under /tmp, never into the system.
set -euo pipefail
cd "$(dirname "$0")/.."

time_limit=450
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  if [[ "${args[i]}" == "--time-limit" && $((i + 1)) -lt ${#args[@]} ]]; then time_limit="${args[i + 1]}"; fi
done

if [[ -x .venv/bin/python ]]; then
  python=.venv/bin/python
else
  python=python3
  site=/tmp/kvservice-site
  if [[ -d .whl ]]; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
  fi
  "$python" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target "$site" .
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi

export PYTHONUNBUFFERED=1
# The steps stop themselves at the limit; this only catches a hang in the orchestrator itself.
exec timeout --kill-after=10 "$(( ${time_limit%.*} + 30 ))" "$python" scripts/device_check.py "$@"
