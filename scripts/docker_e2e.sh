#!/usr/bin/env bash
# End to end through Docker: the image built, the compose demo (SmolLM2, DNS discovery) up,
# real answers through the OpenAI API, and a decode worker added and removed under load.
#
#   scripts/docker_e2e.sh        # `make test-docker` runs it (after `make setup`)
#
# Steps; any failed check exits non-zero with the reason:
#   (a) a Docker engine (dockerd started here when root and none answers); the base image
#       (scripts/docker_base.sh: a local python:3.11-slim-bookworm unless it exists) and the
#       image (docker build --network host, TORCH_INDEX_URL= : pip's configured index), timed;
#   (b) `compose up -d`, timed until the proxy's first answer;
#   (c) 3 chat questions via the `openai` client (temperature 0, max_tokens 32): each answer
#       equals offline greedy (kvservice.LLM("smollm2").chat) in this checkout's venv;
#   (d) under a steady load (kvservice bench serve, openai-chat): decode scaled to 2, timed
#       from the scale command to the new worker's first finished request (the proxy's
#       Stats), both decode workers serving, then scaled back to 1; no request failed;
#       the load's TTFT/TPOT printed per phase (1 worker, scaling up, 2 workers, scaling down);
#   (e) `compose down -v`, on success and failure alike.
# Environment: BASE_IMAGE, KVSERVICE_IMAGE (default kvservice:latest), NO_CACHE=1 (build
# without the layer cache), DOCKER_BUILDKIT (default: BuildKit where `docker buildx` exists,
# else the legacy builder), KEEP=1 (leave the cluster up), LOAD_RATE, LOAD_PROMPTS.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

PROJECT=${COMPOSE_PROJECT_NAME:-kvservice-e2e}
export BASE_IMAGE=${BASE_IMAGE:-python:3.11-slim-bookworm}
export KVSERVICE_IMAGE=${KVSERVICE_IMAGE:-kvservice:latest}
export TORCH_INDEX_URL=          # pip's own configured index, in the build and in compose's build args
export KVSERVICE_MODEL=smollm2
PY=$ROOT/.venv/bin/python
KVSERVICE=$ROOT/.venv/bin/kvservice
# Requests/s during the scale test: enough that the first decode worker usually has one in
# flight, else kv-aware routing rightly keeps sending every request to the worker that caches
# the chat template's prefix and the new one gets none (at 1/s, once the image had its C++
# kernels, a request took ~0.25 s and the new worker served none in 300 s).
LOAD_RATE=${LOAD_RATE:-4}
LOAD_PROMPTS=${LOAD_PROMPTS:-600}
START_TIMEOUT=${START_TIMEOUT:-600}

say() { echo "docker_e2e.sh: $*" >&2; }
die() { say "FAILED: $*"; exit 1; }
[ -x "$PY" ] || die "no .venv: run \`make setup\` first"

# --------------------------------------------------------------- (a) engine, base, image
if ! docker info >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v dockerd >/dev/null 2>&1; then
        say "no Docker engine answers: starting dockerd (log: /tmp/kvservice-dockerd.log)"
        setsid dockerd >/tmp/kvservice-dockerd.log 2>&1 </dev/null &
        for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    fi
    docker info >/dev/null 2>&1 || die "no Docker engine (docker info fails, and dockerd could not be started here)"
fi
if docker compose version >/dev/null 2>&1; then
    COMPOSE=(docker compose)
elif command -v docker-compose >/dev/null 2>&1; then
    COMPOSE=(docker-compose)
else
    die "neither \`docker compose\` nor docker-compose is installed"
fi
COMPOSE+=(-p "$PROJECT" -f "$ROOT/docker/docker-compose.yml")
if [ -z "${DOCKER_BUILDKIT+x}" ]; then
    if docker buildx version >/dev/null 2>&1; then export DOCKER_BUILDKIT=1; else export DOCKER_BUILDKIT=0; fi
fi

work=$(mktemp -d /tmp/docker_e2e.XXXXXX)
load_pid=
cleanup() {
    rc=$?
    [ -n "$load_pid" ] && kill "$load_pid" 2>/dev/null || true
    if [ "$rc" != 0 ]; then
        "${COMPOSE[@]}" ps >&2 2>/dev/null || true
        say "logs of the failed run (last 40 lines per container):"
        "${COMPOSE[@]}" logs --no-color --tail 40 >&2 2>/dev/null || true
        [ -f "$work/load.log" ] && { say "load (bench) output:"; tail -n 30 "$work/load.log" >&2; }
    fi
    if [ "${KEEP:-0}" = 1 ]; then
        say "KEEP=1: the cluster stays up (${COMPOSE[*]} down -v)"
    else
        "${COMPOSE[@]}" down -v --remove-orphans -t 40 >/dev/null 2>&1 || say "compose down failed"
    fi
    rm -rf "$work"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
# Leftovers of an interrupted earlier run hold the proxy's ports.
"${COMPOSE[@]}" down -v --remove-orphans -t 5 >/dev/null 2>&1 || true

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

BASE_IMAGE=$BASE_IMAGE scripts/docker_base.sh

# The build context is the repository root, filtered by .dockerignore (read by BuildKit and
# by the legacy builder alike): only the package sources are sent.
builder=$([ "$DOCKER_BUILDKIT" = 1 ] && echo BuildKit || echo "legacy builder")
say "building $KVSERVICE_IMAGE ($builder, FROM $BASE_IMAGE)"
t=$(now)
docker build --network host -f docker/Dockerfile ${NO_CACHE:+--no-cache} \
        --build-arg BASE_IMAGE="$BASE_IMAGE" --build-arg TORCH_INDEX_URL= -t "$KVSERVICE_IMAGE" . >"$work/build.log" 2>&1 \
    || { tail -n 40 "$work/build.log" >&2; die "docker build failed"; }
BUILD_S=$(since "$t")
docker run --rm "$KVSERVICE_IMAGE" python -c 'import torch; assert "+cpu" in torch.__version__, torch.__version__' \
    || die "the image's torch is not the CPU build"

# The Python side of the checks, run with this checkout's venv.
cat >"$work/check.py" <<'PY'
import asyncio, json, sys, time

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "What is 2 plus 2?"]
PROXY_GRPC, BASE_URL, MODEL = "127.0.0.1:8000", "http://127.0.0.1:8080/v1", "smollm2"


def ask(client, q):
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": q}], temperature=0, max_tokens=32, timeout=120)
    return reply.choices[0].message.content


def openai_client():
    import openai
    return openai.OpenAI(base_url=BASE_URL, api_key="unused", max_retries=0)


async def decode_workers():
    from google.protobuf.json_format import MessageToDict
    from kvservice.client.client import KVServiceClient
    async with KVServiceClient(PROXY_GRPC) as client:
        stats = MessageToDict(await client.stats(timeout=5), preserving_proto_field_name=True)
    return {w["address"]: (int(w.get("stats", {}).get("num_finished_requests", 0)), w.get("state", "?"))
            for w in stats.get("workers", []) if w.get("role", w.get("stats", {}).get("role")) == "decode"}


def main(cmd, *args):
    if cmd == "reference":  # offline greedy, this venv
        from kvservice import LLM, SamplingParams
        llm = LLM(MODEL)
        answers = [llm.chat([{"role": "user", "content": q}], SamplingParams(temperature=0, max_tokens=32))[0].text for q in QUESTIONS]
        json.dump(answers, open(args[0], "w"))
    elif cmd == "wait":  # until the proxy answers a chat request
        deadline, client, error = time.monotonic() + float(args[0]), openai_client(), None
        while time.monotonic() < deadline:
            try:
                if ask(client, QUESTIONS[0]):
                    return
            except Exception as e:  # noqa: BLE001 - not up yet
                error = e
            time.sleep(1)
        sys.exit(f"the proxy gave no answer within {args[0]} s: {error!r}")
    elif cmd == "ask":
        expected, client, bad = json.load(open(args[0])), openai_client(), 0
        for q, want in zip(QUESTIONS, expected):
            got = ask(client, q)
            ok = got == want
            bad += not ok
            print(f"  {'ok  ' if ok else 'DIFF'} {q!r} -> {got!r}" + ("" if ok else f"\n       offline greedy: {want!r}"))
        sys.exit(f"{bad} of {len(QUESTIONS)} answers differ from offline greedy" if bad else 0)
    elif cmd == "workers":  # {address: finished requests} of the decode workers the proxy lists
        print(json.dumps({a: n for a, (n, _) in asyncio.run(decode_workers()).items()}))
    elif cmd == "new-worker":  # old addresses (JSON), t0 (epoch), timeout: a new decode worker's first request
        old, t0, deadline = set(json.loads(args[0])), float(args[1]), time.monotonic() + float(args[2])
        states, workers = {}, {}
        while time.monotonic() < deadline:
            try:
                workers = asyncio.run(decode_workers())
            except Exception:  # noqa: BLE001 - a Stats call may time out under load
                workers = {}
            new = {a: v for a, v in workers.items() if a not in old}
            for address, (finished, state) in new.items():
                if states.get(address) != state:  # the proxy's view of it: joining, serving, ...
                    states[address] = state
                    print(f"  new decode worker {address}: {state} after {time.time() - t0:.1f} s", file=sys.stderr)
                if finished > 0:
                    print(json.dumps({"address": address, "seconds": round(time.time() - t0, 1)}))
                    return
            time.sleep(0.5)
        sys.exit(f"no new decode worker finished a request within {args[2]} s (decode workers: {workers})")
    elif cmd == "bench-result":
        result = json.load(open(args[0]))
        print(json.dumps({"completed": result["completed"], "failed": result["failed"]}))
    elif cmd == "phases":  # the load's requests split by when they were sent: boundaries are epochs
        result, names = json.load(open(args[0])), ["1 decode worker", "scaling up", "2 decode workers", "scaling down to 1"]
        bounds = [float("-inf"), *(float(a) - result["start_unix"] for a in args[1:]), float("inf")]
        print(f"  {'phase (by send time)':<20} {'sent':>5} {'done':>5} {'failed':>6} {'mean TTFT':>10} {'p99 TTFT':>9} {'mean TPOT':>10}")
        for name, lo, hi in zip(names, bounds, bounds[1:]):
            rs = [r for r in result["requests"] if lo <= r["start"] < hi]
            ok = [r for r in rs if r["success"] and r["token_times"]]
            ttft = sorted(1000 * (r["token_times"][0] - r["start"]) for r in ok)
            tpot = [1000 * (r["token_times"][-1] - r["token_times"][0]) / (len(r["token_times"]) - 1) for r in ok if len(r["token_times"]) > 1]
            mean = lambda xs: f"{sum(xs) / len(xs):.0f} ms" if xs else "-"
            p99 = f"{ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))]:.0f} ms" if ttft else "-"
            print(f"  {name:<20} {len(rs):>5} {len(ok):>5} {len(rs) - len(ok):>6} {mean(ttft):>10} {p99:>9} {mean(tpot):>10}")
    else:
        sys.exit(f"unknown command {cmd}")


main(*sys.argv[1:])
PY
check() { "$PY" "$work/check.py" "$@"; }

say "offline greedy answers (venv, kvservice.LLM)"
check reference "$work/expected.json" || die "the offline reference failed"

# --------------------------------------------------------------- (b) compose up
say "compose up (${COMPOSE[*]})"
t=$(now)
"${COMPOSE[@]}" up -d >"$work/up.log" 2>&1 || { cat "$work/up.log" >&2; die "compose up failed"; }
check wait "$START_TIMEOUT" || die "no answer through the proxy"
STARTUP_S=$(since "$t")
say "first answer $STARTUP_S s after compose up"

# --------------------------------------------------------------- (c) answers
say "3 chat questions through http://127.0.0.1:8080/v1 (openai client) vs offline greedy"
check ask "$work/expected.json" || die "answers through the proxy differ from offline greedy"

# --------------------------------------------------------------- (d) scale under load
say "load: $LOAD_PROMPTS chat requests at $LOAD_RATE/s (kvservice bench serve --backend openai-chat)"
"$KVSERVICE" bench serve --backend openai-chat --base-url http://127.0.0.1:8080 --model smollm2 \
    --input-len 32 --output-len 16 --num-prompts "$LOAD_PROMPTS" --request-rate "$LOAD_RATE" --burstiness 100 \
    --disable-tqdm --result-filename "$work/load.json" >"$work/load.log" 2>&1 &
load_pid=$!
sleep 10
kill -0 "$load_pid" 2>/dev/null || die "the load generator exited early"
old=$(check workers) || die "the proxy's Stats failed"
[ "$(echo "$old" | "$PY" -c 'import json,sys; print(len(json.load(sys.stdin)))')" = 1 ] || die "expected 1 decode worker before scaling, the proxy lists $old"
old_ids=$("${COMPOSE[@]}" ps -q decode | sort)
say "scale decode to 2 (up -d --no-deps --no-recreate --scale decode=2 decode)"
t=$(now)
"${COMPOSE[@]}" up -d --no-deps --no-recreate --scale decode=2 decode >>"$work/up.log" 2>&1 || { tail "$work/up.log" >&2; die "scale-up failed"; }
new=$(check new-worker "$old" "$t" 300) || die "the new decode worker served no request"
SCALE_S=$(echo "$new" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["seconds"])')
scale_up_t=$t
serving_t=$(awk -v a="$t" -v b="$SCALE_S" 'BEGIN { printf "%.3f", a + b }')
new_id=$(comm -13 <(echo "$old_ids") <("${COMPOSE[@]}" ps -q decode | sort) | head -n1)
listening=$(docker logs --timestamps "$new_id" 2>&1 | grep -m1 'listening on' | cut -d' ' -f1 || true)
[ -n "$listening" ] && say "new decode worker's server listening $(awk -v a="$t" -v b="$(date -d "$listening" +%s.%N)" 'BEGIN { printf "%.1f", b - a }') s after the scale command"
say "new decode worker's first finished request $SCALE_S s after the scale command"
sleep 10
workers=$(check workers) || die "the proxy's Stats failed"
echo "$workers" | "$PY" -c 'import json,sys; w=json.load(sys.stdin); sys.exit(not (len(w) == 2 and all(n > 0 for n in w.values())))' \
    || die "not both decode workers served requests: $workers"
say "both decode workers served requests: $workers"
kill -0 "$load_pid" 2>/dev/null || die "the load ended before scale-down: raise LOAD_PROMPTS"
say "scale decode back to 1 (the removed worker drains)"
scale_down_t=$(now)
"${COMPOSE[@]}" up -d --no-deps --no-recreate --scale decode=1 decode >>"$work/up.log" 2>&1 || { tail "$work/up.log" >&2; die "scale-down failed"; }
kill -0 "$load_pid" 2>/dev/null || say "note: the load ended while the worker drained"
wait "$load_pid" || { load_pid=; die "the load generator failed"; }
load_pid=
result=$(check bench-result "$work/load.json") || die "no bench result"
echo "$result" | "$PY" -c "import json,sys; r=json.load(sys.stdin); sys.exit(not (r['failed'] == 0 and r['completed'] == $LOAD_PROMPTS))" \
    || die "requests failed during the scale test: $result"
say "load: $result"
after=$(check workers)
[ "$(echo "$after" | "$PY" -c 'import json,sys; print(len(json.load(sys.stdin)))')" = 1 ] || die "after scale-down the proxy lists decode workers $after"

# --------------------------------------------------------------- summary; (e) is the trap
echo "docker_e2e.sh: PASSED"
printf '  %-46s %6s s\n' "image build ($builder):" "$BUILD_S" "compose up to first answer:" "$STARTUP_S" \
    "scale-up to first request on the new worker:" "$SCALE_S"
echo "  answers = offline greedy (3/3); load: $result"
echo "  the load ($LOAD_PROMPTS chat requests at $LOAD_RATE/s, 32 prompt + 16 output tokens) by phase:"
check phases "$work/load.json" "$scale_up_t" "$serving_t" "$scale_down_t"
