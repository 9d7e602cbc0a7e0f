#!/usr/bin/env bash
# Quick start 2: set up, then run the whole test suite (multi-process tests use gloo on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
