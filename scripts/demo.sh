#!/usr/bin/env bash
# The main job: install what is missing, then run the end-to-end demo (scripts/demo.py).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
scripts/setup.sh --torch
exec .venv/bin/python scripts/demo.py "$@"
