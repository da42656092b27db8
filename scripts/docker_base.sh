#!/usr/bin/env bash
# A local stand-in for the base image `python:3.11-slim-bookworm`, for machines that reach
# the package registries (PyPI, Debian) but no image registry. docker/Dockerfile itself
# is unchanged by it: it builds FROM this image as it would FROM the official one.
#
#   scripts/docker_base.sh                 # tags python:3.11-slim-bookworm; skips if it exists
#   BASE_IMAGE=kvservice-base:local scripts/docker_base.sh
#   FORCE=1 scripts/docker_base.sh         # rebuild even if the tag exists
#
# What it holds: Debian bookworm (debootstrap --variant=minbase) with python3, python3-venv
# and ca-certificates, plus this machine's pip setup so that `pip install` inside a
# `docker build --network host` reaches the same index the host's pip does:
#   - every global/user pip configuration file `pip config debug` lists, at the same path
#     (file:// indexes that are not carried into the image are dropped from them);
#   - the PIP_* environment the host's pip sees, as ENV of the image;
#   - the CA bundle (and constraint files) those name, at the same paths;
#   - the torch wheel the host's pip finds (torch==$TORCH_VERSION, the CPU build here), in the
#     first find-links directory of that configuration (/opt/wheels when there is none).
# Needs root (debootstrap), a running Docker engine and Debian's debootstrap (installed
# with apt-get when missing). About a minute.
set -euo pipefail
cd "$(dirname "$0")/.."

TAG=${BASE_IMAGE:-python:3.11-slim-bookworm}
SUITE=${DEBIAN_SUITE:-bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
TORCH_VERSION=${TORCH_VERSION:-$(sed -n 's/.*torch==\([0-9.]*\).*/\1/p' Makefile | head -n1)}
if [ -x .venv/bin/pip ]; then PIP=(.venv/bin/python -m pip); else PIP=(python3 -m pip); fi

say() { echo "docker_base.sh: $*" >&2; }
die() { say "ERROR: $*"; exit 1; }

if [ "${FORCE:-0}" != 1 ] && docker image inspect "$TAG" >/dev/null 2>&1; then
    say "$TAG exists; nothing to do (FORCE=1 rebuilds it)"
    exit 0
fi
[ "$(id -u)" = 0 ] || die "debootstrap needs root"
docker info >/dev/null 2>&1 || die "no Docker engine answers (docker info failed)"
if ! command -v debootstrap >/dev/null 2>&1; then
    say "installing debootstrap"
    apt-get install -y -q debootstrap >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q debootstrap >/dev/null; } \
        || die "could not install debootstrap with apt-get"
fi

work=$(mktemp -d /tmp/docker_base.XXXXXX)
trap 'rm -rf "$work"' EXIT
root=$work/rootfs
start=$(date +%s)

say "debootstrap $SUITE (minbase) from $MIRROR"
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates "$SUITE" "$root" "$MIRROR" >"$work/debootstrap.log" 2>&1 \
    || { tail -n 30 "$work/debootstrap.log" >&2; die "debootstrap failed"; }
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/locale/*

# The host's pip setup, carried over at the same paths.
say "copying the pip configuration, CA bundle and torch==$TORCH_VERSION wheel"
"${PIP[@]}" config debug >"$work/pip-debug.txt"
"${PIP[@]}" download --no-deps --only-binary=:all: -q -d "$work/torch" "torch==$TORCH_VERSION" \
    || die "the host's pip does not find torch==$TORCH_VERSION"
python3 - "$root" "$work/pip-debug.txt" "$work/torch" "$work/env" <<'PY'
import configparser, glob, json, os, re, shutil, sys

root, debug, torch_dir, env_out = sys.argv[1:]
def into(path):  # the path inside the image
    return os.path.join(root, path.lstrip("/"))

def carry(path):
    if os.path.isfile(path):
        os.makedirs(os.path.dirname(into(path)), exist_ok=True)
        shutil.copy2(path, into(path))

text = open(debug).read()
# "  /etc/pip.conf, exists: True" under the global: and user: sections (site: is a venv's own).
files, section = [], None
for line in text.splitlines():
    if re.match(r"^\S+:$", line):
        section = line[:-1]
    m = re.match(r"^\s+(/\S+), exists: True$", line)
    if m and section in ("global", "user"):
        files.append(m.group(1))
env = dict(re.findall(r"^\s+(PIP_\w+)='(.*)'$", text, re.M))

def keep_index(url):  # a local index only if it is carried (it is not: too big)
    return not url.startswith("file://")

find_links = []
values = []  # (key, value) of every setting
for path in files:
    parser = configparser.RawConfigParser()
    parser.read(path)
    for sect in parser.sections():
        for key in list(parser[sect]):
            value = parser[sect][key]
            if key in ("index-url", "extra-index-url"):
                kept = [u for u in value.split() if keep_index(u)]
                if kept:
                    parser[sect][key] = " ".join(kept)
                else:
                    del parser[sect][key]
                continue
            values.append((key, value))
    os.makedirs(os.path.dirname(into(path)), exist_ok=True)
    with open(into(path), "w") as f:
        f.write(f"# Carried from this build machine's {path} by scripts/docker_base.sh.\n")
        parser.write(f)
for key, value in env.items():
    values.append((key[4:].lower().replace("_", "-"), value))
    if key in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
        kept = [u for u in value.split() if keep_index(u)]
        env[key] = " ".join(kept)
for key, value in values:
    if key in ("cert", "client-cert", "constraint", "requirement"):
        for p in value.split():
            carry(p)
    if key == "find-links":
        find_links += [p[len("file://"):] if p.startswith("file://") else p for p in value.split()]
local = [p for p in find_links if p.startswith("/")]
wheels = local[0] if local else "/opt/wheels"
os.makedirs(into(wheels), exist_ok=True)
for wheel in glob.glob(os.path.join(torch_dir, "*.whl")):
    shutil.copy2(wheel, into(wheels))
    print(f"  {os.path.basename(wheel)} -> {wheels}", file=sys.stderr)
if not local:
    env["PIP_FIND_LINKS"] = wheels
# The CA bundle Python's ssl and requests read too.
carry("/etc/ssl/certs/ca-certificates.crt")
with open(env_out, "w") as f:
    for key, value in env.items():
        if value:
            f.write(f"{key}={json.dumps(value)}\n")
for path in files:
    print(f"  {path}", file=sys.stderr)
PY

# What python:3.11-slim-bookworm sets, plus the host's PIP_* environment.
changes=(--change "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" --change "ENV LANG=C.UTF-8" --change 'CMD ["python3"]')
while IFS= read -r line; do changes+=(--change "ENV $line"); done <"$work/env"
say "docker import -> $TAG"
tar -C "$root" --numeric-owner -c . | docker import "${changes[@]}" - "$TAG" >/dev/null
docker run --rm "$TAG" python3 -c 'import sys, venv; assert sys.version_info >= (3, 11), sys.version' \
    || die "$TAG has no usable python3"
say "built $TAG in $(( $(date +%s) - start )) s ($(docker image inspect -f '{{.Size}}' "$TAG" | awk '{printf "%d MB", $1/1e6}'))"
