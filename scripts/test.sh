#!/usr/bin/env bash
# The whole test suite: install what is missing, lint, then pytest (extra args go to pytest).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
scripts/setup.sh --torch
.venv/bin/ruff check quiverfs digests mountd tests scripts
exec .venv/bin/python -m pytest "$@"
