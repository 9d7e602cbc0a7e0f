#!/usr/bin/env bash
# Quick start 2: set up, then run the whole test suite on torch 2.13 (.venv), then its fast part (the tests
# marked oldest_torch in tests/conftest.py: API, runtime parity, checkpoint safety, estimate, CLI) on the
# oldest supported torch, 2.11 (.venv-oldest). Multi-process tests use gloo on CPU; CUDA is hidden from the
# second run (PyPI's torch 2.11 is a CUDA build). Arguments go to both runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh .venv .venv-oldest  # the second environment only the tests use
status=0
echo "== torch $(.venv/bin/python -c 'import torch; print(torch.__version__)') (.venv)"
.venv/bin/python -m pytest -q "$@" || status=$?
echo "== torch $(.venv-oldest/bin/python -c 'import torch; print(torch.__version__)') (.venv-oldest): the tests marked oldest_torch"
# exit 5: none of the tests asked for is in the oldest-torch part
CUDA_VISIBLE_DEVICES= .venv-oldest/bin/python -m pytest -q -m oldest_torch "$@" || { code=$?; [ "$code" -eq 5 ] || status=$code; }
exit "$status"
