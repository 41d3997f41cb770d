#!/usr/bin/env bash
# The whole test suite: install what is missing, lint, check the import layers, then pytest
# (extra args go to pytest).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
scripts/setup.sh --torch
.venv/bin/ruff check quiverfs digests mountd tests scripts
# The layering contracts in pyproject.toml ([tool.importlinter]): one summary line, the whole
# report when one breaks.
layers_log="$(mktemp)"
.venv/bin/lint-imports --no-cache > "$layers_log" 2>&1 || { cat "$layers_log"; rm -f "$layers_log"; exit 1; }
echo "[layers] $(grep '^Contracts:' "$layers_log")"
rm -f "$layers_log"
exec .venv/bin/python -m pytest "$@"
