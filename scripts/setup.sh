#!/usr/bin/env bash
# Make the virtual environments named (default: .venv, the one a user needs), each with fsdp2lite[dev] installed
# editable:
#   .venv         torch==2.13.0 (the CPU build): the demo, your jobs, and the whole test suite;
#   .venv-oldest  torch==2.11.0, pyproject's floor (torch>=2.11), PyPI's CUDA build (about 5 GB; the tests hide
#                 CUDA from it): only the fast part of the suite uses it, and scripts/test.sh makes it.
# Usage: bash scripts/setup.sh [.venv] [.venv-oldest]
# Safe to re-run: a stamp file in each skips its installs when nothing they depend on changed.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}

one_at_a_time() {  # run a command holding a lock on this script (flock, where the system has it)
  if command -v flock >/dev/null 2>&1; then flock scripts/setup.sh "$@"; else "$@"; fi
}

make_venv() {  # make_venv DIR TORCH_VERSION
  local venv=$1 torch=$2 stamp want constraints
  [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
  stamp=$venv/.fsdp2lite-setup
  want="torch==$torch $(sha256sum pyproject.toml | cut -c1-16)"
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    # torch first and pinned, so resolving the package's "torch>=2.11" never pulls a newer build.
    "$venv/bin/python" -m pip install -q "torch==$torch"
    constraints=$(mktemp)
    echo "torch==$torch" >"$constraints"  # no extra (transformers, accelerate, lightning) may move torch
    # one editable install at a time (scripts/test.sh makes both environments at once): each writes
    # fsdp2lite.egg-info into this checkout
    one_at_a_time "$venv/bin/python" -m pip install -q -c "$constraints" -e ".[dev]"
    rm -f "$constraints"
    echo "$want" >"$stamp"
  fi
}

oldest=2.11.0
floor=$(grep -o '"torch>=[0-9.]*"' pyproject.toml | tr -d '"' | cut -d= -f2)
if [ "$oldest" != "$floor" ] && [ "$oldest" != "$floor.0" ]; then
  echo "scripts/setup.sh: .venv-oldest pins torch $oldest but pyproject's floor is torch>=$floor; make them agree" >&2
  exit 2
fi

venvs=("$@")
[ "$#" -gt 0 ] || venvs=(.venv)
for venv in "${venvs[@]}"; do
  case $venv in
    .venv) make_venv .venv 2.13.0 ;;
    .venv-oldest) make_venv .venv-oldest "$oldest" ;;
    *) echo "scripts/setup.sh: unknown environment '$venv'; expected .venv or .venv-oldest" >&2; exit 2 ;;
  esac
done
