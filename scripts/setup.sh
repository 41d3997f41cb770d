#!/usr/bin/env bash
# Install everything a fresh Debian 12 machine needs to run and test quiverfs.
#
# Idempotent: each step checks what is already there and does only what is missing.
#   scripts/setup.sh              system packages, .venv with the test, bench and cluster
#                                 extras, Azurite
#   scripts/setup.sh --torch      the same plus the pinned PyTorch extra (for the main job)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

want_torch=0
for arg in "$@"; do
    case "$arg" in
        --torch) want_torch=1 ;;
        *) echo "setup.sh: unknown option $arg (known: --torch)" >&2; exit 2 ;;
    esac
done

say() { printf '[setup] %s\n' "$*"; }

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
        echo "setup.sh: need root (or sudo) to run: $*" >&2; exit 1; fi
}

# --- system packages: FUSE 3 (fusermount3), libfuse for the benchmarks' pyfuse3,
# redis-server for the cluster's tests (tests/cluster start their own on loopback; the
# package's service is left alone), and nginx with its echo module for the bucket of
# scripts/bench/peers.py (its tests start their own nginx on loopback) --------------------
apt_packages=(fuse3 libfuse3-dev pkg-config redis-server nginx-light libnginx-mod-http-echo)
missing=()
for p in "${apt_packages[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
    say "installing ${missing[*]} with apt-get"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# --- Python virtual environment ---------------------------------------------------------
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3
if [ ! -x .venv/bin/python ]; then
    say "creating .venv with $("$python" --version)"
    "$python" -m venv .venv
fi
extras="test,bench,cluster"
stamp=".venv/.quiverfs-installed"
# With torch already installed, a run without --torch must not drop it: keep the larger set.
if [ "$want_torch" = 1 ] || { [ -f "$stamp" ] && grep -q torch "$stamp"; }; then extras="test,bench,cluster,torch"; fi
# Reinstall only when pyproject.toml or the extras changed since the last successful run.
fingerprint="$(sha256sum pyproject.toml | cut -c1-16) $extras"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$fingerprint" ]; then
    say "installing quiverfs[$extras] into .venv (editable)"
    .venv/bin/python -m pip install -q --upgrade pip >/dev/null
    .venv/bin/python -m pip install -q -e ".[$extras]"
    echo "$fingerprint" > "$stamp"
fi

# --- Azurite (Azure Blob emulator) from npm, under the git-ignored .tools/ ----------------
if [ ! -x .tools/azurite/node_modules/.bin/azurite-blob ]; then
    command -v npm >/dev/null || { say "installing nodejs and npm"; as_root apt-get update -qq;
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null; }
    say "installing azurite with npm"
    mkdir -p .tools/azurite
    npm install --silent --no-audit --no-fund --prefix .tools/azurite azurite >/dev/null
fi

.venv/bin/quiverfs --help >/dev/null
.venv/bin/digests --help >/dev/null
say "ready: .venv/bin/quiverfs, .venv/bin/digests, .tools/azurite"
