#!/usr/bin/env bash
# Make .venv with torch==2.13.0 (CPU build) and fsdp2lite[dev] installed editable.
# Safe to re-run: a stamp file skips the installs when nothing they depend on changed.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
stamp=.venv/.fsdp2lite-setup
want="torch==2.13.0 $(sha256sum pyproject.toml | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  # torch first and pinned, so resolving the package's "torch>=2.6" never pulls a newer (CUDA) build.
  .venv/bin/python -m pip install -q torch==2.13.0
  constraints=$(mktemp)
  echo "torch==2.13.0" >"$constraints"  # no extra (transformers, accelerate, lightning) may move torch
  .venv/bin/python -m pip install -q -c "$constraints" -e ".[dev]"
  rm -f "$constraints"
  echo "$want" >"$stamp"
fi
